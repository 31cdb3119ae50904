"""The pipeline as a dimension (the contract of parallel/dimension.py): `PipelineParallelism` cuts the
(tp-sharded) model to this rank's stage (runtime.py `Stage`), runs the step's forward and backward by the
schedule's action list (`Schedule`, spec.py; the actions run by runtime.py's `PipelineRuntime`), sums the
tied embedding's two copies over the embed group, and gathers the stages' states into one.

Paper: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC 2021): 1F1B and the interleaved schedule; Qi et al., "Zero Bubble Pipeline
Parallelism" (ICLR 2024). Communication: each micro-batch's activation (b·s·h, s/tp with SP) forward to
the next stage and its gradient back, point to point (dim "pp"); the tied embedding's gradient summed
over the first and last stage (dim "embed").
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ...config import Config
from ..dimension import Dimension
from ..engine import Engine, sum_tied_grads
from ..microbatch import LossSum, MicroBatch


class PipelineParallelism(Dimension):
    """The pipeline dimension (pipeline/runtime.py): cuts the (tp-sharded) model to this rank's stage,
    runs the step's forward and backward by the schedule's action list, sums tied embedding copies,
    and gathers the stages' states into one."""

    name = "pp"
    loss_group = "pp"          # only the last stage computes the loss

    def __init__(self, mesh, cfg: Config):
        from .spec import Schedule

        self.mesh, self.cfg = mesh, cfg
        self.schedule = Schedule.of(cfg)            # one value: the lists, the report and pipeline.json
        self.partition = self.schedule.partition
        self.rank = mesh.coords["pp"]
        self.actions = self.schedule.actions()[self.rank]

    def apply(self, model: nn.Module) -> nn.Module:
        from .runtime import Stage, stage_names

        self.names = stage_names(model, self.partition)   # (name, piece shape) per stage, before the cut
        from .runtime import PipelineRuntime

        p = self.cfg.parallel
        self.stage = Stage(model, self.partition, self.rank, seq_split=p.tp if p.sp_mode == "megatron" else 1)
        # the last stage's copy of a tied embedding is the embedding in a checkpoint
        self.checkpoint_aliases = {"head.weight": "embed.weight"} if self.stage.tied_copy is not None else {}
        dtype = next(self.stage.parameters()).dtype
        self.runtime = PipelineRuntime(self.stage, self.actions, self.mesh["pp"], self.cfg.train.recompute, dtype)
        return self.stage

    def forward_backward(self, model: nn.Module, loss_sum: LossSum, engine: Engine,
                         micro_batches: list[MicroBatch], positions=None) -> torch.Tensor:
        """Every micro-batch's forward and backward by the schedule, gradients accumulating locally and
        each chunk's reduced after its last backward (`parallel.overlap_grad_reduce`; engine.py); then the
        tied copies' gradients are summed (dim "embed") and the engine reduces what is left."""
        sync = engine.set_sync if self.cfg.parallel.overlap_grad_reduce else None
        engine.set_sync(False)
        loss_local = self.runtime.run(micro_batches, loss_sum, positions, sync=sync)
        sum_tied_grads(engine, self.mesh)
        engine.set_sync(True)
        engine.end_backward()
        return loss_local

    def forward_only(self, model: nn.Module, loss_sum: LossSum, micro_batches: list[MicroBatch],
                     positions=None) -> torch.Tensor:
        """An evaluation: every micro-batch's forward through the stages (the forward-only action list),
        no gradient; this rank's share of the loss (nonzero on the last stage)."""
        return self.runtime.run_forward(micro_batches, loss_sum, positions)

    def gather_state(self, state: dict) -> dict:
        from .runtime import gather_stages

        return gather_stages(self._stage_state(state, with_copy=False), self.names, self.mesh["pp"])

    def split_state(self, state: dict) -> dict:
        return self._stage_state(state, with_copy=True)

    def _stage_state(self, state: dict, with_copy: bool) -> dict:
        """This stage's entries of a full state; with_copy adds the tied head copy (= the embedding),
        without it the copy is dropped (the checkpoint holds the embedding once)."""
        names = {n: n for n, _ in self.names[self.rank]}
        if self.stage.tied_copy is not None and with_copy:
            names["head.weight"] = "embed.weight"
        return {k: ({n: v[src] for n, src in names.items()} if isinstance(v, dict) else v) for k, v in state.items()}

    def write(self, out: Path, gather_objects, rank: int, draw=None) -> None:
        """OUT/pipeline.json: the last step's measured timeline of the pp ranks of rank 0's group beside
        the simulated one (call on every rank: gathers the timelines); then `draw(out, info)`, when
        given, draws it (the trainer passes train/timeline.py's `draw_pipeline`: OUT/pipeline.svg)."""
        from .runtime import report, write_report

        timelines = gather_objects([tuple(b) for b in self.runtime.timeline])
        if rank == 0:
            rows = [timelines[r] for r in self.mesh["pp"].ranks]
            info = report(rows, self.schedule)
            write_report(out, info)
            if draw is not None:
                draw(out, info)
