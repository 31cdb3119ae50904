"""AdamW on fp32 master weights, the learning-rate schedule, and global grad-norm clipping.

The optimizer works on lists of tensors (whole parameters, or views of flat ZeRO shards) so that every
layout applies the same element-wise arithmetic to the same numbers: a sharded run and a single-process
run produce the same parameters.
"""
from __future__ import annotations

import math

import torch

from .. import comm, rules
from ..comm import Group


# Elements per multi-tensor (foreach) call and per pass of the gradient norm: bounds the temporaries the
# optimizer step makes whatever the model's size (rules.STEP_CHUNK, which the planner charges): AdamW's
# denominators (and low-precision gradients' fp32 copies) of one call, 16 MiB of fp32; the norm's fp64
# copy of one slice, 32 MiB. A tensor larger than the chunk is cut into flat slices (element-wise ops:
# the same numbers).
FOREACH_CHUNK = rules.STEP_CHUNK


class AdamW:
    """Decoupled weight decay Adam (Loshchilov & Hutter, 2019). `decay[i]` says whether tensor i decays
    (matrices do; norms do not). One pass over memory per line of `update` (the planner charges
    rules.EAGER_ADAMW_ACCESSES element accesses per owned element; keep the two in step).

    Two ways to run the same arithmetic: `update`, one tensor at a time (eager), and `update_many`, the
    same ops over lists of tensors with torch's multi-tensor `_foreach_*` kernels (one launch per op
    and chunk of tensors instead of one per op and tensor: what the CUDA path needs, where a ~1B-parameter
    model has ~150 tensors and launches would dominate). Op by op they are the same (decay mul, lerp,
    mul + addcmul, sqrt, divide, add eps, addcdiv), so the results are bit-identical on the CPU, where
    torch's foreach ops run the per-tensor kernels (tests/ranks/test_device.py holds them equal); on CUDA the
    fused kernels may round a scalar division differently (~1 ulp). `foreach`: None (default) uses
    `update_many` everywhere; False keeps the eager loop."""

    def __init__(self, params: list[torch.Tensor], decay: list[bool], betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.1, foreach: bool | None = None):
        self.params, self.decay = params, decay
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.t = 0
        self.foreach = foreach is not False

    def hold(self, params: list[torch.Tensor], decay: list[bool], exp_avg: list[torch.Tensor],
             exp_avg_sq: list[torch.Tensor]) -> "AdamW":
        """Update `params` with moments kept in the caller's tensors (shaped like `params`: views of a ZeRO
        engine's padded moment shards, parallel/zero/state.py) instead of moments of its own."""
        self.params, self.decay, self.exp_avg, self.exp_avg_sq = params, decay, exp_avg, exp_avg_sq
        return self

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        self.advance()
        if self.foreach:
            self.update_many(self.params, grads, self.exp_avg, self.exp_avg_sq, self.decay, lr)
            return
        for p, g, m, v, decay in zip(self.params, grads, self.exp_avg, self.exp_avg_sq, self.decay):
            self.update(p, g, m, v, decay, lr)

    def advance(self) -> None:
        """Start step t + 1: its bias corrections. `step` = advance + `update` of every tensor; an engine
        whose state lives elsewhere (parallel/zero/offload.py) calls the two itself, unit by unit, on its own
        state tensors (then `params` and the moment lists may be empty)."""
        self.t += 1
        self.bc1 = 1 - self.beta1 ** self.t
        self.bc2_sqrt = math.sqrt(1 - self.beta2 ** self.t)

    @torch.no_grad()
    def update(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, decay: bool,
               lr: float) -> None:
        """One tensor's update of the current step (after `advance`): p, m, v in place."""
        g = g.to(p.dtype)  # low-precision gradients (main_grads_fp32 = false) are upcast here
        if decay and self.weight_decay:
            p.mul_(1 - lr * self.weight_decay)
        m.lerp_(g, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        denom = (v.sqrt() / self.bc2_sqrt).add_(self.eps)
        p.addcdiv_(m, denom, value=-lr / self.bc1)

    @torch.no_grad()
    def update_many(self, ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor],
                    vs: list[torch.Tensor], decay: list[bool], lr: float) -> None:
        """`update` of every tensor of the lists (after `advance`), with multi-tensor kernels: the same
        ops in the same order, over calls of at most FOREACH_CHUNK elements (larger tensors in slices)."""
        ps, gs, ms, vs, decay = sliced(ps, gs, ms, vs, decay, limit=FOREACH_CHUNK)
        for a, b in foreach_chunks([p.numel() for p in ps], FOREACH_CHUNK):
            p_, m_, v_ = ps[a:b], ms[a:b], vs[a:b]
            g_ = [g.to(p.dtype) for p, g in zip(p_, gs[a:b])]   # low-precision gradients upcast, as in `update`
            if self.weight_decay:
                decayed = [p for p, d in zip(p_, decay[a:b]) if d]
                if decayed:
                    torch._foreach_mul_(decayed, 1 - lr * self.weight_decay)
            torch._foreach_lerp_(m_, g_, 1 - self.beta1)
            torch._foreach_mul_(v_, self.beta2)
            torch._foreach_addcmul_(v_, g_, g_, value=1 - self.beta2)
            denom = torch._foreach_sqrt(v_)
            torch._foreach_div_(denom, self.bc2_sqrt)
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(p_, m_, denom, value=-lr / self.bc1)
            del denom, g_

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)


def flat_slices(t: torch.Tensor, limit: int) -> list[torch.Tensor]:
    """`t` as views of at most `limit` consecutive elements (`t` itself when it is small enough or not
    contiguous, which no parameter, moment or gradient the engines make is)."""
    if t.numel() <= limit or not t.is_contiguous():
        return [t]
    flat = t.view(-1)
    return [flat[a:a + limit] for a in range(0, flat.numel(), limit)]


def sliced(*lists, limit: int) -> tuple[list, ...]:
    """Parallel lists of tensors (the last may hold per-tensor flags) with every tensor larger than
    `limit` cut into the same flat slices in every list."""
    *tensors, flags = lists
    out = [[] for _ in lists]
    for row in zip(*tensors, flags):
        *ts, flag = row
        cut = [flat_slices(t, limit) for t in ts]
        if len({len(c) for c in cut}) != 1:   # a non-contiguous one among them: keep the whole tensors
            cut = [[t] for t in ts]
        for k, pieces in enumerate(cut):
            out[k].extend(pieces)
        out[-1].extend([flag] * len(cut[0]))
    return tuple(out)


def foreach_chunks(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """[a, b) ranges of consecutive tensors whose sizes sum to at most `limit` (a larger tensor alone)."""
    out, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            out.append((start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


HF_SCHEDULES = ("hf_linear", "hf_cosine", "constant_with_warmup")


def hf_lambda(step: int, warmup: int, total: int, schedule: str) -> float:
    """transformers' multiplier of the peak lr at optimizer step `step` (0-based), as its LambdaLR applies it."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant_with_warmup":
        return 1.0
    if schedule == "hf_linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int, schedule: str = "cosine",
          decay_fraction: float = 0.2) -> float:
    """The learning rate of step `step` (0-based) of `total`: linear warmup over `warmup` steps, then
    - cosine: cosine decay from lr to min_lr at the last step (Loshchilov & Hutter 2017);
    - linear: a straight line from lr to min_lr at the last step;
    - constant: lr;
    - wsd (warmup-stable-decay; Hu et al. 2024, MiniCPM): lr until the last `decay_fraction` of the
      steps after warmup, then a straight line to min_lr at the last step;
    - hf_linear, hf_cosine, constant_with_warmup: transformers' `get_scheduler` of the same names (linear,
      cosine, constant_with_warmup), whose optimizer step k runs at lr x lambda(k): warmup k / warmup (step
      0 at lr 0), then (total - k) / (total - warmup), 0.5 (1 + cos(pi (k - warmup) / (total - warmup))),
      or 1; down to 0, never to min_lr."""
    if schedule in HF_SCHEDULES:
        return lr * hf_lambda(step, warmup, total, schedule)
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup + 1 or schedule == "constant":
        return lr
    span = total - warmup - 1
    progress = min((step - warmup) / span, 1.0)
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        stable = 1.0 - decay_fraction
        progress = 0.0 if progress <= stable else (progress - stable) / max(decay_fraction, 1e-12)
    return lr - (lr - min_lr) * progress


@torch.no_grad()
def global_grad_norm(owned: list[torch.Tensor], group: Group | None = None, device=None, value=float) -> float:
    """L2 norm of all gradients of the model.

    `owned` holds the gradient pieces this rank is responsible for, so that each element of the model
    is counted exactly once across `group` (the ranks holding different pieces: tensor, pipeline and
    ZeRO shards). Replicated gradients must be passed by one rank only. `device` places the sum when
    this rank owns no gradient (its collective still runs). `value` reads the result (a dry run's
    fake tensors have none: tools/dryrun.py).
    """
    sq = torch.zeros(1, dtype=torch.float64, device=owned[0].device if owned else device)
    for g in owned:
        for piece in flat_slices(g, FOREACH_CHUNK):
            x = piece.reshape(-1).double()   # one slice's fp64 copy at a time (FOREACH_CHUNK)
            sq += torch.dot(x, x)
            del x   # before the next slice's copy exists
    if group is not None and group.size > 1:
        if device is not None and sq.device != torch.device(device):
            sq = sq.to(device)   # gradients streamed to host memory (offload): the collective runs on the device
        comm.all_reduce(sq, group, dim="grad_norm")
    return value(sq.sqrt())


@torch.no_grad()
def clip_(grads: list[torch.Tensor], norm: float, max_norm: float) -> float:
    """Scale grads so their global norm is at most max_norm; return the scale used."""
    if max_norm <= 0 or norm <= max_norm:
        return 1.0
    scale = max_norm / (norm + 1e-6)
    for g in grads:
        g.mul_(scale)
    return scale
