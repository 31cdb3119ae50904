"""Memory per rank and per pipeline stage: model states by ZeRO stage, activations by schedule.

Model states (Rajbhandari et al. 2020, "ZeRO", §3 and Table 1): per parameter `w` bytes of weights,
`g` of gradients and `k` of optimizer state (Adam m and v in fp32: 8; plus an fp32 master copy when
weights are 16-bit: 12, the paper's K). With n data-parallel ranks:

    ZeRO-0  (w + g + k)·Φ        ZeRO-1  (w + g)·Φ + k·Φ/n
    ZeRO-2  w·Φ + (g + k)·Φ/n    ZeRO-3  (w + g + k)·Φ/n

Shards are padded so they are even: Φ/n is ceil(Φ/n). Dense parameters are sharded over dp·cp,
routed experts over the expert-data-parallel group dp·cp/ep.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4): per layer, for s·b tokens, GPT-3 style (GeLU, dropout, 16-bit):

    no parallelism           s·b·h·(34 + 5·a·s/h)
    tensor parallel t        s·b·h·(10 + 24/t + 5·a·s/(h·t))
    + sequence parallel      s·b·h/t·(34 + 5·a·s/h)
    selective recompute      the 5·a·s/h term goes (so does it with flash attention)
    full recompute           2·s·b·h per layer (/t with sequence parallel)

`layer_activation_bytes` derives these constants from the layer's tensors instead of hard-coding 34, so
Llama-style layers (SwiGLU, GQA, RMSNorm, no dropout) and MoE layers get their own; on the GPT-3 shape it
reproduces the table exactly (tests/test_plan_literature.py). Context parallelism (ring or Ulysses)
divides the tokens a rank holds by cp. Pipeline schedules multiply by the micro-batches in flight:
GPipe m; 1F1B min(p - j, m) on stage j (p on the first); interleaved (Narayanan et al. 2021) holds
min(2(p-j-1) + (v-1)·N + 1, m·v) chunks of L_j/v layers with N micro-batches per group
(`Layout.microbatch_group`, N = p by default: p·(1 + (p-1)/(p·v)) stage-activations on the first stage).

Mechanisms that change what a layer stores (docs/plan.md, "Mechanisms"): `Workload.fp8_act_cache` caches
the inputs of the FP8 linear layers at 1 byte, the attention output at 1.5 (E5M6) and, in MoE experts,
only the activation function's inputs (its output recomputed); `Layout.recompute_norm_mla` recomputes
the norms' outputs and MLA's up-projections, so MLA stores its latents instead of per-head Q, K, V
(DeepSeek-AI 2024, §3.3.3, §3.4). `layer_acts` lists the tensors.

Buffers: the larger of the backward's (`zero_buffers` plus the backward's working set beyond what it
saved: gradients, receive buffers, a norm's or an MLP's temporaries, `backward_scratch`), the loss's
backward on the last stage (`loss_scratch` beside `zero_at_loss`), the embedding's and the head's
(`edge_scratch` beside `zero_at_edge`) and the optimizer step's scratch (`step_scratch`: one bounded pass of
rules.STEP_CHUNK elements). `zero_buffers` is what ZeRO-2/3 hold during a step beyond the states between steps. ZeRO-3's
gathered units (the root unit of embedding, final norm and head included), gradient buffers and
reduce-scatters in flight are replayed in the runtime's order (parallel/zero.py), so the peak is the
runtime's to the byte (tests/test_plan_memory.py measures it from the runtime's tensors).

Offload (`Layout.offload`, docs/plan.md "Offload"): the optimizer state leaves the device (`offloaded`)
for host memory or a file (`offload_bytes`, the runtime's parallel/offload.py to the byte); the device's
total no longer counts it, the row's `host` and `disk` do. ZeRO-3 with nvme (`params_on_disk`) moves the
parameter shards to the file too: the device's `weights` are 0 (`offloaded_params`: what left), and only
the gathered units `zero_buffers` replays hold parameters on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .. import rules
from ..parallel.pipeline.partition import partition_layers
from ..parallel.zero_order import (MAX_INFLIGHT, backward_prefetch, backward_slots, forward_prefetch,
                                   frees_after_forward)
from ..parallel.pipeline.schedules import interleaved_table, interleaved_warmup
from ..rules import GPIPE, INTERLEAVED
from ..shapes import bucket_ranges, padded, padded_vocab, segments, shard_size
from .layout import Layout, Workload, microbatches
from .models import PlanModel

COMPONENTS = ("weights", "grads", "optimizer", "activations", "buffers")


# -- pipeline partition ------------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def stage_layers(layers: int, pp: int, vpp: int = 1, partition: str = "even") -> tuple[tuple[int, ...], ...]:
    """Per pipeline rank, the layers it holds (all its virtual stages, in model order). This is the
    runtime's split, `fivefold.parallel.pipeline.partition` (even, Llama-3 or user counts over pp·vpp
    chunks, chunk c on rank c % pp), so every planned stage is the one that runs."""
    part = partition_layers(layers, pp, vpp, partition)
    return tuple(tuple(part.layers_of_rank(r)) for r in range(pp))


def layout_layers(model: PlanModel, layout: Layout) -> tuple[tuple[int, ...], ...]:
    """`stage_layers` of a model under a layout."""
    return stage_layers(model.layers, layout.pp, layout.vpp, layout.partition)


@lru_cache(maxsize=4096)
def candidate_stages(model: PlanModel, pp: int, vpp: int = 1, partition: str = "even") -> tuple[int, ...]:
    """Stages that can be the most loaded: memory falls with the stage index within a run of stages of
    equal layer count and kind (fewer micro-batches in flight), so only the first stage of each run, and
    the first and last (embedding, head), need checking."""
    ranks = stage_layers(model.layers, pp, vpp, partition)
    out = {0, pp - 1}
    for j in range(1, pp):
        if len(ranks[j]) != len(ranks[j - 1]):
            out.add(j)
    if model.moe and model.dense_layers:
        for j, rng in enumerate(ranks):
            if model.dense_layers in rng or model.dense_layers - 1 in rng:
                out.update({j, min(j + 1, pp - 1)})
    return tuple(sorted(out))


def in_flight(schedule: str, pp: int, stage: int, m: int, vpp: int = 1, group: int = 0) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of the whole stage.
    Interleaved: min(2(p-s-1) + (v-1)·N + 1, m·v) chunks of 1/v of the stage, N = `group` micro-batches
    per group (0: p), as the schedule simulator counts them (schedules.interleaved_warmup)."""
    if pp == 1:
        return 1.0
    if schedule == GPIPE:
        return float(m)
    if schedule == INTERLEAVED and vpp > 1:
        return interleaved_warmup(pp, stage, m, vpp, group) / vpp
    return float(min(pp - stage, m))  # 1f1b, zero-bubble (ZB-H1 keeps 1F1B's peak)


def interleaved_peak(pp: int, stage: int, m: int, vpp: int, group: int, weights: tuple[float, ...]) -> float:
    """Peak of the stored activations of rank `stage` under the interleaved schedule when its local chunks
    hold different amounts (`weights[c]` per micro-batch: Llama 3's first chunk holds only the embedding,
    its last only the head): the rank's forwards and backwards walked in the runtime's order
    (`schedules.interleaved_table`: the warm-up forwards, then one backward and one forward at a time),
    the held sum's maximum. With equal weights this is `in_flight` x the stage's activations."""
    n = group or pp
    table = interleaved_table(m, vpp, n)
    f = interleaved_warmup(pp, stage, m, vpp, group)
    held = sum(weights[c] for _, c in table[:f])
    peak = held
    for k in range(len(table)):
        held -= weights[vpp - 1 - table[k][1]]
        if f < len(table):
            held += weights[table[f][1]]
            f += 1
            peak = max(peak, held)
    return peak


def interleaved_penalty(pp: int, vpp: int) -> float:
    """First-stage activation factor of the interleaved schedule over 1F1B: 1 + (p-1)/(p·v)."""
    return 1 + (pp - 1) / (pp * vpp)


@lru_cache(maxsize=4096)
def time_stages(model: PlanModel, pp: int, vpp: int = 1, partition: str = "even") -> tuple[int, ...]:
    """Stages that can be the slowest: the first with the most layers, and the last (head and loss),
    which alone suffices when it has as many layers (it computes the head; the first only looks up
    the embedding)."""
    counts = [len(r) for r in stage_layers(model.layers, pp, vpp, partition)]
    most = counts.index(max(counts))
    return (pp - 1,) if counts[most] == counts[-1] and not model.moe else tuple(sorted({most, pp - 1}))


# -- parameters a rank holds -------------------------------------------------------------------------
def layer_rank_params(model: PlanModel, i: int, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters of layer i on one rank: matrices split tp ways (K/V by min(tp, kv)
    heads, replicated beyond), norms and row-parallel biases replicated; an MoE layer's router, shared and
    routed experts stay whole on the tp ranks (EP x TP group-wise dispatch, parallel/tensor.py), routed
    experts split ep ways. MLA: its down-projections and latent norms whole on every tp rank, the
    up-projections and output projection split (parallel/tensor.py `latent_attention`)."""
    h = model.hidden
    norms = 2 * model._norm(h)
    row_bias = h if model.linear_bias else 0
    attn = model.attention_params()
    if model.mla:
        attn_rank = _attn_rank(model, tp)
    else:
        kv = 2 * model._linear(h, model.kv_heads * model.head_dim, model.qkv_bias)
        attn_rank = (attn - kv - row_bias) // tp + kv // min(tp, model.kv_heads) + row_bias
    if not model.is_moe_layer(i):
        mlp = model.mlp_params(model.ffn)
        return attn_rank + norms + (mlp - row_bias) // tp + row_bias, 0
    shared = model.shared_experts * model.expert_params()
    experts = (model.experts // ep) * model.expert_params()
    return attn_rank + norms + model.router_params() + shared, experts


@lru_cache(maxsize=4096)
def _stage_param_table(model: PlanModel, tp: int, pp: int, vpp: int, partition: str, ep: int) -> tuple:
    """Per stage: (dense, expert, largest layer) parameters on one rank."""
    rows = []
    vocab_rank = padded_vocab(model.vocab, tp) // tp * model.hidden
    for j, rng in enumerate(stage_layers(model.layers, pp, vpp, partition)):
        dense = expert = biggest = 0
        for i in rng:
            d, e = layer_rank_params(model, i, tp, ep)
            dense, expert, biggest = dense + d, expert + e, max(biggest, d + e)
        if j == 0:
            dense += vocab_rank + (model.max_seq * model.hidden if model.learned_pos else 0)
        if j == pp - 1:
            dense += model._norm(model.hidden)
            if not model.tie_embeddings or pp > 1:
                dense += vocab_rank
        rows.append((dense, expert, biggest))
    return tuple(rows)


def stage_params(model: PlanModel, layout: Layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters held by one rank of `stage` (tied embeddings: once when pp = 1, a copy
    on the last stage when pp > 1, as Megatron does)."""
    dense, expert, _ = _param_table(model, layout)[stage]
    return dense, expert


def _param_table(model: PlanModel, layout: Layout) -> tuple:
    L = layout
    return _stage_param_table(model, L.tp, L.pp, L.vpp, L.partition, L.ep)


def exact_tensors(model: PlanModel) -> bool:
    """Whether `layer_tensors` lists every layer's tensors one by one (our runtime's blocks: Llama, with
    q/k/v biases, and its MoE layers), none lumped per sub-block."""
    return not (model.linear_bias or model.mlp != "swiglu" or model.router_bias)


def layer_tensors(model: PlanModel, i: int, tp: int, ep: int) -> list[tuple[int, bool, str]]:
    """(elements on one rank, is routed expert, tag) of layer i's tensors in registration order. Exact
    for our runtime's blocks (attn_norm, wq[, bias], wk[, bias], wv[, bias], wo, mlp_norm, then gate, up,
    down, or an MoE layer's router, experts' w_gate, w_up, w_down, shared gate, up, down and shared gate;
    see `exact_tensors`): at real sizes a tensor is larger than a bucket, so the bucket count is the
    tensor count (the dry run found a lumped MoE layer two buckets short). Other variants are lumped
    per sub-block, which only moves ZeRO bucket boundaries. Tags: "norm" (replicated over tp), "kv" (K/V
    weights and biases, replicated over tp/kv_heads ranks when tp > kv_heads), "moe" (an MoE layer's
    weights under tp: whole on every tp rank, partial gradients), "" otherwise; a lump holding K/V is
    tagged ""."""
    h = model.hidden
    dense, expert = layer_rank_params(model, i, tp, ep)
    norm = model._norm(h)
    if not exact_tensors(model):
        attn = _attn_rank(model, tp)
        mlp = dense - 2 * norm - attn     # dense MLP, or router + shared experts
        moe = "moe" if model.is_moe_layer(i) and tp > 1 else ""   # whole on every tp rank, partial grads
        out = [(norm, False, "norm"), (attn, False, ""), (norm, False, "norm"), (mlp, False, moe)]
        return out + ([(expert, True, moe)] if expert else [])
    if model.mla:   # attn_norm, latent attention's tensors, mlp_norm
        out = [(norm, False, "norm")] + [(e, False, tag) for e, tag in model.mla_tensors(tp)] + [(norm, False, "norm")]
    else:
        kv_width = model.kv_heads * model.head_dim // min(tp, model.kv_heads)
        q_width = model.heads * model.head_dim // tp
        bias = model.qkv_bias
        out = [(norm, False, "norm"), (q_width * h, False, "")] + ([(q_width, False, "")] if bias else [])
        for _ in range(2):   # wk, wv
            out += [(kv_width * h, False, "kv")] + ([(kv_width, False, "kv")] if bias else [])
        out += [(q_width * h, False, ""), (norm, False, "norm")]
    if not model.is_moe_layer(i):
        f = model.ffn * h // tp
        return out + [(f, False, ""), (f, False, ""), (f, False, "")]
    moe = "moe" if tp > 1 else ""
    per_expert = (model.experts // ep) * model.moe_ffn * h
    shared = model.shared_experts * model.moe_ffn * h
    out += [(model.experts * h, False, moe)] + [(per_expert, True, moe)] * 3
    if model.shared_experts:
        out += [(shared, False, moe)] * 3
    if model.shared_expert_gate:
        out += [(h, False, moe)]
    return out


def _attn_rank(model: PlanModel, tp: int) -> int:
    """Attention parameters of one rank (as in layer_rank_params)."""
    h = model.hidden
    row_bias = h if model.linear_bias else 0
    attn = model.attention_params()
    if model.mla:
        rep = model.mla_replicated_params()
        return (attn - rep) // tp + rep
    kv = 2 * model._linear(h, model.kv_heads * model.head_dim, model.qkv_bias)
    return (attn - kv - row_bias) // tp + kv // min(tp, model.kv_heads) + row_bias


def root_tensors(model: PlanModel, tp: int, pp: int, stage: int) -> list[tuple[int, str]]:
    """(elements on one rank, tag) of the embedding (first stage), final norm ("norm") and untied head
    (last stage), in registration order; tags as in `layer_tensors`."""
    vocab_rank = padded_vocab(model.vocab, tp) // tp * model.hidden
    out = []
    if stage == 0:
        out.append((vocab_rank + (model.max_seq * model.hidden if model.learned_pos else 0), ""))
    if stage == pp - 1:
        out.append((model._norm(model.hidden), "norm"))
        if not model.tie_embeddings or pp > 1:
            out.append((vocab_rank, ""))
    return out


def zero_units(model: PlanModel, layout: Layout, grad_bytes: int, stage: int, expert: bool = False) -> tuple[int, ...]:
    """Sizes of the flat buffers ZeRO shards, each padded to a multiple of n (parallel/zero.py): one per
    transformer block plus a root unit (embedding, norm, head) for ZeRO-3; buckets of at most bucket_mb
    MiB in backward order for ZeRO-1/2 (and, with zero = 0, DDP's all-reduce buckets, parallel/data.py).
    `expert` selects the routed-expert parameters instead."""
    L = layout
    return _zero_units(model, L.tp, L.pp, L.vpp, L.partition, L.ep, block_units(L), L.bucket_mb, grad_bytes, stage,
                       expert)


def block_units(layout: Layout) -> bool:
    """ZeRO units are blocks plus a root unit (ZeRO-3; ZeRO-2 reducing every micro-batch under pp)."""
    return rules.block_units(layout.zero, layout.pp, layout.reduce_each_microbatch)


def held_root(model: PlanModel, layout: Layout, stage: int) -> bool:
    """Whether `stage`'s root unit holds a tied copy of the embedding (first and last stage, pp > 1):
    such a unit is reduced once per step, after the copies' gradients are summed (parallel/engine.py)."""
    return model.tie_embeddings and layout.pp > 1 and stage in (0, layout.pp - 1)


@lru_cache(maxsize=8192)
def _zero_units(*key) -> tuple[int, ...]:
    return tuple(sum(n for n, _ in u) for u in _unit_tensors(*key))


def unit_tensors(model: PlanModel, layout: Layout, grad_bytes: int, stage: int,
                 expert: bool = False) -> tuple[tuple[tuple[int, str], ...], ...]:
    """`zero_units` tensor by tensor: per unit, its tensors' (elements, tag) in flat-buffer order."""
    L = layout
    return _unit_tensors(model, L.tp, L.pp, L.vpp, L.partition, L.ep, block_units(L), L.bucket_mb, grad_bytes, stage,
                         expert)


@lru_cache(maxsize=8192)
def _layer_tensors_tagged(model: PlanModel, moe: bool, tp: int, ep: int, expert: bool) -> tuple[tuple[int, str], ...]:
    i = model.dense_layers if moe else 0
    return tuple((n, tag) for n, ex, tag in layer_tensors(model, i, tp, ep) if ex == expert)


@lru_cache(maxsize=8192)
def _unit_tensors(model: PlanModel, tp: int, pp: int, vpp: int, partition: str, ep: int, blocks: bool,
                  bucket_mb: float, grad_bytes: int, stage: int, expert: bool) -> tuple:
    rng = stage_layers(model.layers, pp, vpp, partition)[stage]
    per_layer = [_layer_tensors_tagged(model, model.is_moe_layer(i), tp, ep, expert) for i in rng]
    root = [] if expert else root_tensors(model, tp, pp, stage)
    if blocks:
        units = ([tuple(root)] if root else []) + [t for t in per_layer]
        return tuple(u for u in units if sum(n for n, _ in u))
    first = root[:1] if stage == 0 else []
    rest = root[len(first):]
    # backward order (parallel/engine.py backward_order): reverse registration, the tied head copy last
    tied = rest[-1:] if model.tie_embeddings and pp > 1 and stage == pp - 1 and rest else []
    order = list(reversed(first + [t for ts in per_layer for t in ts] + rest[:len(rest) - len(tied)])) + tied
    buckets = bucket_ranges([n for n, _ in order], int(bucket_mb * 2**20), grad_bytes)  # bucket_mb is MiB
    return tuple(tuple(order[i] for i in b) for b in buckets)


def owned_tagged(units: tuple, n: int, rank: int) -> dict[str, int]:
    """Elements per tag that group rank `rank` owns of ZeRO units sharded over n ranks (rank r owns
    elements [r·k, (r+1)·k) of each unit padded to a multiple of n, k = padded/n)."""
    out: dict[str, int] = {}
    for u in units:
        k = shard_size(sum(e for e, _ in u), n)
        for i, _, length in segments([e for e, _ in u], rank * k, (rank + 1) * k):
            out[u[i][1]] = out.get(u[i][1], 0) + length
    return out


@lru_cache(maxsize=65536)
def unit_sums(units: tuple[int, ...], n: int) -> tuple[int, int, int]:
    """(padded elements, shard elements k, real elements owned by rank 0) summed over units."""
    total = k = owned = 0
    for u in units:
        ku = shard_size(u, n)
        total, k, owned = total + ku * n, k + ku, owned + min(ku, u)
    return total, k, owned


def optimizer_bytes_per_param(work: Workload) -> int:
    """Adam m and v in the master dtype, plus a master copy when weights are lower precision."""
    return 2 * work.master_bytes + (work.master_bytes if work.param_bytes != work.master_bytes else 0)


def zero_states(params: int, n: int, zero: int, w: int, g: int, k: int) -> dict:
    """Bytes of weights, gradients and optimizer state per rank for `params` parameters sharded over n
    ranks by ZeRO stage `zero` (Rajbhandari et al. 2020, §5.1 / Table 1)."""
    sh = shard_size(params, n)
    return {"weights": w * (sh if zero >= 3 else params),
            "grads": g * (sh if zero >= 2 else params),
            "optimizer": k * (sh if zero >= 1 else params)}


def unit_states(units: tuple[int, ...], n: int, zero: int, work: Workload, rank: int = 0) -> dict:
    """Model-state bytes of group rank `rank` for ZeRO units (flat buffers padded to a multiple of n;
    rank r owns elements [r·k, (r+1)·k)): stage 1/2 keep the padded parameters, stage 1 the padded
    gradients too, stage 2/3 a gradient shard of k; Adam m, v over the real elements owned, the
    master copy (when weights are 16-bit) over the whole shard k."""
    w, g, mb = work.param_bytes, work.grad_bytes, work.master_bytes
    if rank == 0:
        total, k, owned = unit_sums(units, n)
    else:
        total, k = sum(padded(u, n) for u in units), sum(shard_size(u, n) for u in units)
        owned = sum(max(0, min(shard_size(u, n), u - rank * shard_size(u, n))) for u in units)
    master = k * mb if work.param_bytes != mb else 0
    return {"weights": w * (k if zero >= 3 else total), "grads": g * (total if zero == 1 else k),
            "optimizer": 2 * mb * owned + master}


def model_states(model: PlanModel, layout: Layout, work: Workload, stage: int) -> dict:
    """Model-state bytes of rank 0 of `stage` (the fullest shard): dense part over dp·cp, experts over
    dp·cp/ep. Without ZeRO, the ZeRO paper's (w + g + k)·Φ; with it, per padded unit (`unit_states`)."""
    L = layout
    return dict(_model_states(model, L.tp, L.pp, L.vpp, L.partition, L.ep, L.zero, L.bucket_mb, L.dp * L.cp, L.edp,
                              work, stage, L.reduce_each_microbatch))


@lru_cache(maxsize=65536)
def _model_states(model, tp, pp, vpp, partition, ep, zero, bucket_mb, n_dense, n_expert, work, stage,
                  each: bool = False) -> tuple:
    layout = Layout(tp=tp, pp=pp, vpp=vpp, partition=partition, ep=ep, zero=zero, bucket_mb=bucket_mb, dp=n_dense,
                    reduce_each_microbatch=each)
    dense, expert = stage_params(model, layout, stage)
    w, g, k = work.param_bytes, work.grad_bytes, optimizer_bytes_per_param(work)
    groups = [(dense, n_dense, False)] + ([(expert, n_expert, True)] if expert else [])
    out = {"weights": 0, "grads": 0, "optimizer": 0}
    for count, n, is_expert in groups:
        if zero == 0 or n == 1:
            part = zero_states(count, 1, 0, w, g, k)
        else:
            part = unit_states(zero_units(model, layout, g, stage, is_expert), n, zero, work)
        out = {c: out[c] + part[c] for c in out}
    return tuple(out.items())


# -- activations --------------------------------------------------------------------------------------
@dataclass
class LayerActs:
    """Bytes per token of one layer's stored activations, split by how tensor parallelism divides them."""

    replicated: float = 0.0   # held whole by every tp rank (divided by t only with sequence parallel)
    sharded: float = 0.0      # split t ways (heads, ffn)
    scores: float = 0.0       # the s·a terms (softmax, dropout): split t ways; gone with flash/selective

    def per_rank(self, tp: int, sp: bool, with_scores: bool) -> float:
        rep = self.replicated / tp if sp else self.replicated
        return rep + self.sharded / tp + (self.scores / tp if with_scores else 0.0)


def layer_acts(model: PlanModel, i: int, work: Workload, tp: int = 1, recompute_norm_mla: bool = False) -> LayerActs:
    """Korthikanti et al. 2022 §4.1, term by term, per token of one layer (bytes).

    Attention: norm input, QKV input (replicated); Q, K, V, output-projection input (sharded); softmax
    output (+ dropout mask and output) per key (scores); dropout mask after the projection. MLP: norm
    input, first-linear input, dropout mask (replicated); GeLU input and output, or SwiGLU's gate, up and
    product (sharded). MoE: router input and fp32 logits/probabilities (replicated), per routed copy
    (top_k · capacity) the expert input (replicated) and SwiGLU internals (sharded), shared experts'
    internals (sharded). K/V with fewer kv heads than tp are replicated per head group. A parallel
    block (GPT-NeoX's use_parallel_residual) normalises the block input for the MLP too: that input is
    stored once. MLA (DeepSeek): the latents c_q (q_lora_rank) and c_kv (kv_lora_rank) as their norms'
    inputs and as the up-projections' inputs, and the up-projected per-head Q, K, V the attention reads.

    `work.fp8_act_cache` (DeepSeek-V3 §3.3.3): what only FP8 linear layers read is cached at 1 byte for
    their weight gradients (QKV input, dense MLP input, the up-projections' and down projections' inputs,
    the dispatched expert inputs); the attention output, which the attention's backward reads too, at
    1.5 bytes (E5M6); MoE experts (routed and shared) cache their activation function's inputs in FP8 and
    recompute its output (the down projection's input) in the backward. What higher-precision operators
    read stays in the activation dtype: norm inputs, Q, K, V, the MoE layer's MLP input (the router's).
    `recompute_norm_mla` (DeepSeek-V3 §3.4): the norms' outputs (QKV and MLP inputs) and MLA's
    up-projections are recomputed in the backward, so a layer keeps the norms' inputs and MLA only its
    latents c_q, c_kv and the shared RoPE key k_pe (q_lora_rank + kv_lora_rank + qk_rope_dim), not Q, K, V.
    """
    e, h = work.act_bytes, model.hidden
    fp8 = work.fp8_act_cache
    c = 1 if fp8 else e                     # input of an FP8 linear layer, cached for its weight gradient
    light = recompute_norm_mla
    drop = 1 if model.dropout else 0
    kv_split = min(tp, model.kv_heads) if not model.mla else tp
    acts = LayerActs()
    acts.replicated += e * h + drop * h                             # norm input; dropout mask
    if not light:
        acts.replicated += c * h                                    # QKV input (the norm's output)
    if model.mla:
        q_lat, kv_lat = model.q_lora_rank, model.kv_lora_rank
        if light:                                                   # latents; up-projections recomputed
            acts.replicated += e * (q_lat + kv_lat + model.qk_rope_dim)
        else:                                                       # latents (norm inputs, up-proj inputs)
            acts.replicated += (e + c) * (q_lat + kv_lat)
            acts.sharded += e * (model.kv_width + model.v_width) * tp / kv_split   # per-head K, V
        if not (light and q_lat):                                   # Q (no q latent: a plain projection)
            acts.sharded += e * model.q_width
    else:
        acts.sharded += e * model.q_width                           # Q
        acts.sharded += e * (model.kv_width + model.v_width) * tp / kv_split  # K, V
    acts.sharded += (1.5 if fp8 else e) * model.attn_out_width      # attention output = o-projection input
    acts.scores += model.heads * work.seq * (e + drop * (1 + e))    # softmax out (+ dropout mask, output)
    if work.flash:
        acts.sharded += 4 * model.heads                             # fp32 log-sum-exp per head
    moe = model.is_moe_layer(i)
    mlp_norm_input = 0 if model.parallel_residual else e * h        # parallel: the block input, kept above
    acts.replicated += mlp_norm_input + drop * h                    # MLP norm input; dropout mask
    if not light:
        if moe:   # under tp each rank routes and dispatches its own 1/t of the tokens (replicated_moe)
            acts.sharded += max(4, e) * h                           # the router's input, its fp32 copy
        else:
            acts.replicated += c * h                                # MLP input
    n_act = 1 if model.mlp == "gelu" else 2                         # GeLU input, or SwiGLU's gate and up
    if not moe:
        acts.sharded += (n_act * e + c) * model.ffn                 # activation inputs; down-projection input
        return acts
    k = model.top_k * (work.capacity_factor or 1.0)   # dropless (0): planned as perfectly balanced
    acts.sharded += 2 * 4 * model.experts + k * c * h               # router logits+probs, expert inputs
    per_expert = n_act * 1 if fp8 else (n_act + 1) * e              # FP8: activation output recomputed
    acts.sharded += (k + model.shared_experts) * per_expert * model.moe_ffn
    return acts


def layer_activation_bytes(model: PlanModel, i: int, layout: Layout, work: Workload, tokens: float) -> float:
    """Stored activation bytes of layer i for `tokens` tokens on one rank (without recompute storage)."""
    a = layer_acts(model, i, work, layout.tp, layout.recompute_norm_mla)
    with_scores = not work.flash and layout.recompute == "none"
    return tokens * a.per_rank(layout.tp, layout.seq_parallel, with_scores)


def korthikanti(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """The paper's closed forms (bytes per layer), for checking `layer_acts` against (§4.2, Table 2)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    s2 = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + s2)
    return s * b * h * (10 + 24 / t + s2 / t)


def rank_tokens(layout: Layout, work: Workload) -> float:
    """Tokens of one micro-batch held by one rank (context parallel splits the sequence)."""
    return layout.micro_batch * work.seq / layout.cp


@lru_cache(maxsize=16384)
def _stage_act_table(model: PlanModel, work: Workload, tp: int, sp: bool, with_scores: bool, pp: int, vpp: int,
                     partition: str, light: bool = False) -> tuple:
    """Per stage: (sum, max) over its layers of stored activation bytes per token on one rank."""
    per_layer = {}
    rows = []
    for rng in stage_layers(model.layers, pp, vpp, partition):
        vals = []
        for i in rng:
            key = model.is_moe_layer(i)
            if key not in per_layer:
                per_layer[key] = layer_acts(model, i, work, tp, light).per_rank(tp, sp, with_scores)
            vals.append(per_layer[key])
        rows.append((sum(vals), max(vals, default=0.0)))
    return tuple(rows)


@lru_cache(maxsize=16384)
def _chunk_act_table(model: PlanModel, work: Workload, tp: int, sp: bool, with_scores: bool, pp: int, vpp: int,
                     partition: str, light: bool, full: bool) -> tuple:
    """Per stage, per local chunk: stored activation bytes per token on one rank for one micro-batch (its
    layers' `layer_acts`, or under full recompute each layer's input; the embedding's output on global
    chunk 0, the final norm's and head's inputs and the fp32 logits on the last)."""
    part = partition_layers(model.layers, pp, vpp, partition)
    e, h = work.act_bytes, model.hidden
    split = tp if sp else 1
    vocab = padded_vocab(model.vocab, tp) / tp
    rows = []
    for s in range(pp):
        row = []
        for c in range(vpp):
            q = c * pp + s
            layers = part.layers_of(q)
            if full:
                w = len(layers) * e * h / split
            else:
                w = sum(layer_acts(model, i, work, tp, light).per_rank(tp, sp, with_scores) for i in layers)
            if q == 0:
                w += e * h / split
            if q == pp * vpp - 1:
                w += 2 * e * h / split + (e + 4) * vocab
            row.append(w)
        rows.append(tuple(row))
    return tuple(rows)


def stage_activations(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """Peak activation bytes of one rank of `stage`: layers × micro-batches in flight, embedding on the
    first stage, final norm, head and fp32 logits on the last; full recompute keeps each layer's input
    plus one layer's working set."""
    L = layout
    return _stage_activations(model, work, L.tp, L.sp_mode, L.cp, L.pp, L.dp, L.vpp, L.schedule,
                              L.micro_batch, L.recompute, L.partition, stage, L.microbatch_group,
                              L.recompute_norm_mla)


@lru_cache(maxsize=65536)
def _stage_activations(model, work, tp, sp_mode, cp, pp, dp, vpp, schedule, micro_batch, recompute, partition, stage,
                       group=0, light=False):
    L = Layout(tp=tp, sp_mode=sp_mode, cp=cp, pp=pp, dp=dp, vpp=vpp, schedule=schedule, micro_batch=micro_batch,
               recompute=recompute, partition=partition, microbatch_group=group, recompute_norm_mla=light)
    T = rank_tokens(L, work)
    e, h = work.act_bytes, model.hidden
    n_layers = len(layout_layers(model, L)[stage])
    m = microbatches(L, work)
    flight = in_flight(L.schedule, L.pp, stage, m, L.vpp, L.microbatch_group)
    split = L.tp if L.seq_parallel else 1
    with_scores = not work.flash and L.recompute == "none"
    total_pt, max_pt = _stage_act_table(model, work, L.tp, L.seq_parallel, with_scores, L.pp, L.vpp,
                                        L.partition, L.recompute_norm_mla and L.recompute != "full")[stage]
    if L.interleaved:   # chunks may differ: walk the schedule
        chunks = _chunk_act_table(model, work, L.tp, L.seq_parallel, with_scores, L.pp, L.vpp, L.partition,
                                  L.recompute_norm_mla and L.recompute != "full", L.recompute == "full")[stage]
        return interleaved_peak(L.pp, stage, m, L.vpp, L.microbatch_group, chunks) * T + (max_pt * T if
                                                                                        L.recompute == "full" else 0.0)
    if L.recompute == "full":
        total = flight * n_layers * T * e * h / split + max_pt * T
    else:
        total = flight * total_pt * T
    if stage == 0:
        total += flight * T * e * h / split                     # embedding output
    if stage == L.pp - 1:
        vocab = padded_vocab(model.vocab, L.tp) / L.tp
        total += flight * T * (2 * e * h / split + (e + 4) * vocab)  # norm and head input; logits (+fp32)
    return total


# -- the whole picture -------------------------------------------------------------------------------
@dataclass
class Memory:
    """Per-stage bytes for one rank of each stage, and the most-loaded stage."""

    stages: list[dict] = field(default_factory=list)
    worst: int = 0

    @property
    def most_loaded(self) -> dict:
        return self.stages[self.worst]

    @property
    def host(self) -> float:
        """Host bytes per GPU of the stage that needs the most (offload; 0 without)."""
        return max((s.get("host", 0.0) for s in self.stages), default=0.0)

    @property
    def disk(self) -> float:
        return max((s.get("disk", 0.0) for s in self.stages), default=0.0)

    def to_dict(self) -> dict:
        return {**{c: self.most_loaded[c] for c in COMPONENTS}, "total": self.most_loaded["total"],
                "stage": self.most_loaded["stage"], "offloaded": self.most_loaded.get("offloaded", 0.0),
                "offloaded_params": self.most_loaded.get("offloaded_params", 0.0),
                "host": self.host, "disk": self.disk, "per_stage": self.stages}


# -- ZeRO's buffers during a step ---------------------------------------------------------------------
# MAX_INFLIGHT and the gather/free order are the runtime's (parallel/zero_order.py), not mirrored here


class BufferTimeline:
    """Bytes alive while a step is replayed, and their peak. A reduce-scatter in flight holds its unit's
    full gradient and a shard-sized result until it is folded in, which happens to the oldest once more
    than MAX_INFLIGHT are in flight (parallel/zero_order.py; zero.py `_reduce`)."""

    def __init__(self):
        self.live = self.peak = 0
        self.inflight: list[int] = []

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def drop(self, nbytes: int) -> None:
        self.live -= nbytes

    def reduce(self, grad: int, result: int, freed: int = 0) -> None:
        """Launch one unit's reduce-scatter (its `grad` bytes already alive): the result buffer appears,
        the unit's gathered parameters (`freed` bytes) go, then the oldest reductions are folded in."""
        self.add(result)
        self.inflight.append(grad + result)
        self.drop(freed)
        while len(self.inflight) > MAX_INFLIGHT:
            self.drop(self.inflight.pop(0))


def zero3_slots(model: PlanModel, layout: Layout, stage: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """ZeRO-3's gather slots on one rank of `stage` (parallel/zero.py, `Zero3.make_units`): the root
    (every parameter outside the blocks: embedding on the first stage, final norm and untied head on the
    last), then each block, each slot's units as (elements, group size): dense over dp·cp, routed experts
    over dp·cp/ep. Every unit is a flat buffer padded to a multiple of its group size."""
    L = layout
    n_dense, n_expert = L.dp * L.cp, L.edp
    root = sum(n for n, _ in root_tensors(model, L.tp, L.pp, stage))
    slots = [((root, n_dense),) if root else ()]
    for i in layout_layers(model, L)[stage]:
        dense, expert = layer_rank_params(model, i, L.tp, L.ep)
        slots.append(tuple(u for u in ((dense, n_dense), (expert, n_expert)) if u[0]))
    return tuple(slots)


def _replay_direct(slots: tuple, w: int, g: int, reshard: bool, micro: int) -> int:
    """Peak bytes of ZeRO-3 outside a pipeline, replaying `micro` micro-batches as Zero3 runs them.

    Forward: the root is gathered for the whole forward (its hook wraps the model), each block is
    gathered with the next one prefetched, and freed after its forward (reshard_after_forward; else
    kept). Backward: the root again (the head's and final norm's gradients come first, the embedding's
    last, so the root's gradient lives through the whole backward), each block gathered with the one
    before it prefetched; a block's gradient buffer fills, is reduce-scattered and the block freed.
    Reductions of the last micro-batch stay in flight into the next."""
    t = BufferTimeline()
    held: set = set()

    def gather(k: int) -> None:
        for j, u in enumerate(slots[k]):
            if (k, j) not in held:
                held.add((k, j))
                t.add(w * padded(*u))

    def free(k: int, j: int) -> int:
        if (k, j) not in held:
            return 0
        held.discard((k, j))
        return w * padded(*slots[k][j])

    def reduce_slot(k: int) -> None:
        for j in reversed(range(len(slots[k]))):        # routed experts finish before the dense part
            u = slots[k][j]
            t.reduce(g * padded(*u), g * shard_size(*u), free(k, j))

    def gather_with(k: int, ahead: int | None) -> None:
        gather(k)
        if ahead is not None:
            gather(ahead)

    def free_slot(k: int) -> None:
        if frees_after_forward(k, reshard, pipeline=False):
            t.drop(sum(free(k, j) for j in range(len(slots[k]))))

    last = len(slots) - 1
    for _ in range(micro):
        for k in range(last + 1):                       # the root's hooks wrap the blocks'
            gather_with(k, forward_prefetch(k, last, pipeline=False))
            if k:
                free_slot(k)
        free_slot(0)
        for k in backward_slots(len(slots)):
            gather_with(k, backward_prefetch(k, len(slots), pipeline=False))
            t.add(sum(g * padded(*u) for u in slots[k]))
            if k:
                reduce_slot(k)
        reduce_slot(0)
    return t.peak


def _replay_pipeline(slots: tuple, w: int, g: int, micro: int, head_first: bool) -> int:
    """Peak bytes of ZeRO-3 under a pipeline: the root stays gathered for the step, one block at a time
    is gathered (no prefetch: the next module depends on the schedule), every unit's full gradient
    accumulates over the micro-batches, and `end_backward` reduce-scatters the units in order (root, then
    the blocks) once the step's last backward is done."""
    t = BufferTimeline()
    t.add(sum(w * padded(*u) for u in slots[0]))
    grads = [sum(g * padded(*u) for u in s) for s in slots]
    alive: set = set()

    def grad(k: int) -> None:
        if k not in alive:
            alive.add(k)
            t.add(grads[k])

    if micro > 1:                      # an earlier backward allocated every unit's gradient
        for k in range(len(slots)):
            grad(k)
    if head_first:                     # final norm and head: the first gradients of the backward
        grad(0)
    for k in range(len(slots) - 1, 0, -1):
        block = sum(w * padded(*u) for u in slots[k])
        t.add(block)
        grad(k)
        t.drop(block)
    grad(0)
    for s in slots:
        for u in s:
            t.reduce(g * padded(*u), g * shard_size(*u))
    return t.peak


def _replay_each_microbatch(slots: tuple, w: int, g: int, held: bool) -> int:
    """Peak bytes of ZeRO-2/3 reducing every micro-batch under a pipeline (`reduce_each_microbatch`): the
    root gathered all step (ZeRO-3, w > 0), one block gathered, a held root's full gradient for the whole
    step (a tied copy, reduced once), the block whose gradient is filling and the two reductions still in
    flight behind it (each a full gradient and its shard; parallel/zero_order.py MAX_INFLIGHT)."""
    root = sum(padded(*u) for u in slots[0])
    units = [sum(padded(*u) for u in s) for s in slots[1:]] + ([] if held else [root])
    shards = [sum(shard_size(*u) for u in s) for s in slots[1:]] + ([] if held else [sum(shard_size(*u) for u in slots[0])])
    big = max(units, default=0)
    flight = sorted((u + k for u, k in zip(units, shards)), reverse=True)[:MAX_INFLIGHT]
    return w * (root + big) + g * (root if held else 0) + g * big + g * sum(flight)


@lru_cache(maxsize=16384)
def _zero3_buffers(model: PlanModel, layout: Layout, stage: int, w: int, g: int, micro: int) -> int:
    slots = zero3_slots(model, layout, stage)
    if layout.pp > 1 and layout.reduce_each_microbatch:
        return _replay_each_microbatch(slots, w if layout.zero >= 3 else 0, g, held_root(model, layout, stage))
    if layout.pp > 1:
        return _replay_pipeline(slots, w, g, micro, head_first=stage == layout.pp - 1)
    return _replay_direct(slots, w, g, layout.reshard_after_forward, micro)


def zero_buffers(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """What ZeRO-2/3 hold beyond the model states between steps, at their peak during a step.

    ZeRO-3 (parallel/zero.py, `Zero3`) is replayed event by event on its padded units (`zero3_slots`):
    gathered parameters (w bytes each), full gradient buffers and reduce-scatters in flight (g bytes;
    each keeps its unit's full gradient and a shard-sized result until folded). The root unit (embedding,
    final norm, head) counts in full: outside a pipeline it is gathered for the whole forward and the
    whole backward, and its gradient buffer lives through the whole backward (its first gradients, the
    head's, come first; its last, the embedding's, last). With root R, uniform blocks B (elements per
    rank), shards r = R/n, b = B/n, reshard_after_forward, at least two blocks and two micro-batches the
    peak is at the first block reduction of a micro-batch:

        w·(R + 2B) + g·R + g·(R + r) + 2·g·(B + b)

    (root and two blocks gathered, the root's new gradient, the previous micro-batch's root reduction
    and two blocks' reductions in flight). Under a pipeline the root stays gathered all step, one block
    is gathered at a time and the stage's full gradient G accumulates, reduced at the step's end in
    unit order: about w·(R + B) + g·G plus up to three shard results. Micro-batches after the second
    repeat the second's peak, so at most two are replayed. ZeRO-2 under a pipeline accumulates the
    stage's full gradient (g·G); ZeRO-2's transient buckets outside a pipeline are not counted. With
    `reduce_each_microbatch` under a pipeline (ZeRO-2 or 3) see `_replay_each_microbatch`: about
    w·(R + B) (ZeRO-3) + g·R (a tied root) + g·B + 2·g·(B + b), no full gradient."""
    if layout.zero < 2:
        return 0.0
    if layout.zero == 3 or (layout.pp > 1 and layout.reduce_each_microbatch):
        micro = min(microbatches(layout, work), 2)
        return float(_zero3_buffers(model, _buffer_key(layout), stage, work.param_bytes, work.grad_bytes, micro))
    if layout.pp == 1:
        return 0.0
    dense, expert, _ = _param_table(model, layout)[stage]
    return float(dense + expert) * work.grad_bytes


def zero_at_loss(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """ZeRO's buffers while the loss's backward runs. ZeRO-3 outside a pipeline: the root unit gathered
    (its gradient buffer comes with the head's backward, after the loss's) and, from the second
    micro-batch on, the previous one's last two reductions in flight (the root's and the first block's);
    elsewhere the step's peak (`zero_buffers`: under a pipeline the gradients accumulate all step)."""
    if layout.zero != 3 or layout.pp > 1:
        return zero_buffers(model, layout, work, stage)
    slots = zero3_slots(model, _buffer_key(layout), stage)
    w, g = work.param_bytes, work.grad_bytes
    out = sum(w * padded(*u) for u in slots[0])
    if microbatches(layout, work) > 1:
        out += sum(g * (padded(*u) + shard_size(*u)) for k in (0, 1)[:len(slots)] for u in slots[k])
    return float(out)


def zero_at_edge(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """ZeRO's buffers while the embedding's (or head's) gradient is made: ZeRO-3 outside a pipeline holds
    no gathered block then (the step's peak has two), elsewhere the step's peak (`zero_buffers`)."""
    peak = zero_buffers(model, layout, work, stage)
    if layout.zero != 3 or layout.pp > 1:
        return peak
    blocks = sorted((sum(padded(*u) for u in slot) for slot in zero3_slots(model, _buffer_key(layout), stage)[1:]),
                    reverse=True)
    return peak - work.param_bytes * sum(blocks[:2])


def _buffer_key(layout: Layout) -> Layout:
    """The layout fields ZeRO-3's buffers depend on (a smaller cache key)."""
    L = layout
    return Layout(tp=L.tp, pp=L.pp, dp=L.dp, cp=L.cp, ep=L.ep, zero=L.zero, vpp=L.vpp, partition=L.partition,
                  reshard_after_forward=L.reshard_after_forward, reduce_each_microbatch=L.reduce_each_microbatch)


# -- offload: optimizer state in host memory or on disk ----------------------------------------------------
def offload_units(model: PlanModel, layout: Layout, work: Workload, stage: int) -> tuple[tuple[int, int], ...]:
    """(elements, group size n) of every ZeRO unit one rank of `stage` holds: the units the runtime's ZeRO
    engine builds and the offload engine copies one by one (dense over dp·cp, routed experts over
    dp·cp/ep; `zero_units`), with a group of one rank too (ZeRO at dp = 1 still makes its units)."""
    L = layout
    _, expert = stage_params(model, L, stage)
    units = [(u, L.dp * L.cp) for u in zero_units(model, L, work.grad_bytes, stage)]
    if expert:
        units += [(u, L.edp) for u in zero_units(model, L, work.grad_bytes, stage, True)]
    return tuple(units)


def params_on_disk(layout: Layout) -> bool:
    """ZeRO-Infinity's parameter offload: ZeRO-3 with nvme keeps the parameter shards in the file between
    uses (parallel/zero.py `params_on_disk`), read before each all-gather."""
    return layout.offload == "nvme" and layout.zero == 3


def offload_bytes(model: PlanModel, layout: Layout, work: Workload, stage: int) -> dict:
    """What rank 0 of `stage` keeps off the device under `layout.offload`, as the runtime's offloaded state
    reports it (parallel/offload.py, `bytes()`): {"host": {params, grads, optimizer, total}, "disk": {...}}.
    Per unit of shard k elements (padded), mb / g / w bytes per master / gradient / parameter element,
    s = w when the parameters are not in the master dtype (their staging copy for the copy up), else 0:

        cpu   host  Σ (3·mb + g + s)·k        master, exp_avg, exp_avg_sq, the reduced gradient shard, staging
        nvme  disk  Σ 3·mb·k                  master, exp_avg, exp_avg_sq in one file
              host  2·(3·mb + g + s)·k_max    two slots of the largest unit: the one updated, the one read ahead
        ZeRO-3 nvme, in addition (`params_on_disk`):
              disk  params Σ w·k              the parameter shards
              host  params w·k_max            the buffer a shard passes through on its way to an all-gather
    The device keeps ZeRO's weights (none with ZeRO-3 nvme) and gradients and no optimizer state."""
    none = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    if layout.offload == "none":
        return {"host": dict(none), "disk": dict(none)}
    mb, g = work.master_bytes, work.grad_bytes
    s = work.param_bytes if work.param_bytes != mb else 0
    shards = [shard_size(u, n) for u, n in offload_units(model, layout, work, stage)]
    k = sum(shards) if layout.offload == "cpu" else 2 * max(shards, default=0)
    on_disk = params_on_disk(layout)
    w = work.param_bytes
    host = {"params": s * k + (w * max(shards, default=0) if on_disk else 0), "grads": g * k, "optimizer": 3 * mb * k}
    disk = {"params": w * sum(shards) if on_disk else 0, "grads": 0,
            "optimizer": 3 * mb * sum(shards) if layout.offload == "nvme" else 0}
    return {where: {**d, "total": sum(d.values())} for where, d in (("host", host), ("disk", disk))}


def pipeline_receives(layout: Layout, stage: int) -> int:
    """Receive buffers of one micro-batch's boundary alive beside a backward on `stage` (not saved
    activations): the output gradient the backward consumes (every stage but the last) and the next
    forward's input, posted ahead (every stage but the first); with interleaving every rank has both."""
    if layout.pp == 1:
        return 0
    if layout.interleaved:
        return 2
    return (stage > 0) + (stage < layout.pp - 1)


def mlp_width_per_token(model: PlanModel, work: Workload, tp: int) -> float:
    """The widest SwiGLU a token passes through on one rank, in hidden units per token of the micro-batch:
    a dense layer's ffn, a shared expert's, or the routed experts' (top_k · capacity rows per token)."""
    widths = [model.ffn] if not model.moe or model.dense_layers else []
    if model.moe:
        k = model.top_k * (work.capacity_factor or 1.0)   # dropless (0): planned as perfectly balanced
        widths += [model.shared_experts * model.moe_ffn, k * model.moe_ffn]
    return max(widths) / tp


def backward_scratch(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """The largest working set of a micro-batch's backward beyond its saved activations, on one rank of
    `stage`. Always alive: the residual stream's gradient and the pipeline's receive buffers
    (`pipeline_receives`), one hidden-wide tensor each (/t with sequence parallelism). Then the largest
    of these moments (model/transformer.py, model/moe.py, parallel/tensor.py):
    - the RMSNorm backward (`_RMSNorm`): its incoming gradient, the fp32 input gradient and one fp32
      product, and the input's fp32 copy unless activations are fp32 (e + 8 or e + 12 bytes per element);
    - the SwiGLU backward (`_SiluMul`): its incoming gradient and three temporaries, ffn-wide
      (`mlp_width_per_token`);
    - an MoE layer's backward: three dispatch-sized buffers (top_k · capacity rows of hidden per token:
      the combine's gradient, the experts' input gradients and their concatenation);
    - a layer weight's whole gradient before it is accumulated (`largest_layer_weight`).
    With ZeRO-2/3 `zero_buffers` comes on top (`stage_memory`); the embedding's and head's backward are
    `edge_scratch`, the loss's `loss_scratch`: moments of their own, with ZeRO's buffers of that moment."""
    e, T = work.act_bytes, rank_tokens(layout, work)
    split = layout.tp if layout.seq_parallel else 1
    hidden = e * T * model.hidden / split
    receives = pipeline_receives(layout, stage) * hidden
    fp32 = 8 + (4 if e != 4 else 0)
    norm = hidden + fp32 * T * model.hidden / split
    mlp = 4 * e * T * mlp_width_per_token(model, work, layout.tp)
    dispatch = 3 * e * T * model.top_k * (work.capacity_factor or 1.0) * model.hidden / layout.tp if model.moe else 0.0
    weight_grad = work.param_bytes * largest_layer_weight(model, layout)
    return receives + hidden + max(norm, mlp, dispatch, weight_grad)


def largest_layer_weight(model: PlanModel, layout: Layout) -> float:
    """Elements of a layer's largest weight gradient on one rank before the engine adds it to the
    gradient buffer: autograd makes it whole, in the weights' dtype (a matrix); the routed experts'
    three weights each come per expert, then the experts' unbind stacks them, so at the stack of the
    last one its E/ep experts' three matrices and the stacked result are alive (4 · E/ep · f · h)."""
    tp, h = layout.tp, model.hidden
    out = [h * model.ffn / tp, h * model.q_width / tp]
    if model.moe:
        out.append(4 * h * model.moe_ffn * model.experts / layout.ep)
    return max(out)


def edge_scratch(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """The embedding's backward on the first stage, the head's on the last (0 elsewhere): the table's
    dense gradient, whole in the weights' dtype (vocab/t x hidden), beside the residual gradient and the
    posted receives."""
    if stage not in (0, layout.pp - 1):
        return 0.0
    hidden = work.act_bytes * rank_tokens(layout, work) * model.hidden / (layout.tp if layout.seq_parallel else 1)
    table = work.param_bytes * model.hidden * padded_vocab(model.vocab, layout.tp) / layout.tp
    return (pipeline_receives(layout, stage) + 1) * hidden + table


def loss_scratch(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """The loss's backward on the last stage (0 elsewhere): the logits and two fp32 vocab-wide tensors
    (the upcast and the softmax gradient) per token, beside the posted receives; the layers' working set
    (`backward_scratch`) comes later, and so do most of ZeRO's buffers (`zero_at_loss`)."""
    if stage < layout.pp - 1:
        return 0.0
    vocab = padded_vocab(model.vocab, layout.tp) / layout.tp
    hidden = work.act_bytes * rank_tokens(layout, work) * model.hidden / (layout.tp if layout.seq_parallel else 1)
    return pipeline_receives(layout, stage) * hidden + (work.act_bytes + 8) * rank_tokens(layout, work) * vocab


def step_scratch(owned: float, work: Workload) -> float:
    """What the optimizer step holds beyond the states, per rank updating `owned` elements: one pass of
    rules.STEP_CHUNK elements (train/optim.py) at a time, the gradient norm's fp64 copy (8 bytes) or
    AdamW's denominators and low-precision gradients' upcast copies (master bytes each). The step runs
    after the backward has freed its activations and ZeRO's buffers, so a stage's buffers are the larger
    of the two (`stage_memory`), not their sum."""
    upcast = work.master_bytes if work.grad_bytes != work.master_bytes else 0
    return max(8, work.master_bytes + upcast) * min(rules.STEP_CHUNK, owned)


def offload_memory(model: PlanModel, layout: Layout, work: Workload, stage: int) -> dict:
    """{"host": bytes, "disk": bytes} per GPU of `stage` (`offload_bytes`' totals)."""
    out = offload_bytes(model, layout, work, stage)
    return {"host": float(out["host"]["total"]), "disk": float(out["disk"]["total"])}


def stage_memory(model: PlanModel, layout: Layout, work: Workload, stage: int) -> dict:
    """One rank of `stage`: device bytes per component (COMPONENTS) and their `total`; with offload also
    `offloaded` (the optimizer bytes that left the device), `offloaded_params` (the weight shards that left
    it: ZeRO-3 nvme), `host` and `disk` (`offload_memory`)."""
    row = dict(model_states(model, layout, work, stage))
    row["offloaded"] = row["offloaded_params"] = 0.0
    if layout.offload != "none":
        row["offloaded"], row["optimizer"] = row["optimizer"], 0
    if params_on_disk(layout):
        row["offloaded_params"], row["weights"] = row["weights"], 0
    row.update(offload_memory(model, layout, work, stage))
    row["activations"] = stage_activations(model, layout, work, stage)
    owned = (row["optimizer"] + row["offloaded"]) / optimizer_bytes_per_param(work)
    backward = zero_buffers(model, layout, work, stage) + backward_scratch(model, layout, work, stage)
    loss = zero_at_loss(model, layout, work, stage) + loss_scratch(model, layout, work, stage) if \
        stage == layout.pp - 1 else 0.0
    edge = zero_at_edge(model, layout, work, stage) + edge_scratch(model, layout, work, stage) if \
        stage in (0, layout.pp - 1) else 0.0
    row["buffers"] = max(backward, loss, edge, step_scratch(owned, work))
    row["total"] = sum(row[c] for c in COMPONENTS)
    row["stage"] = stage
    row["layers"] = len(layout_layers(model, layout)[stage])
    return row


def memory(model: PlanModel, layout: Layout, work: Workload, all_stages: bool = True) -> Memory:
    """Bytes per rank on every pipeline stage (or only the candidates for the most loaded)."""
    stages = range(layout.pp) if all_stages else candidate_stages(model, layout.pp, layout.vpp, layout.partition)
    out = Memory([stage_memory(model, layout, work, j) for j in stages])
    out.worst = max(range(len(out.stages)), key=lambda k: out.stages[k]["total"])
    return out
