"""Tensor parallelism's input collectives overlapped with the column-parallel GEMMs beside them.

Where a part enters the tensor-parallel region (attention's q/k/v, the MLP's gate and up, the LM head),
Megatron's f (identity forward, all-reduce of the input gradient backward) or, under sequence parallelism,
ḡ (all-gather of the sequence shards forward, reduce-scatter of the input gradient backward) runs next to
GEMMs that do not need its result (parallel/tensor.py has the layout; comm/autograd.py the plain ops):

* Backward (Megatron-LM's asynchronous input-gradient reduction, `LinearWithGradAccumulationAndAsync-
  Communication`): the input gradient Σᵢ dyᵢ·Wᵢ is computed first and its all-reduce (or reduce-scatter)
  launched; the weight gradients dWᵢ = dyᵢᵀ·x, which need only this rank's dy and its saved input, run while
  it is in flight; then it is waited for.
* Forward under sequence parallelism, token-wise parts (the MLP; rank-major rows, no layout copy; the
  head and attention gather in sequence order and project after): the all-gather is launched and this
  rank's own rows, which it already has, are projected while the other ranks' rows arrive; then theirs. This is the first step of the decomposed all-gather-then-GEMM of
  Wang et al., "Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
  Models" (ASPLOS 2023), the scheme torch's async TP runs ring step by ring step; on gloo one all-gather
  stands for the ring, so only the local rows are taken ahead.

The bytes are the plain path's: the same collectives with the same messages, so the ledger, comm/volume.py
and the planner's traffic are unchanged; only where a collective waits moves (plan/time.py `tp_hidden`
charges what hides). The results equal the plain path's up to rounding: the input gradient's terms are
added in the order autograd adds them (the last projection's first), and a GEMM over a slice of rows may
block its sums differently from one over all rows.

`columns_entered(x, group, sp, ordered, columns)` runs it for `ColumnParallelLinear`s without a LoRA adapter
(an adapter's path needs the gathered input as a tensor of the graph: those parts take the plain path).

Where a part leaves the region under sequence parallelism (attention's wo, the MLP's down projection), its
reduce-scatter and, backward, the all-gather of the output gradient are decomposed the same way
(`ExitRows`): the other ranks' tokens projected first and their exchange launched, this rank's own
tokens projected while it runs. This needs a reduce-scatter that takes the own chunk after the launch: gloo's
pairwise exchange (comm/ops.py `takes_own_later`); on NCCL, whose reduce-scatter reads its whole input
at launch, the exit takes the plain path.
"""
from __future__ import annotations

import torch

from ..comm import Group, ops
from ..comm.autograd import _gather_seq, _reduce_scatter_seq_async


def _project(x_2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_2d: torch.Tensor) -> None:
    """out = x Wᵀ (+ b) into a slice of rows of the output."""
    if bias is None:
        torch.mm(x_2d, weight.t(), out=out_2d)
    else:
        torch.addmm(bias, x_2d, weight.t(), out=out_2d)


class EnterColumns(torch.autograd.Function):
    """(x, W₁, b₁, …, W_k, b_k) -> (y₁, …, y_k), yᵢ = enter(x) Wᵢᵀ + bᵢ, with enter f (`sp` False) or the
    sequence all-gather (`sp`; `ordered` False: rank-major rows) and the overlaps of the module doc."""

    @staticmethod
    def forward(ctx, x_bsh, group: Group, sp: bool, ordered: bool, *params):
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.sp, ctx.ordered, ctx.biased = group, sp, ordered, [b is not None for b in biases]
        if sp and not ordered:
            x_full, ys = _gathered_projections(x_bsh, group, weights, biases)
        else:           # f is the identity forward; sequence order gathers whole, then projects
            x_full = _gather_seq(x_bsh, group, ordered=True) if sp else x_bsh
            ys = [torch.nn.functional.linear(x_full, w, b) for w, b in zip(weights, biases)]
        ctx.save_for_backward(x_full, *weights)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grad_ys):
        x_full, *weights = ctx.saved_tensors     # autograd materializes every output's gradient
        dy_2d = {i: dy.reshape(-1, dy.shape[-1]) for i, dy in enumerate(grad_ys)}
        grad_x, handle = None, None
        if ctx.needs_input_grad[0]:
            grad_x, handle = _launch_input_grad(ctx, x_full, weights, dy_2d)
        grads = _weight_grads(ctx, x_full, dy_2d)      # while the input gradient's collective is in flight
        if handle is not None:
            handle.wait()
        return (grad_x, None, None, None, *grads)


def _launch_input_grad(ctx, x_full: torch.Tensor, weights, dy_2d: dict):
    """The input gradient Σᵢ dyᵢ·Wᵢ, and its collective launched: f's all-reduce, in place, or the SP
    reduce-scatter. Its terms are added last projection first, the order autograd's engine adds them in on
    the plain path. Returns (the input gradient, final once the handle is waited for; the handle)."""
    grad_2d = None
    for i in reversed(list(dy_2d)):
        grad_2d = dy_2d[i].mm(weights[i]) if grad_2d is None else grad_2d.addmm_(dy_2d[i], weights[i])
    grad_full = grad_2d.view(x_full.shape)
    if ctx.sp:
        return _reduce_scatter_seq_async(grad_full, ctx.group, ctx.ordered)
    return grad_full, ops.all_reduce(grad_full, ctx.group, async_op=True)


def _weight_grads(ctx, x_full: torch.Tensor, dy_2d: dict) -> list:
    """dWᵢ = dyᵢᵀ·x and dbᵢ = Σ dyᵢ for the weights and biases that need them, in `EnterColumns`' input
    order (W₁, b₁, …): no communication."""
    x_2d = x_full.reshape(-1, x_full.shape[-1])
    grads: list = [None] * (2 * len(ctx.biased))
    for i, dy in dy_2d.items():
        if ctx.needs_input_grad[4 + 2 * i]:
            grads[2 * i] = dy.t().mm(x_2d)
        if ctx.biased[i] and ctx.needs_input_grad[5 + 2 * i]:
            grads[2 * i + 1] = dy.sum(dim=0)
    return grads


def _gathered_projections(x_bsh: torch.Tensor, group: Group, weights, biases):
    """The all-gather of the sequence shards in rank-major rows (n·b, s/n, h), launched, with this rank's own
    rows projected while it runs and the other ranks' after: (gathered input, projections)."""
    n, r = group.size, group.rank
    x_local = x_bsh.contiguous()
    rows = x_local.shape[0]
    x_full = torch.empty((n * rows,) + tuple(x_local.shape[1:]), dtype=x_local.dtype, device=x_local.device)
    handle = ops.all_gather(x_full, x_local, group, async_op=True)
    ys = [torch.empty((n * rows,) + tuple(x_local.shape[1:-1]) + (w.shape[0],), dtype=x_local.dtype,
                      device=x_local.device) for w in weights]
    h = x_local.shape[-1]

    def project_rows(j: int, x_rows: torch.Tensor) -> None:
        for y, w, b in zip(ys, weights, biases):
            _project(x_rows.reshape(-1, h), w, b, y[j * rows:(j + 1) * rows].view(-1, w.shape[0]))

    project_rows(r, x_local)
    handle.wait()
    for j in range(n):
        if j != r:
            project_rows(j, x_full[j * rows:(j + 1) * rows])
    return x_full, ys


class ExitRows(torch.autograd.Function):
    """Sequence parallelism's exit of a part (row-parallel: attention's wo, the MLP's down projection): x ->
    y (b, s/n, h), the reduce-scatter along the sequence of x Wᵀ, decomposed (Wang et al. 2023). x is in
    rank-major rows (n·b, s/n, f) (`ordered` False: the MLP's, as its entry gathered them) or in sequence
    order (b, s, f) (attention's); either way rank j's chunk is the tokens j holds.

    Forward, the other ranks' chunks are projected first and the exchange launched (gloo's pairwise
    reduce-scatter never sends a rank's own chunk, comm/ops.py `takes_own_later`), this rank's own chunk is
    projected while it runs; backward, the all-gather of dy is launched and the own chunk's input and weight
    gradients computed while it runs, the other ranks' after. The same collectives and bytes as the plain
    path; the chunks' partial sums are added in the same order. Sequence order needs no copy of the whole
    partial sum into rank-major order (the plain path's `rank_major`): each chunk's input is copied instead,
    f/h of it."""

    @staticmethod
    def forward(ctx, x, group: Group, weight, ordered: bool):
        n, r = group.size, group.rank
        rows, tokens = _chunking(x, n, ordered)
        h = weight.shape[0]
        send = torch.empty((n, rows, tokens, h), dtype=x.dtype, device=x.device)
        for j in range(n):
            if j != r:
                _project(_chunk(x, j, n, ordered), weight, None, send[j].view(-1, h))
        own = torch.empty_like(send[r])
        out = torch.empty_like(send[r])
        handle = ops.reduce_scatter(out, send.view(n * rows, tokens, h), group, async_op=True, own=own)
        _project(_chunk(x, r, n, ordered), weight, None, own.view(-1, h))
        handle.wait()
        ctx.group, ctx.ordered = group, ordered
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad_bsh):
        x, weight = ctx.saved_tensors
        group, ordered = ctx.group, ctx.ordered
        n, r = group.size, group.rank
        dy = grad_bsh.contiguous()
        dy_all = torch.empty((n * dy.shape[0],) + tuple(dy.shape[1:]), dtype=dy.dtype, device=dy.device)
        handle = ops.all_gather(dy_all, dy, group, async_op=True)
        rows, tokens = _chunking(x, n, ordered)
        f, h = x.shape[-1], weight.shape[0]
        dy_chunks = dy_all.view(n, rows, tokens, h)
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if ctx.needs_input_grad[0] else None
        grad_w = None

        def chunk_of(j: int, dy_2d: torch.Tensor) -> None:
            nonlocal grad_w
            if grad_x is not None:
                if ordered:   # tokens [j·s/n, (j+1)·s/n) of every row
                    grad_x[:, j * tokens:(j + 1) * tokens].copy_(dy_2d.mm(weight).view(rows, tokens, f))
                else:
                    torch.mm(dy_2d, weight, out=grad_x[j * rows:(j + 1) * rows].view(-1, f))
            if ctx.needs_input_grad[2]:
                x_2d = _chunk(x, j, n, ordered)
                grad_w = dy_2d.t().mm(x_2d) if grad_w is None else grad_w.addmm_(dy_2d.t(), x_2d)

        chunk_of(r, dy.view(-1, h))              # this rank's tokens, while the other ranks' dy arrive
        handle.wait()
        for j in range(n):
            if j != r:
                chunk_of(j, dy_chunks[j].reshape(-1, h))
        return grad_x, None, grad_w, None


def _chunking(x: torch.Tensor, n: int, ordered: bool) -> tuple[int, int]:
    """(rows, tokens per row) of one rank's chunk of x: (b, s/n)."""
    if ordered:
        return x.shape[0], x.shape[1] // n
    return x.shape[0] // n, x.shape[1]


def _chunk(x: torch.Tensor, j: int, n: int, ordered: bool) -> torch.Tensor:
    """Rank j's chunk of x as (rows·tokens, f): a view of rank-major rows, a copy of a strided slice of a
    sequence-order input."""
    rows, tokens = _chunking(x, n, ordered)
    part = x[:, j * tokens:(j + 1) * tokens] if ordered else x[j * rows:(j + 1) * rows]
    return part.reshape(-1, x.shape[-1])


def rows_exited(x: torch.Tensor, group: Group, weight: torch.Tensor, ordered: bool) -> torch.Tensor:
    """A row-parallel projection and SP's reduce-scatter through `ExitRows`."""
    return ExitRows.apply(x, group, weight, ordered)


def fusable(columns) -> bool:
    """Whether these projections can run fused with their input op: plain weights, no LoRA adapter."""
    return all(getattr(c, "lora", None) is None and hasattr(c, "weight") for c in columns)


def columns_entered(x_bsh: torch.Tensor, group: Group, sp: bool, ordered: bool, columns) -> tuple:
    """Each column's projection of the entered input, through `EnterColumns`."""
    params = []
    for c in columns:
        params += [c.weight, c.bias]
    return EnterColumns.apply(x_bsh, group, sp, ordered, *params)
