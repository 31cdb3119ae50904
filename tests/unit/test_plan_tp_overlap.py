"""The planner's tp overlap (plan/time.py `tp_hidden`, plan/traffic.py `tp_overlapped`) follows what the
runtime does (parallel/tensor_overlap.py): each part's input-gradient collective hides behind the part's
weight-gradient GEMM and, under SP, the MLP's all-gather behind the projection of the rank's own rows; at
most the GEMM, at most the collective less the SMs' share it takes, scaled by the tier's measured overlap."""
from dataclasses import replace

import pytest

from fivefold.plan.estimate import estimate
from fivefold.plan.gemm import gemm_seconds, linear_rate
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.models import PRESETS
from fivefold.plan.time import call_seconds, tp_hidden
from fivefold.plan.topology import TOPOLOGIES, topology_from_dict
from fivefold.plan.traffic import stage_flows, tp_overlapped
from fivefold.plan.tiers import place
from fivefold.shapes import padded_vocab

LLAMA = PRESETS["llama3-8b"]
H100 = TOPOLOGIES["dgx-h100"]
WORK = Workload(seq=4096, global_batch=64)


def placed(model, lay, work, topo, stage=0):
    return place(stage_flows(model, lay, work, stage), lay, topo)


@pytest.mark.parametrize("sp", ["none", "megatron"])
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_what_overlaps_is_each_entry_the_sp_mlp_gather_and_on_gloo_its_exit(sp, backend):
    work = replace(WORK, backend=backend)
    lay = Layout(tp=4, dp=2, sp_mode=sp, micro_batch=2)
    rows = tp_overlapped(LLAMA, lay, work, 0)
    T, h, t = 2 * 4096, LLAMA.hidden, 4
    act = T * h * work.act_bytes
    back = "reduce_scatter" if sp == "megatron" else "all_reduce"
    qkv = (T, (LLAMA.q_width + LLAMA.kv_width + LLAMA.v_width) / t, h)
    mlp = (T, 2 * LLAMA.ffn / t, h)
    exits = sp == "megatron" and backend == "gloo"     # an exit's reduce-scatter takes the own chunk later
    wo = [("forward", "reduce_scatter", act, 1, (T / t, h, LLAMA.attn_out_width / t)),
          ("backward", "all_gather", act, 1, (2 * T / t, h, LLAMA.attn_out_width / t))] if exits else []
    want = [("backward", back, act, 1, qkv), *wo, ("backward", back, act, 1, mlp)]
    if sp == "megatron":
        want.append(("forward", "all_gather", act, 1, (T / t, 2 * LLAMA.ffn / t, h)))
    if exits:
        want += [("forward", "reduce_scatter", act, 1, (T / t, h, LLAMA.ffn / t)),
                 ("backward", "all_gather", act, 1, (2 * T / t, h, LLAMA.ffn / t))]
    assert rows[:len(want)] == want
    assert len(rows) == len(want) * LLAMA.layers + 1                      # and the head, once
    assert rows[-1] == ("backward", back, act, 1, (T, padded_vocab(LLAMA.vocab, t) / t, h))
    # the bytes are the plain path's: every overlapped call is one of the placed rows' calls
    calls = {f.op: f.calls for f in placed(LLAMA, lay, work, H100) if f.dim == "tp" and f.group == "tp"}
    m = 64 // (2 * 2)
    for op in {r[1] for r in rows}:
        assert m * sum(r[3] for r in rows if r[1] == op) <= calls[op]


def test_nothing_overlaps_where_the_runtime_takes_the_plain_path():
    lay = Layout(tp=2, pp=2, dp=2, sp_mode="megatron", micro_batch=1)
    assert tp_overlapped(LLAMA, replace(lay, schedule="zb"), WORK, 0) == []             # W replays modules
    assert tp_overlapped(LLAMA, replace(lay, tp_overlap=False), WORK, 0) == []
    assert tp_overlapped(LLAMA, replace(lay, tp=1, dp=4), WORK, 0) == []
    lora = replace(LLAMA, lora_rank=16, lora_targets=("wq", "wk", "wv", "wo", "gate", "up", "down"))
    assert tp_overlapped(lora, lay, WORK, 0) == []                     # adapters everywhere, weights frozen
    attn = replace(LLAMA, lora_rank=16, lora_targets=("wq", "wv"))
    rows = tp_overlapped(attn, lay, WORK, 0)                           # frozen MLPs: only the forward gather
    assert rows and {r[:2] for r in rows} == {("forward", "all_gather")}
    frozen = replace(LLAMA, frozen=("layers.*",))
    rows = tp_overlapped(frozen, replace(lay, pp=1, dp=4), WORK, 0)
    assert {r[:2] for r in rows} == {("forward", "all_gather"), ("backward", "reduce_scatter")}
    assert sum(r[0] == "backward" for r in rows) == 1   # the head
    # a frozen prefix: embedding and layer 0's norm frozen, its q/k/v trained: that entry's input needs no
    # gradient (autograd never runs its collective), so it hides nothing; the next entries do
    prefix = replace(LLAMA, frozen=("embed.weight", "layers.0.attn_norm.weight"))
    one = replace(lay, pp=1, dp=4)
    full, cut = tp_overlapped(LLAMA, one, WORK, 0), tp_overlapped(prefix, one, WORK, 0)
    assert [r for r in full if r[0] == "backward"][1:] == [r for r in cut if r[0] == "backward"]


def test_call_seconds_are_the_rows_rate():
    lay = Layout(tp=8, dp=1, sp_mode="megatron", micro_batch=1)
    for f in placed(LLAMA, lay, WORK, H100):
        if f.dim == "tp" and f.op == "all_gather":     # one message size: every call the same
            assert f.calls * call_seconds(f, H100, f.message_bytes / f.calls) == pytest.approx(f.seconds)


def _hidden_by_hand(model, lay, work, topo):
    flows = {f.op: f for f in placed(model, lay, work, topo) if f.dim == "tp" and f.group == "tp"}
    acc, o = topo.accelerator, topo.tiers[0].overlap
    fwd = bwd = 0.0
    for direction, op, message, calls, (m, n, k) in tp_overlapped(model, lay, work, 0):
        c = call_seconds(flows[op], topo, message)
        t = gemm_seconds(m, n, k, linear_rate(acc, work), acc.hbm_bandwidth, work.act_bytes, acc.gemm_kernel)
        part = calls * o * min(t, (1 - acc.comm_share) * c)
        fwd, bwd = (fwd + part, bwd) if direction == "forward" else (fwd, bwd + part)
    return fwd, bwd


@pytest.mark.parametrize("gbps", [900, 5])
def test_a_call_hides_at_most_its_gemm_and_at_most_itself(gbps):
    """On NVLink a call is shorter than its GEMM: (1 - comm_share) of it hides; over a 5 GB/s tier the GEMM
    is the shorter: all of it. The step is shorter by exactly what hides, micro-batch by micro-batch."""
    topo = topology_from_dict({"accelerator": "h100", "tier": [{"name": "box", "size": 8, "bandwidth_gbps": gbps,
                                                                  "latency_us": 3, "overlap": 0.75}]})
    lay = Layout(tp=8, dp=1, sp_mode="megatron", micro_batch=1)
    work = Workload(seq=4096, global_batch=8)
    fwd, bwd = tp_hidden(LLAMA, lay, work, topo, placed(LLAMA, lay, work, topo), 0)
    assert (fwd, bwd) == pytest.approx(_hidden_by_hand(LLAMA, lay, work, topo))
    acc = topo.accelerator
    gemms = sum(calls * gemm_seconds(m, n, k, linear_rate(acc, work), acc.hbm_bandwidth, work.act_bytes,
                                     acc.gemm_kernel)
                for d, _, _, calls, (m, n, k) in tp_overlapped(LLAMA, lay, work, 0) if d == "backward")
    if gbps == 5:
        assert bwd == pytest.approx(0.75 * gemms)
    else:
        assert bwd < 0.75 * gemms
    on = estimate(LLAMA, lay, work, topo).time
    off = estimate(LLAMA, replace(lay, tp_overlap=False), work, topo).time
    m = 8
    assert off.layer_comm_s - on.layer_comm_s == pytest.approx(m * (fwd + bwd))
    assert off.step_time_s - on.step_time_s == pytest.approx(m * (fwd + bwd))


def test_a_calibrated_host_hides_its_measured_share():
    """A CPU host's tier overlaps a measured share (`Tier.overlap`, calibrate's): half hides, not all."""
    topo = topology_from_dict({"accelerator": {"peak_tflops": {"fp32": 0.07}, "memory_gb": 24},
                               "tier": [{"name": "loopback", "size": 2, "bandwidth_gbps": 2, "latency_us": 50,
                                         "overlap": 0.5}]})
    model = replace(LLAMA, layers=2)
    lay = Layout(tp=2, dp=1, micro_batch=1)
    work = Workload(seq=256, global_batch=8, dtype="fp32")
    fwd, bwd = tp_hidden(model, lay, work, topo, placed(model, lay, work, topo), 0)
    assert fwd == 0 and bwd > 0
    full = tp_hidden(model, lay, work, topology_from_dict({**{"accelerator": {"peak_tflops": {"fp32": 0.07},
                                                                             "memory_gb": 24}},
                                                           "tier": [{"name": "loopback", "size": 2,
                                                                     "bandwidth_gbps": 2, "latency_us": 50}]}),
                     placed(model, lay, work, topo), 0)[1]
    assert bwd == pytest.approx(0.5 * full)
