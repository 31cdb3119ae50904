"""ZeRO-Offload (host memory) and disk offload reproduce the run without offload bit for bit, move
exactly the ledger's bytes, take optimizer state and masters off the device (with ZeRO-3 on disk the
parameter shards too; with ZeRO-2/3 the gradients, streamed to the host bucket by bucket during the
backward), save and resume across modes, and in disk mode keep resident memory below the optimizer
state's size."""
import json
from pathlib import Path

import pytest
import torch

from fivefold.config import Config, ConfigError

from tests.support.spawn import spawn_jobs
from tests.support.tiny import tiny_config

STAGES = (1, 2, 3)
MODES = ("none", "cpu", "nvme")
SECTIONS = ("model", "exp_avg", "exp_avg_sq")


def config(tmp: Path, mode: str, dtype: str = "fp32", **parallel) -> dict:
    cfg = tiny_config(offload=mode, **parallel)
    if mode == "nvme":
        cfg.parallel.offload_dir = str(tmp / "nvme")
    cfg.train.dtype = dtype
    if dtype == "bf16":
        cfg.train.main_grads_fp32 = False   # bf16 gradients: every width in the contract differs from fp32
    return cfg.to_dict()


def run_steps(rank, world, cfg_dict, steps=3):
    """Losses, full state, per-step ledger rows and what the contract needs (shard sizes, widths)."""
    from fivefold.train.trainer import Trainer

    tr = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    losses, rows = [], []
    for k in range(steps):
        snap = tr.ledger.snapshot()
        losses.append(tr.step(k)["loss"])
        rows.append(tr.ledger.since(snap).rows())
    e = tr.engine
    width = lambda dtype: torch.empty((), dtype=dtype).element_size()   # noqa: E731
    out = {"losses": losses, "rows": rows, "bytes": tr.model_state_bytes(), "n_params": tr.n_params,
           "shards": [u.shard_size for u in e.units],
           "widths": (width(e.grad_dtype), width(e.param_dtype), width(e.master_dtype)),
           "params_on_disk": e.state.holds_params, "streams": e.state.streams_grads,
           "reductions": 1 if e.spec.stage == 1 or tr.cfg.parallel.pp > 1 else tr.cfg.parallel.microbatches,
           "grad_peak": e.grad_buffer_peak, "padded": [u.padded for u in e.units],
           "gathers": [zero3_gathers(e, u, tr.cfg.parallel.microbatches) for u in e.units] if e.spec.stage == 3 else []}
    state = tr.full_state()
    out["state"] = {s: state[s] for s in SECTIONS}
    out["opt_t"] = state["opt_t"]
    tr.engine.remove()
    return out


def train(rank, world, cfg_dict, out, resume=None, steps=4):
    from fivefold.train.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    cfg.train.steps, cfg.train.checkpoint, cfg.train.checkpoint_every = steps, True, 2
    tr = Trainer(cfg, rank, world, quiet=True)
    result = tr.run(out, resume)
    return [m["loss"] for m in result["history"]]


def zero3_gathers(engine, unit, m: int) -> int:
    """All-gathers of a ZeRO-3 unit per step (parallel/zero/engine.py): without a pipeline before each micro-batch's
    forward and backward (once without resharding); under one a block per use, the root once."""
    if engine.spec.pipeline:
        return 1 if unit.name == "root" else 2 * m
    return (2 if engine.sharding.reshard_after_forward else 1) * m


def contract(r, mode: str) -> dict:
    """The ledger rows offload adds per rank per step (parallel/zero/offload.py's tables): ZeRO-2/3 copy each
    reduced gradient shard down after every reduce-scatter (once per micro-batch outside a pipeline, once
    a step under one); ZeRO-3 nvme reads each parameter shard from disk and copies it up before each
    all-gather, and writes it after the step instead of copying it up."""
    if mode == "none":
        return {}
    g, w, m = r["widths"]
    k, n = sum(r["shards"]), len(r["shards"])
    c = r["reductions"] if r["streams"] else 1
    rows = {"d2h": (c * n, c * k * g), "h2d": (n, k * w)}
    if mode == "nvme":
        rows.update({"nvme_read": (n, 3 * k * m), "nvme_write": (n, 3 * k * m)})
    if r["params_on_disk"]:
        reads = sum(r["gathers"]), sum(c * ku for c, ku in zip(r["gathers"], r["shards"])) * w
        rows["h2d"] = reads
        rows["nvme_read"] = (n + reads[0], 3 * k * m + reads[1])
        rows["nvme_write"] = (2 * n, 3 * k * m + k * w)
    return rows


def assert_same_run(got, ref, what):
    assert got["losses"] == ref["losses"], what   # bit for bit
    assert got["opt_t"] == ref["opt_t"]
    for s in SECTIONS:
        assert got["state"][s].keys() == ref["state"][s].keys()
        for name, t in got["state"][s].items():
            assert torch.equal(t, ref["state"][s][name]), f"{what}: {s}/{name} differs"


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """On 2 ranks: ZeRO-1/2/3 x none/cpu/nvme (fp32, 2 micro-batches, several buckets), ZeRO-1/3 in bf16,
    ZeRO-3 none/nvme with reshard_after_forward off and under a pipeline (pp 2), and checkpoints: an nvme
    run saved at step 2 resumed by nvme, by none and by cpu; a run without offload resumed by nvme."""
    root = tmp_path_factory.mktemp("offload2")
    jobs = []
    for stage in STAGES:
        for mode in MODES:
            d = root / f"z{stage}-{mode}"
            jobs.append((f"z{stage}-{mode}", run_steps, (config(d, mode, zero=stage, dp=2, microbatches=2,
                                                                 bucket_mb=0.05),)))
    for stage in (1, 3):
        for mode in MODES:
            d = root / f"bf16-z{stage}-{mode}"
            jobs.append((f"bf16-z{stage}-{mode}", run_steps, (config(d, mode, "bf16", zero=stage, dp=2,
                                                                     bucket_mb=0.05),)))
    for mode in ("none", "nvme"):   # ZeRO-3 parameters on disk: kept gathered to the backward; pipelined
        jobs.append((f"keep-z3-{mode}", run_steps, (config(root / f"keep-{mode}", mode, zero=3, dp=2, microbatches=2,
                                                           reshard_after_forward=False),)))
        jobs.append((f"pp2-z3-{mode}", run_steps, (config(root / f"pp2-{mode}", mode, zero=3, pp=2, dp=1,
                                                          microbatches=2),)))
    ck = lambda mode: config(root / f"ck-{mode}", mode, zero=3, dp=2, microbatches=2)   # noqa: E731
    step2 = "checkpoints/step-00000002"
    jobs += [("ck-nvme", train, (ck("nvme"), str(root / "ck-nvme"))),
             ("ck-none", train, (ck("none"), str(root / "ck-none"))),
             ("nvme->nvme", train, (ck("nvme"), str(root / "r1"), str(root / "ck-nvme" / step2))),
             ("nvme->none", train, (ck("none"), str(root / "r2"), str(root / "ck-nvme" / step2))),
             ("nvme->cpu", train, (ck("cpu"), str(root / "r3"), str(root / "ck-nvme" / step2))),
             ("none->nvme", train, (ck("nvme"), str(root / "r4"), str(root / "ck-none" / step2)))]
    return root, spawn_jobs(2, jobs, timeout_s=240)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", ("cpu", "nvme"))
@pytest.mark.ranks
def test_offload_equals_the_run_without_it(two, stage, mode):
    _, r = two
    for rank in range(2):
        assert_same_run(r[f"z{stage}-{mode}"][rank], r[f"z{stage}-none"][rank], f"ZeRO-{stage} {mode} rank {rank}")


@pytest.mark.parametrize("stage", (1, 3))
@pytest.mark.ranks
def test_bf16_offload_equals_the_run_without_it(two, stage):
    """Masters in fp32, parameters and gradients in bf16: converted on the host, the same rounding."""
    _, r = two
    for mode in ("cpu", "nvme"):
        for rank in range(2):
            assert_same_run(r[f"bf16-z{stage}-{mode}"][rank], r[f"bf16-z{stage}-none"][rank], f"bf16 {mode}")


@pytest.mark.parametrize("case", ["keep-z3", "pp2-z3"])
@pytest.mark.ranks
def test_zero3_params_on_disk_equal_the_run_without_offload(two, case):
    """ZeRO-3 nvme with reshard_after_forward off (one gather per micro-batch) and under a pipeline (a
    block per use, the root once; dp = 1: the gather is the shard itself, read in place)."""
    _, r = two
    for rank in range(2):
        assert_same_run(r[f"{case}-nvme"][rank], r[f"{case}-none"][rank], f"{case} rank {rank}")


@pytest.mark.ranks
def test_ledger_rows_per_step_are_the_contract(two):
    """Per rank per step: d2h and h2d once per unit (its gradient and parameter shard), in nvme mode a
    read and a write of its master and moments; ZeRO-3 nvme a read and a copy up of the parameter shard
    per all-gather (as many as the dp all_gather rows count) and its write after the step instead of the
    copy up; every other row as without offload."""
    _, r = two
    names = [f"z{s}-{m}" for s in STAGES for m in MODES] + [f"bf16-z{s}-{m}" for s in (1, 3) for m in MODES]
    for name in names + [f"{c}-z3-{m}" for c in ("keep", "pp2") for m in ("none", "nvme")]:
        mode = name.rsplit("-", 1)[1]
        for rank, res in enumerate(r[name]):
            ref = r[name.rsplit("-", 1)[0] + "-none"][rank]
            want = contract(res, mode)
            for step_rows, ref_rows in zip(res["rows"], ref["rows"]):
                off = {x["op"]: (x["calls"], x["message_bytes"]) for x in step_rows if x["dim"] == "offload"}
                assert off == want, name
                gathers = [x["calls"] for x in step_rows if (x["dim"], x["op"]) == ("dp", "all_gather")]
                if res["params_on_disk"] and gathers:   # one read per all-gather the ledger shows
                    assert want["h2d"][0] == gathers[0], name
                assert all(x["bytes_sent"] == x["message_bytes"] for x in step_rows if x["dim"] == "offload")
                rest = lambda rows: [(x["dim"], x["op"], x["calls"], x["bytes_sent"])   # noqa: E731
                                     for x in rows if x["dim"] != "offload"]
                assert rest(step_rows) == rest(ref_rows), name


@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
@pytest.mark.ranks
def test_optimizer_state_and_masters_leave_the_device(two, dtype):
    """ZeRO-Offload: the device keeps parameters (and ZeRO-1 its gradients); masters and moments (12 bytes
    per owned element) go to host memory, or to disk with two units' worth of host buffers; ZeRO-2/3's
    gradient shards go to host memory in both modes (with two landing buffers of the largest shard)."""
    _, r = two
    for stage in (STAGES if dtype == "fp32" else (1, 3)):
        key = f"z{stage}" if dtype == "fp32" else f"bf16-z{stage}"
        for rank in range(2):
            none, cpu, nvme = (r[f"{key}-{m}"][rank]["bytes"] for m in MODES)
            shards = r[f"{key}-cpu"][rank]["shards"]
            owned, (g, w, _) = sum(shards), r[f"{key}-cpu"][rank]["widths"]
            assert none["optimizer"] > 0 and "host" not in none
            streamed = none["grads"] if stage >= 2 else 0   # ZeRO-2/3: the shards are in host memory
            assert streamed == (g * owned if stage >= 2 else 0)
            for off in (cpu, nvme):
                assert off["grads"] == none["grads"] - streamed and off["optimizer"] == 0
                if stage >= 2:
                    assert off["host"]["grads"] == g * (owned + 2 * max(shards))
            assert cpu["params"] == none["params"]
            assert cpu["total"] == none["total"] - none["optimizer"] - streamed
            assert cpu["host"]["optimizer"] == 12 * owned and cpu["disk"]["total"] == 0
            assert nvme["disk"]["optimizer"] == 12 * owned
            assert nvme["host"]["optimizer"] == 2 * 12 * max(r[f"{key}-nvme"][rank]["shards"])
            if stage == 3:   # ZeRO-Infinity: the parameter shards on disk, none on the device between steps
                assert none["params"] == w * owned > 0
                assert nvme["params"] == 0 and nvme["total"] == 0   # ZeRO-Infinity: nothing stays between steps
                assert nvme["disk"]["params"] == w * owned
                staging = 2 * w * max(shards) if dtype == "bf16" else 0   # + the gather's host buffer
                assert nvme["host"]["params"] == staging + w * max(shards)
            else:
                assert nvme["params"] == none["params"]
                assert nvme["total"] == none["total"] - none["optimizer"] - streamed
                assert nvme["disk"]["params"] == 0


@pytest.mark.ranks
def test_pipeline_streams_once_a_step_after_accumulating_the_whole_gradient(two):
    """Under a pipeline (pp 2, reduce once per step) the stage's whole gradient accumulates on the device
    through the step (the pipeline's accumulate-then-reduce): each unit is reduce-scattered once and its
    shard streamed down once (the contract's one d2h per unit); streaming saves the shards, not the
    backward's full gradient (outside a pipeline: test_streamed_gradients_leave_the_device_bucket_by_bucket)."""
    _, r = two
    for rank in range(2):
        pp = r["pp2-z3-nvme"][rank]
        g = pp["widths"][0]
        assert pp["streams"] and pp["reductions"] == 1
        assert pp["grad_peak"] >= g * sum(pp["padded"])           # every unit's full gradient at once
        assert pp["bytes"]["grads"] == 0                           # none between steps


def test_streamed_gradients_leave_the_device_bucket_by_bucket(tmp_path):
    """ZeRO-2 over one rank (a shard is the whole gradient) with offload cpu and nvme, 2 micro-batches,
    buckets of ~0.02 MiB: the run equals the run without offload bit for bit; the device's gradient
    buffers (the engine's own count of bucket gradients and results in flight) peak where the planner's
    replay says (plan/buffers.py `_replay_buckets`), well under the whole gradient; no gradient shard stays
    on the device between steps (the planner's grads row: 0), the host holds them (offload_bytes); and the
    ledger's offload rows per step are the planner's (a d2h per bucket per micro-batch)."""
    from fivefold.plan.buffers import offload_bytes, zero_buffers
    from fivefold.plan.layout import from_config
    from fivefold.plan.memory import stage_memory
    from fivefold.plan.models import from_model_config
    from fivefold.plan.traffic import stage_flows

    runs = {}
    for mode in MODES:
        cfg = Config.from_dict(config(tmp_path / mode, mode, zero=2, microbatches=2, bucket_mb=0.02))
        runs[mode] = (cfg, run_steps(0, 1, cfg.to_dict()))
    ref = runs["none"][1]
    for mode in ("cpu", "nvme"):
        cfg, got = runs[mode]
        assert_same_run(got, ref, f"ZeRO-2 {mode} over one rank")
        model, (layout, work) = from_model_config(cfg.model), from_config(cfg)
        g = got["widths"][0]
        assert len(got["shards"]) >= 6 and got["grad_peak"] == zero_buffers(model, layout, work, 0)
        assert got["grad_peak"] < g * sum(got["shards"])         # never the whole gradient (with n = 1 a
        # bucket's result is as large as the bucket: three buckets and their results, the tied embedding's first)
        row = stage_memory(model, layout, work, 0)
        assert got["bytes"]["grads"] == row["grads"] == 0 and ref["bytes"]["grads"] == row["offloaded_grads"]
        assert got["bytes"]["host"] == offload_bytes(model, layout, work, 0)["host"]
        want = {f.op: (f.calls, f.message_bytes) for f in stage_flows(model, layout, work, 0) if f.dim == "offload"}
        assert want["d2h"] == (2 * len(got["shards"]), 2 * g * sum(got["shards"]))
        for rows in got["rows"]:
            assert {x["op"]: (x["calls"], x["message_bytes"]) for x in rows if x["dim"] == "offload"} == want


@pytest.mark.parametrize("resumed", ["nvme->nvme", "nvme->none", "nvme->cpu", "none->nvme"])
@pytest.mark.ranks
def test_resume_across_offload_modes_equals_the_uninterrupted_run(two, resumed):
    root, r = two
    before = resumed.split("->")[0]
    for rank in range(2):
        assert len(r[f"ck-{before}"][rank]) == 4 and len(r[resumed][rank]) == 2
        assert r[resumed][rank] == r[f"ck-{before}"][rank][2:]
    assert r["ck-nvme"][0] == r["ck-none"][0]
    run = json.loads((root / "ck-nvme" / "run.json").read_text())["model_state_bytes_per_rank"]
    assert run["optimizer"] == 0 and run["disk"]["optimizer"] > 0
    assert not list((root / "ck-nvme" / "nvme").glob("rank-*/*")), "the scratch files go with the run"


@pytest.mark.ranks
def test_four_ranks_dp2_pp2_and_dp4(tmp_path):
    """ZeRO-1 under a pipeline (dp2 x pp2) and ZeRO-2 over 4 ranks, both modes, equal no offload."""
    jobs = []
    for mode in MODES:
        jobs.append((f"pp-{mode}", run_steps, (config(tmp_path / f"pp-{mode}", mode, zero=1, dp=2, pp=2,
                                                      microbatches=2, bucket_mb=0.05),)))
        jobs.append((f"dp4-{mode}", run_steps, (config(tmp_path / f"dp4-{mode}", mode, zero=2, dp=4,
                                                       bucket_mb=0.05),)))
    r = spawn_jobs(4, jobs, timeout_s=240)
    for layout in ("pp", "dp4"):
        for mode in ("cpu", "nvme"):
            for rank in range(4):
                got, ref = r[f"{layout}-{mode}"][rank], r[f"{layout}-none"][rank]
                assert_same_run(got, ref, f"{layout} {mode} rank {rank}")
                off = {x["op"]: (x["calls"], x["message_bytes"]) for x in got["rows"][-1] if x["dim"] == "offload"}
                assert off == contract(got, mode)


def _resident_memory(rank, world, cfg_dict, steps=3):
    """Resident memory (/proc/self/statm) growth over the steps after the first (each step reads and
    writes all the offloaded state), the peak (VmHWM) over the whole run from before the trainer was
    built, and the offloaded state's size."""
    import os

    from fivefold.train.trainer import Trainer

    status = Path("/proc/self/status")
    rss = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")   # noqa: E731
    hwm = lambda: next(int(x.split()[1]) * 1024 for x in status.read_text().splitlines()   # noqa: E731
                       if x.startswith("VmHWM"))
    start = rss()
    tr = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    tr.step(0)                # warm: the allocator's pools, autograd's buffers
    before, after = rss(), 0
    for k in range(1, steps):
        tr.step(k)
        after = max(after, rss())
    b = tr.model_state_bytes()
    out = {"steps": after - before, "peak": hwm() - start, "offloaded": b["disk"]["optimizer"] + b["host"]["optimizer"]}
    tr.engine.remove()
    return out


@pytest.mark.ranks
def test_disk_mode_keeps_resident_memory_below_the_optimizer_state(tmp_path):
    """~72 MB of masters and moments on disk, in units of ~1 MB (a single process, ZeRO-2 over one
    rank). Every step reads and writes all of it, yet resident memory grows by a small fraction of it;
    and the run's peak resident memory is below the same run's with the state in host memory by about
    the state's size."""
    cfg = tiny_config(zero=2, bucket_mb=1.0)
    cfg.model.hidden, cfg.model.ffn, cfg.model.layers, cfg.model.heads = 256, 1024, 6, 4
    cfg.parallel.offload_dir = str(tmp_path / "nvme")
    cfg.train.global_batch, cfg.train.seq_len = 2, 16
    r = {}
    for mode in ("nvme", "cpu"):
        cfg.parallel.offload = mode
        r[mode] = spawn_jobs(1, [("rss", _resident_memory, (cfg.to_dict(),))], timeout_s=120)["rss"][0]
    state = r["cpu"]["offloaded"]
    assert state > 64e6
    assert r["nvme"]["offloaded"] == state + 2 * 12 * 2**18   # on disk, and two 1 MiB units' in host buffers
    # growth over the steps after the first: -5 to +11 MB in repeated quiet runs (the heap's layout moves
    # with what the rank allocated before), so a quarter of the state: were it kept resident, it would be all
    assert r["nvme"]["steps"] < state / 4, r
    assert r["cpu"]["peak"] - r["nvme"]["peak"] > 0.75 * state, r


def test_offload_rules():
    cfg = tiny_config(offload="cpu")
    with pytest.raises(ConfigError, match="needs zero 1, 2 or 3"):
        cfg.validate(1)
    cfg = tiny_config(zero=1, offload="nvme")
    with pytest.raises(ConfigError, match="offload_dir"):
        cfg.validate(1)
    with pytest.raises(ConfigError, match="parallel.offload"):
        Config.from_dict({"parallel": {"offload": "gpu"}})
    cfg.parallel.offload_dir = "/tmp/x"
    cfg.validate(1)


def test_a_disk_offloaded_run_leaves_no_folder_behind(tmp_path):
    """offload = nvme makes OFFLOAD_DIR/rank-00000 for its (nameless) file; when the run returns the folder is
    gone again, and a folder someone else put there stays."""
    from fivefold.train.trainer import train_rank

    cfg = tiny_config(zero=1, offload="nvme")
    cfg.parallel.offload_dir = str(tmp_path / "nvme")
    cfg.train.steps = 1
    (tmp_path / "nvme" / "theirs").mkdir(parents=True)
    train_rank(0, 1, cfg.to_dict(), str(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir()) == ["theirs"]
