"""Mechanisms behind published runs (docs/plan.md, "Mechanisms"): gradient reduction under a pipeline
(accumulated, reduced once in the reduce dtype, bucketed, hidden in the last backwards and the drain),
and MoE at scale (two-stream all-to-all overlap, node-limited routing, FP8 GEMMs). Each test checks a
mechanism's formula; the published layouts (Llama-3 405B, DeepSeek-V3) are few and only say that the
layout is expressible and what the mechanisms change, never tune a constant to a paper."""
from dataclasses import replace

import pytest

from fivefold.comm import volume
from fivefold.config import ConfigError
from fivefold.plan.estimate import estimate
from fivefold.plan.layout import Layout, Workload, check, from_config, microbatches
from fivefold.plan.activations import layer_acts, stage_activations
from fivefold.plan.memory import stage_memory
from fivefold.plan.units import ExpertSplit, layer_rank_params
from fivefold.plan.models import PRESETS
from fivefold.plan.time import (MERGE_GROUPS, bucket_groups, chunk_first_use, chunk_ready, ep_exposed,
                                fp8_cast_seconds, gather_delay, grad_streams, reduction_end, stage_flops,
                                stage_grad_exposed)
from fivefold.plan.topology import TOPOLOGIES, GiB, topology_from_dict
from fivefold.plan.traffic import Flow, stage_flows
from fivefold.plan.tiers import ep_nodes, place

from tests.support.deepseek import DSV3, DSV3_LAYOUT, DSV3_WORK, H800
from tests.support.tiny import tiny_config

LLAMA8 = PRESETS["llama3-8b"]
MIXTRAL = PRESETS["mixtral-8x7b"]


def rows(flows):
    return {(f.dim, f.op, f.part): f for f in flows}


# -- gradient reduction under a pipeline ----------------------------------------------------------------
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_pipeline_reduces_once_per_step_in_the_reduce_dtype(zero):
    """Under a pipeline every ZeRO stage (and DDP) accumulates over the micro-batches and reduces each
    bucket or unit once per step; the bytes follow the reduce dtype, the parameter gathers do not."""
    w = Workload(seq=1024, global_batch=64)                   # 32 micro-batches of one sequence per dp rank
    lay = Layout(pp=4, dp=2, zero=zero, micro_batch=1)
    op = "all_reduce" if zero == 0 else "reduce_scatter"
    fp32 = rows(stage_flows(LLAMA8, lay, w, 1))
    bf16 = rows(stage_flows(LLAMA8, lay, replace(w, reduce_dtype="bf16"), 1))
    red = fp32[("dp", op, "")]
    twice = rows(stage_flows(LLAMA8, lay, replace(w, global_batch=128), 1))[("dp", op, "")]
    assert twice.calls == red.calls and twice.bytes_sent == red.bytes_sent   # not per micro-batch
    assert bf16[("dp", op, "")].bytes_sent == pytest.approx(red.bytes_sent / 2)
    assert bf16[("dp", op, "")].calls == red.calls               # buckets follow the accumulation dtype
    if zero:
        assert bf16[("dp", "all_gather", "")].bytes_sent == fp32[("dp", "all_gather", "")].bytes_sent


def _queue(free, groups):
    """Brute force: bucket k of u becomes final at t - d + k·d/u, buckets run one at a time in order."""
    for t, d, r_sum, u in groups:
        for k in range(1, u + 1):
            free = max(free, t - d + k * d / u) + r_sum / u
    return free


@pytest.mark.parametrize("groups", [
    [(10.0, 1.0, 0.2, 4)],                         # hidden but the last bucket
    [(10.0, 1.0, 3.0, 4)],                         # longer than the backward
    [(4.0, 0.5, 1.0, 2), (7.0, 0.5, 1.0, 2), (10.0, 0.5, 1.0, 2)],   # chunks of an interleaved stage
    [(4.0, 0.5, 5.0, 3), (5.0, 0.5, 5.0, 3)],      # a backlog carried into the next chunk
    [(10.0, 0.0, 2.0, 8)],                         # all at once (reduction after the schedule)
])
def test_reduction_end_is_the_bucket_queue(groups):
    assert reduction_end(float("-inf"), groups) == pytest.approx(_queue(float("-inf"), groups))


def test_drain_hides_later_stages_reduction():
    """1F1B, p = 4, unit costs: stage s's last backward ends s·(B + send) before stage 0's, so with the
    reduction launched when the stage's schedule ends (the runtime) stage s exposes max(0, R - s·B);
    launched bucket by bucket during the last backward (production) only max(R/u, R - B(1 - 1/u))
    past the stage's own end."""
    cost_b = {s: 1.0 for s in range(4)}
    end, r_sum, u = 20.0, 1.5, 4
    flows = [Flow("dp", "reduce_scatter", "dp_cp", 8, calls=u, seconds=r_sum)]
    for s in range(4):
        ready = chunk_ready(None, "1f1b", 4, 1, s, end, cost_b, 0.0)
        assert ready == [(end - s * 1.0, 1.0)]
        after, _ = stage_grad_exposed(flows, Layout(pp=4, dp=8, zero=1, overlap_grad_reduce=False), 8, end, ready,
                                      [(0.0, 0.5)], 0.5, 1.0)
        during, _ = stage_grad_exposed(flows, Layout(pp=4, dp=8, zero=1), 8, end, ready, [(0.0, 0.5)], 0.5, 1.0)
        assert after == pytest.approx(max(0.0, r_sum - s))
        assert during == pytest.approx(max(0.0, max(r_sum / u, r_sum - 1.0 * (1 - 1 / u)) - s))


def _series_queue(ready, streams):
    """Brute force over every bucket: each series' u buckets final evenly through each chunk's backward
    (1/k of the series a chunk), all launched in the order they become final, one at a time."""
    k, buckets = len(ready), []
    for t, d in ready:
        for r_sum, u in streams:
            u = max(1, round(u / k))
            buckets += [(t - d + j * d / u, r_sum / k / u) for j in range(1, u + 1)]
    free = float("-inf")
    for at, r in sorted(buckets):
        free = max(free, at) + r
    return free


def test_each_gradient_group_fills_its_own_buckets():
    """A MoE's dense gradients (dp) and its experts' (edp) go in buckets of their own (the runtime never
    mixes groups): two groups of one bucket each are both final only when the backward ends, so nothing
    hides behind it, where one stream of two buckets would have hidden the first from mid-backward."""
    flows = [Flow("dp", "all_reduce", "dp_cp", 4, calls=1, seconds=0.2),
             Flow("edp", "all_reduce", "edp", 2, calls=1, seconds=1.4)]
    assert sorted(grad_streams(flows)) == [(0.2, 1), (1.4, 1)]
    lay = Layout(dp=4, ep=2)
    exposed, _ = stage_grad_exposed(flows, lay, 1, 10.0, [(10.0, 1.0)], [(0.0, 0.5)], 0.5, 1.0)
    assert exposed == pytest.approx(1.6)
    one_stream = [Flow("dp", "all_reduce", "dp_cp", 4, calls=2, seconds=1.6)]
    hidden, _ = stage_grad_exposed(one_stream, lay, 1, 10.0, [(10.0, 1.0)], [(0.0, 0.5)], 0.5, 1.0)
    assert hidden == pytest.approx(1.1)                 # the first bucket's 0.8 s from t - 0.5


@pytest.mark.parametrize("ready, streams", [
    ([(10.0, 2.0)], [(0.6, 4)]),                                     # one series: the closed form as it was
    ([(10.0, 2.0)], [(0.6, 4), (1.2, 8)]),                           # two series, a bucket a span
    ([(10.0, 2.0)], [(0.3, MERGE_GROUPS), (2.5, 3)]),
    ([(4.0, 0.5), (7.0, 0.5), (10.0, 0.5)], [(0.9, 6), (3.0, 3)]),    # chunks of an interleaved stage
])
def test_merged_series_are_the_bucket_queue(ready, streams):
    """Where every series has at most MERGE_GROUPS buckets each span is one bucket, and the groups
    `bucket_groups` hands `reduction_end` give the queue of every bucket of every series."""
    groups = [g for g, _ in bucket_groups(ready, streams)]
    assert reduction_end(float("-inf"), groups) == pytest.approx(_series_queue(ready, streams))


def test_longer_series_end_within_a_span_of_the_queue():
    """Beyond MERGE_GROUPS buckets a span (2 and 3 buckets here) runs whole before the next, so where
    two series' buckets interleave inside a span the stream ends later than the queue, by less than the
    longest span's seconds (never earlier: the bound on what hides is kept)."""
    ready, streams = [(10.0, 2.0)], [(0.32, 2 * MERGE_GROUPS), (0.48, 3 * MERGE_GROUPS)]
    spans = bucket_groups(ready, streams)
    end, queue = reduction_end(float("-inf"), [g for g, _ in spans]), _series_queue(ready, streams)
    assert queue <= end < queue + max(g[2] for g, _ in spans)
    assert end > queue                                               # the case does interleave


def test_interleaved_chunks_finish_along_the_last_backward_chain():
    """Closed form: global chunk q = c·p + s finishes q·(B/v + send) before the end; its first forward
    starts q·(F/v + send) after the start. The simulator agrees for uniform stages."""
    from fivefold.parallel.pipeline import build_schedule
    from fivefold.plan.time import _simulate

    p, v, m = 4, 2, 8
    cost_f, cost_b = {s: 1.0 for s in range(p)}, {s: 2.0 for s in range(p)}
    sim = _simulate(build_schedule("interleaved", p, m, v), p, m, v, [1.0] * p, [2.0] * p, 0.0)
    for s in range(p):
        closed = chunk_ready(None, "interleaved", p, v, s, sim.makespan, cost_b, 0.0)
        assert closed == [(sim.makespan - (c * p + s) * 1.0, 1.0) for c in reversed(range(v))]
        simulated = chunk_ready(sim, "interleaved", p, v, s, sim.makespan, cost_b, 0.0)
        assert [x for pair in simulated for x in pair] == pytest.approx([x for pair in closed for x in pair])
        first = chunk_first_use(None, p, v, s, cost_f, 0.0)
        assert first == [((c * p + s) * 0.5, 0.5) for c in range(v)]
        assert list(chunk_first_use(sim, p, v, s, cost_f, 0.0)[0]) == pytest.approx(list(first[0]))


def test_parameter_gather_waits_only_for_what_the_first_forward_needs():
    """Bucket k of u is needed (k-1)·d/u into its chunk's first forward: the first bucket is always
    waited for; the rest hide while the forward runs, and behind the pipeline fill on later stages."""
    assert gather_delay([(0.0, 1.0)], 0.4, 4) == pytest.approx(0.1)
    assert gather_delay([(0.0, 1.0)], 4.0, 4) == pytest.approx(4.0 - 0.75)
    assert gather_delay([(2.0, 1.0)], 0.4, 4) == 0.0


def test_llama3_405b_reduction_hides_in_the_drain():
    """Dubey et al. 2024, §3.3.2/§3.3.4: TP8 PP16 DP128, FP32 gradients accumulated over the micro-batches
    and reduce-scattered in FP32. Launched as the last backwards make buckets final, the reduction of a
    stage hides in the drain behind it; launched after the schedule it is stage 0's whole reduction."""
    model = PRESETS["llama3-405b"]
    block_mb = layer_rank_params(model, 0, 8, ExpertSplit())[0] * 4 / 2**20
    lay = Layout(tp=8, pp=16, dp=128, zero=2, sp_mode="megatron", vpp=4, schedule="interleaved",
                 partition="llama3", order="tp-cp-ep-pp-dp", bucket_mb=block_mb)
    w = Workload(seq=8192, global_batch=2048)
    topo = TOPOLOGIES["llama3"]
    prod = estimate(model, lay, w, topo, 16384)
    runtime = estimate(model, replace(lay, overlap_grad_reduce=False, overlap_param_gather=False), w, topo, 16384)
    rs0 = next(f.seconds for f in prod.flows_by_stage[0] if f.dim == "dp" and f.op == "reduce_scatter")
    assert runtime.time.grad_comm_s >= rs0
    assert prod.time.grad_comm_s < rs0 / 2
    assert prod.time.mfu > runtime.time.mfu
    bf16 = estimate(model, lay, replace(w, reduce_dtype="bf16"), topo, 16384)
    assert sum(f.bytes_sent for f in bf16.flows if f.dim == "dp") < sum(f.bytes_sent for f in prod.flows if f.dim == "dp")


def test_from_config_plans_what_the_runtime_does():
    """The runtime reduces in its accumulation dtype, each chunk's buckets after its last backward under
    a pipeline (parallel.overlap_grad_reduce; off: after the stage's schedule), and gathers ZeRO-1/2
    parameters after the step."""
    cfg = tiny_config(pp=2, dp=2, zero=1, microbatches=2)
    cfg.train.dtype = "bf16"
    lay, w = from_config(cfg)
    assert w.reduce_bytes == 4 and lay.overlap_grad_reduce and not lay.overlap_param_gather
    cfg.parallel.overlap_grad_reduce = False
    lay, _ = from_config(cfg)
    assert not lay.overlap_grad_reduce
    cfg.train.main_grads_fp32 = False
    _, w = from_config(cfg)
    assert w.reduce_dtype == "bf16" and w.grad_bytes == 2 and w.reduce_bytes == 2
    lay, _ = from_config(tiny_config(dp=2))
    assert lay.overlap_grad_reduce            # without a pipeline the runtime's buckets overlap the backward
    lay, _ = from_config(tiny_config(pp=2, dp=2, zero=2, microbatches=2, reduce_each_microbatch=True))
    assert lay.reduce_each_microbatch


def test_a_frozen_vocabulary_table_makes_no_gradient_at_the_edges():
    """The embedding's and the head's backward make the table's dense gradient (vocab/t × hidden) only where
    the table trains: under LoRA, or train.freeze of the table, the edge holds the residual's gradient
    alone (the dry run of Llama-3 8B, LoRA, tp8: 149.9 MB planned against 98.5 measured before)."""
    from fivefold.plan.buffers import edge_scratch, hidden_tensor_bytes

    w, lay = Workload(seq=1024, global_batch=2), Layout(tp=8, dp=2, zero=3)
    table = 2 * LLAMA8.hidden * LLAMA8.vocab / 8
    for stage_layout in (lay, replace(lay, pp=2)):
        for stage in ((0,) if stage_layout.pp == 1 else (0, 1)):
            trained = edge_scratch(LLAMA8, stage_layout, w, stage)
            lora = edge_scratch(replace(LLAMA8, lora_rank=16, lora_targets=("wq",)), stage_layout, w, stage)
            assert trained - lora == pytest.approx(table, rel=0.01) and lora >= hidden_tensor_bytes(LLAMA8, stage_layout, w)
    head_frozen = replace(LLAMA8, frozen=("head.weight",))
    assert edge_scratch(head_frozen, replace(lay, pp=2), w, 1) < edge_scratch(head_frozen, replace(lay, pp=2), w, 0)


def test_reduce_each_microbatch_trades_gradient_memory_for_traffic():
    """ZeRO-2 under a pipeline: accumulating the full gradient costs g·G of buffers and one reduce-scatter
    per unit; reducing every micro-batch keeps only shards and block-sized buffers, for m times the
    bytes of every unit but the held (tied) root. ZeRO-1 cannot: it keeps full gradients by definition."""
    w = Workload(seq=4096, global_batch=64)
    once = Layout(pp=4, dp=8, zero=2, micro_batch=1)
    each = replace(once, reduce_each_microbatch=True)
    m = microbatches(once, w)
    for stage in (0, 1):
        a, b = stage_memory(LLAMA8, once, w, stage), stage_memory(LLAMA8, each, w, stage)
        assert b["buffers"] < a["buffers"] / (1 if stage == 0 else 2) and b["grads"] == a["grads"]   # 0: embedding
        rs = {lay.reduce_each_microbatch: sum(f.bytes_sent for f in stage_flows(LLAMA8, lay, w, stage)
                                               if f.op == "reduce_scatter") for lay in (once, each)}
        assert rs[True] / rs[False] == pytest.approx(m, rel=0.02)   # Llama 3 8B is untied: nothing held
    with pytest.raises(ConfigError, match="reduce_each_microbatch"):
        check(LLAMA8, replace(each, zero=1), w)


def test_mechanism_options_are_checked():
    w = Workload(seq=1024, global_batch=8)
    with pytest.raises(ConfigError, match="reduce_dtype"):
        check(LLAMA8, Layout(dp=8), replace(w, reduce_dtype="fp8"))
    with pytest.raises(ConfigError, match="moe_route_nodes"):
        check(MIXTRAL, Layout(dp=8, ep=8), replace(w, moe_route_nodes=-1))
    with pytest.raises(ConfigError, match="no experts"):
        check(LLAMA8, Layout(dp=8), replace(w, moe_route_nodes=2))
    with pytest.raises(ConfigError, match="ep_overlap"):
        check(MIXTRAL, Layout(dp=8, ep=8, ep_overlap=1), w)


# -- MoE at scale ---------------------------------------------------------------------------------------
def test_two_stream_overlap_exposes_only_the_excess():
    """DualPipe: a forward chunk's all-to-alls (half of them without recompute) run beside another
    micro-batch's backward compute, the backward's beside its forward compute."""
    assert ep_exposed(1.0, 0.3, 0.6, 1, False, 8) == 1.0
    assert ep_exposed(1.0, 0.3, 0.6, 1, True, 8) == pytest.approx(0.2)          # (0.5 - 0.6)+ + (0.5 - 0.3)+
    assert ep_exposed(0.4, 0.3, 0.6, 1, True, 8) == 0.0
    assert ep_exposed(1.0, 0.3, 0.6, 1, True, 1) == 1.0                         # no other micro-batch
    assert ep_exposed(1.2, 0.3, 0.9, 2, True, 8) == pytest.approx(0.8 - 0.3)    # full recompute: 1/3 forward


def test_node_limited_routing_splits_the_all_to_all_by_tier():
    """DeepSeek-V3 §3.2.2: a token crosses the network once per remote node it selects (at most M of the
    k nodes of its ep group) and reaches its experts over NVLink; the ledger's rows (stage_flows) stay
    the plain all-to-all, placement splits them."""
    topo = TOPOLOGIES["dgx-h100"]
    MOE32 = replace(MIXTRAL, name="moe32", experts=32)     # top-2 of 32 experts
    lay = Layout(ep=32, dp=32)                              # 4 nodes of 8
    w = Workload(seq=4096, global_batch=64)
    plain = rows(stage_flows(MOE32, lay, w, 0))[("ep", "all_to_all", "")]
    limited = stage_flows(MOE32, lay, replace(w, moe_route_nodes=1), 0)
    routed = rows(limited)[("ep", "all_to_all", "routed")]
    assert routed.bytes_sent == plain.bytes_sent and routed.calls == plain.calls
    assert ep_nodes(lay, topo) == (4, 8)
    placed = rows(place(limited, lay, topo))
    inter, intra = placed[("ep", "all_to_all", "inter")], placed[("ep", "all_to_all", "intra")]
    top_k = MOE32.top_k
    for m_nodes in (1, 2, 4, 8):
        got = rows(place(stage_flows(MOE32, lay, replace(w, moe_route_nodes=m_nodes), 0), lay, topo))
        d = min(m_nodes, 4, top_k)
        assert got[("ep", "all_to_all", "inter")].bytes_sent == pytest.approx(
            volume.all_to_all(plain.message_bytes * d / top_k, 4))
    assert inter.tier == "leaf" and inter.n == 4 and intra.tier == "nvlink" and intra.n == 8
    assert intra.bytes_sent == pytest.approx(volume.all_to_all(plain.message_bytes, 8))
    # inside one node nothing crosses the network: the row stays whole
    small = place(stage_flows(MOE32, Layout(ep=8, dp=8), replace(w, moe_route_nodes=1), 0), Layout(ep=8, dp=8), topo)
    assert [f.part for f in small if f.dim == "ep"] == [""]
    # the network part and the forwarding run together: the longer counts
    t_plain = estimate(MOE32, lay, w, topo).time.layer_comm_s
    t_lim = estimate(MOE32, lay, replace(w, moe_route_nodes=1), topo).time.layer_comm_s
    assert t_lim < t_plain


def test_fp8_gemms_run_linear_layers_at_the_fp8_rate_plus_their_casts():
    """Linear layers at efficiency × fp8_gemm_ratio × the FP8 peak (tests/unit/test_plan_fp8.py: the ratio's
    source), attention and the LM head at the BF16 peak, and FP8's casts (`fp8_cast_seconds`) on top."""
    topo = TOPOLOGIES["dgx-h100"]
    lay, w = Layout(tp=8, dp=1), Workload(seq=4096, global_batch=8, gemm="flat")   # GEMMs at the flat efficiency
    bf16 = estimate(LLAMA8, lay, w, topo).time
    fp8 = estimate(LLAMA8, lay, replace(w, fp8_gemm=True), topo).time
    lin, attn, head = stage_flops(LLAMA8, lay, w, 0)
    acc, m = topo.accelerator, 8
    cast_f, cast_b = fp8_cast_seconds(LLAMA8, lay, replace(w, fp8_gemm=True), acc, 0, m)
    assert cast_f > 0 and cast_b > 0
    expect = m * (3 * (lin / (acc.peak("fp8") * acc.fp8_gemm_ratio) + (attn + head) / acc.peak("bf16")) / w.efficiency
                  + cast_f + cast_b)
    assert fp8.compute_s == pytest.approx(expect)
    assert bf16.compute_s == pytest.approx(m * 3 * (lin + attn + head) / acc.peak("bf16") / w.efficiency)
    a100 = topology_from_dict({"accelerator": "a100", "tier": [{"name": "nvlink", "size": 8, "bandwidth_gbps": 300}]})
    with pytest.raises(ConfigError, match="no peak for 'fp8'"):
        estimate(LLAMA8, lay, replace(w, fp8_gemm=True), a100)




def test_deepseek_v3_layout_is_expressible_and_its_mechanisms_act():
    e = estimate(DSV3, DSV3_LAYOUT, DSV3_WORK, H800, 2048)
    assert e.layout.edp == 2 and e.placement["ep"] == "ib"
    assert ep_nodes(DSV3_LAYOUT, H800) == (8, 8)
    ep = [f for f in e.flows if f.dim == "ep" and f.part]
    net = sum(f.bytes_sent for f in ep if f.part == "inter")
    assert {f.tier for f in ep if f.part == "inter"} == {"ib"} and {f.tier for f in ep if f.part == "intra"} == {"nvlink"}
    plain = estimate(DSV3, replace(DSV3_LAYOUT, ep_overlap=False), replace(DSV3_WORK, moe_route_nodes=0, fp8_gemm=False),
                     H800, 2048)
    whole = sum(f.bytes_sent for f in plain.flows if f.dim == "ep")
    assert net <= whole * 4 / 8                                # at most M/k of the plain all-to-all
    # the all-to-alls hide behind compute, which loses the SMs they take (time.interfered): share x a2a
    a2a = sum(f.seconds for f in ep if f.part == "inter")
    assert e.time.layer_comm_s == pytest.approx(H800.accelerator.comm_share * a2a, rel=0.05)
    assert e.time.layer_comm_s < 0.1 * e.time.compute_s
    assert e.time.step_time_s < plain.time.step_time_s
    for off in (replace(DSV3_LAYOUT, ep_overlap=False),):
        assert estimate(DSV3, off, DSV3_WORK, H800, 2048).time.step_time_s > e.time.step_time_s
    for off in (replace(DSV3_WORK, moe_route_nodes=0), replace(DSV3_WORK, fp8_gemm=False)):
        assert estimate(DSV3, DSV3_LAYOUT, off, H800, 2048).time.step_time_s > e.time.step_time_s


def test_deepseek_v3_layout_fits():
    """With FP8 activation caching and the norm/up-projection recompute the layout fits in 80 GB; with
    neither (MHA-sized bf16 tensors) it does not, and each mechanism alone lowers every stage."""
    e = estimate(DSV3, DSV3_LAYOUT, DSV3_WORK, H800, 2048)
    assert e.fits, e.warnings
    assert e.memory.most_loaded["total"] < 80 * GiB
    plain = estimate(DSV3, replace(DSV3_LAYOUT, recompute_norm_mla=False), replace(DSV3_WORK, fp8_act_cache=False),
                     H800, 2048)
    assert not plain.fits
    for one in (estimate(DSV3, DSV3_LAYOUT, replace(DSV3_WORK, fp8_act_cache=False), H800, 2048),
                estimate(DSV3, replace(DSV3_LAYOUT, recompute_norm_mla=False), DSV3_WORK, H800, 2048)):
        for a, b, c in zip(e.memory.stages, one.memory.stages, plain.memory.stages):
            assert a["activations"] < b["activations"] < c["activations"]
            assert a["weights"] == b["weights"] == c["weights"]


# -- what a layer stores: FP8 caching and the norm / MLA up-projection recompute ------------------------
def test_fp8_activation_cache_formula():
    """DeepSeek-V3 §3.3.3: inputs of FP8 linear layers cached at 1 byte (QKV input, dense MLP input and down
    projection, dispatched expert inputs, MLA up-projection inputs), the attention output at 1.5 (E5M6),
    experts' activation inputs at 1 byte with the output (the down projection's input) recomputed; norm
    inputs, Q/K/V, the router's input and fp32 router logits stay as they were. Per token, e = 2 bytes."""
    w = Workload(seq=4096, flash=True)
    f8 = replace(w, fp8_act_cache=True)
    e, h = 2, LLAMA8.hidden
    dense = layer_acts(LLAMA8, 0, w).per_rank(1, False, False) - layer_acts(LLAMA8, 0, f8).per_rank(1, False, False)
    assert dense == (e - 1) * (h + h + LLAMA8.ffn) + (e - 1.5) * LLAMA8.attn_out_width
    m, hd = DSV3, DSV3.hidden
    i = m.dense_layers                                      # an MoE layer
    moe = layer_acts(m, i, w).per_rank(1, False, False) - layer_acts(m, i, f8).per_rank(1, False, False)
    k = m.top_k                                             # dropless: balanced
    lat = m.q_lora_rank + m.kv_lora_rank
    assert moe == ((e - 1) * hd                             # QKV input (the MLP input feeds the router: kept)
                   + (e - 1) * lat                          # up-projection inputs
                   + (e - 1.5) * m.attn_out_width           # attention output, E5M6
                   + k * (e - 1) * hd                       # dispatched expert inputs
                   + (k + m.shared_experts) * (3 * e - 2) * m.moe_ffn)   # gate, up at 1 byte; no product
    # tensor parallelism splits and replicates the same tensors as before
    for tp in (2, 8):
        a8, a = layer_acts(LLAMA8, 0, f8, tp), layer_acts(LLAMA8, 0, w, tp)
        assert a.replicated - a8.replicated == 2 * (e - 1) * h
        assert a.sharded - a8.sharded == (e - 1) * LLAMA8.ffn + (e - 1.5) * LLAMA8.attn_out_width


def test_norm_and_mla_up_projection_recompute_stores_the_latents():
    """DeepSeek-V3 §3.4: with the norms' outputs and MLA's up-projections recomputed, a layer keeps the
    norms' inputs and MLA's latents c_q, c_kv and k_pe instead of per-head Q, K, V and the norm outputs."""
    w = Workload(seq=4096)
    m, e = DSV3, 2
    for i in (0, m.dense_layers):
        plain, light = layer_acts(m, i, w), layer_acts(m, i, w, recompute_norm_mla=True)
        moe = m.is_moe_layer(i)   # an MoE layer's input is its router's fp32 copy, per tp rank's tokens
        assert plain.replicated - light.replicated == (
            e * m.hidden + (0 if moe else e * m.hidden)           # QKV and MLP inputs (norm outputs)
            + 2 * e * (m.q_lora_rank + m.kv_lora_rank)            # latents as norm inputs and up-proj inputs
            - e * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim))   # latents and k_pe kept
        assert plain.sharded - light.sharded == e * (m.q_width + m.kv_width + m.v_width) + \
            (max(4, e) * m.hidden if moe else 0)
    # a model without MLA only drops the norm outputs
    d = layer_acts(LLAMA8, 0, w).replicated - layer_acts(LLAMA8, 0, w, recompute_norm_mla=True).replicated
    assert d == 2 * e * LLAMA8.hidden
    # full recompute keeps layer inputs only: the option changes nothing there
    full = Layout(pp=4, dp=2, recompute="full")
    assert stage_activations(m, replace(full, recompute_norm_mla=True), Workload(seq=4096, global_batch=64), 1) == \
        stage_activations(m, full, Workload(seq=4096, global_batch=64), 1)
    with pytest.raises(ConfigError, match="recompute_norm_mla"):
        check(m, Layout(pp=4, dp=2, recompute_norm_mla="yes"), Workload(seq=4096, global_batch=64))


def test_light_recompute_costs_the_up_projections_forward():
    """recompute_norm_mla repeats MLA's up-projections in the backward: the stage's backward grows by
    exactly their forward FLOPs (2 per weight per token, q: q_lora_rank x heads*d_qk, kv: kv_lora_rank x
    heads*(d_nope + d_v)); MFU counts none of it, HFU all of it. Nothing for a model without MLA."""
    light, plain = DSV3_LAYOUT, replace(DSV3_LAYOUT, recompute_norm_mla=False)
    a = estimate(DSV3, light, DSV3_WORK, H800, 2048)
    b = estimate(DSV3, plain, DSV3_WORK, H800, 2048)
    m = DSV3
    up = m.q_lora_rank * m.heads * m.qk_head_dim + m.kv_lora_rank * m.heads * (m.qk_nope_dim + m.v_head_dim)
    extra = 2 * up * (m.layers + m.mtp_depth) * DSV3_WORK.tokens   # FLOPs per step over all GPUs (MTP's block too)
    assert a.time.step_time_s > b.time.step_time_s
    assert a.time.hfu * a.time.step_time_s - a.time.mfu * a.time.step_time_s == pytest.approx(
        extra / (H800.accelerator.peak(DSV3_WORK.dtype) * 2048), rel=1e-9)
    assert b.time.hfu == pytest.approx(b.time.mfu)
    assert estimate(LLAMA8, Layout(dp=8, recompute_norm_mla=True), Workload(seq=1024, global_batch=8),
                    TOPOLOGIES["dgx-h100"], 8).time.compute_s == pytest.approx(
        estimate(LLAMA8, Layout(dp=8), Workload(seq=1024, global_batch=8), TOPOLOGIES["dgx-h100"], 8).time.compute_s)


# -- multi-token prediction -------------------------------------------------------------------------------
def test_deepseek_v3_mtp_module_is_counted_on_the_last_stage():
    """DeepSeek-V3 §2.2 (D = 1): an MTP module is one more block (an MoE layer), a projection M of
    [norm(h); norm(emb)] (2h -> h) and the shared head's second pass. Its own parameters, with the copies
    of embedding and head the released checkpoint stores, bring 671B to the published 685B; per token it
    adds 6 FLOPs per weight of block, M and head, and one layer's attention; the last stage computes it."""
    m, h = DSV3, DSV3.hidden
    block = m.layer_params(m.layers)                        # index 61: an MoE layer
    assert m.is_moe_layer(m.layers) and block == m.layer_params(m.layers - 1)
    assert m.mtp_params() == block + 2 * h * h + 3 * h
    assert m.num_params() + m.mtp_params() + 2 * m.vocab * h == pytest.approx(685e9, rel=1e-3)
    plain = replace(m, mtp_depth=0)
    active = m.layer_params(m.layers, m.top_k) + 2 * h * h
    attn = m.attention_flops_per_token(4096) / m.layers
    assert m.flops_per_token(4096) - plain.flops_per_token(4096) == pytest.approx(
        6 * (active + m.vocab * h) + 3 * attn, rel=1e-12)
    w = Workload(seq=4096, global_batch=64)
    lay = Layout(pp=4, dp=2, ep=2, micro_batch=1)
    tokens = 4096
    for j in range(4):
        with_mtp, without = stage_flops(m, lay, w, j), stage_flops(plain, lay, w, j)
        if j < 3:
            assert with_mtp == without
        else:
            assert with_mtp[0] - without[0] == pytest.approx(tokens * 2 * active, rel=1e-12)
            assert with_mtp[1] - without[1] == pytest.approx(tokens * attn, rel=1e-12)
            assert with_mtp[2] == 2 * without[2]             # the head's second pass
    # the layout's step grows (its last stage is the slowest), a model without MTP is unchanged
    e, e0 = estimate(m, DSV3_LAYOUT, DSV3_WORK, H800, 2048), estimate(plain, DSV3_LAYOUT, DSV3_WORK, H800, 2048)
    assert e.time.step_time_s > e0.time.step_time_s
    assert LLAMA8.mtp_depth == 0 and LLAMA8.mtp_params() == 0
