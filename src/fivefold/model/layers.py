"""The building blocks the dense model and the mixture of experts share: the SwiGLU MLP (and its
`silu_mul`, which keeps gate and up only), and the one channel for auxiliary losses (`AuxLosses`).
transformer.py and moe.py both import them from here, so neither imports the other's module in a circle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _SiluMul(torch.autograd.Function):
    """silu(gate) · up, storing gate and up only (silu's output is recomputed in the backward, as
    Megatron's fused SwiGLU does): eager autograd also keeps silu(gate), a fourth ffn-wide tensor."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy):
        """The same arithmetic as autograd's, in place where it can be: beside dy at most three
        ffn-wide tensors are alive (the planner's `mlp_backward_scratch`), not six."""
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        d_up = dy * (gate * sig)                                            # silu(gate) = gate · σ(gate)
        slope = torch.rsub(sig, 1).mul_(gate).add_(1).mul_(sig)            # silu's derivative σ(1 + g(1 - σ))
        del sig
        return (dy * up).mul_(slope), d_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SiluMul.apply(gate, up)


class AttachAuxLoss(torch.autograd.Function):
    """x -> x; when x's gradient comes back, `loss` receives the gradient 1 (so it is trained)."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        (loss,) = ctx.saved_tensors
        return grad_x, torch.ones_like(loss)


class AuxLosses:
    """The model's one channel for auxiliary losses (MoE load balance, router z-loss).

    A module that computes such a loss passes the activation it rides on through `add(x, loss)`: the
    forward returns x unchanged, and the backward that reaches x also gives `loss` the gradient 1. The
    loss is thus trained by the backward that already runs through its block: the single-process
    backward, or the pipeline runtime's backward of whichever stage holds the block, with nothing but the
    activation crossing a stage boundary (Megatron-Core's MoEAuxLossAutoScaler does the same). A module
    scales its loss itself, like the main loss (a share of the global batch). Values are recorded,
    detached, only by a forward that builds a graph, so a forward re-run for recomputation counts once;
    `take()` returns their sum and clears them."""

    def __init__(self):
        self.values: list[torch.Tensor] = []

    def add(self, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return x
        self.values.append(loss.detach())
        return AttachAuxLoss.apply(x, loss)

    def take(self) -> float:
        total = float(sum(v.double().sum() for v in self.values)) if self.values else 0.0
        self.values = []
        return total


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int, device=None):
        super().__init__()
        self.enter = nn.Identity()  # tensor parallelism puts its input op here (f, or the SP all-gather)
        self.gate = nn.Linear(hidden, ffn, bias=False, device=device)
        self.up = nn.Linear(hidden, ffn, bias=False, device=device)
        self.down = nn.Linear(ffn, hidden, bias=False, device=device)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        x_bsh = self.enter(x_bsh)
        return self.down(silu_mul(self.gate(x_bsh), self.up(x_bsh)))
