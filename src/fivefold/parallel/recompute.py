"""Activation recomputation: keep fewer activations for the backward and run the forward that made them
again when the backward needs them.

Papers: Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (checkpoint a segment's input,
re-run the segment in the backward); Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (§5, selective: only the attention core softmax(QKᵀ)V, whose s² activations
are many and cheap to remake). No communication of its own: a recomputed forward runs its collectives
(tensor, sequence, context, expert parallel) again, through `fivefold.comm`, so the ledger records them
and the planner counts them (plan/traffic.py: forward passes x2 under full recompute).

Modes (`train.recompute`), for any layout:

* "selective": every attention core (`Attention.core`, `LatentAttention.core`; under context parallelism
  only the local attention `inner` of the Ulysses core, whose all-to-alls are kept; ring attention keeps
  only q, k, v, its output and log-sum-exp already) keeps only its inputs q, k, v and recomputes its
  output, softmax statistics and scores in the backward.
* "full" (`set_full_recompute`; `parallelize` applies it at pp = 1, the pipeline runtime to its stage):
  each transformer block keeps only its input, as Megatron-LM's full/uniform recompute with one layer per
  checkpoint, which is what the planner counts (plan/activations.py `full_recompute_peak`: each layer's
  input, 2·s·b·h in 16 bits, plus one layer's working set while it is re-run). The block's forward hooks
  (ZeRO-3's gather) stay outside the checkpoint: the block is re-run inside its own backward, after
  ZeRO-3's pre-backward gather, so no extra all-gather (`ZeroSpec.gathers`: 2m per block).
* "full" under the zero bubble schedule (zb, pp > 1): its split backward (I, then W) needs an ordinary
  graph of the weight-holding modules, so the pipeline runtime runs a chunk's F without autograd, keeps
  only the chunk's input and `rng_state`, and re-runs the whole chunk at I (chunk granularity: the
  planner's per-layer count is then an estimate; ZeRO-3 does not run under zb).

Exactness: a checkpoint records the random streams a forward may draw from (`rng_state`: torch's CPU
and CUDA default generators and our dropout generators) and restores them for the re-run, then puts
back the streams as they were, so dropout draws the same masks and the run equals one without
recompute bit for bit (same kernels on the same numbers).

`Recompute` (one autograd Function) is the checkpoint: it saves its tensor inputs with
`ctx.save_for_backward`, so the ActivationMeter (train/activations.py) counts them, and it re-runs the
forward inside its backward (as torch.utils.checkpoint's reentrant variant), where the meter counts the
re-run's own saved tensors while they live.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..model.transformer import Block

RECOMPUTE = ("none", "full", "selective")


# -- random streams ----------------------------------------------------------------------------------
def generators(module: nn.Module | None) -> list[torch.Generator]:
    """The dropout generators of `module`'s submodules (model/layers.py `Dropout.generator`)."""
    if module is None:
        return []
    return [m.generator for m in module.modules() if isinstance(getattr(m, "generator", None), torch.Generator)]


def rng_state(module: nn.Module | None, device: torch.device) -> tuple:
    """Every stream a forward of `module` may draw from: the CPU default, the CUDA default (on CUDA
    runs) and the module's dropout generators."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, [g.get_state() for g in generators(module)]


def set_rng_state(module: nn.Module | None, device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
    for g, s in zip(generators(module), state[2]):
        g.set_state(s)


# -- the checkpoint ------------------------------------------------------------------------------------
class Recompute(torch.autograd.Function):
    """`run(*tensors)` without autograd in the forward, keeping only `tensors` (and the RNG state); in the
    backward, `run` again with autograd from the same inputs and streams, then its backward."""

    @staticmethod
    def forward(ctx, run: Callable, module: nn.Module | None, device: torch.device, *tensors):
        ctx.run, ctx.module, ctx.device = run, module, device
        ctx.rng = rng_state(module, device)
        ctx.save_for_backward(*tensors)
        return run(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[3:]
        inputs = [t.detach().requires_grad_(need) if torch.is_floating_point(t) else t
                  for t, need in zip(ctx.saved_tensors, needs)]
        now = rng_state(ctx.module, ctx.device)
        set_rng_state(ctx.module, ctx.device, ctx.rng)
        try:
            with torch.enable_grad():
                out = ctx.run(*inputs)
        finally:
            set_rng_state(ctx.module, ctx.device, now)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None) + tuple(x.grad if need else None for x, need in zip(inputs, needs))


def recomputed(fn: Callable, module: nn.Module | None, *args, **kwargs):
    """fn(*args, **kwargs), its activations recomputed in the backward (`Recompute`); the tensors among
    args and kwargs are what is kept. Without autograd (evaluation, generation, a pipeline's F under
    full recompute) just fn."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in where]
    skeleton = [None if i in where else x for i, x in enumerate(leaves)]   # the tensors live in ctx only

    def run(*ts):
        filled = list(skeleton)
        for i, t in zip(where, ts):
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        return fn(*a, **kw)

    device = tensors[0].device if tensors else torch.device("cpu")
    return Recompute.apply(run, module, device, *tensors)


# -- selective: the attention core ---------------------------------------------------------------------
def checkpointed(core: Callable) -> Callable:
    """Selective recompute (Korthikanti et al. 2022): keep no activation inside the attention core; it
    is recomputed from q, k, v in backward."""
    def run(*args, **kwargs):
        return recomputed(core, None, *args, **kwargs)
    run.recomputes = True
    return run


def set_selective_recompute(module: nn.Module) -> None:
    """Swap every attention core in `module` for its checkpointed version. A context-parallel core
    (parallel/context.py) keeps its communication: only its local attention (`inner`) is recomputed."""
    for m in module.modules():
        core = getattr(m, "core", None)
        owner, name = (core, "inner") if hasattr(core, "inner") else (m, "core")
        inner = getattr(owner, name, None)
        if callable(inner) and not isinstance(inner, nn.Module) and not getattr(inner, "recomputes", False):
            setattr(owner, name, checkpointed(inner))


# -- full: every transformer block ---------------------------------------------------------------------
def set_full_recompute(module: nn.Module) -> None:
    """Checkpoint each transformer block in `module` (one layer per checkpoint): its forward keeps only its
    inputs. The block's module hooks run outside (ZeRO-3's gather), so they fire once per forward, as
    without recompute."""
    for block in (m for m in module.modules() if isinstance(m, Block)):
        forward = block.forward
        if getattr(forward, "recomputes", False):
            continue

        def run(*args, _forward=forward, _block=block, **kwargs):
            return recomputed(_forward, _block, *args, **kwargs)
        run.recomputes = True
        block.forward = run


def apply_recompute(model: nn.Module, mode: str) -> None:
    """`train.recompute` on a model or a pipeline stage."""
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {mode!r}")
    if mode == "selective":
        set_selective_recompute(model)
    elif mode == "full":
        set_full_recompute(model)
