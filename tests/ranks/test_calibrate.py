"""`fivefold calibrate` writes a topology the planner reads and uses; it never writes over a file.

No timing is asserted: the figures depend on the machine and its load. The calibration runs once (quick
mode, 2 ranks) for the module.
"""
import argparse
import dataclasses

import pytest

from fivefold.tools import calibrate
from fivefold.tools.calibrate import (FRESH_BYTES, TP_OPS, _fresh_fill, _windowed, cmd_calibrate, fit_alpha_beta,
                                      gemm_curve, hidden_share, layer_overhead_beyond_gemms, tp_step_rows,
                                      window_s)
from fivefold.plan.estimate import estimate
from fivefold.plan.layout import from_config
from fivefold.plan.models import from_model_config
from fivefold.plan.topology import load_topology

from tests.support.tiny import tiny_config


def _args(out, nproc=2) -> argparse.Namespace:
    return argparse.Namespace(nproc=nproc, out=str(out), quick=True)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibrate") / "local.toml"
    assert cmd_calibrate(_args(out)) == 0
    return out


@pytest.mark.ranks
def test_writes_a_topology_load_topology_reads(calibrated):
    text = calibrated.read_text()
    assert "--efficiency 1.0" in text                     # the peaks are achieved rates
    topo = load_topology(str(calibrated))
    acc = topo.accelerator
    assert acc.name == "local-cpu-2"
    assert set(acc.peak_flops) >= {"fp32", "bf16"} and all(v > 0 for v in acc.peak_flops.values())
    assert acc.memory > 0 and acc.hbm_bandwidth > 0
    assert [t.name for t in topo.tiers] == ["loopback"]
    tier = topo.tiers[0]
    assert tier.size == 2 and tier.bandwidth > 0 and tier.latency >= 0
    # what a datasheet leaves to `efficiency`, measured and read back
    assert acc.attention_flops["fp32"] > 0 and acc.layer_overhead > 0 and acc.elementwise == 1
    assert acc.action_overhead >= 0 and "action_overhead_us" in text   # from a real 1F1B step
    assert {op for op, _, _ in tier.ops} >= {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"}
    assert all(lat >= 0 and bw > 0 for _, lat, bw in tier.ops) and 0 <= tier.overlap <= 1
    # the local GEMM curve (plan/gemm.py): the fitted rate is the fp32 peak, the fitted floor per kernel
    assert "gemm_kernel_us" in text and acc.gemm_kernel is not None and acc.gemm_kernel >= 0


@pytest.mark.ranks
def test_a_layers_collectives_are_fitted_from_real_tp_steps(calibrated):
    """The ops table's all_reduce, all_gather and reduce_scatter come from the Trainer's own tp steps (the
    comments list their rows), the other ops from the burst probe."""
    text = calibrated.read_text()
    assert "# in a real step (the ops table's all_reduce, all_gather, reduce_scatter)" in text
    ops = {op: (lat, bw) for op, lat, bw in load_topology(str(calibrated)).tiers[0].ops}
    fitted = [line.split(":")[0].strip("# ") for line in text.splitlines() if " us/hop, " in line and
              line.startswith("#   ") and "own fit" not in line and "joint" not in line]
    assert fitted == list(TP_OPS) and set(ops) >= set(TP_OPS)


def test_the_tp_probe_times_each_collective_blocking(monkeypatch):
    """The ops table holds a collective's whole in-step cost and the planner hides the overlapped share
    (plan/time.py tp_hidden): so the probe's steps run with parallel.tp_overlap off, or the plan would
    hide the same seconds twice."""
    import fivefold.train.trainer as trainer_module
    seen = []

    class FakeTrainer:
        def __init__(self, cfg, rank, world, **kw):
            seen.append((cfg.parallel.tp, cfg.parallel.sp_mode, cfg.parallel.tp_overlap))
            self.ledger = type("L", (), {"rows": staticmethod(lambda: [])})()

        def step(self, k):
            pass

    monkeypatch.setattr(trainer_module, "Trainer", FakeTrainer)
    for quick, seqs in ((True, calibrate.TP_SEQS_QUICK), (False, calibrate.TP_SEQS)):
        seen.clear()
        configs = calibrate._measure_tp_steps(0, 2, quick=quick)
        assert [(c["sp"], c["seq"]) for c in configs] == [(sp, seq) for sp in ("none", "megatron") for seq in seqs]
        assert seen == [(2, sp, False) for sp in ("none", "megatron") for _ in seqs]
        assert all(len(c["steps"]) == (3 if quick else calibrate.TP_STEPS) for c in configs)


def test_tp_step_rows_by_hand():
    """Per probe config and op: the step's calls × hops, its bytes, and the median over steps of the
    slowest rank's seconds (gloo over 2 ranks, comm/volume.py latency_hops: all_reduce 4 hops a call, two
    ring steps each a ready-notice and the data; all_gather 2)."""
    def config(*steps):
        return {"sp": "megatron", "seq": 32, "steps": list(steps)}
    per_rank = [[config({"all_reduce": (10, 4e6, 0.020), "all_gather": (4, 1e6, 0.009)},
                        {"all_reduce": (10, 4e6, 0.030), "all_gather": (4, 1e6, 0.004)},
                        {"all_reduce": (10, 4e6, 0.012), "all_gather": (4, 1e6, 0.005)})],
                [config({"all_reduce": (10, 4e6, 0.025), "all_gather": (4, 1e6, 0.003)},
                        {"all_reduce": (10, 4e6, 0.010), "all_gather": (4, 1e6, 0.006)},
                        {"all_reduce": (10, 4e6, 0.011), "all_gather": (4, 1e6, 0.004)})]]
    rows = tp_step_rows(per_rank, 2)
    assert rows["all_reduce"] == [(40.0, 4e6, pytest.approx(0.025))]    # slowest: 25, 30, 12 ms
    assert rows["all_gather"] == [(8.0, 1e6, pytest.approx(0.006))]     # slowest: 9, 6, 5 ms
    # two configs of exact model times give back the model's latency and bandwidth
    alpha, bw = 700e-6, 0.4e9
    exact = [(h, b, h * alpha + b / bw) for h, b in ((20.0, 1.3e6), (20.0, 10.5e6))]
    assert fit_alpha_beta(exact) == (pytest.approx(alpha, rel=1e-9), pytest.approx(bw, rel=1e-9))


def test_hidden_share_by_hand():
    """A 12 ms burst, 4 ms of all-reduce after it: 13 ms side by side hides 3 of the 4 ms."""
    assert hidden_share(0.012, 0.016, 0.013) == pytest.approx(0.75)
    assert hidden_share(0.012, 0.016, 0.017) == 0.0 and hidden_share(0.012, 0.016, 0.011) == 1.0


class _Clock:
    """A fake perf_counter that only calls move: each call of `work` takes `seconds` of it."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now

    def work(self, seconds):
        def call():
            self.now += seconds
        return call


def test_windowed_counts_the_calls_that_end_inside_the_window(monkeypatch):
    """A 1 s window: after a 0.1 s warm-up, calls of 0.2, 0.2, 0.2 s end inside it (0.6 s) and a 0.9 s one
    runs past its end (1.5 s) uncounted, so the figure is 0.2 s a call, not the 1.5 / 4 = 0.375 s that
    counting it would give. The barrier comes after the warm-up call, so every rank's window starts
    together."""
    clock, order = _Clock(), []
    monkeypatch.setattr(calibrate.time, "perf_counter", clock.perf_counter)
    durations = iter([0.1, 0.2, 0.2, 0.2, 0.9])

    def call():
        order.append("call")
        clock.work(next(durations))()
    assert _windowed(call, 1.0, lambda: order.append("barrier")) == pytest.approx(0.2)
    assert order == ["call", "barrier"] + ["call"] * 4
    assert _windowed(clock.work(2.5), 1.0, lambda: None) == pytest.approx(2.5)   # longer than the window: one call


def test_the_window_stretches_with_the_ranks_a_core_serves():
    assert window_s(7, 2, 2) == pytest.approx(7 * 0.03)
    assert window_s(2, 2, 2) == pytest.approx(4 * 0.03)            # at least four blocks
    assert window_s(7, 8, 2) == pytest.approx(4 * window_s(7, 2, 2))


def test_the_fresh_fill_maps_its_own_pages():
    """The first-touch probe fills a new private mapping each call, whatever malloc's state: every call
    faults pages in (warm heap memory would fault none; at least one fault a call even with huge pages),
    and nothing stays mapped behind it."""
    import resource

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    _fresh_fill()
    before, faults = maps(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        _fresh_fill()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults >= 3
    assert maps() == before and FRESH_BYTES >= 4 << 20


@pytest.mark.parametrize("parallel", [dict(dp=2, microbatches=2), dict(pp=2, microbatches=4),
                                      dict(tp=2, sp_mode="megatron")])
@pytest.mark.ranks
def test_estimate_consumes_it(calibrated, parallel):
    cfg = tiny_config(**parallel)
    layout, work = from_config(cfg)
    est = estimate(from_model_config(cfg.model), layout, dataclasses.replace(work, efficiency=1.0),
                   load_topology(str(calibrated)))
    assert est.time.step_time_s > 0 and est.fits


@pytest.mark.ranks
def test_each_measured_term_moves_the_prediction(calibrated):
    """The attention rate, the element-wise term, the per-op fits and the overlap share each change the
    predicted step the way they should (slower attention, unfused ops, a partly hidden reduction: longer)."""
    cfg = tiny_config(dp=2, tp=1, microbatches=2, bucket_mb=0.05)   # buckets that go during the backward
    cfg.train.seq_len = cfg.model.max_seq = 1024
    layout, work = from_config(cfg)
    work = dataclasses.replace(work, efficiency=1.0)
    model = from_model_config(cfg.model)
    topo = load_topology(str(calibrated))
    acc, tier = topo.accelerator, topo.tiers[0]

    def step(accel=acc, t=tier):
        return estimate(model, layout, work, dataclasses.replace(topo, accelerator=accel, tiers=(t,))).time

    base = step()
    fast = step(dataclasses.replace(acc, attention_flops={}, elementwise=0.0, layer_overhead=0.0))
    assert fast.compute_s < base.compute_s
    slow_attn = step(dataclasses.replace(acc, attention_flops={"fp32": acc.attention_flops["fp32"] / 2}))
    assert slow_attn.compute_s > base.compute_s
    hidden = step(t=dataclasses.replace(tier, overlap=1.0))
    exposed = step(t=dataclasses.replace(tier, overlap=0.0))
    assert hidden.grad_comm_s <= base.grad_comm_s <= exposed.grad_comm_s and hidden.grad_comm_s < exposed.grad_comm_s
    pp_cfg = tiny_config(pp=2, microbatches=4)
    pp_layout, pp_work = from_config(pp_cfg)
    pp_work = dataclasses.replace(pp_work, efficiency=1.0)

    def pp_step(overhead):
        accel = dataclasses.replace(acc, action_overhead=overhead)
        return estimate(model, pp_layout, pp_work, dataclasses.replace(topo, accelerator=accel)).time.pipeline_s
    assert pp_step(1e-3) > pp_step(0.0) + 8 * 1e-3 * 0.9           # 2·m actions a rank, most on the critical path
    slow_ar = step(t=dataclasses.replace(tier, ops=tuple((op, lat * 10, bw) if op == "all_reduce" else (op, lat, bw)
                                                        for op, lat, bw in tier.ops)))
    assert slow_ar.step_time_s > base.step_time_s


@pytest.mark.ranks
def test_calibrated_gemms_go_by_shape(calibrated):
    """The calibrated curve makes the planner charge each GEMM its fitted time (`--gemm shape`, the
    default): a floor per kernel on top of the flat figure (`--gemm flat`: every GEMM at the peak alone)."""
    cfg = tiny_config(dp=2, microbatches=2)
    layout, work = from_config(cfg)
    work = dataclasses.replace(work, efficiency=1.0)
    model, topo = from_model_config(cfg.model), load_topology(str(calibrated))
    shaped = estimate(model, layout, work, topo).time.compute_s
    flat = estimate(model, layout, dataclasses.replace(work, gemm="flat"), topo).time.compute_s
    assert shaped > flat if topo.accelerator.gemm_kernel > 0 else shaped >= flat


def test_gemm_curve_by_hand():
    """F.linear forward + backward is three GEMMs of 2·T·k·n / rate + floor each (plan/gemm.py): with the
    floor measured apart, each shape gives FLOPs / (time − 3·floor), and the median over shapes is the
    rate. (256, 256, 704) at 20 GFLOP/s and 30 us a kernel: 3 x (92.27 MFLOP / 20 GFLOP/s + 30 us) =
    3 x 4.644 ms; a shape disturbed by a neighbour does not move the median."""
    rate, floor = 20e9, 30e-6
    shapes = [(t, k, n) for t in (256, 1024) for k, n in ((256, 256), (256, 704), (512, 1408))]
    rows = [([t, k, n], 6.0 * t * k * n, 3 * (2.0 * t * k * n / rate + floor)) for t, k, n in shapes]
    assert rows[1][2] / 3 == pytest.approx(4.6437e-3, rel=1e-4)
    assert gemm_curve(rows, floor) == pytest.approx(rate, rel=1e-12)
    disturbed = rows[:2] + [(rows[2][0], rows[2][1], 5 * rows[2][2])] + rows[3:]
    assert gemm_curve(disturbed, floor) == pytest.approx(rate, rel=1e-12)
    assert gemm_curve(rows, 0.0) < rate                      # without the floor: the flat, lower rate


def test_layer_overhead_leaves_the_gemm_floors_to_the_curve():
    """The tiny Block's time holds its GEMMs' floors, which the planner charges by shape: the planner counts
    4 GEMMs in a dense layer (fused QKV, output, gate+up, down), 3 kernels each, so 1 ms less 12 x 10 us."""
    assert layer_overhead_beyond_gemms(1e-3, 10e-6) == pytest.approx(0.88e-3)
    assert layer_overhead_beyond_gemms(1e-4, 10e-6) == 0.0           # never negative


def test_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "local.toml"
    out.write_text("mine\n")
    assert cmd_calibrate(_args(out)) == 2
    assert out.read_text() == "mine\n"
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "exists" in err and str(out) in err


def test_refuses_one_rank(tmp_path, capsys):
    assert cmd_calibrate(_args(tmp_path / "x.toml", nproc=1)) == 2
    assert not (tmp_path / "x.toml").exists()
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_fit_recovers_latency_and_bandwidth():
    alpha, bw = 50e-6, 2e9
    rows = [(h, b, h * alpha + b / bw) for h in (1, 2) for b in (4096, 2**20, 2**24)]
    a, w = fit_alpha_beta(rows)
    assert a == pytest.approx(alpha, rel=1e-9) and w == pytest.approx(bw, rel=1e-9)


def _spin_cpu(rank, world):
    """Burn about 0.5 s of CPU; return the CPU seconds this rank used."""
    import time

    t = time.process_time()
    while time.process_time() - t < 0.5:
        pass
    return time.process_time()


@pytest.mark.ranks
def test_foreign_load_counts_ranks_forked_by_the_fork_server_as_ours():
    """Ranks are the fork server's children, not the launcher's (train/launch.py): the CPU that
    `ForeignLoad` subtracts as this process tree's must still hold theirs, or every calibration and
    plan_vs_run round reads its own ranks as another job's load (1.7 of 2 cores did)."""
    from fivefold.tools.calibrate import _own_cpu_s
    from fivefold.train.launch import run_ranks

    before = _own_cpu_s()
    used = run_ranks(_spin_cpu, 2, ())
    assert _own_cpu_s() - before >= 0.95 * sum(used)
