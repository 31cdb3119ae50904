"""AdamW on fp32 master weights, the learning-rate schedule, and global grad-norm clipping.

The optimizer works on lists of tensors (whole parameters, or views of flat ZeRO shards) so that every
layout applies the same element-wise arithmetic to the same numbers: a sharded run and a single-process
run produce the same parameters.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..comm import Group


class AdamW:
    """Decoupled weight decay Adam (Loshchilov & Hutter, 2019). `decay[i]` says whether tensor i decays
    (matrices do; norms do not). Eager: one pass over memory per line of `step` (the planner charges
    rules.EAGER_ADAMW_ACCESSES element accesses per owned element; keep the two in step)."""

    def __init__(self, params: list[torch.Tensor], decay: list[bool], betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.1):
        self.params, self.decay = params, decay
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        self.t += 1
        bc1 = 1 - self.beta1 ** self.t
        bc2_sqrt = math.sqrt(1 - self.beta2 ** self.t)
        for p, g, m, v, decay in zip(self.params, grads, self.exp_avg, self.exp_avg_sq, self.decay):
            g = g.to(p.dtype)  # low-precision gradients (main_grads_fp32 = false) are upcast here
            if decay and self.weight_decay:
                p.mul_(1 - lr * self.weight_decay)
            m.lerp_(g, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / bc1)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_lr at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup + 1:
        return lr
    progress = min((step - warmup) / (total - warmup - 1), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def global_grad_norm(owned: list[torch.Tensor], group: Group | None = None, device=None) -> float:
    """L2 norm of all gradients of the model.

    `owned` holds the gradient pieces this rank is responsible for, so that each element of the model
    is counted exactly once across `group` (the ranks holding different pieces: tensor, pipeline and
    ZeRO shards). Replicated gradients must be passed by one rank only. `device` places the sum when
    this rank owns no gradient (its collective still runs).
    """
    sq = torch.zeros(1, dtype=torch.float64, device=owned[0].device if owned else device)
    for g in owned:
        sq += g.double().pow(2).sum()
    if group is not None and group.size > 1:
        comm.all_reduce(sq, group, dim="grad_norm")
    return float(sq.sqrt())


@torch.no_grad()
def clip_(grads: list[torch.Tensor], norm: float, max_norm: float) -> float:
    """Scale grads so their global norm is at most max_norm; return the scale used."""
    if max_norm <= 0 or norm <= max_norm:
        return 1.0
    scale = max_norm / (norm + 1e-6)
    for g in grads:
        g.mul_(scale)
    return scale
