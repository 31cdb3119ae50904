"""ZeRO's composition as one value: `ZeroSpec(stage, pipeline, each_microbatch, offload, reshard_after_forward,
prefetch)`.

A run's ZeRO engine (engine.py) and the planner (plan/) both need the same facts about a ZeRO setting:
what it shards, when it reduce-scatters a unit (reduce.py's policies), whether its units are whole
blocks, how many gathers and reductions a unit makes in a step, where the optimizer state lives and what
leaves the device during the backward. They are derived here, once, from the five settings that decide
them (and ZeRO-3's prefetch depth); the engine is built from this value and the planner reads it (`plan.layout.Layout.zero_spec`), as
both read the pipeline's `Schedule` (pipeline/spec.py).

    stage                   0 (plain DDP: nothing sharded), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)
    pipeline                pp > 1: micro-batch backwards spread over the step
    each_microbatch         parallel.reduce_each_microbatch: reduce-scatter after every backward under a pipeline
    offload                 "none", "cpu" (ZeRO-Offload) or "nvme" (ZeRO-Infinity)
    reshard_after_forward   ZeRO-3 outside a pipeline: free a unit after its forward and gather it again
    prefetch                ZeRO-3 outside a pipeline: slots gathered ahead of the one running (order.py)

Pure Python: the planner imports it (no torch). Construction checks the rules the settings must keep.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import rules


@dataclass(frozen=True)
class ZeroSpec:
    stage: int = 0
    pipeline: bool = False
    each_microbatch: bool = False
    offload: str = "none"
    reshard_after_forward: bool = True
    prefetch: int = 1

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise rules.ConfigError(f"parallel.zero = {self.stage!r}: valid 0, 1, 2 or 3")
        rules.check_reduce_each_microbatch(self.each_microbatch, self.stage)
        rules.check_offload(self.offload, self.stage, offload_dir="(set)")
        rules.check_zero_prefetch(self.prefetch)

    @staticmethod
    def of(parallel) -> "ZeroSpec":
        """The ZeRO setting of a `ParallelConfig` or a planner `Layout` (zero, pp, reduce_each_microbatch,
        offload, reshard_after_forward, zero_prefetch)."""
        return ZeroSpec(parallel.zero, parallel.pp > 1, parallel.reduce_each_microbatch, parallel.offload,
                        parallel.reshard_after_forward, parallel.zero_prefetch)

    # -- what is sharded ------------------------------------------------------------------------------
    @property
    def shards_states(self) -> bool:
        """Any stage: each rank keeps its shard of the optimizer state (masters and moments) only."""
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        """Stages 2 and 3 keep only this rank's shard of each gradient between steps."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """Stage 3 keeps only this rank's shard of each parameter, gathering a unit before each use."""
        return self.stage == 3

    # -- when a unit is reduced (reduce.py) ---------------------------------------------------------
    @property
    def once_per_step(self) -> bool:
        """Gradients accumulate unsharded and each unit is reduce-scattered once a step (`OncePerStep`):
        stage 1, and stages 2 and 3 under a pipeline unless `each_microbatch`. Else every micro-batch's
        backward reduce-scatters the units it completes (`EachMicrobatch`)."""
        return self.stage == 1 or (self.pipeline and not self.each_microbatch)

    @property
    def reduces_each_microbatch(self) -> bool:
        """Stages 2 and 3 reduce-scatter the units a backward completes after every micro-batch's backward
        (`EachMicrobatch`): outside a pipeline always, under one with `each_microbatch`."""
        return self.shards_grads and not self.once_per_step

    @property
    def block_units(self) -> bool:
        """Units are whole blocks plus a root unit rather than buckets (`rules.block_units`): stage 3, and
        stage 2 reducing every micro-batch under a pipeline."""
        return rules.block_units(self.stage, 2 if self.pipeline else 1, self.each_microbatch)

    def reductions(self, microbatches: int, held: bool = False) -> int:
        """Reduce-scatters of one unit per step on one rank: once (`once_per_step`, or a `held` unit: a
        tied copy's, reduced after the copies' sum) or once per micro-batch."""
        return 1 if held or self.once_per_step else microbatches

    def gathers(self, microbatches: int, root: bool = False) -> int:
        """All-gathers of one ZeRO-3 unit per step on one rank (stages.py `ShardedParams`): without a pipeline
        before each micro-batch's forward and again before its backward (once with reshard_after_forward
        off), the root unit included; under one, a block before every forward and backward it runs, the
        `root` unit once for the step. Full recompute adds none: recompute.py re-runs a block inside its
        backward, after its pre-backward gather. Whatever the group size (a group of one "gathers" too, a
        copy the ledger does not record). 0 below stage 3 (stages 1 and 2 gather each unit once, after the
        step)."""
        if not self.shards_params:
            return 0
        if self.pipeline:
            return 1 if root else 2 * microbatches
        return (2 if self.reshard_after_forward else 1) * microbatches

    # -- offload (offload.py) -------------------------------------------------------------------------------
    @property
    def streams_grads(self) -> bool:
        """Reduced gradient shards go to host memory during the backward (ZeRO-Offload, Ren et al. 2021):
        offloaded stages 2 and 3; ZeRO-1 keeps the whole gradient on the device and copies its shards at
        the step."""
        return self.offload != "none" and self.stage >= 2

    @property
    def params_on_disk(self) -> bool:
        """ZeRO-Infinity's parameter shards in files (offload "nvme" at stage 3), read before each gather."""
        return self.offload == "nvme" and self.stage == 3

    # -- the step ----------------------------------------------------------------------------------------
    def norm_group(self, only_dp: bool = True) -> str:
        """The group the gradient norm's sum of squares is all-reduced over (`rules.grad_norm_group`)."""
        return rules.grad_norm_group(self.stage, only_dp)
