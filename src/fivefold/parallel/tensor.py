"""Tensor parallelism (Megatron) and Megatron sequence parallelism.

Papers: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), section 3; Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), section 4.2.2 for sequence parallelism.

Each transformer block is split column-then-row, so the two matmuls of a part need no communication
between them (GeLU/SwiGLU are element-wise on the column shards):

    attention:  x ─f─> wq, wk, wv (column: this rank's heads) ─> attention ─> wo (row) ─g─> out
    SwiGLU:     x ─f─> gate, up (column: ffn/n each) ─> silu(gate)·up ─> down (row) ─g─> out

f is identity forward / all-reduce backward and g its conjugate (comm/autograd.py). Per layer and
micro-batch each rank so sends 2 all-reduces of b·s·h forward (the two g) and 2 backward (the two f).
K and V are split by heads when kv_heads % n == 0; when n % kv_heads == 0 each group of n/kv_heads
consecutive ranks holds one KV head (the one its query heads use), and those ranks sum their partial
K/V weight gradients once per step.

Vocabulary: the embedding and the LM head are split by vocabulary rows. The vocab is padded to a
multiple of n with zero rows; a rank looks up only the tokens in its range and the partial embeddings
are summed (g). The LM head keeps its logits sharded (b, s, v/n) and `vocab_parallel_cross_entropy`
all-reduces only the per-token max and the per-token sum-exp and target logit: the full logits are
never gathered. Padded logits are set to -inf, so they never win the max and carry no probability,
loss or gradient. Tied embeddings share one sharded weight (both split by vocabulary rows).

Sequence parallelism (sp_mode "megatron"): between blocks the activations are split along the sequence
(b, s/n, h); norms, residual adds and dropout run on 1/n of the tokens. f becomes an all-gather along
the sequence (reduce-scatter backward) and g a reduce-scatter (all-gather backward): the same bytes as
the all-reduces, since an all-reduce is a reduce-scatter plus an all-gather. Norm weights then see
only their rank's tokens, so their gradients are partial and are all-reduced over tp once per step.

Dropout streams: where activations are replicated over tp (between blocks without SP) every tp rank
must drop the same elements, so all tp ranks of a group share one generator; with SP those activations
are sequence shards and each tp rank draws its own stream.

`parallelize(model, group, ...)` takes the full seeded model that every rank built and replaces its
layers in place by this rank's shards, keeping parameter names, and writes each parameter's placement
(placement.py): its `Shard` over "tp", which group sums its partial gradients ("tp" for SP norms and
K/V replicated over all of tp, "tp_kv" for K/V shared by tp/kv_heads ranks) and which rank counts it in
the global norm. `TensorParallelism` is the dimension object the trainer applies (parallelize.py): it
also gathers full tensors for checkpoints (dim "checkpoint") and slices them back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm, rules
from ..comm import Group
from ..comm.ops import takes_own_later
from ..comm.autograd import (GatherRows, ScatterRows, copy_to_tensor_region, gather_sequence, rank_major,
                             reduce_from_tensor_region, reduce_scatter_sequence)
from ..model.latent_attention import LatentAttention
from ..model.lora import attach, low_rank
from ..model.moe import MoE
from ..model.layers import Dropout
from ..model.loss import IGNORE_INDEX, compute_dtype, row_blocks, spend
from ..model.transformer import Transformer
from ..shapes import padded_vocab
from .dimension import ShardedState
from .placement import Shard, add_shard, place, placement_of
from .tensor_overlap import columns_entered, fusable, rows_exited


# -- layers -------------------------------------------------------------------------------------

class ParallelInput(nn.Module):
    """Where a block part enters the tensor-parallel region: f (copy; all-reduce backward) or, under
    sequence parallelism, the all-gather along the sequence (reduce-scatter backward). One per part,
    shared by its column-parallel layers (wq, wk, wv; gate, up), so backward reduces once.

    `token_wise`: the part treats each token alone (the MLP), so under SP it takes the gathered tokens in
    the rank-major order the all-gather writes, (n·b, s/n, h), and its `RowParallelLinear` hands them
    back to the reduce-scatter in that order: no layout copy either way (with (b, s, h) activations and
    b > 1 the sequence order costs one copy of the whole activation per collective).

    Called with the part's column-parallel layers (`forward(x, *columns)`, model/layers.py `Enter`'s
    contract) it returns their outputs; with `overlap` (rules.overlaps_tp_input) and no LoRA adapter on
    them it runs op and projections as one (parallel/tensor_overlap.py), so the collectives overlap the
    GEMMs beside them. Called with x alone it returns the entered input (latent attention's q_proj)."""

    def __init__(self, group: Group, sequence_parallel: bool, token_wise: bool = False, overlap: bool = False):
        super().__init__()
        self.group, self.sequence_parallel, self.token_wise = group, sequence_parallel, token_wise
        self.overlap = overlap

    def forward(self, x_bsh: torch.Tensor, *columns):
        if columns and self.overlap and fusable(columns):
            return columns_entered(x_bsh, self.group, self.sequence_parallel, not self.token_wise, columns)
        if self.sequence_parallel:
            x_bsh = gather_sequence(x_bsh, self.group, ordered=not self.token_wise)
        else:
            x_bsh = copy_to_tensor_region(x_bsh, self.group)
        # each column through its own module call (its hooks fire: the zero-bubble runtime records the
        # output of every module holding weights for its W pass); the head, whose forward this is, projects
        return tuple(c(x_bsh) if c.enter is None else c.project(x_bsh) for c in columns) if columns else x_bsh


class ParallelLatents(nn.Module):
    """Where latent attention enters the tensor-parallel region (model/latent_attention.py): its latents
    (c_q, c_kv, k_pe: q_lora_rank + kv_lora_rank + qk_rope_dim wide, far narrower than hidden) joined into
    one tensor, then f (copy; all-reduce backward) or, under sequence parallelism, the all-gather along
    the sequence (reduce-scatter backward), as Megatron-Core's MLA does; split again after. One
    collective per layer and direction, whatever the number of latents."""

    def __init__(self, group: Group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, c_q_bsr, c_kv_bsr, k_pe_bsd):
        parts = [t for t in (c_q_bsr, c_kv_bsr, k_pe_bsd) if t is not None]
        joined_bsl = torch.cat(parts, dim=-1)
        if self.sequence_parallel:
            joined_bsl = gather_sequence(joined_bsl, self.group)
        else:
            joined_bsl = copy_to_tensor_region(joined_bsl, self.group)
        out = list(joined_bsl.split([t.shape[-1] for t in parts], dim=-1))
        return (out.pop(0) if c_q_bsr is not None else None, *out)


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ with A's output rows (the "columns" of Megatron's X·A) split across ranks: this rank
    holds rows [r·out/n, (r+1)·out/n) and produces that slice of y; no communication in forward.

    `enter` is the input op: None when a shared `ParallelInput` already ran (attention, MLP), or a
    `ParallelInput` of its own (the LM head). A bias (Qwen2's q/k/v) is split like the output rows."""

    def __init__(self, weight: nn.Parameter, enter: ParallelInput | None = None, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.enter = enter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x) if self.enter is None else self.enter(x, self)[0]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of y for an input already in the region."""
        y = F.linear(x, self.weight, self.bias)
        extra = low_rank(self, x)          # LoRA (model/lora.py): B split like the weight's rows, A whole
        return y if extra is None else y + extra


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r A_rᵀ with A's input columns split across ranks: the input is already split (the
    output of column-parallel layers), each rank's product is a partial sum, and g sums them: an
    all-reduce, or under sequence parallelism a reduce-scatter along the sequence.

    Under SP a token-wise part's input is already rank-major (`ParallelInput.token_wise`), the order the
    reduce-scatter reads, so its partial sums go to it as they are. Attention's are in sequence order and
    are copied into that order by the reduce-scatter: putting its (b, s, h/n) input in rank-major order
    first would copy n times fewer bytes, but that copy is saved for backward, where the sequence-order
    input shares its storage with the attention core's saved output (b·s·h/n more activation memory a
    layer, measured: 2 MiB on plan_vs_run's tp2-sp).

    With `overlap` a part under SP leaves decomposed (parallel/tensor_overlap.py `ExitRows`: no copy of the
    partial sums into rank-major order either) where the group's reduce-scatter takes this rank's own chunk
    after the launch (gloo); else the plain path."""

    def __init__(self, weight: nn.Parameter, group: Group, sequence_parallel: bool, token_wise: bool = False,
                 overlap: bool = False):
        super().__init__()
        self.weight = weight
        self.group, self.sequence_parallel, self.token_wise = group, sequence_parallel, token_wise
        self.overlap = overlap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap and self.sequence_parallel and fusable([self]) and takes_own_later(self.group):
            return rows_exited(x, self.group, self.weight, not self.token_wise)   # parallel/tensor_overlap.py
        partial = F.linear(x, self.weight)
        extra = low_rank(self, x)          # LoRA: A split like the weight's columns, so a partial sum too
        if extra is not None:
            partial = partial + extra
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group, ordered=not self.token_wise)
        return reduce_from_tensor_region(partial, self.group)


class VocabParallelEmbedding(nn.Module):
    """Rank r holds embedding rows [start, start + v/n) of the padded vocabulary; it looks up the tokens
    in its range, zeros the others, and the partial embeddings are summed over the group (all-reduce;
    under sequence parallelism a reduce-scatter leaves each rank its sequence shard)."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group: Group, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, tokens_bs: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:   # look the tokens up rank-major: the reduce-scatter's order, no copy of h
            tokens_bs = rank_major(tokens_bs, self.group.size)
        local_bs = tokens_bs - self.vocab_start
        outside_bs = (local_bs < 0) | (local_bs >= self.weight.shape[0])
        x_bsh = F.embedding(local_bs.masked_fill(outside_bs, 0), self.weight)
        x_bsh = x_bsh.masked_fill(outside_bs.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(x_bsh, self.group, ordered=False)
        return reduce_from_tensor_region(x_bsh, self.group)


# -- vocab-parallel cross-entropy ---------------------------------------------------------------

class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary, without gathering them.

    Forward: the max over the vocabulary (all-reduce max of t values), then one all-reduce (sum) of
    the t sum-exps and t target logits (the target's logit lives on one rank, the others add 0).
    Backward needs no communication: d loss / d logit = softmax - onehot(target), both local.
    Columns at or beyond `vocab` (padding) are -inf: they never win the max and get probability 0.

    As model/loss.py, a block of rows at a time (`row_blocks`) between the two all-reduces: each block of
    logits is read once more (after the max's pass) and exp(x − max) written once, in the compute dtype,
    into the tensor saved for the backward (16-bit logits promoted as they are read, never copied); the
    backward scales it in place by incoming gradient / sum-exp and takes the one-hot off: in memory, the
    max's read, one block pass (read the logits, write the exponentials) and the backward's one pass."""

    @staticmethod
    def forward(ctx, logits_tv, targets_t, group: Group, vocab_start: int, vocab: int):
        v_local = logits_tv.shape[-1]
        real = max(0, min(v_local, vocab - vocab_start))
        if real > 0:
            max_t = logits_tv[:, :real].amax(dim=-1)
        else:
            max_t = torch.full(logits_tv.shape[:1], float("-inf"), dtype=logits_tv.dtype, device=logits_tv.device)
        max_t = max_t.to(compute_dtype(logits_tv))
        comm.all_reduce(max_t, group, reduce_op="max")
        local_t = targets_t - vocab_start
        mine_t = (local_t >= 0) & (local_t < real)
        local_t = local_t.clamp(0, v_local - 1)
        exp_tv = torch.empty(logits_tv.shape, dtype=max_t.dtype, device=logits_tv.device)
        stats_2t = torch.empty(2, logits_tv.shape[0], dtype=max_t.dtype, device=logits_tv.device)
        for a, b in row_blocks(logits_tv):
            e = exp_tv[a:b]
            torch.sub(logits_tv[a:b], max_t[a:b, None], out=e)   # 16-bit logits promoted as they are read
            if real < v_local:
                e[:, real:] = float("-inf")
            stats_2t[1, a:b] = torch.where(mine_t[a:b], e.gather(1, local_t[a:b, None]).squeeze(1), 0.0)
            stats_2t[0, a:b] = e.exp_().sum(dim=-1)
        comm.all_reduce(stats_2t, group)
        sum_exp_t, target_t = stats_2t[0], stats_2t[1]
        ctx.dtype = logits_tv.dtype
        ctx.save_for_backward(exp_tv, sum_exp_t, local_t, mine_t)
        return sum_exp_t.log() - target_t

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_t):
        """softmax − one-hot, scaled by each token's incoming gradient, made in place in the saved
        exponentials (as model/loss.py's: no second t × v/n tensor; a second backward is refused)."""
        spend(ctx)
        exp_tv, sum_exp_t, local_t, mine_t = ctx.saved_tensors
        exp_tv.mul_((grad_t / sum_exp_t).unsqueeze(-1))
        rows = torch.arange(exp_tv.shape[0], device=exp_tv.device)
        exp_tv[rows, local_t] -= mine_t.to(exp_tv.dtype) * grad_t
        return exp_tv.to(ctx.dtype), None, None, None, None


def vocab_parallel_loss_sum(logits_bsv: torch.Tensor, targets_bs: torch.Tensor, group: Group,
                            vocab_start: int, vocab: int) -> torch.Tensor:
    """Sum of token cross-entropies (fp32; fp64 for fp64 models), as `model.loss_sum` but for logits
    split by vocabulary; every rank of the group gets the same value. Targets of IGNORE_INDEX (-100, a loss
    mask's context tokens) add nothing and get no gradient, as F.cross_entropy's."""
    targets_t = targets_bs.flatten()
    loss_t = VocabParallelCrossEntropy.apply(logits_bsv.flatten(0, 1), targets_t, group, vocab_start, vocab)
    return torch.where(targets_t == IGNORE_INDEX, 0.0, loss_t).sum()


# -- sharding a model ---------------------------------------------------------------------------

class TensorParallelism(ShardedState):
    """The tensor-parallel dimension (the contract: dimension.py): shards a model in place (`apply`),
    gives the vocab-parallel loss, gathers full states and splits them back (`ShardedState`). The partial
    gradients of replicated parameters are summed by the trainer from their placements ("tp", "tp_kv")."""

    name = "tp"

    def __init__(self, mesh, sequence_parallel: bool, seed: int, overlap: bool = True, experts_folded: bool = False):
        self.mesh, self.group, self.sequence_parallel, self.seed = mesh, mesh["tp"], sequence_parallel, seed
        self.overlap, self.experts_folded = overlap, experts_folded   # folded: the expert grid places the experts
        self.shards: dict[str, Shard] = {}

    def apply(self, model: Transformer) -> Transformer:
        self.vocab, self.vocab_start = model.cfg.vocab, parallelize(
            model, self.group, self.sequence_parallel,
            dropout_generator(self.seed, self.mesh.coords, self.sequence_parallel),
            self.mesh.groups.get("tp_kv"), self.overlap,   # tp_kv: made by the mesh when tp > kv_heads
            self.experts_folded)
        self.shards = {name: placement_of(p).shard("tp") for name, p in model.named_parameters(remove_duplicate=False)}
        return model

    def loss(self, loss_sum):
        def vocab_parallel(logits_bsv: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_loss_sum(logits_bsv, targets_bs, self.group, self.vocab_start, self.vocab)
        return vocab_parallel


def _shard(param: nn.Parameter, shard: Shard, group: Group, partial: str | None = None) -> nn.Parameter:
    """A new parameter holding this rank's piece, with its placement: sharded over tp, counted in the
    norm by the first of its replicas, its partial gradients summed over `partial`."""
    new = nn.Parameter(shard.piece(param.detach(), group.rank, group.size), requires_grad=param.requires_grad)
    new.placement = placement_of(param)
    add_shard(new, shard)
    return place(new, partial=partial, counted=group.rank % shard.replicas == 0)


@torch.no_grad()
def parallelize(model: Transformer, group: Group, sequence_parallel: bool = False,
                generator: torch.Generator | None = None, kv_group: Group | None = None,
                overlap: bool = False, experts_folded: bool = False) -> int:
    """Replace `model`'s layers in place by this rank's tensor-parallel shards (names unchanged), write
    every parameter's placement (placement.py), and return this rank's first vocabulary row.

    Every rank passes the same full model (same seed); afterwards the ranks of `group` together
    compute what the single-process model computes. `generator` drives dropout (see module doc);
    `kv_group` is the group of ranks sharing a KV head when group.size > kv_heads (the mesh's "tp_kv");
    `overlap`: each part's input op runs fused with its projections (rules.overlaps_tp_input).
    """
    cfg, n = model.cfg, group.size
    rules.check_tensor_parallel(n, cfg.heads, cfg.kv_heads, {"ffn": cfg.ffn})
    kv_replicas = rules.kv_replicas(n, cfg.kv_heads)
    if 1 < kv_replicas < n and kv_group is None:
        raise ValueError(f"tp={n} > kv_heads={cfg.kv_heads}: pass kv_group (ParallelMesh's 'tp_kv')")
    sp = sequence_parallel

    def column(linear: nn.Linear, shard: Shard, partial: str | None = None, enter=None) -> ColumnParallelLinear:
        bias = None if linear.bias is None else _shard(linear.bias, shard, group, partial)
        layer = ColumnParallelLinear(_shard(linear.weight, shard, group, partial), enter, bias)
        if getattr(linear, "lora", None) is not None:   # B by rows as the weight; A whole, its gradient partial
            attach(layer, _shard(linear.lora_A, Shard("tp", None, replicas=n), group, "tp"),
                   _shard(linear.lora_B, shard, group, partial), linear.lora)
        return layer

    def row(linear: nn.Linear, full: int, token_wise: bool = False) -> RowParallelLinear:
        layer = RowParallelLinear(_shard(linear.weight, Shard("tp", 1, full), group), group, sp, token_wise,
                                  overlap)
        if getattr(linear, "lora", None) is not None:   # A by columns as the weight; B whole, its gradient partial
            attach(layer, _shard(linear.lora_A, Shard("tp", 1, full), group),
                   _shard(linear.lora_B, Shard("tp", None, replicas=n), group, "tp"), linear.lora)
        return layer

    def replicated(weight: nn.Parameter) -> None:  # norms: whole on every rank; partial grads under SP
        add_shard(weight, Shard("tp", None, replicas=n))
        place(weight, partial="tp" if sp else None, counted=group.rank == 0)

    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        if isinstance(mlp, MoE):
            replicated_moe(mlp, group, sp, routed=not experts_folded)
            mlp = None
        if isinstance(attn, LatentAttention):
            latent_attention(attn, cfg, group, sp, column, row, replicated)
            attn = None
        if attn is not None:
            gqa_attention(attn, cfg, group, sp, column, row, kv_replicas, n, overlap)
        if mlp is not None:
            mlp.enter = ParallelInput(group, sp, token_wise=True, overlap=overlap)
            mlp.gate = column(mlp.gate, Shard("tp", 0, cfg.ffn))
            mlp.up = column(mlp.up, Shard("tp", 0, cfg.ffn))
            mlp.down = row(mlp.down, cfg.ffn, token_wise=True)
        replicated(block.attn_norm.weight)
        replicated(block.mlp_norm.weight)
    replicated(model.norm.weight)

    vocab = Shard("tp", 0, cfg.vocab)
    vocab_start = group.rank * padded_vocab(cfg.vocab, n) // n
    embed_weight = _shard(model.embed.weight, vocab, group)
    head_weight = embed_weight if cfg.tie_embeddings else _shard(model.head.weight, vocab, group)
    model.embed = VocabParallelEmbedding(embed_weight, vocab_start, group, sp)
    model.head = ColumnParallelLinear(head_weight, ParallelInput(group, sp, token_wise=False, overlap=overlap))

    for m in model.modules():
        if isinstance(m, Dropout):
            m.generator = generator
    return vocab_start


def gqa_attention(attn, cfg, group: Group, sp: bool, column, row, kv_replicas: int, n: int,
                  overlap: bool = False) -> None:
    """Grouped-query attention: x enters once (f, or the SP all-gather), wq/wk/wv column-parallel by heads
    (K/V replicated over tp/kv_heads ranks when tp > kv_heads), wo row-parallel; Qwen3's q/k norms whole on
    every rank with partial gradients (each rank normalises its own heads), summed over tp."""
    d = cfg.head_dim
    attn.enter = ParallelInput(group, sp, overlap=overlap)
    attn.wq = column(attn.wq, Shard("tp", 0, cfg.heads * d))
    kv = Shard("tp", 0, cfg.kv_heads * d, kv_replicas)
    kv_partial = "tp_kv" if 1 < kv_replicas < n else ("tp" if kv_replicas == n > 1 else None)
    attn.wk, attn.wv = column(attn.wk, kv, kv_partial), column(attn.wv, kv, kv_partial)
    attn.wo = row(attn.wo, cfg.heads * d)
    for norm in (attn.q_norm, attn.k_norm):   # Qwen3: whole on every rank, each rank's heads add to its gradient
        if norm is not None:
            add_shard(norm.weight, Shard("tp", None, replicas=n))
            place(norm.weight, partial="tp", counted=group.rank == 0)


def latent_attention(attn: LatentAttention, cfg, group: Group, sp: bool, column, row, replicated) -> None:
    """Latent attention (Megatron-Core's MLA split): the down-projections q_a, kv_a and the latent norms
    whole on every rank, run on this rank's tokens (the sequence shard under SP; their gradients then
    partial, summed over tp like the SP norms'); the latents enter the region (`ParallelLatents`); q_b
    (or q_proj, whose input x enters by `ParallelInput`) and kv_b column-parallel by heads; wo
    row-parallel."""
    n_qk, n_kv = cfg.heads * cfg.qk_head_dim, cfg.heads * (cfg.qk_nope_dim + cfg.v_head_dim)
    if attn.q_lora:
        replicated(attn.q_a.weight)
        replicated(attn.q_norm.weight)
        attn.q_b = column(attn.q_b, Shard("tp", 0, n_qk))
    else:
        attn.enter = ParallelInput(group, sp)
        attn.q_proj = column(attn.q_proj, Shard("tp", 0, n_qk))
    replicated(attn.kv_a.weight)
    replicated(attn.kv_norm.weight)
    attn.kv_b = column(attn.kv_b, Shard("tp", 0, n_kv))
    attn.wo = row(attn.wo, cfg.heads * cfg.v_head_dim)
    attn.enter_latent = ParallelLatents(group, sp)


def replicated_moe(moe: MoE, group: Group, sequence_parallel: bool, routed: bool = True) -> None:
    """A mixture-of-experts layer under tensor parallelism: each tp rank routes and dispatches only its
    own tokens, so no token crosses the expert all-to-all twice. Without sequence parallelism the input
    is replicated: each rank takes its 1/n of the micro-batch's sequences (ScatterRows) and the outputs
    are all-gathered back inside tp (GatherRows: forward b·s·h·(n-1)/n bytes, and the same for the input
    gradient in backward). With sequence parallelism the input is already this rank's 1/n of every
    sequence; the per-sequence balance statistics are then summed over tp (and cp).
    The router and the shared experts follow the dense mapping: whole on every tp rank, their gradients
    partial (each rank saw its own tokens), summed over tp once a step; so do the routed experts when
    `routed` (ep = etp = 1). Otherwise they follow the expert grid (expert.py ExpertParallelism: ep and etp
    pieces over the same ranks, MoE parallel folding) and are not placed here. The layer learns the row split (`moe_rows`) and the sequence group from
    parallelize.configure_moe's one `MoE.configure` call (rules.moe_splits_rows, rules.moe_sequence_group)."""
    elsewhere = set() if routed else {id(p) for p in moe.experts.parameters()}
    for p in moe.parameters():
        if id(p) not in elsewhere:
            add_shard(p, Shard("tp", None, replicas=group.size))
            place(p, partial="tp", counted=group.rank == 0)


def moe_rows(group: Group) -> tuple[nn.Module, nn.Module]:
    """(enter, leave) of a MoE layer whose input is replicated over tp (no SP): take this rank's 1/n of
    the micro-batch's sequences (ScatterRows), all-gather the outputs back inside tp (GatherRows)."""
    return _Rows(ScatterRows, group), _Rows(GatherRows, group)


def moe_keys_view(group: Group, rows: bool):
    """The keys of the tokens a MoE layer routes (model/random_routing.py) from those of its block's
    input: this rank's rows of the micro-batch (`moe_rows`), or under sequence parallelism its shard
    [r·s/n, (r+1)·s/n) of every sequence (comm/autograd.py rank_major's order)."""
    n, r = group.size, group.rank

    def view(keys_bs: torch.Tensor) -> torch.Tensor:
        return keys_bs.chunk(n, dim=0 if rows else 1)[r]
    return view


class _Rows(nn.Module):
    def __init__(self, fn, group: Group):
        super().__init__()
        self.fn, self.group = fn, group

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(x_bsh, self.group)


# -- dropout streams ---------------------------------------------------------

def dropout_generator(seed: int, coords: dict[str, int], sequence_parallel: bool) -> torch.Generator:
    """The dropout stream of a rank: shared by the tp ranks of a group (replicated activations), or,
    under sequence parallelism, one per tp rank (sequence-sharded activations). Always distinct
    across data, context and pipeline ranks."""
    stream = (coords.get("dp", 0), coords.get("cp", 0), coords.get("pp", 0),
              coords.get("tp", 0) if sequence_parallel else -1)
    s = seed
    for c in stream:
        s = (s * 1_000_003 + c + 2) % (2 ** 62)
    return torch.Generator().manual_seed(s)
