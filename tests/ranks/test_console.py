"""The console line and its scalars (issue 24, item 5): tokens/s, achieved TFLOP/s and MFU from the
planner's FLOPs per token and the device's peak (the calibrated one on the CPU, none without it), peak
memory, ETA, MoE imbalance and dropped share; the same scalars for TensorBoard, W&B and the report."""
import io
import json
import math
import types

import pytest

from fivefold.tools.run_plan import peak_text, speed_model
from fivefold.config import Config, ConfigError
from fivefold.plan.models import from_model_config
from fivefold.plan.topology import ACCELERATORS
from fivefold.train import progress
from fivefold.train.progress import Progress, duration
from fivefold.train.scalars import step_scalars
from fivefold.train.speed import Speed
from fivefold.train.wandb_log import require_wandb

CALIBRATED = """name = "local"
[accelerator]
name = "this-cpu"
memory_gib = 16
peak_tflops = { fp32 = 0.05, bf16 = 0.01, fp64 = 0.02 }
[[tier]]
name = "intra"
bandwidth_gbps = 2
"""


def test_speed_scalars():
    s = Speed(flops_per_token=6e6, peak_flops=1e12, ranks=2)
    out = s.scalars(tokens=1000, seconds=0.5)
    assert out["tokens_per_s"] == 2000 and out["tflops"] == pytest.approx(2000 * 6e6 / 1e12)
    assert out["mfu"] == pytest.approx(2000 * 6e6 / 2e12)   # the peak of every rank together
    assert "mfu" not in Speed(6e6, 0.0).scalars(1000, 0.5)           # no peak: no MFU
    assert set(Speed().scalars(1000, 0.5)) == {"tokens_per_s"}       # no FLOPs per token: no TFLOP/s
    assert Speed().scalars(1000, 0.0) == {}


def test_speed_model_peaks(tmp_path):
    cfg = Config()
    flops = from_model_config(cfg.model).flops_per_token(cfg.train.seq_len)
    cfg.train.calibration = str(tmp_path / "missing.toml")
    cpu = speed_model(cfg, "cpu")
    assert cpu["flops_per_token"] == flops and cpu["peak_flops"] == 0        # no calibration: no MFU
    assert "no MFU" in peak_text(cpu, cfg.train.calibration) and "fivefold calibrate" in peak_text(cpu, "x")
    (tmp_path / "local.toml").write_text(CALIBRATED)
    cfg.train.calibration = str(tmp_path / "local.toml")
    assert speed_model(cfg, "cpu")["peak_flops"] == pytest.approx(0.05e12)  # the calibrated fp32 peak
    cfg.train.dtype = "bf16"
    gpu = speed_model(cfg, "cuda", "NVIDIA H100 80GB HBM3")
    assert gpu["peak_flops"] == ACCELERATORS["h100"].peak("bf16") and "H100" in gpu["peak_source"]
    assert speed_model(cfg, "cuda", "Some Other GPU")["peak_flops"] == 0
    assert "MFU against 989 TFLOP/s per rank" in peak_text(gpu, "")


def run_bar(monkeypatch, records, **kw):
    clock = [0.0]
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    bar = Progress(**kw)
    for m in records:
        clock[0] += 2.0
        bar.update(m)
    return stream.getvalue().splitlines()


def record(step, **extra):
    return {"step": step, "tokens": 1000, "seconds": 0.5, "loss": 2.0, "grad_norm": 0.5, "lr": 1e-3, **extra}


def test_console_line_shows_what_matters(monkeypatch):
    moe = {"expert_imbalance": 1.234, "dropped_fraction": 0.015, "peak_memory_bytes": 3 * 2**30}
    lines = run_bar(monkeypatch, [record(s, **moe) for s in range(1, 5)] + [record(5, eval_loss=1.5, eval_ppl=4.48)],
                    total=10, log_every=2, speed=Speed(6e9, 1e13, ranks=2))
    assert [int(x.split()[1].split("/")[0]) for x in lines] == [1, 2, 4, 5]   # step N: the N-th (1-based)
    first = lines[0]
    for part in ("2,000 tok/s", "12 TFLOP/s", "MFU 60.0%", "mem 3.00 GiB", "ETA 18s", "moe 1.23 drop 1.5%"):
        assert part in first, (part, first)
    assert "4,000 tok/s" not in lines[1] and "2,000 tok/s" in lines[1]   # the window since the last line
    assert lines[-1].endswith("eval 1.5000 (ppl 4.48)") and "moe" not in lines[-1]
    plain = run_bar(monkeypatch, [record(1)], total=1)[0]
    assert "TFLOP/s" not in plain and "MFU" not in plain and "moe" not in plain and "ETA" not in plain
    assert "GFLOP/s" in run_bar(monkeypatch, [record(1)], total=1, speed=Speed(1e6))[0]   # CPU-sized figures
    assert [duration(s) for s in (42, 185, 3725)] == ["42s", "3m05s", "1h02m"]


def test_scalars_carry_the_console_figures():
    m = record(3, tflops=1.5, mfu=0.3, peak_memory_bytes=2**31, expert_imbalance=1.1, dropped_fraction=0.0)
    s = step_scalars(m)
    assert s["tokens_per_s"] == 2000 and s["tflops"] == 1.5 and s["mfu"] == 0.3
    assert s["peak_memory_gib"] == 2.0 and s["expert_imbalance"] == 1.1 and s["dropped_fraction"] == 0.0


def test_report_summary_has_speed_memory_and_moe(tmp_path):
    from fivefold.tools.report import panels, read_run, summary

    run = tmp_path / "moe"
    run.mkdir()
    lines = [record(s, tokens_per_s=2000.0, tflops=0.012, mfu=0.25, peak_memory_bytes=2**30,
                    expert_imbalance=1.2 + s / 10, dropped_fraction=0.01) for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    table = summary([read_run(run)])
    header, row = table.splitlines()
    for col in ("TFLOP/s", "MFU", "peak mem", "moe imbalance", "dropped"):
        assert col in header
    assert "0.012" in row and "25.0%" in row and "1.00 GiB" in row and "1.400" in row and "1.0%" in row
    assert [k for k, _ in panels([read_run(run)])][4:] == ["mfu", "peak_memory_gib", "expert_imbalance"]


def test_wandb_missing_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[wandb\]'") as e:
        require_wandb(True)
    assert "\n" not in str(e.value)
    require_wandb(False)   # off: nothing asked of the environment


def test_wandb_offline_logs_the_scalars(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed in this environment (the [wandb] extra)")
    from fivefold.train.wandb_log import WandbLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    log = WandbLog(tmp_path, True, Config(), 0)
    log.add(record(1, tflops=1.0))
    log.close()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline run folder"
    assert wandb.__version__


def test_dropped_fraction_of_routing_counts():
    import torch

    from fivefold.parallel.expert import moe_step_stats

    assert math.isclose(moe_dropped(torch, moe_step_stats), 2 / 10)


def moe_dropped(torch, moe_step_stats):
    """One fake MoE layer whose step ran 8 assignments (3 + 5) and dropped 2."""
    from fivefold.model.moe import MoE

    layer = MoE.__new__(MoE)
    torch.nn.Module.__init__(layer)
    layer.n_experts, layer.step_stats = 2, torch.tensor([3.0, 5.0, 2.0])
    layer.update_bias = lambda counts: None
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    model.w = torch.nn.Parameter(torch.zeros(1))
    stats = moe_step_stats(model, types.SimpleNamespace(size=1), layers=1)   # one rank: nothing to sum
    return stats["dropped_fraction"]


def test_eta_seconds_is_the_console_eta(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    bar = Progress(10, enabled=False)
    assert bar.eta_seconds(0) is None
    clock[0] = 6.0
    assert bar.eta_seconds(3) == pytest.approx(14.0) and bar.eta_seconds(10) == 0.0   # 2 s a step x 7 left
    assert bar.eta_text(3) == "  ETA 14s" and bar.eta_text(10) == ""


BALLAST_BYTES = 300 * 2**20   # rank 1's extra resident memory: its peak is the largest


def train_two_steps(rank, world, cfg_dict, out):
    """rank 1 first touches BALLAST_BYTES; every rank trains; returns (peak before, peak after) of this rank."""
    import numpy as np

    from fivefold.train.trainer import Trainer, peak_rss_bytes

    ballast = np.ones(BALLAST_BYTES // 8) if rank == 1 else None
    before = peak_rss_bytes()
    Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True).run(out)
    del ballast
    return before, peak_rss_bytes()


@pytest.mark.ranks
def test_metrics_peak_memory_is_the_largest_rank_and_eta_is_recorded(tmp_path):
    """metrics.jsonl (written by rank 0) carries the largest rank's peak memory, not rank 0's, and the
    console's ETA as eta_s."""
    from tests.support.spawn import ranks
    from tests.support.tiny import tiny_config

    cfg = tiny_config(dp=2)
    cfg.train.steps = 2
    (r0_before, r0_after), (r1_before, r1_after) = ranks(train_two_steps, 2, cfg.to_dict(), str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert r0_after < r1_before   # rank 0's own peak is below rank 1's: the metric must be rank 1's
    slack = 2**20   # the kernel folds per-thread RSS counters into the high-water mark lazily (a few pages)
    for row in rows:
        assert r1_before - slack <= row["peak_memory_bytes"] <= max(r0_after, r1_after) + slack
    assert rows[0]["eta_s"] > 0 and rows[-1]["eta_s"] == 0.0
