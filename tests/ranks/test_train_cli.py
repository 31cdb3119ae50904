"""`fivefold train` end to end: outputs, layout-independent loss, data options, failures."""
import json
import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from fivefold.comm import CommLedger
from fivefold.train import checkpoint
from fivefold.train.launch import RankError, run_ranks

from tests.support.cli import TINY, fivefold, metrics


@pytest.mark.ranks
def test_train_writes_outputs_and_loss_is_layout_independent(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = fivefold("train", *TINY, "--out", str(one))
    assert r1.returncode == 0, r1.stderr
    r2 = fivefold("train", "--nproc", "2", "--microbatches", "2", *TINY, "--out", str(two))
    assert r2.returncode == 0, r2.stderr
    assert "all_reduce" in r2.stdout and "dp" in r2.stdout  # the ledger table is printed
    m1, m2 = metrics(one), metrics(two)
    assert [m["step"] for m in m2] == [1, 2, 3, 4]
    assert set(m2[0]) >= {"step", "loss", "grad_norm", "lr", "tokens", "seconds"}
    assert m2[0]["tokens"] == 8 * 32
    np.testing.assert_allclose([m["loss"] for m in m2], [m["loss"] for m in m1], rtol=1e-5)
    ledger = CommLedger.read(two / "comm.json")
    assert ledger.total("dp", "all_reduce", "calls") > 0 and len(ledger.per_rank()) == 2
    run = json.loads((two / "run.json").read_text())
    assert run["world_size"] == 2 and run["config"]["parallel"]["dp"] == 2
    assert run["params"] == run["model_state_bytes_per_rank"]["params"] // 4
    assert run["versions"]["torch"] == torch.__version__
    model = checkpoint.to_model(two)
    assert sum(p.numel() for p in model.parameters()) == run["params"]


@pytest.mark.ranks
def test_resume_continues_the_same_run(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert fivefold("train", *TINY, "--out", str(full)).returncode == 0
    short = [a if a != "4" else "2" for a in TINY]
    assert fivefold("train", *short, "--out", str(part)).returncode == 0
    r = fivefold("train", *TINY, "--out", str(part / "rest"), "--resume", str(part))
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose([m["loss"] for m in metrics(part / "rest")],
                               [m["loss"] for m in metrics(full)][2:], rtol=1e-6)


@pytest.mark.ranks
def test_user_text_and_token_files(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    r = fivefold("train", *TINY, "--data", str(text), "--out", str(tmp_path / "t"))
    assert r.returncode == 0, r.stderr
    tokens = tmp_path / "tok.u16"
    np.random.default_rng(0).integers(0, 256, 20000).astype(np.uint16).tofile(tokens)
    r = fivefold("train", *TINY, "--data", str(tokens), "--out", str(tmp_path / "u"))
    assert r.returncode == 0, r.stderr
    assert metrics(tmp_path / "u")[-1]["loss"] > 0


@pytest.mark.ranks
def test_config_error_exits_2_with_the_rule(tmp_path):
    r = fivefold("train", "--nproc", "3", "--global-batch", "16", "--out", str(tmp_path))
    assert r.returncode == 2
    assert "global_batch (16) must divide by dp*microbatches" in r.stderr


def _fail_on_rank1(rank, world):
    import torch.distributed as dist
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait forever without the launcher's clean-up
    return rank


def _hang(rank, world):
    time.sleep(600)


@pytest.mark.ranks
def test_failing_rank_gives_traceback_and_no_orphans():
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        run_ranks(_fail_on_rank1, 2, timeout_s=120)
    assert "rank 1 failed" in str(e.value) and "ValueError: boom on rank 1" in str(e.value)
    assert "Traceback" in str(e.value)
    assert time.monotonic() - t0 < 60
    assert multiprocessing.active_children() == []


@pytest.mark.ranks
def test_hang_is_killed_at_the_timeout():
    with pytest.raises(TimeoutError):
        run_ranks(_hang, 2, timeout_s=8)
    assert multiprocessing.active_children() == []


@pytest.mark.ranks
def test_data_errors_are_one_line_before_any_rank_starts(tmp_path):
    r = fivefold("train", "--nproc", "2", *TINY, "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "missing.txt" in r.stderr
    assert "Traceback" not in r.stderr and "rank" not in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.ranks
def test_torchrun_runs_one_rank_per_process(tmp_path):
    """Under torchrun the same command is one rank of the job (gloo here, NCCL when CUDA is present)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(_port()), "-m", "fivefold.cli",
                        "train", *TINY, "--out", str(tmp_path)], capture_output=True, text=True, timeout=240,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(metrics(tmp_path)) == 4
    assert CommLedger.read(tmp_path / "comm.json").total("dp", "all_reduce", "calls") > 0


def _port():
    from fivefold.train.launch import free_port
    return free_port()


# -- the command line in a fresh interpreter ---------------------------------------------------------------

def test_third_party_progress_bars_are_off_in_the_cli(tmp_path):
    """tqdm (transformers' shard loading, huggingface_hub, datasets) reads TQDM_DISABLE at import: the
    CLI sets it (and the hub's and datasets' switches) before any of them is imported, ranks inherit it."""
    pytest.importorskip("tqdm")
    code = ("import os, sys; from fivefold.process import quiet_third_party_bars; quiet_third_party_bars(); "
            "from tqdm.auto import tqdm; [None for _ in tqdm(range(3))]; print(os.environ['HF_HUB_DISABLE_PROGRESS_BARS'])")
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "1" and "it/s" not in r.stderr, r.stderr


def test_a_command_imports_only_its_own_module(capsys):
    """`fivefold plan` (a search a person waits for) imports no numpy, torch, train module, and of tools/
    only its own command (tools/plan.py): each command's arguments and code are imported only when it
    runs, in a fresh interpreter."""
    from fivefold.cli import main

    code = ("import contextlib, io, sys; from fivefold.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): rc = main(['plan', '--model', 'llama3-8b', '--gpus', '8'])\n"
            "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'matplotlib')"
            " or m.startswith(('fivefold.train', 'fivefold.tools.')) and m != 'fivefold.tools.plan'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "0 []", r.stderr[-2000:]
    for cmd in ("tokenize", "generate", "plan", "schedule"):      # each command still has its own flags
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "--" in capsys.readouterr().out


def test_cli_refuses_a_bad_mixture_in_one_line(tmp_path):
    source = tmp_path / "s0.u16"
    np.arange(5_000, dtype=np.uint16).__mod__(64).astype(np.uint16).tofile(source)
    r = fivefold("train", "--data", f"{source}:0.5", f"{source}:heavy", "--steps", "1", "--out",
                 str(tmp_path / "run"))
    assert r.returncode == 2 and "weight 'heavy' is not a number" in r.stderr and r.stderr.count("\n") == 1
