"""Differentiable collectives: each forward collective has the conjugate collective as its backward.

Tensor parallelism (Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism", 2019, section 3 and figure 3) needs two conjugate operators around each
column-then-row split block:

| op  | forward                 | backward                | where                                |
|-----|-------------------------|-------------------------|--------------------------------------|
| f   | identity                | all-reduce (sum)        | entering a column-parallel layer     |
| g   | all-reduce (sum)        | identity                | leaving a row-parallel layer         |

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, section 4.2.2) keeps the activations between blocks split along the sequence, so norms
and dropout run on 1/n of the tokens, and replaces f and g by another conjugate pair:

| op  | forward                           | backward                          |
|-----|-----------------------------------|-----------------------------------|
| ḡ   | all-gather along the sequence     | reduce-scatter along the sequence |
| ḡ*  | reduce-scatter along the sequence | all-gather along the sequence     |

Traffic for an activation of S bytes (b·s·h elements) on n ranks: f and g each send one all-reduce,
2(n-1)/n·S; ḡ and ḡ* each send one all-gather plus one reduce-scatter over forward and backward,
(n-1)/n·S each, so SP sends exactly the bytes of plain TP. Every collective goes through
`fivefold.comm`, so the ledger records it under the group's name ("tp").

The sequence is dimension 1 of a (b, s, h) activation. Rank r of the group holds tokens
[r·s/n, (r+1)·s/n) of every row. An all-gather along dim 0 writes the shards rank-major, (n·b, s/n, h),
and a reduce-scatter along dim 0 reads them so; with b > 1 the sequence order costs one copy of the whole
activation per collective. Token-wise work (the MLP) takes the rank-major order as it is (`ordered`
False: Megatron-Core gets the same for free from its (s, b, h) layout); `rank_major` puts a tensor in
that order where one is needed (the token ids the embedding looks up).

Ulysses context parallelism (Jacobs et al., "DeepSpeed Ulysses", 2023) trades the split of attention's
inputs with an all-to-all, whose conjugate is the reverse all-to-all:

| op             | forward                                          | backward       |
|----------------|--------------------------------------------------|----------------|
| seq_to_heads   | (b, n, s/N, d) on each rank -> (b, n/N, s, d)    | heads_to_seq   |
| heads_to_seq   | (b, n/N, s, d) on each rank -> (b, n, s/N, d)    | seq_to_heads   |

Each sends (N-1)/N of its input (`volume.all_to_all`). Expert parallelism's dispatch and combine move
token rows with uneven splits: `all_to_all_rows(x, group, send, recv)` sends send[j] rows to rank j and
receives recv[j] from it; its backward is the same exchange with the splits swapped. Expert tensor
parallelism gathers each etp rank's routed rows on every etp rank (`gather_rows_uneven`) and sums the
partial outputs back into their owners' rows (`reduce_scatter_rows_uneven`), a conjugate pair over
uneven row counts, each one all-to-all. Heads are dimension 1 and the sequence
dimension 2 of a (b, n, s, d) tensor; rank r's tokens land at [r·s/N, (r+1)·s/N) of the gathered
sequence and rank r keeps heads [r·n/N, (r+1)·n/N).
"""
from __future__ import annotations

import torch

from . import ops
from .ops import Group


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy we may reduce in place (never write into autograd's own buffers)."""
    return t.clone(memory_format=torch.contiguous_format)


def _all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    out = _fresh(t)
    ops.all_reduce(out, group)
    return out


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether nothing but this reference holds `t` (its TensorImpl's use count is 1) and it is a plain,
    contiguous tensor of its own: then it may be reduced in place. A gradient autograd hands a backward
    is usually fresh (a matmul's input gradient, or the sum of several), but an add's backward hands the
    same tensor to both its inputs (use count 2), and a view or a retained gradient shares storage: those
    are reduced in a copy. Without `_use_count` (another torch) every gradient is copied."""
    count = getattr(t, "_use_count", None)
    return count is not None and t._base is None and t.is_contiguous() and count() == 1


def _gather_seq(x_bsh: torch.Tensor, group: Group, ordered: bool = True) -> torch.Tensor:
    """(b, s/n, ...) on each rank -> (b, s, ...): rank r's tokens land at [r·s/n, (r+1)·s/n). Not
    `ordered`: the rank-major (n·b, s/n, ...) the all-gather writes, with no copy (token-wise work only)."""
    n = group.size
    b, s_local, rest = x_bsh.shape[0], x_bsh.shape[1], tuple(x_bsh.shape[2:])
    out = torch.empty((n * b, s_local) + rest, dtype=x_bsh.dtype, device=x_bsh.device)
    ops.all_gather(out, x_bsh.contiguous(), group)  # rank-major: (n·b, s/n, ...)
    if not ordered:
        return out
    return out.view((n, b, s_local) + rest).movedim(0, 1).reshape((b, n * s_local) + rest)


def _reduce_scatter_seq(x_bsh: torch.Tensor, group: Group, ordered: bool = True) -> torch.Tensor:
    """(b, s, ...) partial sums on each rank -> (b, s/n, ...) of the sum, rank r keeping its tokens. Not
    `ordered`: the input is already rank-major (n·b, s/n, ...) (`_gather_seq`'s unordered output, or
    `rank_major`), and is reduce-scattered with no copy."""
    out, handle = _reduce_scatter_seq_async(x_bsh, group, ordered)
    handle.wait()
    return out


def _reduce_scatter_seq_async(x_bsh: torch.Tensor, group: Group, ordered: bool = True):
    """`_reduce_scatter_seq` launched: (the output, final once the handle is waited for; the handle)."""
    n = group.size
    rest = tuple(x_bsh.shape[2:])
    if ordered:
        b, s = x_bsh.shape[0], x_bsh.shape[1]
        x_nbsh = rank_major(x_bsh, n)
    else:
        b, s = x_bsh.shape[0] // n, x_bsh.shape[1] * n
        x_nbsh = x_bsh.contiguous()
    out = torch.empty((b, s // n) + rest, dtype=x_bsh.dtype, device=x_bsh.device)
    # chunk r of the rank-major (n·b, s/n, ...) goes to rank r
    return out, ops.reduce_scatter(out, x_nbsh, group, async_op=True)


def rank_major(x_bsh: torch.Tensor, n: int) -> torch.Tensor:
    """(b, s, ...) -> (n·b, s/n, ...): rank r's tokens [r·s/n, (r+1)·s/n) of every row as block r, the
    order an all-gather along dim 0 writes and a reduce-scatter along dim 0 reads (one copy when b > 1)."""
    b, s, rest = x_bsh.shape[0], x_bsh.shape[1], tuple(x_bsh.shape[2:])
    if s % n:
        raise ValueError(f"sequence length {s} must divide by the tensor-parallel size {n}")
    return x_bsh.reshape((b, n, s // n) + rest).movedim(1, 0).reshape((n * b, s // n) + rest)


class CopyToTensorRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward (one all-reduce of
    the activation, 2(n-1)/n·S bytes, in the backward pass only). The gradient is reduced in place when
    this backward holds the only reference to it (`_sole_owner`), as Megatron does unconditionally; else
    in a copy."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _sole_owner(grad):
            ops.all_reduce(grad, ctx.group)
            return grad, None
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward (summing the row-parallel partial outputs), identity backward
    (one all-reduce of the activation, 2(n-1)/n·S bytes, in the forward pass only). The partial output is
    a row-parallel matmul's fresh result that nothing saves, so it is reduced in place, as Megatron does
    (marked dirty: were it saved after all, autograd's version check would refuse the backward rather
    than use the sum); a view or a non-contiguous input is reduced in a copy."""

    @staticmethod
    def forward(ctx, x, group: Group):
        if x._base is not None or not x.is_contiguous() or x.requires_grad and x.is_leaf:
            return _all_reduce(x, group)
        ops.all_reduce(x, group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSequence(torch.autograd.Function):
    """Sequence parallel's ḡ (Korthikanti et al. 2022): all-gather the sequence shards forward,
    reduce-scatter the gradient backward ((n-1)/n·S bytes each way). `ordered` False: rank-major."""

    @staticmethod
    def forward(ctx, x_bsh, group: Group, ordered: bool):
        ctx.group, ctx.ordered = group, ordered
        return _gather_seq(x_bsh, group, ordered)

    @staticmethod
    def backward(ctx, grad_bsh):
        return _reduce_scatter_seq(grad_bsh, ctx.group, ctx.ordered), None, None


class ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel's ḡ*: reduce-scatter partial sums along the sequence forward, all-gather the
    gradient backward ((n-1)/n·S bytes each way). `ordered` False: the input is rank-major."""

    @staticmethod
    def forward(ctx, x_bsh, group: Group, ordered: bool):
        ctx.group, ctx.ordered = group, ordered
        return _reduce_scatter_seq(x_bsh, group, ordered)

    @staticmethod
    def backward(ctx, grad_bsh):
        return _gather_seq(grad_bsh, ctx.group, ctx.ordered), None, None


def _seq_to_heads(x_bnsd: torch.Tensor, group: Group) -> torch.Tensor:
    n = group.size
    b, h, s, d = x_bnsd.shape
    send = x_bnsd.reshape(b, n, h // n, s, d).movedim(1, 0).contiguous()     # chunk j: heads for rank j
    recv = torch.empty_like(send)                                            # chunk j: rank j's tokens
    ops.all_to_all(recv, send, group)
    return recv.movedim(0, 2).reshape(b, h // n, n * s, d)


def _heads_to_seq(x_bnsd: torch.Tensor, group: Group) -> torch.Tensor:
    n = group.size
    b, h, s, d = x_bnsd.shape
    send = x_bnsd.reshape(b, h, n, s // n, d).movedim(2, 0).contiguous()     # chunk j: rank j's tokens
    recv = torch.empty_like(send)                                            # chunk j: rank j's heads
    ops.all_to_all(recv, send, group)
    return recv.movedim(0, 1).reshape(b, n * h, s // n, d)


class SeqToHeads(torch.autograd.Function):
    """Ulysses' first all-to-all: sequence shards of every head -> every token of a head shard."""

    @staticmethod
    def forward(ctx, x_bnsd, group: Group):
        ctx.group = group
        return _seq_to_heads(x_bnsd, group)

    @staticmethod
    def backward(ctx, grad_bnsd):
        return _heads_to_seq(grad_bnsd, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """Ulysses' second all-to-all: every token of a head shard -> sequence shards of every head."""

    @staticmethod
    def forward(ctx, x_bnsd, group: Group):
        ctx.group = group
        return _heads_to_seq(x_bnsd, group)

    @staticmethod
    def backward(ctx, grad_bnsd):
        return _seq_to_heads(grad_bnsd, ctx.group), None


def seq_to_heads(x_bnsd: torch.Tensor, group: Group) -> torch.Tensor:
    return x_bnsd if group.size == 1 else SeqToHeads.apply(x_bnsd, group)


def heads_to_seq(x_bnsd: torch.Tensor, group: Group) -> torch.Tensor:
    return x_bnsd if group.size == 1 else HeadsToSeq.apply(x_bnsd, group)


def _gather_rows(x_b, group: Group) -> torch.Tensor:
    """(b/n, ...) on each rank -> (b, ...): rank r's rows land at [r·b/n, (r+1)·b/n)."""
    out = torch.empty((group.size * x_b.shape[0],) + tuple(x_b.shape[1:]), dtype=x_b.dtype, device=x_b.device)
    ops.all_gather(out, x_b.contiguous(), group)
    return out


def _my_rows(x_b, group: Group) -> torch.Tensor:
    n = x_b.shape[0] // group.size
    return x_b[group.rank * n:(group.rank + 1) * n].contiguous()


class ScatterRows(torch.autograd.Function):
    """Enter a region where each tp rank works on its 1/n of a replicated batch's rows (sequences):
    forward keeps this rank's rows; backward all-gathers the rows' gradients (each rank had its own)."""

    @staticmethod
    def forward(ctx, x_b, group: Group):
        ctx.group = group
        return _my_rows(x_b, group)

    @staticmethod
    def backward(ctx, grad_b):
        return _gather_rows(grad_b, ctx.group), None


class GatherRows(torch.autograd.Function):
    """Leave that region: forward all-gathers the rows (the output is replicated again); backward keeps
    this rank's rows of the (replicated, complete) gradient."""

    @staticmethod
    def forward(ctx, x_b, group: Group):
        ctx.group = group
        return _gather_rows(x_b, group)

    @staticmethod
    def backward(ctx, grad_b):
        return _my_rows(grad_b, ctx.group), None


class SumAcross(torch.autograd.Function):
    """y = Σ over the group of x, for a value every rank then uses in its own loss: backward sums the
    ranks' gradients the same way (an all-reduce each way)."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


def sum_across(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else SumAcross.apply(x, group)


def _rows(x_md: torch.Tensor, group: Group, send: list[int], recv: list[int]) -> torch.Tensor:
    out = torch.empty((sum(recv),) + tuple(x_md.shape[1:]), dtype=x_md.dtype, device=x_md.device)
    ops.all_to_all(out, x_md.contiguous(), group, out_splits=recv, in_splits=send)
    return out


class AllToAllRows(torch.autograd.Function):
    """Rows to ranks with uneven splits; backward returns each gradient row to where it came from."""

    @staticmethod
    def forward(ctx, x_md, group: Group, send: list[int], recv: list[int]):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _rows(x_md, group, send, recv)

    @staticmethod
    def backward(ctx, grad_md):
        return _rows(grad_md, ctx.group, ctx.recv, ctx.send), None, None, None


def all_to_all_rows(x_md: torch.Tensor, group: Group, send: list[int], recv: list[int]) -> torch.Tensor:
    return x_md if group.size == 1 else AllToAllRows.apply(x_md, group, send, recv)


def _gather_uneven(x_md: torch.Tensor, group: Group, rows: list[int]) -> torch.Tensor:
    """Every rank's rows, rank-major (rank t sent rows[t]); `x_md` goes to each rank once, through one
    all-to-all of n copies (the n·m-row send buffer is the bound: uneven all-gathers need no padding)."""
    return _rows(x_md.repeat(group.size, *([1] * (x_md.dim() - 1))), group, [x_md.shape[0]] * group.size, rows)


def _reduce_scatter_uneven(y_md: torch.Tensor, group: Group, rows: list[int]) -> torch.Tensor:
    """Rank-major rows (rows[t] of them for rank t) summed over the group into this rank's own rows:
    rank t's block goes to rank t (one all-to-all), which adds the n partial blocks it receives."""
    mine = rows[group.rank]
    return _rows(y_md, group, rows, [mine] * group.size).view(group.size, mine, *y_md.shape[1:]).sum(0)


class GatherRowsUneven(torch.autograd.Function):
    """Expert tensor parallelism's entry: each etp rank's routed rows gathered on every etp rank (rank
    t's rows[t] rows at their rank-major place); backward sums each rank's gradient rows over the group
    back to their owner (a reduce-scatter). Each way sends (n-1)/n of an n·m-row all-to-all."""

    @staticmethod
    def forward(ctx, x_md, group: Group, rows: list[int]):
        ctx.group, ctx.rows = group, rows
        return _gather_uneven(x_md, group, rows)

    @staticmethod
    def backward(ctx, grad_md):
        return _reduce_scatter_uneven(grad_md, ctx.group, ctx.rows), None, None


class ReduceScatterRowsUneven(torch.autograd.Function):
    """Expert tensor parallelism's exit: the partial outputs of every etp rank's rows (each rank computed
    its slice of the expert width) summed into their owner's rows; backward gathers the owners'
    gradients to every rank again."""

    @staticmethod
    def forward(ctx, y_md, group: Group, rows: list[int]):
        ctx.group, ctx.rows = group, rows
        return _reduce_scatter_uneven(y_md, group, rows)

    @staticmethod
    def backward(ctx, grad_md):
        return _gather_uneven(grad_md, ctx.group, ctx.rows), None, None


def gather_rows_uneven(x_md: torch.Tensor, group: Group, rows: list[int]) -> torch.Tensor:
    return x_md if group.size == 1 else GatherRowsUneven.apply(x_md, group, rows)


def reduce_scatter_rows_uneven(y_md: torch.Tensor, group: Group, rows: list[int]) -> torch.Tensor:
    return y_md if group.size == 1 else ReduceScatterRowsUneven.apply(y_md, group, rows)


E4M3_MAX = 448.0   # the largest float8 e4m3 value


def _quantize_rows(x_md: torch.Tensor) -> torch.Tensor:
    """Each row as float8 e4m3 scaled by its absolute max, packed with its fp32 scale: (m, d + 4) bytes."""
    x32 = x_md.float()
    scale_m1 = (x32.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-30)
    q_md = (x32 / scale_m1).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q_md, scale_m1.view(torch.uint8).reshape(-1, 4)], dim=1)


def _dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q_md, scale_m1 = packed[:, :-4], packed[:, -4:].contiguous().view(torch.float32)
    return (q_md.contiguous().view(torch.float8_e4m3fn).float() * scale_m1).to(dtype)


class Fp8AllToAllRows(torch.autograd.Function):
    """DeepSeek-V3's FP8 dispatch: forward sends each row as float8 e4m3 with one fp32 scale (d + 4
    bytes a row instead of 2d or 4d), dequantised on arrival; backward returns the gradient rows in full
    precision, as if the exchange were exact (the quantisation is treated as the identity)."""

    @staticmethod
    def forward(ctx, x_md, group: Group, send: list[int], recv: list[int]):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _dequantize_rows(_rows(_quantize_rows(x_md), group, send, recv), x_md.dtype)

    @staticmethod
    def backward(ctx, grad_md):
        return _rows(grad_md, ctx.group, ctx.recv, ctx.send), None, None, None


def fp8_all_to_all_rows(x_md: torch.Tensor, group: Group, send: list[int], recv: list[int]) -> torch.Tensor:
    return x_md if group.size == 1 else Fp8AllToAllRows.apply(x_md, group, send, recv)


def copy_to_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return x if group.size == 1 else CopyToTensorRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return x if group.size == 1 else ReduceFromTensorRegion.apply(x, group)


def gather_sequence(x_bsh: torch.Tensor, group: Group, ordered: bool = True) -> torch.Tensor:
    """All-gather along dim 1 forward, reduce-scatter backward. `ordered` False: the rank-major
    (n·b, s/n, ...) with no layout copy, for token-wise work (the MLP)."""
    return x_bsh if group.size == 1 else GatherSequence.apply(x_bsh, group, ordered)


def reduce_scatter_sequence(x_bsh: torch.Tensor, group: Group, ordered: bool = True) -> torch.Tensor:
    """Reduce-scatter along dim 1 forward, all-gather backward. `ordered` False: the input is rank-major
    (n·b, s/n, ...) and needs no layout copy."""
    return x_bsh if group.size == 1 else ReduceScatterSequence.apply(x_bsh, group, ordered)
