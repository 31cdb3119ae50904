"""Activations a rank stores: per layer, per stage, and at the pipeline schedule's peak.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4): per layer, for s·b tokens, GPT-3 style (GeLU, dropout, 16-bit):

    no parallelism           s·b·h·(34 + 5·a·s/h)
    tensor parallel t        s·b·h·(10 + 24/t + 5·a·s/(h·t))
    + sequence parallel      s·b·h/t·(34 + 5·a·s/h)
    selective recompute      the 5·a·s/h term goes (so does it with flash attention)
    full recompute           2·s·b·h per layer (/t with sequence parallel), plus one layer's working
                             set or the head's tensors, whichever is larger (`full_recompute_peak`)

`layer_acts` derives these constants from the layer's tensors instead of hard-coding 34, so
Llama-style layers (SwiGLU, GQA, RMSNorm, no dropout) and MoE layers get their own; on the GPT-3 shape it
reproduces the table exactly (tests/unit/test_plan_literature.py). Context parallelism (ring or Ulysses)
divides the tokens a rank holds by cp. Pipeline schedules multiply by the micro-batches in flight:
GPipe m; 1F1B min(p - j, m) on stage j (p on the first); interleaved (Narayanan et al. 2021) holds
min(2(p-j-1) + (v-1)·N + 1, m·v) chunks of L_j/v layers with N micro-batches per group
(`Layout.microbatch_group`, N = p by default: p·(1 + (p-1)/(p·v)) stage-activations on the first stage).

Mechanisms that change what a layer stores (docs/plan.md, "Mechanisms"): `Workload.fp8_act_cache` caches
the inputs of the FP8 linear layers at 1 byte, the attention output at 1.5 (E5M6) and, in MoE experts,
only the activation function's inputs (its output recomputed); `Layout.recompute_norm_mla` recomputes
the norms' outputs and MLA's up-projections, so MLA stores its latents instead of per-head Q, K, V
(DeepSeek-AI 2024, §3.3.3, §3.4). `layer_acts` lists the tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..parallel.pipeline.partition import partition_layers
from ..parallel.pipeline.schedules import interleaved_table, interleaved_warmup
from ..rules import GPIPE, INTERLEAVED
from ..shapes import padded_vocab
from .layout import Layout, Workload, microbatches
from .models import PlanModel
from .units import frozen_prefix_layers, head_stage, layout_blocks, mtp_blocks, stage_layers


# -- micro-batches in flight -------------------------------------------------------------------------
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


def layer_acts(model: PlanModel, i: int, work: Workload, tp: int = 1, recompute_norm_mla: bool = False,
               etp: int = 1) -> LayerActs:
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
    Qwen3's q/k norms keep their inputs (Q and K before RoPE) and an fp32 inverse rms per head and token.
    Expert tensor parallelism (`etp`): each etp rank keeps the rows of all etp ranks as its expert slices'
    input (etp times the routed rows, each 1/etp of the width: the SwiGLU internals per token are unchanged).
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
        if model.qk_norm:   # Qwen3: each q/k norm keeps its input and an fp32 inverse rms per head
            acts.sharded += e * (model.q_width + model.kv_width * tp / kv_split) + 4 * (model.heads + model.kv_heads)
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
    k = routed_per_token(model, work)
    acts.sharded += 2 * 4 * model.experts + k * c * h * etp         # router logits+probs, expert inputs
    per_expert = n_act * 1 if fp8 else (n_act + 1) * e              # FP8: activation output recomputed
    acts.sharded += (k + model.shared_experts) * per_expert * model.moe_ffn
    return acts


def korthikanti(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """The paper's closed forms (bytes per layer), for checking `layer_acts` against (§4.2, Table 2)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    s2 = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + s2)
    return s * b * h * (10 + 24 / t + s2 / t)


def routed_per_token(model: PlanModel, work: Workload) -> float:
    """Expert rows per token of an MoE layer: top_k times the capacity factor (its zero-padded buffers);
    dropless routing (capacity 0) is planned as perfectly balanced, top_k rows."""
    return model.top_k * (work.capacity_factor or 1.0)


def hidden_tensor_bytes(model: PlanModel, layout: Layout, work: Workload) -> float:
    """One hidden-wide tensor of a micro-batch on one rank (/t with sequence parallelism): a stage's
    boundary activation or gradient, the residual stream's gradient."""
    return work.act_bytes * rank_tokens(layout, work) * model.hidden / (layout.tp if layout.seq_parallel else 1)


def rank_tokens(layout: Layout, work: Workload) -> float:
    """Tokens of one micro-batch held by one rank (context parallel splits the sequence)."""
    return layout.micro_batch * work.seq / layout.cp


@lru_cache(maxsize=16384)
def _stage_act_table(model: PlanModel, work: Workload, tp: int, sp: bool, with_scores: bool, pp: int, vpp: int,
                     partition: str, light: bool = False, head_first: bool = False, etp: int = 1) -> tuple:
    """Per stage: (sum, max) over its blocks (its layers, and the MTP modules' on the last; with
    `head_first` the layers only: `_stage_activations` counts the MTP modules once) of stored activation
    bytes per token on one rank."""
    per_layer = {}
    rows = []
    quiet = frozen_prefix_layers(model)   # train.freeze: leading layers autograd records nothing in
    for j, rng in enumerate(stage_layers(model.layers, pp, vpp, partition)):
        vals = []
        for i in rng + (() if head_first else mtp_blocks(model, pp, j)):
            if i < quiet:
                vals.append(0.0)
                continue
            key = model.is_moe_layer(i)
            if key not in per_layer:
                per_layer[key] = layer_acts(model, i, work, tp, light, etp).per_rank(tp, sp, with_scores)
            vals.append(per_layer[key])
        rows.append((sum(vals), max(vals, default=0.0)))
    return tuple(rows)


@lru_cache(maxsize=16384)
def _chunk_act_table(model: PlanModel, work: Workload, tp: int, sp: bool, with_scores: bool, pp: int, vpp: int,
                     partition: str, light: bool, full: bool, etp: int = 1) -> tuple:
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
            layers = tuple(part.layers_of(q)) + (mtp_blocks(model, pp, s) if q == pp * vpp - 1 else ())
            if full:
                w = len(layers) * e * h / split
            else:
                w = sum(layer_acts(model, i, work, tp, light, etp).per_rank(tp, sp, with_scores) for i in layers)
            if q == 0:
                w += e * h / split
            if q == pp * vpp - 1:
                w += head_acts(e, h, split, vocab) + mtp_acts(model, e, split, vocab)
            row.append(w)
        rows.append(tuple(row))
    return tuple(rows)


def stage_activations(model: PlanModel, layout: Layout, work: Workload, stage: int, flight: float = 0.0) -> float:
    """Peak activation bytes of one rank of `stage`: layers × micro-batches in flight, embedding on the
    first stage, final norm, head and fp32 logits on the last, with the MTP modules' blocks and what they
    keep beyond them (`mtp_acts`); full recompute keeps each layer's input
    plus one layer's working set (`full_recompute_peak`). `flight` > 0 gives the micro-batches in flight
    instead of the schedule's (a one-way schedule's stage; DualPipe, plan/dualpipe.py), the head's for one
    micro-batch (its forward and backward run back to back, as on a 1F1B last stage)."""
    L = layout
    return _stage_activations(model, work, L.tp, L.sp_mode, L.cp, L.pp, L.dp, L.vpp, L.schedule,
                              L.micro_batch, L.recompute, L.partition, stage, L.microbatch_group,
                              L.recompute_norm_mla, L.head_first, flight)


@lru_cache(maxsize=65536)
def _stage_activations(model, work, tp, sp_mode, cp, pp, dp, vpp, schedule, micro_batch, recompute, partition, stage,
                       group=0, light=False, head_first=False, flight=0.0):
    L = Layout(tp=tp, sp_mode=sp_mode, cp=cp, pp=pp, dp=dp, vpp=vpp, schedule=schedule, micro_batch=micro_batch,
               recompute=recompute, partition=partition, microbatch_group=group, recompute_norm_mla=light,
               head_first=head_first)
    T = rank_tokens(L, work)
    e, h = work.act_bytes, model.hidden
    n_layers = len(layout_blocks(model, L, stage))
    m = microbatches(L, work)
    head_flight = 1.0 if flight else None
    flight = flight or in_flight(L.schedule, L.pp, stage, m, L.vpp, L.microbatch_group)
    head_flight = head_flight or flight
    split = L.tp if L.seq_parallel else 1
    with_scores = not work.flash and L.recompute == "none"
    total_pt, max_pt = _stage_act_table(model, work, L.tp, L.seq_parallel, with_scores, L.pp, L.vpp,
                                        L.partition, L.recompute_norm_mla and L.recompute != "full", head_first,
                                        L.etp)[stage]
    if L.interleaved:   # chunks may differ: walk the schedule
        chunks = _chunk_act_table(model, work, L.tp, L.seq_parallel, with_scores, L.pp, L.vpp, L.partition,
                                  L.recompute_norm_mla and L.recompute != "full", L.recompute == "full", L.etp)[stage]
        return interleaved_peak(L.pp, stage, m, L.vpp, L.microbatch_group, chunks) * T + (max_pt * T if
                                                                                        L.recompute == "full" else 0.0)
    vocab = padded_vocab(model.vocab, L.tp) / L.tp
    head = T * (head_acts(e, h, split, vocab) + mtp_acts(model, e, split, vocab)) \
        if stage == head_stage(L.pp, head_first) else 0.0
    once = 0.0
    if head_first and head:
        # DualPipe's placement: the head's and MTP modules' chunk is the last in the data flow, so, as on a
        # last stage, one micro-batch's head and MTP activations are alive at a time, not the first stage's
        # micro-batches in flight
        light_on = L.recompute_norm_mla and L.recompute != "full"
        once = head + T * sum(layer_acts(model, i, work, L.tp, light_on, L.etp).per_rank(L.tp, L.seq_parallel, with_scores)
                              for i in mtp_blocks(model, L.pp, stage, head_first))
        head = 0.0
    if L.recompute == "full":
        return full_recompute_peak(flight, n_layers, T * e * h / split, max_pt * T, head) + once \
            - (flight - head_flight) * head
    total = flight * total_pt * T
    if stage == 0 and not frozen_prefix_layers(model):
        total += flight * T * e * h / split                     # embedding output (stored unless nothing reads its grad)
    return total + head_flight * head + once


def head_acts(e: float, h: int, split: int, vocab: float) -> float:
    """Bytes per token the last stage's head keeps: the final norm's and the head's inputs, and the loss's
    gradient (softmax − one-hot) of the rank's vocabulary slice, made in the forward in fp32 (fp64 for
    fp64 models: `buffers.loss_grad_bytes`); the logits themselves are not kept."""
    return 2 * e * h / split + max(4, e) * vocab


def mtp_acts(model: PlanModel, e: float, split: int, vocab: float) -> float:
    """Bytes per token the MTP modules keep on the last stage beyond their blocks (DeepSeek-V3 §2.2), per
    depth: the embedding's norm input and M's input [norm(h); norm(emb)] (2h; the previous depth's hidden,
    the other norm's input, is kept already as a head's norm input), and the shared head's second pass
    as the first (`head_acts`: its norm's and the head's inputs and the second loss gradient)."""
    h = model.hidden
    return model.mtp_depth * (3 * e * h / split + head_acts(e, h, split, vocab))


def full_recompute_peak(flight: float, n_layers: int, layer_input: float, layer_peak: float, head: float) -> float:
    """Full recompute, one layer per checkpoint (parallel/recompute.py): every micro-batch in flight keeps
    each layer's input (the first layer's is the embedding's output) and, on the last stage, the head's
    tensors (norm and head inputs, logits). The micro-batch in backward has freed its head's tensors
    before its last layer is re-run, and the re-run layer's working set holds its kept input once: the
    peak is the inputs, the other micro-batches' heads and the larger of the head and one layer's working
    set beyond its input."""
    extra = layer_peak - layer_input if n_layers else 0.0
    return flight * n_layers * layer_input + (flight - 1) * head + max(extra, head)
