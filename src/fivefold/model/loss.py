"""The language-modelling loss: the sum of token cross-entropies, with its gradient made in the forward,
a block of rows at a time (the fused cross-entropy of Liger-Kernel, Hsu et al. 2024, without the head's
matmul; no communication).

`F.cross_entropy` on logits (t, v) writes the log-probabilities (t × v, saved for the backward), and its
backward makes a zeroed t × v gradient for the picked entries and runs log-softmax's backward into a third
t × v tensor, reading two: six passes over t × v in memory. Here each block of rows (`BLOCK` elements) is
read once and its gradient, softmax − one-hot, written once into the tensor saved for the backward (the
block's other passes stay in cache); the backward scales that tensor in place by the incoming gradient and
hands it on. On one CPU core forward and backward take 0.51-0.54 of F.cross_entropy's time (2048 × 8192
and 512 × 128,256, fp32: benchmarks/loss.py), and for fp32 logits the only t × v tensor they make is the
gradient (fp64 for fp64 logits) where F.cross_entropy makes three. Logits of lower precision are promoted
to fp32 as they are read (exact), never copied; their gradient is cast back in the backward (a second
t × v tensor, in their dtype).

The backward spends the saved gradient, so it runs once: a second backward through the same graph
(retain_graph) is refused (`spend`). Autograd's own check on tensors modified in place would not do: it
is off while saved-tensor hooks run, and the trainer's step runs under its activation meter. Nothing in
fivefold backpropagates twice through a loss (zero bubble's split backward goes through the loss once).
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100     # a target the loss skips (a loss mask's context token): transformers' labels = -100
BLOCK = 2**20           # elements a block on the CPU (4 MiB in fp32, in cache): timed on one core, the fastest or
                        # within 8% of it for vocabularies of 256 (4096 rows), 8192 (128) and 128,256 (8 rows)
BLOCK_CUDA = 2**24      # on a GPU each op of a block is a kernel launch: 64 MiB blocks keep a billion logits to
                        # 64 blocks (about 600 launches); not yet timed on a GPU


def loss_sum(logits_bsv: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token cross-entropies in fp32 (fp64 for fp64 models); targets of IGNORE_INDEX add
    nothing and get no gradient. The trainer divides by the global count of targets that count, so the loss
    is the mean over the global batch however it is split across ranks and micro-batches. Equal to
    `F.cross_entropy` of the logits in the compute dtype (`compute_dtype`) with reduction="sum" and
    ignore_index=IGNORE_INDEX, up to rounding. Plain tensors only (a DTensor's loss is DTensor's own,
    F.cross_entropy under `loss_parallel()`)."""
    logits_tv, targets_t = logits_bsv.flatten(0, 1), targets_bs.flatten()
    if torch.is_grad_enabled() and logits_tv.requires_grad:
        return TokenCrossEntropy.apply(logits_tv, targets_t)
    scratch_rv = torch.empty(min(block_rows(logits_tv), logits_tv.shape[0]), logits_tv.shape[1], dtype=compute_dtype(logits_tv),
                             device=logits_tv.device)
    return blocks(logits_tv, targets_t, lambda a, b: scratch_rv[:b - a])


def block_rows(logits_tv: torch.Tensor) -> int:
    block = BLOCK_CUDA if logits_tv.device.type == "cuda" else BLOCK
    return max(1, block // max(1, logits_tv.shape[1]))


def row_blocks(logits_tv: torch.Tensor):
    """The row ranges (a, b) of `logits_tv`'s blocks, in order (this loss's and the vocab-parallel one's)."""
    rows, n = block_rows(logits_tv), logits_tv.shape[0]
    for a in range(0, n, rows):
        yield a, min(a + rows, n)


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class TokenCrossEntropy(torch.autograd.Function):
    """logits (t, v), targets (t,) -> the summed loss; the gradient is made in the forward (module doc)."""

    @staticmethod
    def forward(ctx, logits_tv: torch.Tensor, targets_t: torch.Tensor) -> torch.Tensor:
        grad_tv = torch.empty(logits_tv.shape, dtype=compute_dtype(logits_tv), device=logits_tv.device)
        loss = blocks(logits_tv, targets_t, lambda a, b: grad_tv[a:b])
        ctx.dtype = logits_tv.dtype
        ctx.save_for_backward(grad_tv)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        spend(ctx)
        grad_tv, = ctx.saved_tensors
        return grad_tv.mul_(grad_out).to(ctx.dtype), None


def spend(ctx) -> None:
    """Mark a loss's saved gradient spent by its one backward; refuse a second (retain_graph)."""
    if getattr(ctx, "spent", False):
        raise RuntimeError("a loss's backward ran twice through one graph: its saved gradient was scaled in place "
                           "by the first (model/loss.py); recompute the loss for a second backward")
    ctx.spent = True


def blocks(logits_tv: torch.Tensor, targets_t: torch.Tensor, out) -> torch.Tensor:
    """The summed loss, a block of rows at a time; `out(a, b)` is where rows a:b's gradient go (compute dtype)."""
    keep_t = targets_t != IGNORE_INDEX
    safe_t1 = torch.where(keep_t, targets_t, 0).unsqueeze(1)
    loss_t = torch.empty(logits_tv.shape[0], dtype=compute_dtype(logits_tv), device=logits_tv.device)
    for a, b in row_blocks(logits_tv):
        loss_t[a:b] = block(logits_tv[a:b], safe_t1[a:b], keep_t[a:b], out(a, b))
    return torch.where(keep_t, loss_t, 0.0).sum()


def block(x_rv: torch.Tensor, target_r1: torch.Tensor, keep_r: torch.Tensor, grad_rv: torch.Tensor) -> torch.Tensor:
    """Each row's loss, log Σ exp(x − max) − (x_target − max); `grad_rv` <- softmax(x) − one-hot(target),
    zero on rows not kept."""
    max_r1 = x_rv.amax(dim=1, keepdim=True).to(grad_rv.dtype)
    torch.sub(x_rv, max_r1, out=grad_rv)                       # 16-bit logits promoted (exactly) as they are read
    picked_r1 = grad_rv.gather(1, target_r1)
    sum_r1 = grad_rv.exp_().sum(dim=1, keepdim=True)
    grad_rv.div_(sum_r1).scatter_add_(1, target_r1, torch.full_like(picked_r1, -1.0))
    grad_rv.masked_fill_(~keep_r.unsqueeze(1), 0.0)
    return (sum_r1.log() - picked_r1).squeeze(1)
