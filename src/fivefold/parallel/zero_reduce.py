"""When ZeRO reduce-scatters a unit's gradients: after every micro-batch's backward, or once per step.
Torch-free: the runtime (zero.py) follows it and the planner may read it.

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

The communication is the reduce-scatter of `comm.reduce_scatter`, issued by the engine (zero.py).
"""
from __future__ import annotations

from typing import Protocol

from .. import rules


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


def reduce_policy(stage: int, pipeline: bool, reduce_each_microbatch: bool) -> ReducePolicy:
    """The policy of ZeRO `stage` (1, 2, 3), under a pipeline or not (`parallel.reduce_each_microbatch`)."""
    rules.check_reduce_each_microbatch(reduce_each_microbatch, stage)
    if stage == 1 or (pipeline and not reduce_each_microbatch):
        return OncePerStep()
    return EachMicrobatch(pipeline)


# ZeRO-Offload's streamed gradients (parallel/offload.py): host buffers of the largest shard a reduced shard
# lands in (d2h) before it is added to its host shard; on CUDA the copy of one may still run when the next
# comes. The planner counts them in host memory (plan/buffers.py `offload_bytes`).
LANDING = 2


def streams_grads(stage: int, offload: str) -> bool:
    """Whether the reduced gradient shards go to host memory during the backward (ZeRO-Offload, Ren et al.
    2021): offloaded ("cpu", "nvme") stages that shard gradients (2, 3). ZeRO-1 keeps the whole gradient
    on the device anyway; its shards are copied down at the step."""
    return offload != "none" and stage >= 2
