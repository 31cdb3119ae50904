"""Traffic per dimension and collective, from comm/volume.py; tiers, rank order, placement warnings."""
from dataclasses import replace

import pytest

from fivefold.comm import volume
from fivefold.plan.estimate import estimate
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.models import PRESETS, from_model_config
from fivefold.plan.topology import TOPOLOGIES
from fivefold.plan.traffic import by_dim, stage_flows
from fivefold.plan.tiers import group_block, recommend_order

from tests.support.tiny import tiny_config

LLAMA8 = PRESETS["llama3-8b"]
MIXTRAL = PRESETS["mixtral-8x7b"]
FP32 = Workload(seq=1024, global_batch=64, dtype="fp32")


def rows(model, layout, work, stage=0):
    """(dim, op) -> the stage's row; rows of one (dim, op) over several groups (tp and its tp_kv
    sub-groups, the loss over dp_cp and pp) summed, as the ledger records them."""
    out = {}
    for f in stage_flows(model, layout, work, stage):
        g = out.get((f.dim, f.op))
        out[(f.dim, f.op)] = f if g is None else replace(g, calls=g.calls + f.calls,
                                                         message_bytes=g.message_bytes + f.message_bytes,
                                                         bytes_sent=g.bytes_sent + f.bytes_sent)
    return out


def dp_bytes(model, zero, work=FP32, n=8, mb=8):
    layout = Layout(dp=n, zero=zero, micro_batch=mb)
    return sum(f.bytes_sent for f in stage_flows(model, layout, work, 0) if f.dim == "dp")


def test_zero_1_2_send_what_ddp_sends_and_zero_3_half_again():
    """DESIGN / ZeRO §7: stages 1 and 2 send DDP's 2Φ(n-1)/n, stage 3 1.5x that (one micro-batch, fp32)."""
    m = from_model_config(tiny_config().model)
    ddp = dp_bytes(m, 0)
    assert ddp == volume.all_reduce(4 * m.num_params(), 8)
    assert dp_bytes(m, 1) == pytest.approx(ddp, rel=1e-3)     # differs only by bucket padding
    assert dp_bytes(m, 2) == pytest.approx(ddp, rel=1e-3)
    assert dp_bytes(m, 3) == pytest.approx(1.5 * ddp, rel=1e-3)


def test_tensor_parallel_bytes_per_layer_and_sequence_parallel_same_bytes():
    """Shoeybi et al. 2019: 2 all-reduces of b·s·h forward and 2 backward per layer; Korthikanti 2022:
    SP turns each into an all-gather + reduce-scatter of the same bytes."""
    w = Workload(seq=2048, global_batch=8, dtype="bf16")
    tp, T, h, L = 4, 2048, LLAMA8.hidden, LLAMA8.layers
    plain = rows(LLAMA8, Layout(tp=tp, dp=1, micro_batch=1), w)
    msg = T * h * 2
    per_layer = 4 * L * 8                        # 4 per layer per micro-batch, 8 micro-batches
    ar = plain[("tp", "all_reduce")]
    # + embedding (1/mb), head input (1/mb), and the cross-entropy reductions of 3T fp32 values per mb
    assert ar.message_bytes == per_layer * msg + 2 * 8 * msg + 3 * 8 * T * 4
    sp = rows(LLAMA8, Layout(tp=tp, dp=1, sp_mode="megatron", micro_batch=1), w)
    layer_sp = sp[("tp", "all_gather")].bytes_sent + sp[("tp", "reduce_scatter")].bytes_sent
    norms = volume.all_reduce((2 * L + 1) * h * 4, tp)   # SP's norm-weight gradient all-reduce
    assert layer_sp + sp[("tp", "all_reduce")].bytes_sent - norms == pytest.approx(ar.bytes_sent)


def test_pipeline_sends_bsh_per_microbatch_per_boundary_times_v():
    """Narayanan et al. 2021: b·s·h per micro-batch per boundary each way; x v interleaved."""
    w = Workload(seq=1024, global_batch=32, dtype="bf16")
    act = 1024 * LLAMA8.hidden * 2
    for v in (1, 2):
        lay = Layout(pp=4, dp=1, vpp=v, schedule="interleaved" if v > 1 else "1f1b")
        mid = rows(LLAMA8, lay, w, stage=1)[("pp", "send")]
        assert mid.bytes_sent == 2 * 32 * v * act
        first = rows(LLAMA8, lay, w, stage=0)[("pp", "send")]
        assert first.bytes_sent == (2 * v - 1) * 32 * act   # the first chunk sends no gradient back


def test_expert_parallel_all_to_all_and_fp8_dispatch():
    """Lepikhin et al. 2020: dispatch + combine all-to-all forward and backward per MoE layer; FP8
    dispatch (DeepSeek-V3 §3.3) halves the forward dispatch bytes of bf16 (plus one fp32 scale a row)."""
    w = Workload(seq=4096, global_batch=16, dtype="bf16")
    lay = Layout(ep=8, dp=8, zero=1)
    a2a = rows(MIXTRAL, lay, w)[("ep", "all_to_all")]
    msg = 2 * 4096 * MIXTRAL.hidden * 2            # top_k copies of each token, bf16
    assert a2a.calls == 4 * 32 * 2                  # 4 per layer, 32 layers, 2 micro-batches
    assert a2a.bytes_sent == pytest.approx(4 * 32 * 2 * volume.all_to_all(msg, 8))
    fp8 = rows(MIXTRAL, lay, Workload(seq=4096, global_batch=16, dtype="bf16", fp8_dispatch=True))
    h = MIXTRAL.hidden   # 3 of 4 exchanges unchanged; the dispatch goes from 2h to h + 4 bytes a row
    assert fp8[("ep", "all_to_all")].bytes_sent == pytest.approx(a2a.bytes_sent * (7 * h + 4) / (8 * h))


def test_context_parallel_ring_and_ulysses():
    w = Workload(seq=8192, global_batch=8, dtype="bf16")
    ring = rows(LLAMA8, Layout(cp=4, dp=2), w)
    kv = 8192 / 4 * 2 * 1024 * 2                    # local K and V blocks
    assert ring[("cp", "send")].bytes_sent == 3 * (4 - 1) * 32 * 4 * kv
    assert ring[("cp", "recv")].bytes_sent == 0
    uly = rows(LLAMA8, Layout(cp=4, dp=2, cp_mode="ulysses"), w)[("cp", "all_to_all")]
    assert uly.calls == 8 * 32 * 4                   # 4 forward + 4 backward per layer per micro-batch


def test_groups_land_on_tiers_and_tp_across_nodes_is_flagged():
    topo = TOPOLOGIES["dgx-h100"]
    lay = Layout(tp=8, pp=4, dp=16, order="tp-cp-ep-pp-dp")
    assert group_block(lay, "tp") == 8 and group_block(lay, "pp") == 32 and group_block(lay, "dp") == 512
    e = estimate(LLAMA8, lay, Workload(seq=4096, global_batch=256), topo)
    assert e.placement == {"tp": "nvlink", "pp": "leaf", "dp": "spine"}
    bad = estimate(LLAMA8, Layout(tp=16, dp=1, sp_mode="megatron"), Workload(seq=4096, global_batch=16), topo)
    assert any("tp group crosses the leaf tier" in w for w in bad.warnings)
    llama = TOPOLOGIES["llama3"]
    big = estimate(PRESETS["llama3-405b"], Layout(tp=8, pp=16, dp=128, zero=1, sp_mode="megatron", order="tp-cp-ep-dp-pp"),
                   Workload(seq=8192, global_batch=2048), llama)
    assert big.placement["pp"] == "cluster"
    assert any("oversubscribed" in w for w in big.warnings)


def test_order_for_a_large_moe_model_is_the_fields_practice():
    """DESIGN and Megatron-Core practice: TP > SP/CP > EP > PP > DP, innermost first. With group-wise
    EP x TP (experts whole on the tp ranks, Megatron's expert-tensor-parallel size 1, what the runtime
    runs) an MoE layer carries no tp traffic, so EP's all-to-all can outweigh TP and go innermost
    (`recommend_order`: blocking bytes, heaviest innermost): tp, cp, ep stay inside, pp and dp outside, dp
    beside ep (the expert grid carves ep from dp: with pp between them a rank would sit on different stages
    in the two grids, `grid.check_grids_agree`, as Megatron-Core requires ep and dp adjacent)."""
    for name, lay, seq in (("mixtral-8x7b", Layout(tp=2, cp=2, ep=8, pp=4, dp=16, zero=1, sp_mode="megatron"), 8192),
                           ("deepseek-v3", Layout(tp=2, cp=2, ep=32, pp=8, dp=64, zero=1, sp_mode="megatron"), 4096)):
        e = estimate(PRESETS[name], lay, Workload(seq=seq, global_batch=1024), TOPOLOGIES["dgx-h100"])
        volume = by_dim(e.flows)
        inner = e.recommended_order.split("-")[:3]
        assert set(inner) == {"tp", "cp", "ep"} and e.recommended_order.endswith("dp-pp"), (name, volume)
    dense = estimate(LLAMA8, Layout(tp=4, pp=2, dp=4, sp_mode="megatron", zero=1), Workload(seq=4096, global_batch=64),
                     TOPOLOGIES["dgx-h100"])
    assert recommend_order(dense.flows) == "tp-cp-ep-pp-dp"


def test_partial_gradients_of_replicated_kv_and_sp_norms_are_summed_once_per_step():
    """parallel/tensor.py: when tp > kv_heads the tp/kv_heads ranks sharing a K/V head sum their K/V
    weight gradients (one all-reduce on that subgroup per step, window by window of STEP_CHUNK
    elements); under SP the norm weights' gradients are summed over tp; with ZeRO a rank sends only its
    shard's part (the mean over dp ranks here)."""
    from dataclasses import replace

    from fivefold.rules import STEP_CHUNK
    from fivefold.shapes import windows

    w = Workload(seq=1024, global_batch=8, dtype="bf16")
    h, L, hd = LLAMA8.hidden, LLAMA8.layers, LLAMA8.head_dim
    no_rep = replace(LLAMA8, kv_heads=16)              # tp 16 splits the K/V heads: nothing to sum
    kv = 2 * L * hd * h * 4                            # one K and one V head per rank, fp32 gradients
    for dp, zero in ((1, 0), (2, 1)):
        lay = Layout(tp=16, dp=dp, zero=zero)
        got, ref = rows(LLAMA8, lay, w)[("tp", "all_reduce")], rows(no_rep, lay, w)[("tp", "all_reduce")]
        assert got.calls == ref.calls + sum(k for _, k in windows(kv / 4 / dp, STEP_CHUNK))   # a call per window
        assert got.message_bytes - ref.message_bytes == kv / dp
        assert got.bytes_sent - ref.bytes_sent == pytest.approx(volume.all_reduce(kv / dp, 2))
    sp = rows(LLAMA8, Layout(tp=8, dp=1, sp_mode="megatron"), w)[("tp", "all_reduce")]
    assert sp.calls == 2 * 8 + 1                         # two cross-entropy reductions per micro-batch, one sync
    assert sp.message_bytes == 3 * 1024 * 4 * 8 + (2 * L + 1) * h * 4


def test_gradient_reduction_calls_one_per_bucket_or_unit():
    """data.py / zero.py: DDP and ZeRO-1/2 make one call per bucket, ZeRO-3 one per unit (block, root),
    gathered twice per micro-batch unless parameters stay gathered from forward to backward."""
    m = from_model_config(tiny_config().model)      # 2 blocks + root
    w = Workload(seq=32, global_batch=4, dtype="fp32")
    ddp = rows(m, Layout(dp=2, bucket_mb=0.05), w)[("dp", "all_reduce")]
    assert ddp.calls > 1 and ddp.message_bytes == 4 * m.num_params()
    z3 = rows(m, Layout(dp=2, zero=3, micro_batch=1), w)      # 2 micro-batches
    assert z3[("dp", "all_gather")].calls == 2 * 2 * 3 and z3[("dp", "reduce_scatter")].calls == 2 * 3
    keep = rows(m, Layout(dp=2, zero=3, micro_batch=1, reshard_after_forward=False), w)
    assert keep[("dp", "all_gather")].calls == 2 * 3
    assert keep[("dp", "all_gather")].bytes_sent == pytest.approx(z3[("dp", "all_gather")].bytes_sent / 2)


def test_hybrid_context_parallel_is_ulysses_inside_and_ring_across():
    """Hybrid (USP): Ulysses over the largest degree the heads of a tp rank allow, ring over the rest;
    ring blocks after the all-to-all hold u times the tokens and 1/u of the heads. Llama-3 8B at tp 8
    leaves one K/V head per tp rank, so Ulysses (u = 4) first repeats it 4 times (context.py): its ring
    block is then 4x the pure ring's."""
    w = Workload(seq=8192, global_batch=8, dtype="bf16")
    hyb = rows(LLAMA8, Layout(tp=8, cp=8, dp=1, cp_mode="hybrid"), w)    # 4 heads per tp rank: u 4, ring 2
    uly = rows(LLAMA8, Layout(tp=8, cp=4, dp=1, cp_mode="ulysses"), w)
    ring = rows(LLAMA8, Layout(tp=8, cp=8, dp=1, cp_mode="ring"), w)
    a2a, send = hyb[("cp", "all_to_all")], hyb[("cp", "send")]
    assert a2a.n == 4 and send.n == 2
    assert a2a.calls == 8 * 32 * 8                   # 4 forward + 4 backward per layer per micro-batch
    assert a2a.message_bytes == pytest.approx(uly[("cp", "all_to_all")].message_bytes / 2)   # half the tokens
    kv = ring[("cp", "send")].message_bytes / ring[("cp", "send")].calls
    assert send.calls == (2 - 1) * 8 * 32 * 3 and send.message_bytes == send.calls * kv * 4
