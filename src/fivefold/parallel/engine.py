"""The gradient engine: what the trainer asks of data parallelism (DDP) and ZeRO-1/2/3.

An engine owns the parameters' gradients and the optimizer. It partitions the parameters by the group
their gradient is summed over (`placement.reduce`: dp, dp×cp, expert-dp, ...) and reduces each
partition over its own group; buckets and ZeRO units never mix groups. One step, explicitly:

    for i, mb in enumerate(micro_batches):   # parallel/microbatch.py
        engine.set_sync(i == last)     # are this backward's gradients the step's final ones?
        mb.loss(loss_sum, model(mb.tokens)).backward()   # hooks accumulate, reduce what is final
        engine.end_backward()          # reduce what the backward left pending (grad-less params)
    engine.finish()                    # wait for every reduction
    ... sum partial gradients (placement.partial), norm over engine.norm_group, clip ...
    engine.step(lr); engine.zero_grad()

A pipeline runs every micro-batch's backward with `set_sync(False)`, except each chunk's last backward
(the one after which its weights' gradients are final), which runs with `set_sync(True)`: the buckets and
units that backward completes are reduced at once, overlapped with the rest of the schedule (the drain,
other chunks' backwards), as Megatron's overlap_grad_reduce does. A bucket that spans two chunks goes when
the second is final. Tied copies (`placement.tied`) are *held*: their buckets wait until the schedule is
over, the copies' local gradients are summed (`local_grad`), and `set_sync(True)` + `end_backward()`
reduce them with whatever got no gradient. Held parameters come last in the backward order
(`backward_order`) so they never block a lane.
"""
from __future__ import annotations

from itertools import accumulate
from abc import ABC, abstractmethod
from typing import Mapping

import torch
from torch import nn

from .. import comm, rules
from ..comm import Group
from ..shapes import segments, windows
from .placement import by_group, placement_of


class Engine(ABC):
    """What the trainer asks of a gradient engine: DDP (data.py DataParallelOptimizer) and ZeRO (zero.py
    ShardedOptimizer) subclass it, so a missing method fails when the engine is made and the trainer
    calls every one directly. `release_params` has a default (nothing to free)."""

    params: list[nn.Parameter]
    norm_group: Group

    @abstractmethod
    def set_sync(self, enabled: bool) -> None: ...
    @abstractmethod
    def end_backward(self) -> None: ...
    @abstractmethod
    def finish(self) -> None: ...
    @abstractmethod
    def local_grad(self, p: nn.Parameter) -> torch.Tensor: ...
    @abstractmethod
    def owned_grads(self, params: list[nn.Parameter] | None = None) -> list[torch.Tensor]: ...
    @abstractmethod
    def norm_grads(self) -> list[torch.Tensor]: ...
    @abstractmethod
    def step(self, lr: float) -> None: ...
    @abstractmethod
    def zero_grad(self) -> None: ...
    @abstractmethod
    def state_bytes(self) -> dict: ...
    @abstractmethod
    def full_state(self) -> dict: ...
    @abstractmethod
    def load_full_state(self, state: dict) -> None: ...
    @abstractmethod
    def local_state(self) -> tuple[list, int]: ...
    @abstractmethod
    def load_local_state(self, read_into, opt_t: int) -> None: ...
    @abstractmethod
    def remove(self) -> None: ...

    def release_params(self) -> None:
        """Free what forwards outside a step gathered (an evaluation's: ZeRO-3's parameters); an engine
        that holds its parameters whole has nothing to free."""


def decays(name: str, shape, embeddings: bool = True) -> bool:
    """Whether AdamW's weight decay applies to parameter `name` of `shape`: weights of two or more
    dimensions (never norms or biases, as Megatron and Hugging Face's Trainer), and of those the token
    embedding and the LM head only when `embeddings` (train.decay_embeddings)."""
    if len(shape) < 2:
        return False
    parts = name.split(".")
    return embeddings or "layers" in parts or parts[-2:] not in (["embed", "weight"], ["head", "weight"])


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, each tied weight once, in registration order."""
    seen, out = set(), []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def held(p: nn.Parameter) -> bool:
    """A tied copy's gradient is final only after the copies' sum, which follows the whole backward."""
    return placement_of(p).tied is not None


def backward_order(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Parameters in the order backward makes their gradients final: reverse registration order, with
    held (tied) parameters last, since they are reduced only at the step's end."""
    rev = list(reversed(params))
    return [p for p in rev if not held(p)] + [p for p in rev if held(p)]


def reduce_partitions(params: list[nn.Parameter], groups: Mapping[str, Group]) -> list[tuple[Group, list]]:
    """(group, parameters) for each reduction group named by the parameters' placements, in the order
    the groups first appear in `params` (the same on every rank of a group)."""
    return [(groups[name], ps) for name, ps in by_group(params, "reduce").items()]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def sum_partial_grads(engine: Engine, groups: Mapping[str, Group]) -> None:
    """Sum gradients that the ranks of a group each computed in part (`placement.partial`): one
    all-reduce per group per step, after the engine's reduction (sums commute). The ranks of such a
    group hold the same pieces, so they own the same gradient segments under ZeRO too."""
    for name, params in by_group(engine.params, "partial").items():
        all_reduce_windows(engine.owned_grads(params), groups[name])


def all_reduce_windows(tensors: list[torch.Tensor], group: Group, chunk: int = rules.STEP_CHUNK) -> None:
    """All-reduce `tensors` in place as one flat sequence, window by window of at most `chunk` elements
    (`shapes.windows`, which the planner counts): the scratch is one window, not the whole set (the
    experts of Mixtral 8x7B under ep8 x tp2 are 5.6G elements per rank: 21 GiB as one flat copy)."""
    numels = [t.numel() for t in tensors]
    starts = [0, *accumulate(numels)][:-1]
    lo = 0
    for size, count in windows(sum(numels), chunk):
        for _ in range(count):
            parts = [(tensors[i].view(-1), starts[i], lo + at, n) for i, at, n in segments(numels, lo, lo + size)]
            flat = torch.cat([t[a - s:a - s + n] for t, s, a, n in parts])
            comm.all_reduce(flat, group)
            done = 0
            for t, s, a, n in parts:
                t[a - s:a - s + n].copy_(flat[done:done + n])
                done += n
            lo += size


@torch.no_grad()
def sum_tied_grads(engine: Engine, groups: Mapping[str, Group]) -> None:
    """Sum the local gradients of a tied weight's copies (`placement.tied`) before the reduction."""
    for name, params in by_group(engine.params, "tied").items():
        for p in params:
            comm.all_reduce(engine.local_grad(p), groups[name], dim=name)


def counted(p: nn.Parameter) -> bool:
    return placement_of(p).counted
