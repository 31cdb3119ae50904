"""What a rank holds: its layers, its parameters, ZeRO's units and shards, the model states they make.

Model states (Rajbhandari et al. 2020, "ZeRO", §3 and Table 1): per parameter `w` bytes of weights,
`g` of gradients and `k` of optimizer state (Adam m and v in fp32: 8; plus an fp32 master copy when
weights are 16-bit: 12, the paper's K). With n data-parallel ranks:

    ZeRO-0  (w + g + k)·Φ        ZeRO-1  (w + g)·Φ + k·Φ/n
    ZeRO-2  w·Φ + (g + k)·Φ/n    ZeRO-3  (w + g + k)·Φ/n

Shards are padded so they are even: Φ/n is ceil(Φ/n). Dense parameters are sharded over dp·cp,
routed experts, when on the expert grid, over the expert-data-parallel group tp·cp·dp/(etp·ep) (each rank
holding E/ep experts, 1/etp of each one's width: `ExpertSplit`).

A pipeline rank's layers are the runtime's split (`stage_layers`); `candidate_stages` and `time_stages`
name the stages that can be the most loaded or the slowest. `layer_tensors` and `root_tensors` list a
rank's tensors in registration order, `zero_units` packs them into the flat buffers ZeRO shards (as
parallel/zero/engine.py), and `unit_states` / `model_states` turn the units into bytes.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

from .. import rules
from ..parallel.pipeline.partition import partition_layers
from ..parallel.zero.spec import ZeroSpec
from ..shapes import bucket_ranges, padded, padded_vocab, segments, shard_size
from .layout import Layout, Workload
from .models import PlanModel


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


def head_stage(pp: int, head_first: bool = False) -> int:
    """The stage holding the final norm, the LM head and the MTP modules: the last, or with `head_first`
    (`Layout.head_first`, DualPipe's placement: DeepSeek-V3 §3.2.1 keeps the shallowest and the deepest
    layers, embedding and output head, on one pipeline rank) the first, beside the embedding."""
    return 0 if head_first else pp - 1


def mtp_blocks(model: PlanModel, pp: int, stage: int, head_first: bool = False) -> tuple[int, ...]:
    """The multi-token-prediction modules one rank of `stage` runs (DeepSeek-V3 §2.2, `PlanModel.mtp_depth`):
    all of them on the last stage, with the output head whose weights they share (DeepSeek-V3 §3.2.3 keeps
    embedding, head and MTP on one pipeline rank), none elsewhere. Each is named by the layer index
    `model.layers` (its block is a layer of that kind: MoE where the model has them, as the released
    checkpoint's layer 61); `block_rank_params` and `block_tensors` add the module's own M and norms."""
    return (model.layers,) * model.mtp_depth if stage == head_stage(pp, head_first) else ()


def layout_blocks(model: PlanModel, layout: Layout, stage: int) -> tuple[int, ...]:
    """The blocks one rank of `stage` runs: its layers (`layout_layers`), then the MTP modules' (`mtp_blocks`)."""
    return layout_layers(model, layout)[stage] + mtp_blocks(model, layout.pp, stage, layout.head_first)


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


@lru_cache(maxsize=4096)
def time_stages(model: PlanModel, pp: int, vpp: int = 1, partition: str = "even") -> tuple[int, ...]:
    """Stages that can end the step last: the first with the most layers and the last (head and loss),
    the slowest in the pipeline (the last alone suffices for that when it has as many layers: it computes
    the head, the first only looks up the embedding), and the first, whose gradient reduction starts
    last (its chunks' last backwards end the pipeline) and includes the embedding's."""
    counts = [len(r) for r in stage_layers(model.layers, pp, vpp, partition)]
    most = counts.index(max(counts))
    slow = {pp - 1} if counts[most] == counts[-1] and not model.moe else {most, pp - 1}
    return tuple(sorted(slow | {0}))


# -- parameters a rank holds -------------------------------------------------------------------------
class ExpertSplit(NamedTuple):
    """How one rank holds the routed experts (MoE parallel folding, parallel/expert.py): E/ep whole
    experts, each 1/etp of its width; `folded`: on the expert grid (rules.experts_on_expert_grid), so
    they form their own ZeRO units and their gradients are summed over edp; else they are dense weights."""
    ep: int = 1
    etp: int = 1
    folded: bool = False

    @staticmethod
    def of(layout: Layout) -> "ExpertSplit":
        return ExpertSplit(layout.ep, layout.etp, layout.experts_folded)

    def routed(self, model: PlanModel) -> int:
        """Elements of one of a layer's stacked expert weights (w_gate, w_up or w_down) on one rank."""
        return (model.experts // self.ep) * model.moe_ffn * model.hidden // self.etp


def layer_rank_params(model: PlanModel, i: int, tp: int, ep: ExpertSplit) -> tuple[int, int]:
    """`_layer_rank_params` of layer i: every dense layer holds the same, and every MoE layer (with
    train.freeze patterns, layer i's own tensors that are not frozen)."""
    if model.frozen:
        tensors = layer_tensors(model, i, tp, ep)
        return sum(n for n, ex, _ in tensors if not ex), sum(n for n, ex, _ in tensors if ex)
    return _layer_rank_params(model, model.is_moe_layer(i), tp, ep)


def block_rank_params(model: PlanModel, i: int, tp: int, ep: ExpertSplit) -> tuple[int, int]:
    """`layer_rank_params` of block i of a stage: layer i, or (i = model.layers, `mtp_blocks`) an MTP
    module: its block plus M and its three norms (`PlanModel.mtp_projection_params`), whole on every tp rank."""
    dense, expert = layer_rank_params(model, i, tp, ep)
    return (dense + model.mtp_projection_params(), expert) if i >= model.layers else (dense, expert)


@lru_cache(maxsize=4096)
def _layer_rank_params(model: PlanModel, moe: bool, tp: int, ep: ExpertSplit) -> tuple[int, int]:
    """(dense, expert) parameters of layer i on one rank: matrices split tp ways (K/V by min(tp, kv)
    heads, replicated beyond), norms and row-parallel biases replicated; an MoE layer's router and shared
    experts stay whole on the tp ranks (each routes its own tokens, parallel/tensor.py), and so do the routed
    experts unless they are folded onto the expert grid: E/ep of them, 1/etp of each one's width
    (`ExpertSplit`). Qwen3's q/k norms whole on every tp rank. MLA: its down-projections and latent norms
    whole on every tp rank, the up-projections and output projection split (parallel/tensor.py
    `latent_attention`)."""
    if model.lora_rank:   # the adapters are what trains (frozen_params: the rest)
        return sum(n for n, _, _ in lora_tensors(model, moe, tp)), 0
    h = model.hidden
    norms = 2 * model._norm(h)
    row_bias = h if model.linear_bias else 0
    attn_rank = _attn_rank(model, tp)
    if not moe:
        mlp = model.mlp_params(model.ffn)
        return attn_rank + norms + (mlp - row_bias) // tp + row_bias, 0
    shared = model.shared_experts * model.expert_params()
    experts = (model.experts // ep.ep) * model.expert_params() // ep.etp
    return attn_rank + norms + model.router_params() + shared, experts


@lru_cache(maxsize=4096)
def _stage_param_table(model: PlanModel, tp: int, pp: int, vpp: int, partition: str, ep: ExpertSplit,
                       head_first: bool = False) -> tuple:
    """Per stage: (dense, expert, largest block) parameters on one rank (the MTP modules' on the last);
    "expert": the routed experts reduced over their own "edp" group, so none when they are not folded."""
    rows = []
    for j, rng in enumerate(stage_layers(model.layers, pp, vpp, partition)):
        dense = expert = biggest = 0
        for i in rng + mtp_blocks(model, pp, j, head_first):
            d, e = block_rank_params(model, i, tp, ep)
            dense, expert, biggest = dense + d, expert + e, max(biggest, d + e)
        dense += sum(n for n, _ in root_tensors(model, tp, pp, j, head_first))   # embedding, final norm, head (unless frozen)
        if not ep.folded:   # not on the expert grid: the experts are reduced and sharded with the rest
            dense, expert = dense + expert, 0
        rows.append((dense, expert, biggest))
    return tuple(rows)


def stage_params(model: PlanModel, layout: Layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters held by one rank of `stage` (tied embeddings: once when pp = 1, a copy
    on the last stage when pp > 1, as Megatron does)."""
    dense, expert, _ = _param_table(model, layout)[stage]
    return dense, expert


def _param_table(model: PlanModel, layout: Layout) -> tuple:
    L = layout
    return _stage_param_table(model, L.tp, L.pp, L.vpp, L.partition, ExpertSplit.of(L), L.head_first)


def frozen_params(model: PlanModel, layout: Layout, stage: int) -> int:
    """Parameters one rank of `stage` holds frozen (LoRA: every base weight; train.freeze: what its patterns
    match), each its tp / pp / ep piece, held whole by each data-parallel rank (no engine shards what has
    no gradient); 0 when everything trains."""
    if not (model.lora_rank or model.frozen):
        return 0
    every = sum(stage_params(unfrozen(model), layout, stage))
    return every if model.lora_rank else every - sum(stage_params(model, layout, stage))   # adapters are extra


def frozen_share(model: PlanModel, layout: Layout, stage: int) -> tuple[float, bool]:
    """(share of the stage's block matrices that are frozen, whether the LM head is): the weight-gradient
    GEMMs the backward skips (plan/time.py). LoRA: (1, True); nothing frozen: (0, False)."""
    if model.lora_rank:
        return 1.0, True
    if not model.frozen:
        return 0.0, False
    every = trained = 0
    for i in layout_blocks(model, layout, stage):
        if i >= model.layers:
            continue
        every += sum(n for n, _, tag in layer_tensors(unfrozen(model), i, layout.tp, ExpertSplit.of(layout)) if tag != "norm")
        trained += sum(n for n, _, tag in layer_tensors(model, i, layout.tp, ExpertSplit.of(layout)) if tag != "norm")
    head = is_frozen(model, "embed.weight" if model.tie_embeddings else "head.weight")
    return (1 - trained / every if every else 0.0), head


def frozen_prefix_layers(model: PlanModel) -> int:
    """Leading layers with every weight frozen behind a frozen embedding (train.freeze): nothing before or in
    them trains, so autograd records nothing there (no activation stored, no backward run)."""
    if not model.frozen or not is_frozen(model, "embed.weight"):
        return 0
    n = 0
    while n < model.layers and all(is_frozen(model, f"layers.{n}.{name}") for name in layer_names(model, n)):
        n += 1
    return n


def unfrozen(model: PlanModel) -> PlanModel:
    """`model` with every parameter trained (no LoRA, no freeze patterns)."""
    return replace(model, lora_rank=0, lora_targets=(), frozen=())


def is_frozen(model: PlanModel, name: str) -> bool:
    """Whether parameter `name` is frozen by train.freeze (fnmatch, as model/lora.py `freeze`) or by LoRA."""
    return bool(model.lora_rank) or rules.frozen_by(name, model.frozen)


def layer_names(model: PlanModel, i: int) -> list[str]:
    """Our parameter names of layer i's tensors, in `layer_tensors`'s order (our runtime's blocks; latent
    attention's and the lumped variants' are not listed one by one: ValueError)."""
    if model.mla or not exact_tensors(model):
        raise ValueError("train.freeze is planned for our runtime's blocks without latent attention")
    bias = model.qkv_bias
    out = ["attn_norm.weight"]
    for k in ("wq", "wk", "wv"):
        out += [f"attn.{k}.weight"] + ([f"attn.{k}.bias"] if bias else [])
    out += ["attn.wo.weight", "mlp_norm.weight"]
    if not model.is_moe_layer(i):
        return out + ["mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"]
    out += ["mlp.router.weight", "mlp.experts.w_gate", "mlp.experts.w_up", "mlp.experts.w_down"]
    if model.shared_experts:
        out += ["mlp.shared.gate.weight", "mlp.shared.up.weight", "mlp.shared.down.weight"]
    return out + (["mlp.shared_gate.weight"] if model.shared_expert_gate else [])




def lora_tensors(model: PlanModel, moe: bool, tp: int) -> list[tuple[int, bool, str]]:
    """(elements on one rank, False, tag) of one layer's LoRA adapters in registration order: A then B of
    each target, attention's (wq, wk, wv, wo; latent attention: wo) then the dense MLP's or the shared
    experts' (gate, up, down). Under tp (parallel/tensor.py): a column layer's B split like its weight's
    rows (K/V: by min(tp, kv_heads), tagged "kv") and its A whole with partial gradients; a row layer's A
    split like its weight's columns and its B whole with partial gradients (tag "moe": whole on every tp
    rank, summed over tp). The shared experts' adapters are whole on every tp rank, as the experts are."""
    r, h = model.lora_rank, model.hidden
    whole = "moe" if tp > 1 else ""
    widths = {"wq": model.q_width, "wk": model.kv_width, "wv": model.v_width}
    out = []
    attn = ("wo",) if model.mla else ("wq", "wk", "wv", "wo")
    for t in attn:
        if t not in model.lora_targets:
            continue
        if t == "wo":
            out += [(r * model.attn_out_width // tp, False, ""), (h * r, False, whole)]
            continue
        split = min(tp, model.kv_heads) if t != "wq" else tp
        tag = "kv" if t != "wq" and tp > model.kv_heads else ""
        out += [(r * h, False, whole), (widths[t] // split * r, False, tag)]
    if moe and not model.shared_experts:
        return out
    f = model.shared_experts * model.moe_ffn if moe else model.ffn
    div = 1 if moe else tp                     # shared experts: whole on every tp rank
    for t in ("gate", "up", "down"):
        if t not in model.lora_targets:
            continue
        if moe:
            out += [(r * (h if t != "down" else f), False, whole), ((f if t != "down" else h) * r, False, whole)]
        elif t == "down":
            out += [(r * f // div, False, ""), (h * r, False, whole)]
        else:
            out += [(r * h, False, whole), (f // div * r, False, "")]
    return out


def exact_tensors(model: PlanModel) -> bool:
    """Whether `layer_tensors` lists every layer's tensors one by one (our runtime's blocks: Llama, with
    q/k/v biases, and its MoE layers), none lumped per sub-block."""
    return not (model.linear_bias or model.mlp != "swiglu" or model.router_bias)


def layer_tensors(model: PlanModel, i: int, tp: int, ep: ExpertSplit) -> list[tuple[int, bool, str]]:
    """(elements on one rank, is routed expert, tag) of layer i's tensors in registration order. Exact
    for our runtime's blocks (attn_norm, wq[, bias], wk[, bias], wv[, bias], wo, mlp_norm, then gate, up,
    down, or an MoE layer's router, experts' w_gate, w_up, w_down, shared gate, up, down and shared gate;
    see `exact_tensors`): at real sizes a tensor is larger than a bucket, so the bucket count is the
    tensor count (the dry run found a lumped MoE layer two buckets short). Other variants are lumped
    per sub-block, which only moves ZeRO bucket boundaries. Tags: "norm" (replicated over tp), "kv" (K/V
    weights and biases, replicated over tp/kv_heads ranks when tp > kv_heads), "moe" (an MoE layer's
    router and shared experts under tp, and its routed experts unless they are folded: whole on every tp rank,
    partial gradients), "" otherwise (folded routed experts too: their pieces follow the expert grid); a
    lump holding K/V is tagged ""."""
    if model.lora_rank:
        return lora_tensors(model, model.is_moe_layer(i), tp)
    if model.frozen:   # train.freeze: the layer's tensors that are not frozen
        every = layer_tensors(unfrozen(model), i, tp, ep)
        return [t for t, name in zip(every, layer_names(model, i)) if not is_frozen(model, f"layers.{i}.{name}")]
    h = model.hidden
    dense, expert = layer_rank_params(model, i, tp, ep)
    norm = model._norm(h)
    if not exact_tensors(model):
        attn = _attn_rank(model, tp)
        mlp = dense - 2 * norm - attn     # dense MLP, or router + shared experts
        moe = "moe" if model.is_moe_layer(i) and tp > 1 else ""   # whole on every tp rank, partial grads
        out = [(norm, False, "norm"), (attn, False, ""), (norm, False, "norm"), (mlp, False, moe)]
        return out + ([(expert, True, "" if ep.folded else moe)] if expert else [])
    if model.mla:   # attn_norm, latent attention's tensors, mlp_norm
        out = [(norm, False, "norm")] + [(e, False, tag) for e, tag in model.mla_tensors(tp)] + [(norm, False, "norm")]
    else:
        kv_width = model.kv_heads * model.head_dim // min(tp, model.kv_heads)
        q_width = model.heads * model.head_dim // tp
        bias = model.qkv_bias
        out = [(norm, False, "norm"), (q_width * h, False, "")] + ([(q_width, False, "")] if bias else [])
        for _ in range(2):   # wk, wv
            out += [(kv_width * h, False, "kv")] + ([(kv_width, False, "kv")] if bias else [])
        out += [(q_width * h, False, "")]
        if model.qk_norm:   # Qwen3's q and k norms: whole on every tp rank, partial gradients (as MoE routers)
            out += [(model.head_dim, False, "moe" if tp > 1 else "")] * 2
        out += [(norm, False, "norm")]
    if not model.is_moe_layer(i):
        f = model.ffn * h // tp
        return out + [(f, False, ""), (f, False, ""), (f, False, "")]
    moe = "moe" if tp > 1 else ""
    shared = model.shared_experts * model.moe_ffn * h
    out += [(model.experts * h, False, moe)] + [(ep.routed(model), True, "" if ep.folded else moe)] * 3
    if model.shared_experts:
        out += [(shared, False, moe)] * 3
    if model.shared_expert_gate:
        out += [(h, False, moe)]
    return out


def block_tensors(model: PlanModel, i: int, tp: int, ep: ExpertSplit) -> list[tuple[int, bool, str]]:
    """`layer_tensors` of block i of a stage: layer i, or (i = model.layers, `mtp_blocks`) an MTP module in
    DeepSeek-V3's order: the embedding's and the hidden state's norms and M (2h -> h), its block, the
    shared head's input norm; all its own tagged "norm" (whole on every tp rank, `block_rank_params`)."""
    out = layer_tensors(model, i, tp, ep)
    if i < model.layers:
        return out
    norm = model._norm(model.hidden)
    own = model.mtp_projection_params() - 3 * norm
    return [(norm, False, "norm"), (norm, False, "norm"), (own, False, "norm")] + out + [(norm, False, "norm")]


def _attn_rank(model: PlanModel, tp: int) -> int:
    """Attention parameters of one rank (as in layer_rank_params)."""
    h = model.hidden
    row_bias = h if model.linear_bias else 0
    attn = model.attention_params()
    if model.mla:
        rep = model.mla_replicated_params()
        return (attn - rep) // tp + rep
    kv = 2 * model._linear(h, model.kv_heads * model.head_dim, model.qkv_bias)
    whole = row_bias + model.qk_norm_params()     # Qwen3's q/k norms: whole on every tp rank
    return (attn - kv - whole) // tp + kv // min(tp, model.kv_heads) + whole


def root_tensors(model: PlanModel, tp: int, pp: int, stage: int, head_first: bool = False) -> list[tuple[int, str]]:
    """(elements on one rank, tag) of the embedding (first stage), final norm ("norm") and untied head
    (`head_stage`: the last, or the first with `head_first`, where a tied head is the embedding itself), in
    registration order; tags as in `layer_tensors`."""
    vocab_rank = padded_vocab(model.vocab, tp) // tp * model.hidden
    out = []
    head = "embed.weight" if model.tie_embeddings else "head.weight"   # a tied head is the embedding
    if stage == 0 and not is_frozen(model, "embed.weight"):
        out.append((vocab_rank + (model.max_seq * model.hidden if model.learned_pos else 0), ""))
    if stage == head_stage(pp, head_first):
        if not is_frozen(model, "norm.weight"):
            out.append((model._norm(model.hidden), "norm"))
        if (not model.tie_embeddings or (pp > 1 and not head_first)) and not is_frozen(model, head):
            out.append((vocab_rank, ""))
    return out


def zero_units(model: PlanModel, layout: Layout, grad_bytes: int, stage: int, expert: bool = False) -> tuple[int, ...]:
    """Sizes of the flat buffers ZeRO shards, each padded to a multiple of n (parallel/zero/engine.py): one per
    transformer block plus a root unit (embedding, norm, head) for ZeRO-3; buckets of at most bucket_mb
    MiB in backward order for ZeRO-1/2 (and, with zero = 0, DDP's all-reduce buckets, parallel/data.py).
    `expert` selects the routed-expert parameters instead."""
    L = layout
    return _zero_units(model, L.tp, L.pp, L.vpp, L.partition, ExpertSplit.of(L), block_units(L), L.bucket_mb,
                       grad_bytes, stage, expert, L.head_first)


def block_units(layout: Layout) -> bool:
    """ZeRO units are blocks plus a root unit (ZeRO-3; ZeRO-2 reducing every micro-batch under pp)."""
    return layout.zero_spec.block_units


def root_units(model: PlanModel, layout: Layout, stage: int) -> int:
    """ZeRO root units on one rank of `stage` (the first of `zero_units`): 1 where the units are blocks plus a
    root and the stage holds parameters outside its blocks (embedding, final norm, head), else 0."""
    return 1 if block_units(layout) and any(n for n, _ in root_tensors(model, layout.tp, layout.pp, stage,
                                                                         layout.head_first)) else 0


def held_root(model: PlanModel, layout: Layout, stage: int) -> bool:
    """Whether `stage`'s root unit holds a tied copy of the embedding (first and last stage, pp > 1):
    such a unit is reduced once per step, after the copies' gradients are summed (parallel/engine.py)."""
    return model.tie_embeddings and layout.pp > 1 and not layout.head_first and stage in (0, layout.pp - 1)


@lru_cache(maxsize=8192)
def _zero_units(*key) -> tuple[int, ...]:
    return tuple(sum(n for n, _ in u) for u in _unit_tensors(*key))


def unit_tensors(model: PlanModel, layout: Layout, grad_bytes: int, stage: int,
                 expert: bool = False) -> tuple[tuple[tuple[int, str], ...], ...]:
    """`zero_units` tensor by tensor: per unit, its tensors' (elements, tag) in flat-buffer order."""
    L = layout
    return _unit_tensors(model, L.tp, L.pp, L.vpp, L.partition, ExpertSplit.of(L), block_units(L), L.bucket_mb,
                         grad_bytes, stage, expert, L.head_first)


def _block_tensors_tagged(model: PlanModel, i: int, tp: int, ep: ExpertSplit, expert: bool) -> tuple[tuple[int, str], ...]:
    """(elements, tag) of block i's tensors (`block_tensors`), routed experts or the others; every dense
    layer has the same, and every MoE layer, and every MTP module (not so with train.freeze patterns).
    Routed experts off the expert grid (tp = ep = etp = 1) are reduced and sharded with the rest (no
    "edp" group of their own): they count as the others."""
    if model.frozen:
        return tuple((n, tag) for n, ex, tag in block_tensors(model, i, tp, ep) if (ex and ep.folded) == expert)
    return _tensors_of_kind(model, model.is_moe_layer(i), i >= model.layers, tp, ep, expert)


@lru_cache(maxsize=8192)
def _tensors_of_kind(model: PlanModel, moe: bool, mtp: bool, tp: int, ep: ExpertSplit, expert: bool) -> tuple:
    i = model.layers if mtp else (model.dense_layers if moe else 0)
    return tuple((n, tag) for n, ex, tag in block_tensors(model, i, tp, ep) if (ex and ep.folded) == expert)


@lru_cache(maxsize=8192)
def _unit_tensors(model: PlanModel, tp: int, pp: int, vpp: int, partition: str, ep: ExpertSplit, blocks: bool,
                  bucket_mb: float, grad_bytes: int, stage: int, expert: bool, head_first: bool = False) -> tuple:
    rng = stage_layers(model.layers, pp, vpp, partition)[stage] + mtp_blocks(model, pp, stage, head_first)
    per_layer = [_block_tensors_tagged(model, i, tp, ep, expert) for i in rng]
    root = [] if expert else root_tensors(model, tp, pp, stage, head_first)
    if blocks:
        units = ([tuple(root)] if root else []) + [t for t in per_layer]
        return tuple(u for u in units if sum(n for n, _ in u))
    embed = not is_frozen(model, "embed.weight")   # trained: the first root tensor, and a tied head copy the last
    first = root[:1] if stage == 0 and embed else []
    rest = root[len(first):]
    # backward order (parallel/engine.py backward_order): reverse registration, the tied head copy last
    tied = rest[-1:] if model.tie_embeddings and pp > 1 and not head_first and stage == pp - 1 and rest and embed else []
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
    """Adam m and v in the master dtype, plus a master copy when weights are lower precision; with
    `optimizer_dtype` "bf16" both moments in bf16 and no master copy: 4 (NeMo's distributed_fused_adam with
    `dtype: bf16`, which Apex's DistributedFusedAdam keeps as bf16 moments with store_params=False when the
    model is bf16, as in NVIDIA's Nemotron-4 340B benchmark; tests/unit/test_plan_reserve.py)."""
    if work.optimizer_dtype == "bf16":
        return 2 * 2
    return 2 * work.master_bytes + (work.master_bytes if work.param_bytes != work.master_bytes else 0)


def zero_states(params: int, n: int, spec: ZeroSpec, w: int, g: int, k: int) -> dict:
    """Bytes of weights, gradients and optimizer state per rank for `params` parameters sharded over n
    ranks as ZeRO setting `spec` shards them (Rajbhandari et al. 2020, §5.1 / Table 1)."""
    sh = shard_size(params, n)
    return {"weights": w * (sh if spec.shards_params else params),
            "grads": g * (sh if spec.shards_grads else params),
            "optimizer": k * (sh if spec.shards_states else params)}


def unit_states(units: tuple[int, ...], n: int, spec: ZeroSpec, work: Workload, rank: int = 0) -> dict:
    """Model-state bytes of group rank `rank` for ZeRO units (flat buffers padded to a multiple of n;
    rank r owns elements [r·k, (r+1)·k)): stage 1/2 keep the padded parameters, stage 1 the padded
    gradients too, stage 2/3 a gradient shard of k; Adam m, v over the real elements owned, the
    master copy (when weights are 16-bit) over the whole shard k; with `optimizer_dtype` "bf16" m and v
    in bf16 and no master copy."""
    w, g, mb = work.param_bytes, work.grad_bytes, work.master_bytes
    if rank == 0:
        total, k, owned = unit_sums(units, n)
    else:
        total, k = sum(padded(u, n) for u in units), sum(shard_size(u, n) for u in units)
        owned = sum(max(0, min(shard_size(u, n), u - rank * shard_size(u, n))) for u in units)
    master = k * mb if work.param_bytes != mb else 0
    moment = mb
    if work.optimizer_dtype == "bf16":   # bf16 moments, no master copy (`optimizer_bytes_per_param`)
        master, moment = 0, 2
    return {"weights": w * (k if spec.shards_params else total), "grads": g * (k if spec.shards_grads else total),
            "optimizer": 2 * moment * owned + master}


def model_states(model: PlanModel, layout: Layout, work: Workload, stage: int) -> dict:
    """Model-state bytes of rank 0 of `stage` (the fullest shard): dense part over dp·cp, experts over
    edp = tp·cp·dp/(etp·ep). Without ZeRO, the ZeRO paper's (w + g + k)·Φ; with it, per padded unit
    (`unit_states`)."""
    L = layout
    z = L.zero_spec   # the states depend on the stage and the reduce policy alone: the cache key keeps just those
    return dict(_model_states(model, L.tp, L.pp, L.vpp, L.partition, L.ep, L.etp,
                              ZeroSpec(z.stage, each_microbatch=z.each_microbatch), L.bucket_mb, L.dp * L.cp, L.edp,
                              work, stage))


@lru_cache(maxsize=65536)
def _model_states(model, tp, pp, vpp, partition, ep, etp, spec: ZeroSpec, bucket_mb, n_dense, n_expert, work,
                  stage) -> tuple:
    # (dp = n_dense stands for dp x cp: the units depend on neither, the shard counts are passed)
    layout = Layout(tp=tp, pp=pp, vpp=vpp, partition=partition, ep=ep, etp=etp, zero=spec.stage, bucket_mb=bucket_mb,
                    dp=n_dense, reduce_each_microbatch=spec.each_microbatch)
    dense, expert = stage_params(model, layout, stage)
    w, g, k = work.param_bytes, work.grad_bytes, optimizer_bytes_per_param(work)
    groups = [(dense, n_dense, False)] + ([(expert, n_expert, True)] if expert else [])
    out = {"weights": w * frozen_params(model, layout, stage), "grads": 0, "optimizer": 0}
    for count, n, is_expert in groups:
        if not spec.shards_states or n == 1:
            part = zero_states(count, 1, spec, w, g, k)
        else:
            part = unit_states(zero_units(model, layout, g, stage, is_expert), n, spec, work)
        out = {c: out[c] + part[c] for c in out}
    return tuple(out.items())
