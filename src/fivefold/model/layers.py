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

    def take(self, read=float) -> float:
        """The recorded losses' sum (`read` makes it a number: a dry run's fake tensors read as 0)."""
        total = read(sum(v.double().sum() for v in self.values)) if self.values else 0.0
        self.values = []
        return total


class Enter(nn.Module):
    """Where a part's input meets its input projections (attention's q, k, v; the MLP's gate and up):
    `forward(x, *linears)` returns each projection of x. Tensor parallelism puts its input op here
    (parallel/tensor.py `ParallelInput`: f, or the SP all-gather, run fused with the projections so that
    its collectives overlap their GEMMs)."""

    def forward(self, x_bsh: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
        return tuple(linear(x_bsh) for linear in linears)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int, device=None):
        super().__init__()
        self.enter = Enter()  # tensor parallelism puts its input op here (f, or the SP all-gather)
        self.gate = nn.Linear(hidden, ffn, bias=False, device=device)
        self.up = nn.Linear(hidden, ffn, bias=False, device=device)
        self.down = nn.Linear(ffn, hidden, bias=False, device=device)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        gate_bsf, up_bsf = self.enter(x_bsh, self.gate, self.up)
        return self.down(silu_mul(gate_bsf, up_bsf))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    """weight · (x / rms(x)) with the normalisation in fp32 (as Hugging Face's LlamaRMSNorm), storing for
    the backward only x and the fp32 inverse rms per token, as fused RMSNorm kernels do (apex, Megatron):
    autograd of the eager expression would keep x's fp32 copy and the normalised x as well (three
    times x's bytes in bf16). The backward recomputes x / rms(x) and applies, step for step, the
    gradients autograd would: the weight's product, the cast, the scaling, rsqrt, mean and square."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return weight * (x32 * inv_rms).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, inv_rms = ctx.saved_tensors
        x32 = x.float()
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (dy * (x32 * inv_rms).to(x.dtype)).sum_to_size(weight.shape)
        d_x32 = (dy * weight).float()                                      # through the cast to x.dtype
        d_mean = (d_x32 * x32).sum(-1, keepdim=True) * (-0.5) * inv_rms.pow(3)   # rsqrt
        d_x32.mul_(inv_rms)                                                # through x32 · inv_rms
        d_x32.addcmul_(x32, d_mean / x32.shape[-1], value=2)                # through the mean of squares
        return d_x32.to(x.dtype), d_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


class _MaskedScale(torch.autograd.Function):
    """x · keep / (1 − p), keeping only the boolean mask for the backward (one byte an element, as
    Megatron's dropout does and the planner counts: plan/activations.py), not a copy of it in x's dtype."""

    @staticmethod
    def forward(ctx, x, keep, p: float):
        ctx.save_for_backward(keep)
        ctx.p = p
        return x * keep.to(x.dtype) / (1.0 - p)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep.to(grad.dtype) / (1.0 - ctx.p), None, None


class Dropout(nn.Module):
    """Inverted dropout whose mask is drawn from `generator` (None: torch's default stream); the backward
    keeps the boolean mask only.

    Parallel layouts hand it a generator so that masks agree across ranks that hold the same
    activations and differ across ranks that hold different ones (see parallel/tensor.py)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.generator: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        g = self.generator   # drawn where the generator lives (CPU for parallel layouts), so masks match any device
        keep = (torch.rand(x.shape, generator=g, device=g.device if g is not None else x.device) >= self.p).to(x.device)
        return _MaskedScale.apply(x, keep, self.p)
