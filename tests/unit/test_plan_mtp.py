"""The multi-token-prediction module (DeepSeek-V3 §2.2) in the planner's memory and traffic: one more
block on the last pipeline stage, with its own M (2h -> h) and three norms, its activations and the
head's second pass. Each figure below is worked by hand for a small model and compared with the same
model without the module (mtp_depth = 0): only the last stage moves, by exactly that much."""
from dataclasses import replace

import pytest

from fivefold.plan.layout import Layout, Workload, microbatches
from fivefold.plan.memory import stage_memory
from fivefold.plan.models import PRESETS, PlanModel
from fivefold.plan.traffic import partial_grad_params, stage_flows
from fivefold.plan.units import optimizer_bytes_per_param

# h = 8, 2 heads of 4, ffn 16: a layer is 4·h² (attention) + 2h (norms) + 3·h·16 (SwiGLU) = 656 parameters;
# the MTP module adds M (2h·h = 128) and three norms (24): mtp_params = 808
DENSE = PlanModel(name="tiny-mtp", vocab=64, hidden=8, layers=4, heads=2, kv_heads=2, ffn=16, tie_embeddings=False, max_seq=64,
                  mtp_depth=1)
# the same shape with 4 routed experts of width 8 (top 2) after one dense layer: the MTP block is an MoE layer
MOE = replace(DENSE, name="tiny-mtp-moe", experts=4, top_k=2, moe_ffn=8, dense_layers=1)
WORK = Workload(seq=16, global_batch=8)            # T = 16 tokens per micro-batch, 4 micro-batches per rank
BYTES = 2 + 4 + 12                                   # bf16 weight, fp32 gradient, Adam m, v and fp32 master


def _without(model: PlanModel) -> PlanModel:
    return replace(model, mtp_depth=0)


def _memory_growth(model: PlanModel, layout: Layout, work: Workload = WORK) -> list[dict]:
    """Per stage, what each memory component gains with the module."""
    out = []
    for j in range(layout.pp):
        a, b = stage_memory(model, layout, work, j), stage_memory(_without(model), layout, work, j)
        out.append({c: a[c] - b[c] for c in ("weights", "grads", "optimizer", "activations", "buffers")})
    return out


def _flow_growth(model: PlanModel, layout: Layout, work: Workload = WORK) -> list[dict]:
    """Per stage, (dim, op) -> (calls, message bytes, bytes sent) gained with the module."""
    out = []
    for j in range(layout.pp):
        rows = {}
        for sign, m in ((1, model), (-1, _without(model))):
            for fl in stage_flows(m, layout, work, j):
                c, msg, sent = rows.get((fl.dim, fl.op), (0, 0.0, 0.0))
                rows[(fl.dim, fl.op)] = (c + sign * fl.calls, msg + sign * fl.message_bytes,
                                         sent + sign * fl.bytes_sent)
        out.append({k: v for k, v in rows.items() if v != (0, 0.0, 0.0)})
    return out


def test_mtp_params_of_the_tiny_models():
    assert DENSE.layer_params(0) == 656 and DENSE.mtp_projection_params() == 152 and DENSE.mtp_params() == 808
    # MoE block: attention 256, norms 16, router 4·8 = 32, 4 experts of 3·8·8 = 192
    assert MOE.is_moe_layer(MOE.layers) and MOE.mtp_params() == 256 + 16 + 32 + 4 * 192 + 152


def test_dense_module_model_states_on_the_last_stage():
    """tp 2: the block's matrices split (q, o 32 each; k, v 64 each: 2 kv heads over 2 ranks; SwiGLU 192),
    norms, M and the module's norms whole: 128 + 16 + 192 + 152 = 488 parameters per rank."""
    lay = Layout(tp=2, pp=2, dp=2)
    assert optimizer_bytes_per_param(WORK) == 12
    grow = _memory_growth(DENSE, lay)
    assert grow[0] == dict.fromkeys(grow[0], 0)
    assert (grow[1]["weights"], grow[1]["grads"], grow[1]["optimizer"]) == (2 * 488, 4 * 488, 12 * 488)
    # ZeRO-3 over dp 2: the module is one more unit of 488, a shard of 244 each
    grow = _memory_growth(DENSE, replace(lay, zero=3))
    assert grow[0] == dict.fromkeys(grow[0], 0)
    assert grow[1]["weights"] + grow[1]["grads"] + grow[1]["optimizer"] == BYTES * 244
    assert (grow[1]["weights"], grow[1]["grads"]) == (2 * 244, 4 * 244)


def test_moe_module_model_states_on_the_last_stage():
    """ep 2, tp 1: the routed experts split two ways (2 · 192 = 384 per rank), the rest whole: attention
    256, norms 16, router 32, M and the module's norms 152 = 456."""
    lay = Layout(pp=2, dp=2, ep=2)
    grow = _memory_growth(MOE, lay)
    assert grow[0] == dict.fromkeys(grow[0], 0)
    assert (grow[1]["weights"], grow[1]["grads"], grow[1]["optimizer"]) == \
        (2 * (456 + 384), 4 * (456 + 384), 12 * (456 + 384))


def test_dense_module_activations_and_second_logits():
    """Per token on one rank (tp 2, no sp, flash, bf16): the block as a layer stores 64 bytes whole on
    each rank (norm inputs 2·2h, QKV and MLP inputs 2·2h) and 336/2 split (Q 16, K and V 32, attention
    output 16, log-sum-exp 4·2, SwiGLU 3·2·16): 148. The module beyond its block: the embedding's norm
    input and M's input, 3·2·h = 48. The head's second pass: its norm's and the head's inputs 2·2·h = 32
    and the fp32 loss gradient of the rank's 32 vocabulary rows, 128. 1F1B holds one micro-batch on
    the last stage of two: 16 tokens × (148 + 48 + 160) = 5696 bytes."""
    lay = Layout(tp=2, pp=2, dp=2)
    grow = _memory_growth(DENSE, lay)
    assert grow[1]["activations"] == 16 * (148 + 48 + 160) == 5696
    # sequence parallelism splits the whole-on-each-rank part, the module's and the head's inputs too
    sp = _memory_growth(DENSE, replace(lay, sp_mode="megatron"))
    assert sp[1]["activations"] == 16 * (64 / 2 + 168 / 2 + 48 / 2 + 32 / 2 + 128)
    assert sp[0]["activations"] == 0
    # full recompute: the block keeps its input (2h = 16 bytes); the module's and head's tensors stay
    full = _memory_growth(DENSE, replace(lay, recompute="full"))
    assert full[1]["activations"] == 16 * (16 + 48 + 160)


def test_moe_module_activations():
    """tp 1, dropless (capacity 1.0: top_k rows): the MoE block stores 48 (norm, QKV and MLP-norm
    inputs) + 32 (the router's input, fp32) + Q 16 + K, V 32 + output 16 + log-sum-exp 8 + router logits
    and probabilities 2·4·4 = 32 + the two routed rows' inputs 2·2·8 = 32 + their SwiGLU internals
    2·3·2·8 = 96: 312 bytes per token; the module 48, the head's second pass 2·2·8 + 4·64 = 288."""
    grow = _memory_growth(MOE, Layout(pp=2, dp=2, ep=2))
    assert grow[0]["activations"] == 0
    assert grow[1]["activations"] == 16 * (312 + 48 + 288) == 10368


def test_dense_module_traffic():
    """tp 2 without sp, 4 micro-batches: the block's two regions all-reduce T·h·e = 256 bytes forward and
    backward (4 calls), the head's second pass its input's backward all-reduce (256) and the cross
    entropy's two (max: T·4 = 64, sum of exponentials and target logit: 128): per micro-batch 7 calls,
    5·256 + 64 + 128 = 1472 bytes (an all-reduce over 2 sends its message). The dp reduction (DDP over
    dp 2, fp32) carries the module's 488 parameters more: 1952 bytes, in the same bucket."""
    lay = Layout(tp=2, pp=2, dp=2)
    m = microbatches(lay, WORK)
    assert m == 4
    grow = _flow_growth(DENSE, lay)
    assert grow[0] == {}
    assert grow[1] == {("tp", "all_reduce"): (7 * m, 1472.0 * m, 1472.0 * m),
                       ("dp", "all_reduce"): (0, 1952.0, 1952.0)}


def test_moe_module_traffic():
    """ep 2, tp 1, capacity factor 1: each expert's buffer holds C = 16·2/4 = 8 rows per sequence, the
    dispatch and combine messages 4 experts × 8 rows × h × 2 bytes = 512; dispatch forward, combine
    forward, both backward: 4 all-to-alls per micro-batch, 2048 bytes, half of it sent over 2 ranks. The
    dense part's reduction over dp 2 grows by 456 parameters (1824 bytes); the experts' group (dp/ep = 1)
    sends nothing."""
    lay = Layout(pp=2, dp=2, ep=2)
    m = microbatches(lay, WORK)
    grow = _flow_growth(MOE, lay)
    assert grow[0] == {}
    assert grow[1] == {("ep", "all_to_all"): (4 * m, 2048.0 * m, 1024.0 * m),
                       ("dp", "all_reduce"): (0, 1824.0, 1824.0)}


def test_module_gradients_are_partial_over_tp_with_sequence_parallelism():
    """Under sp the module's norms and M, whole on every tp rank, see only their rank's tokens: their
    gradients join the block's norms (2h) in the tp sync: 16 + 152 = 168 more on the last stage."""
    lay = Layout(tp=2, pp=2, dp=2, sp_mode="megatron")
    for j, extra in ((0, 0), (1, 168)):
        assert partial_grad_params(DENSE, lay, j)["norm"] - partial_grad_params(_without(DENSE), lay, j)["norm"] \
            == extra


def test_deepseek_v3_last_stage_grows_by_the_module():
    """The published layout (pp 16, ep 64, ZeRO-1 over dp 128, tp 1): the last stage holds the module's
    dense parameters whole and 256/64 = 4 of its routed experts, and shards their optimizer state 128
    ways (buckets padded to a multiple of 128: within one element per rank and bucket)."""
    m = PRESETS["deepseek-v3"]
    lay = Layout(pp=16, dp=128, ep=64, zero=1, micro_batch=1)
    work = Workload(seq=4096, global_batch=15360, capacity_factor=0)
    expert = m.experts * m.expert_params()
    share = m.mtp_params() - expert + expert // lay.ep
    grow = _memory_growth(m, lay, work)
    assert all(g == dict.fromkeys(g, 0) for g in grow[:-1])
    assert grow[-1]["weights"] == pytest.approx(2 * share, abs=2 * 128 * 8)
    assert grow[-1]["grads"] == pytest.approx(4 * share, abs=4 * 128 * 8)
    dense, routed = share - expert // lay.ep, expert // lay.ep
    assert grow[-1]["optimizer"] == pytest.approx(12 * (dense / 128 + routed / lay.edp), abs=12 * 8)
    assert grow[-1]["activations"] > 0
