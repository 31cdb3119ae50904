"""Offload in the planner (docs/plan.md, "Offload"): ZeRO's optimizer state and step in host memory
(`offload = "cpu"`, ZeRO-Offload) or on NVMe (`"nvme"`): what leaves the device, what the host and the
disk hold, the copies per step (dim "offload", tiers "pcie" and "nvme"), their time, and the search."""
import json
from dataclasses import replace

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError, ModelConfig
from fivefold.plan.estimate import estimate
from fivefold.plan.layout import Layout, Workload, from_config
from fivefold.parallel.zero.order import MAX_INFLIGHT
from fivefold.parallel.zero.reduce import LANDING
from fivefold.plan.buffers import offload_bytes, offload_units, zero_buffers
from fivefold.plan.memory import stage_memory
from fivefold.plan.models import PRESETS, PlanModel, from_model_config
from fivefold.shapes import shard_size
from fivefold.plan.search import search
from fivefold.plan.time import host_step_seconds, offload_exposed, stage_offload_exposed, stage_param_reads
from fivefold.plan.topology import GB, GiB, TOPOLOGIES, topology_from_dict
from fivefold.plan.traffic import all_ranks, stage_flows
from fivefold.plan.tiers import by_tier, place

from tests.support.tiny import tiny_config

DGX = TOPOLOGIES["dgx-h100"]
LLAMA8 = PRESETS["llama3-8b"]
WORK8 = Workload(seq=4096, global_batch=8)


# -- memory -----------------------------------------------------------------------------------------------
def test_llama3_8b_fits_one_h100_only_with_offload():
    """Llama-3 8B (8.03 B parameters, untied) on one 80 GB H100, bf16 with fp32 gradients: 2 + 4 + 12 bytes
    per parameter (144 GB) do not fit; offloading the 12 bytes of fp32 master and Adam moments leaves
    weights, gradients and activations (49 GiB with full recompute). With one rank a ZeRO shard is the
    whole unit, so the host holds master, m, v (12), the gradient (4) and the bf16 staging shard (2) of
    every parameter: 18·Φ bytes; on disk 12·Φ."""
    phi = LLAMA8.num_params()
    lay = Layout(dp=1, zero=1, recompute="full")
    plain = estimate(LLAMA8, lay, WORK8, DGX)
    cpu = estimate(LLAMA8, replace(lay, offload="cpu"), WORK8, DGX)
    nvme = estimate(LLAMA8, replace(lay, offload="nvme"), WORK8, DGX)
    assert not plain.fits and plain.memory.most_loaded["total"] > 80 * GiB
    assert plain.memory.most_loaded["optimizer"] == 12 * phi and plain.memory.host == 0
    for est in (cpu, nvme):
        row = est.memory.most_loaded
        assert est.fits and est.device_fits and row["total"] < 80 * GiB
        assert row["optimizer"] == 0 and row["offloaded"] == 12 * phi
        assert (row["weights"], row["grads"]) == (2 * phi, 4 * phi)           # ZeRO-Offload keeps these on device
        assert row["total"] == plain.memory.most_loaded["total"] - 12 * phi
    assert cpu.memory.host == 18 * phi and cpu.memory.disk == 0
    assert nvme.memory.disk == 12 * phi
    # nvme: two slots of the largest unit (ZeRO-1 bucket: the 128k x 4096 embedding alone) in host memory
    assert nvme.memory.host == 2 * 18 * 128256 * 4096
    assert cpu.offload()["host_fits"] and cpu.offload()["moved_from_device"] == 12 * phi


def test_zero_offload_paper_split_of_model_states():
    """Ren et al. 2021 (ZeRO-Offload, USENIX ATC), §3-4: with mixed-precision Adam (16 bytes per parameter)
    the GPU keeps the 16-bit parameters (2M bytes for M parameters), the CPU the 16-bit gradients and the
    fp32 parameters, momentum and variance (2M + 12M), and each step moves 4M over PCIe (2M gradients
    down, 2M parameters up); the gradients leave the GPU bucket by bucket during the backward. Here with
    bf16 gradients over n = 16 ranks (ZeRO-2), one micro-batch a step: per rank 4Φ/n over PCIe and
    12Φ/n + 2Φ/n on the host (plus the runtime's 2Φ/n bf16 staging shard for the copy up and two landing
    buffers of the largest shard); on the device the 16-bit parameters and no gradient shard, only the
    buckets in flight (in `buffers`)."""
    n = 16
    work = Workload(seq=4096, global_batch=64, grad_dtype="param", reduce_dtype="bf16")
    est = estimate(LLAMA8, Layout(dp=n, zero=2, offload="cpu", recompute="full", micro_batch=4), work, DGX)
    phi = LLAMA8.num_params()
    row = est.memory.most_loaded
    assert row["weights"] == 2 * phi and row["grads"] == 0 and row["optimizer"] == 0
    assert row["offloaded_grads"] == pytest.approx(2 * phi / n, rel=1e-5)
    parts = offload_bytes(LLAMA8, est.layout, work, 0)["host"]
    assert parts["optimizer"] == pytest.approx(12 * phi / n, rel=1e-5)      # fp32 p, m, v
    k = [shard_size(u, m) for u, m in offload_units(LLAMA8, est.layout, work, 0)]
    assert parts["grads"] == 2 * (sum(k) + LANDING * max(k))               # the 16-bit gradients, landing buffers
    assert 2 * sum(k) == pytest.approx(2 * phi / n, rel=1e-5)             # (the largest shard: the embedding's)
    assert parts["params"] == pytest.approx(2 * phi / n, rel=1e-5)         # staging for the copy up
    assert est.offload()["pcie_bytes"] == pytest.approx(4 * phi / n, rel=1e-5)


def test_streamed_gradients_by_hand():
    """ZeRO-2 over one rank with ZeRO-Offload's streamed gradients (TINY, 2 micro-batches, fp32): the
    device keeps no gradient shard; its gradient is the buckets in flight (plan/buffers.py
    `_replay_buckets`); each micro-batch's reduced shards go down (2 d2h per bucket a step); the step
    waits only for the last copy, not for the whole gradient's."""
    work = Workload(seq=32, global_batch=2, dtype="fp32")
    phi = TINY.num_params()
    bucket_mb = BLOCK / 2**20              # buckets of about a quarter block's gradient (fp32)
    plain = Layout(dp=1, zero=2, bucket_mb=bucket_mb)
    lay = replace(plain, offload="cpu")
    units = [u for u, _ in offload_units(TINY, lay, work, 0)]
    assert sum(units) == phi and len(units) >= 6
    none, cpu = stage_memory(TINY, plain, work, 0), stage_memory(TINY, lay, work, 0)
    assert none["grads"] == 4 * phi and cpu["grads"] == 0 and cpu["offloaded_grads"] == 4 * phi
    # three consecutive buckets' gradients and results (n = 1: a result is the whole bucket) at the third
    # launch; the last two of the first micro-batch are still in flight when the second begins
    both = units * 2
    peak = max(sum(8 * u for u in both[i:i + MAX_INFLIGHT + 1]) for i in range(len(both) - MAX_INFLIGHT))
    assert zero_buffers(TINY, lay, work, 0) == peak < 4 * phi
    assert zero_buffers(TINY, plain, work, 0) == 0          # without offload the shards hold the gradient
    rows = _offload_rows(lay, work)
    assert (rows["d2h"].calls, rows["d2h"].message_bytes) == (2 * len(units), 2 * 4 * phi)
    assert (rows["h2d"].calls, rows["h2d"].message_bytes) == (len(units), 4 * phi)
    acc = DGX.accelerator
    flows = place(stage_flows(TINY, lay, work, 0), lay, DGX)
    d2h = 2 * 4 * phi / acc.pcie_bandwidth
    step = d2h / (2 * len(units)) + offload_exposed(len(units), 0.0, host_step_seconds(work, acc, phi), 4 * phi / acc.pcie_bandwidth)
    assert stage_offload_exposed(flows, work, acc, 2) == pytest.approx(step)
    assert stage_offload_exposed(flows, work, acc, 2) < stage_offload_exposed(flows, work, acc)   # copied at the step
    assert estimate(TINY, lay, work, DGX).time.offload_s == pytest.approx(step)


def test_zero_offload_trains_13b_on_one_32gb_gpu():
    """Ren et al. 2021, §1 and §6: ZeRO-Offload trains a 13B model on a single 32 GB V100. A 13B Llama-style
    model (Llama-2 13B's shape), fp16 parameters and gradients, full recompute, ZeRO-2 over one GPU: with
    the gradients streamed to the host the device holds 2Φ of weights (26 GB) plus activations and a few
    buckets, and fits; had the 2Φ gradient stayed on the device (as before streaming: the gradient shard
    is the whole gradient at dp = 1) it would need 52 GB. Where it came from moves the other way: the
    host holds the 2Φ gradient beside the 12Φ of state."""
    model = PlanModel(name="llama2-13b", vocab=32000, hidden=5120, layers=40, heads=40, kv_heads=40, ffn=13824,
                      tie_embeddings=False, max_seq=8192)
    phi = model.num_params()
    assert 12.8e9 < phi < 13.1e9
    v100 = replace(DGX, accelerator=replace(DGX.accelerator, memory=32 * GiB))
    work = Workload(seq=1024, global_batch=1, dtype="fp16", grad_dtype="param", reduce_dtype="fp16")
    est = estimate(model, Layout(dp=1, zero=2, offload="cpu", recompute="full"), work, v100)
    row = est.memory.most_loaded
    assert est.device_fits and row["total"] < 32 * GiB
    assert row["weights"] == 2 * phi and row["grads"] == 0 and row["offloaded_grads"] == 2 * phi
    assert zero_buffers(model, est.layout, work, 0) < 2 * phi / 25          # the buckets in flight (under 1 GB), not 2Φ
    assert row["total"] + 2 * phi > 32 * GiB                              # the gradient on the device would not fit
    assert est.memory.host >= 14 * phi


# -- traffic: the ledger's rows, by hand ----------------------------------------------------------------------
TINY = from_model_config(ModelConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_seq=64))
BLOCK = 2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128     # norms, wq wo, wk wv (2 kv heads of 16), SwiGLU
ROOT = 256 * 64 + 64                                         # tied embedding, final norm


def _offload_rows(layout, work, stage=0):
    return {f.op: f for f in stage_flows(TINY, layout, work, stage) if f.dim == "offload"}


def test_traffic_rows_are_the_contract_by_hand():
    """Per rank per step, once per ZeRO unit: d2h k·g (ZeRO-2/3: streamed, once per micro-batch), h2d k·w;
    nvme adds nvme_read and nvme_write of 3·k·mb; bytes sent = message. ZeRO-3 over dp = 3: a root unit and one per block, shards padded; with
    nvme the parameter shards live on disk (ZeRO-Infinity): before each all-gather (2 micro-batches, each
    unit gathered before its forward and again before its backward: 4 per unit) a read and a copy up of
    k·w, after the step a write of k·w and no copy up."""
    assert BLOCK == 36992 and TINY.num_params() == ROOT + 2 * BLOCK
    k = -(-ROOT // 3) + 2 * -(-BLOCK // 3)                       # 5483 + 2 * 12331
    for dtype, g, w in (("fp32", 4, 4), ("bf16", 4, 2)):
        work = Workload(seq=32, global_batch=6, dtype=dtype)     # 2 micro-batches of 1 sequence per rank
        for mode in ("cpu", "nvme"):
            rows = _offload_rows(Layout(dp=3, zero=3, offload=mode), work)
            want = {"d2h": (6, 2 * k * g), "h2d": (3, k * w)}
            if mode == "nvme":
                want = {"d2h": (6, 2 * k * g), "h2d": (12, 4 * k * w),
                        "nvme_read": (3 + 12, 3 * k * 4 + 4 * k * w), "nvme_write": (3 + 3, 3 * k * 4 + k * w)}
            assert set(rows) == set(want)
            for op, (calls, nbytes) in want.items():
                r = rows[op]
                assert (r.dim, r.calls, r.message_bytes, r.bytes_sent, r.n) == ("offload", calls, nbytes, nbytes, 1), op
    # reshard_after_forward off: one gather a micro-batch
    rows = _offload_rows(Layout(dp=3, zero=3, offload="nvme", reshard_after_forward=False),
                         Workload(seq=32, global_batch=6, dtype="fp32"))
    assert (rows["h2d"].calls, rows["h2d"].message_bytes) == (6, 2 * k * 4)
    # ZeRO-1 nvme keeps its parameters on the device: the step's h2d, no parameter reads
    rows = _offload_rows(Layout(dp=3, zero=1, offload="nvme"), Workload(seq=32, global_batch=6, dtype="fp32"))
    assert rows["nvme_read"].message_bytes == rows["nvme_write"].message_bytes == 3 * rows["h2d"].message_bytes
    # ZeRO-2 over dp = 2 with one bucket (25 MiB holds the whole model): one unit of k = Φ/2, streamed
    # after each of the 2 micro-batches' reductions
    rows = _offload_rows(Layout(dp=2, zero=2, offload="cpu"), Workload(seq=32, global_batch=4, dtype="fp32"))
    assert (rows["d2h"].calls, rows["d2h"].message_bytes) == (2, 2 * 4 * (ROOT + 2 * BLOCK) // 2)
    # no offload: no row
    assert not _offload_rows(Layout(dp=3, zero=3), Workload(seq=32, global_batch=6))


def test_zero3_nvme_under_a_pipeline_by_hand():
    """pp = 2, dp = 1, 2 micro-batches: stage 0 holds the root (embedding) and block 0, stage 1 the root
    (final norm and the tied head's copy) and block 1, each a whole unit (a group of one). Under a
    pipeline the root is gathered once a step, a block before each forward and backward (2·2), with full
    recompute too (the block is re-run inside its backward, after its pre-backward gather)."""
    work = Workload(seq=32, global_batch=2, dtype="fp32")
    roots = (256 * 64, 64 + 256 * 64)
    for recompute, per_use in (("none", 4), ("full", 4)):
        lay = Layout(pp=2, dp=1, zero=3, offload="nvme", recompute=recompute)
        for stage, root in enumerate(roots):
            rows = _offload_rows(lay, work, stage)
            k = root + BLOCK
            assert (rows["h2d"].calls, rows["h2d"].message_bytes) == (1 + per_use, 4 * (root + per_use * BLOCK))
            reads = 4 * (root + per_use * BLOCK)
            assert (rows["nvme_read"].calls, rows["nvme_read"].message_bytes) == (2 + 1 + per_use, 3 * 4 * k + reads)
            assert (rows["nvme_write"].calls, rows["nvme_write"].message_bytes) == (4, 3 * 4 * k + 4 * k)
            assert (rows["d2h"].calls, rows["d2h"].message_bytes) == (2, 4 * k)


def test_zero3_nvme_memory_by_hand():
    """ZeRO-3 nvme: the device keeps no weight shard (only the gathered units of `zero_buffers`); the disk
    gains the parameter shards (k·w), the host a buffer of the largest shard they pass through."""
    k_units = (-(-ROOT // 3), -(-BLOCK // 3), -(-BLOCK // 3))
    k = sum(k_units)
    for dtype, w in (("fp32", 4), ("bf16", 2)):
        work = Workload(seq=32, global_batch=6, dtype=dtype)
        cpu = stage_memory(TINY, Layout(dp=3, zero=3, offload="cpu"), work, 0)
        nvme = stage_memory(TINY, Layout(dp=3, zero=3, offload="nvme"), work, 0)
        assert cpu["weights"] == w * k and cpu["offloaded_params"] == 0
        assert nvme["weights"] == 0 and nvme["offloaded_params"] == w * k
        assert nvme["buffers"] == cpu["buffers"] > 0 and nvme["grads"] == cpu["grads"]
        assert nvme["total"] == cpu["total"] - w * k
        off = offload_bytes(TINY, Layout(dp=3, zero=3, offload="nvme"), work, 0)
        staging = 2 * w * max(k_units) if dtype == "bf16" else 0
        assert off["disk"] == {"params": w * k, "grads": 0, "optimizer": 12 * k, "total": (w + 12) * k}
        assert off["host"]["params"] == staging + w * max(k_units)
        assert off["host"]["optimizer"] == 2 * 12 * max(k_units)
        # ZeRO-1/2 nvme keep their weights on the device
        assert offload_bytes(TINY, Layout(dp=3, zero=2, offload="nvme"), work, 0)["disk"]["params"] == 0


def test_rows_from_a_config_summed_over_ranks():
    """`from_config` reads parallel.offload, and `all_ranks` sums the rows over the world, as comm.json does."""
    cfg = tiny_config(dp=2, zero=3, microbatches=2, offload="cpu")
    layout, work = from_config(cfg)
    assert layout.offload == "cpu"
    rows = all_ranks(from_model_config(cfg.model), layout, work)
    k = -(-ROOT // 2) + 2 * -(-BLOCK // 2)
    assert rows[("offload", "d2h")] == {"calls": 2 * 3 * 2, "message_bytes": 2 * 2 * k * 4, "bytes_sent": 2 * 2 * k * 4}
    assert rows[("offload", "h2d")]["message_bytes"] == 2 * k * 4
    assert ("offload", "nvme_read") not in rows


def test_copies_land_on_the_pcie_and_nvme_links():
    """`place` gives offload rows the accelerator's PCIe or NVMe bandwidth, no latency; by_tier lists them."""
    work = Workload(seq=32, global_batch=6)
    lay = Layout(dp=3, zero=3, offload="nvme")
    flows = place(stage_flows(TINY, lay, work, 0), lay, DGX)
    rows = {f.op: f for f in flows if f.dim == "offload"}
    acc = DGX.accelerator
    assert {f.tier for f in rows.values()} == {"pcie", "nvme"}
    assert rows["d2h"].seconds == rows["d2h"].bytes_sent / acc.pcie_bandwidth
    assert rows["nvme_write"].seconds == rows["nvme_write"].bytes_sent / acc.nvme_bandwidth
    tiers = by_tier(flows, DGX)
    assert tiers["pcie"] == rows["d2h"].bytes_sent + rows["h2d"].bytes_sent
    assert tiers["nvme"] == rows["nvme_read"].bytes_sent + rows["nvme_write"].bytes_sent


# -- time ---------------------------------------------------------------------------------------------------
def test_offload_time_formulas():
    """cpu: a flow shop of u equal units through d2h, the host's Adam, h2d, all ready after clipping;
    nvme: the host's chain against the disk's read + write, plus one unit's read and write not hidden."""
    assert offload_exposed(1, 1.0, 4.0, 0.5) == 5.5                                    # one unit: in turn
    assert offload_exposed(10, 1.0, 4.0, 0.5) == pytest.approx(5.5 / 10 + 0.9 * 4.0)   # the host's Adam paces
    assert offload_exposed(10, 1.0, 4.0, 0.5, 20.0, 20.0) == pytest.approx(4.0 + 40.0)  # the disk paces
    assert offload_exposed(10, 1.0, 4.0, 0.5, 1.0, 1.0) == pytest.approx(0.2 + 5.5)    # the host's chain paces
    # CPU Adam is memory bound: 6 master-precision accesses, the gradient and the 16-bit parameter
    acc = DGX.accelerator
    assert host_step_seconds(WORK8, acc, 1e9) == pytest.approx(1e9 * (6 * 4 + 4 + 2) / acc.host_bandwidth)


def test_zero3_nvme_parameter_reads_are_exposed():
    """Each all-gather waits for its shard's read from disk and copy up: those seconds are all exposed,
    beside the host step (whose disk traffic now includes the parameter shards' write)."""
    work = Workload(seq=32, global_batch=6, dtype="fp32")
    acc = DGX.accelerator
    k = -(-ROOT // 3) + 2 * -(-BLOCK // 3)
    est = estimate(TINY, Layout(dp=3, zero=3, offload="nvme"), work, DGX)
    reads = 4 * k * 4                                             # 4 gathers a unit, fp32 shards
    assert stage_param_reads(est.flows, work, 2) == pytest.approx(reads / acc.nvme_bandwidth + reads / acc.pcie_bandwidth)
    # the gradients streamed during the backward (2 micro-batches): the step waits for the last copy only
    last = 2 * k * 4 / acc.pcie_bandwidth / 6
    step = last + offload_exposed(3, 0.0, host_step_seconds(work, acc, k), 0.0,
                                  12 * k / acc.nvme_bandwidth, 16 * k / acc.nvme_bandwidth)
    assert stage_offload_exposed(est.flows, work, acc, 2) == pytest.approx(step)
    assert est.time.offload_s == pytest.approx(step + stage_param_reads(est.flows, work, 2))
    cpu = estimate(TINY, Layout(dp=3, zero=3, offload="cpu"), work, DGX)
    assert stage_param_reads(cpu.flows, work, 2) == 0.0


def test_step_time_charges_the_host_step_not_the_device_optimizer():
    lay = Layout(dp=1, zero=1, recompute="full")
    plain = estimate(LLAMA8, lay, WORK8, DGX)
    cpu = estimate(LLAMA8, replace(lay, offload="cpu"), WORK8, DGX)
    nvme = estimate(LLAMA8, replace(lay, offload="nvme"), WORK8, DGX)
    t = cpu.time
    assert plain.time.offload_s == 0 and plain.time.optimizer_s > 0
    assert t.optimizer_s == 0 and t.offload_s > 0
    assert t.step_time_s == pytest.approx(t.pipeline_s + t.grad_comm_s + t.step_comm_s + t.offload_s)
    # the host's Adam over 8.03 B fp32 elements at 60 GB/s paces it: 30 bytes each, about 4 s
    assert t.offload_s == pytest.approx(LLAMA8.num_params() * 30 / 60e9, rel=0.01)
    # disk: 24 bytes per parameter read and written at 3.5 GB/s
    assert nvme.time.offload_s == pytest.approx(LLAMA8.num_params() * 24 / 3.5e9, rel=0.01)
    assert cpu.to_dict()["offload"]["exposed_s"] == t.offload_s


# -- search -------------------------------------------------------------------------------------------------
def test_search_offloads_only_when_nothing_fits():
    one = search(LLAMA8, WORK8, DGX, 1, top=3)
    assert one.best and all(e.layout.offload == "cpu" for e in one.best) and one.best[0].fits
    assert one.offload["cpu"] == 1 and "nvme" not in one.offload and one.offload["fit"] == one.fit
    assert any(why.startswith("memory") and lay.offload == "none" for lay, why in one.rejected)
    eight = search(LLAMA8, Workload(seq=4096, global_batch=64), DGX, 8, top=3)
    assert eight.best and not eight.offload
    assert all(lay.offload == "none" for _, lay in eight.ranked)
    assert all(lay.offload == "none" for lay, _ in eight.rejected)
    never = search(LLAMA8, WORK8, DGX, 1, top=3, fixed={"offload": "none"})
    assert not never.best and not never.offload


def test_search_goes_to_nvme_when_the_host_is_too_small():
    small = replace(DGX, accelerator=replace(DGX.accelerator, host_memory=64 * GiB))
    res = search(LLAMA8, WORK8, small, 1, top=2)
    assert res.best and all(e.layout.offload == "nvme" for e in res.best)
    assert res.offload["cpu"] == res.offload["nvme"] == 1
    host = [why for lay, why in res.rejected if why.startswith("host memory")]
    assert host and "offload cpu" in host[0] and "> 64 GiB per GPU" in host[0]


def test_fixed_offload_is_held():
    res = search(LLAMA8, Workload(seq=4096, global_batch=64), DGX, 8, top=2, fixed={"offload": "cpu"})
    assert res.best and all(lay.offload == "cpu" and lay.zero >= 1 for _, lay in res.ranked)


# -- the CLI, the topology, bad values ------------------------------------------------------------------------
def test_cli_offload_text_and_json(capsys):
    argv = ["plan", "--model", "llama3-8b", "--gpus", "1", "--tp", "1", "--pp", "1", "--cp", "1", "--zero", "1",
            "--recompute", "full", "--global-batch", "8", "--offload", "nvme"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "offload-nvme" in out and "host GiB" in out and "disk GiB" in out and "+ offload" in out
    assert "offload nvme: optimizer state 89.75 GiB off the device" in out and "to and from NVMe" in out
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"]["offload"] == "nvme" and d["fits"] and d["memory"]["optimizer"] == 0
    assert d["memory"]["disk"] == 12 * LLAMA8.num_params() and d["offload"]["nvme_bytes"] > 0
    assert {r["op"] for r in d["traffic"]["offload"]} == {"d2h", "h2d", "nvme_read", "nvme_write"}
    assert {"pcie", "nvme"} <= set(d["bytes_per_tier"])


def test_config_planning_reads_offload(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text('[parallel]\ndp = 2\nzero = 2\noffload = "cpu"\n[train]\nglobal_batch = 8\nseq_len = 64\n')
    assert main(["plan", "--config", str(f), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"]["offload"] == "cpu" and [r["op"] for r in d["traffic"]["offload"]] == ["d2h", "h2d"]


def one_line(argv, capsys) -> str:
    assert main(["plan", "--model", "llama3-8b", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fivefold: config error: "), err
    return err[0]


def test_bad_values_are_one_line_errors(capsys, tmp_path):
    assert "needs zero 1, 2 or 3 (got zero 0)" in one_line(["--gpus", "1", "--tp", "1", "--pp", "1", "--cp", "1",
                                                             "--offload", "cpu"], capsys)
    with pytest.raises(ConfigError, match=r"^offload must be one of none, cpu, nvme, got 'gpu'$"):
        estimate(LLAMA8, Layout(zero=1, offload="gpu"), WORK8, DGX)
    with pytest.raises(SystemExit):                       # argparse's own one line for an unknown choice
        main(["plan", "--offload", "disk"])
    capsys.readouterr()
    for key, value, message in (("pcie_gbps", 0, "pcie_gbps must be a finite number > 0"),
                                ("host_memory_gib", -1, "host_memory_gib must be a finite number > 0"),
                                ("host_gbps", "fast", "host_gbps must be a number > 0 (host memory bandwidth per "
                                                      "GPU), got 'fast'"),
                                ("nvme_gbps", float("nan"), "nvme_gbps must be a finite number > 0")):
        f = tmp_path / "host.toml"
        v = f'"{value}"' if isinstance(value, str) else ("nan" if value != value else value)
        f.write_text(f"[accelerator]\npeak_tflops = {{ bf16 = 989 }}\nmemory_gib = 80\n{key} = {v}\n"
                     f"[[tier]]\nname = \"nvlink\"\nsize = 8\nbandwidth_gbps = 450\n")
        assert message in one_line(["--gpus", "8", "--topology", str(f)], capsys), key
    f = tmp_path / "pcie.toml"
    f.write_text('accelerator = "h100"\n[[tier]]\nname = "pcie"\nsize = 8\nbandwidth_gbps = 64\n')
    assert "tier 0 is named 'pcie'" in one_line(["--gpus", "8", "--topology", str(f)], capsys)


def test_topology_host_side():
    """Presets carry their DGX node's per-GPU host side; a TOML gives its own, and a custom accelerator
    without them is its own host (a CPU-only machine): PCIe and host bandwidth = memory bandwidth."""
    acc = DGX.accelerator
    assert (acc.pcie_bandwidth, acc.host_memory, acc.host_bandwidth, acc.nvme_bandwidth) == \
        (55 * GB, 256 * GiB, 60 * GB, 3.5 * GB)
    tiers = [{"name": "local", "size": 2, "bandwidth_gbps": 5}]
    own = topology_from_dict({"accelerator": {"peak_tflops": {"fp32": 0.1}, "memory_gib": 16, "hbm_gbps": 20},
                              "tier": tiers}).accelerator
    assert (own.pcie_bandwidth, own.host_memory, own.host_bandwidth) == (20 * GB, 16 * GiB, 20 * GB)
    given = topology_from_dict({"accelerator": {"peak_tflops": {"bf16": 989}, "memory_gib": 80, "pcie_gbps": 25,
                                                "host_memory_gb": 128, "host_gbps": 40, "nvme_gbps": 6.5},
                                "tier": tiers}).accelerator
    assert (given.pcie_bandwidth, given.host_memory, given.host_bandwidth, given.nvme_bandwidth) == \
        (25 * GB, 128 * GB, 40 * GB, 6.5 * GB)
