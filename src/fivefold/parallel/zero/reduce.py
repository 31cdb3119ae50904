"""When ZeRO reduce-scatters a unit's gradients: after every micro-batch's backward, or once per step.
Torch-free: the runtime (engine.py) follows it and the planner may read it.

Two policies (Rajbhandari et al., "ZeRO", SC 2020; Zhao et al., "PyTorch FSDP", VLDB 2023):

* `EachMicrobatch`: a rank keeps no full gradient between micro-batches. As soon as a backward has
  produced every gradient of a unit, the unit is reduce-scattered and only this rank's shard accumulates
  (DeepSpeed's ZeRO-2/3, FSDP): stages 2 and 3 outside a pipeline, and under one with
  `reduce_each_microbatch` (then a unit must lie inside one chunk, whose backward completes it:
  `rules.block_units`, and a chunk's next backward starts the unit over: `restarts_at_reduce`).
  Bytes: the backward's reduce-scatter m times per step for m micro-batches.
* `OncePerStep`: gradients accumulate unsharded in the unit's buffer over the step's micro-batches and
  each unit is reduce-scattered once, by the backward that makes it final (`set_sync(True)`): stage 1
  always (it keeps the whole gradient anyway), and stages 2 and 3 under a pipeline, whose micro-batch
  backwards are spread over the step (FSDP under torch.distributed.pipelining, Megatron's distributed
  optimizer). Bytes: one reduce-scatter per step; memory: the full gradient during the backward phase.

The communication is the reduce-scatter of `comm.reduce_scatter`, issued by the engine (engine.py).
"""
from __future__ import annotations

from typing import Protocol

from .spec import ZeroSpec


class ReducePolicy(Protocol):
    keeps_full_grads: bool      # a unit's whole gradient lives across micro-batches (accumulated unsharded)
    restarts_at_reduce: bool    # a unit's reduction re-arms it for the next backward of its chunk

    def reduces(self, sync: bool) -> bool:
        """Whether a backward run with `sync` (are its gradients the step's final ones?) reduces the units
        it completes."""
        ...


class EachMicrobatch:
    """Reduce-scatter every backward; only the shard accumulates."""

    keeps_full_grads = False

    def __init__(self, pipeline: bool):
        self.restarts_at_reduce = pipeline   # under a pipeline a chunk runs several backwards before end_backward

    def reduces(self, sync: bool) -> bool:
        return True


class OncePerStep:
    """Accumulate the whole gradient over the step's micro-batches, reduce-scatter it once."""

    keeps_full_grads = True
    restarts_at_reduce = False

    def reduces(self, sync: bool) -> bool:
        return sync


def reduce_policy(spec: ZeroSpec) -> ReducePolicy:
    """The policy of a ZeRO setting (stage 1, 2, 3, under a pipeline or not, `each_microbatch`)."""
    if spec.once_per_step:
        return OncePerStep()
    return EachMicrobatch(spec.pipeline)


# ZeRO-Offload's streamed gradients (parallel/zero/offload.py): host buffers of the largest shard a reduced shard
# lands in (d2h) before it is added to its host shard; on CUDA the copy of one may still run when the next
# comes. The planner counts them in host memory (plan/buffers.py `offload_bytes`).
LANDING = 2

