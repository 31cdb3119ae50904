"""One seam for every parallelism: each dimension is an object with the same small interface, and
`parallelize` applies them to the full seeded model in one documented order.

    tp → cp → ep → pp        (as torchtitan's parallelize_llama: apply_tp → apply_cp → ... → apply_fsdp)

then the gradient engine (DDP or ZeRO, data.py / zero.py) wraps whatever parameters this rank holds,
partitioned by each parameter's `placement.reduce` group. Each dimension shards what it owns in place
and writes the parameters' placements (placement.py); the trainer never names a dimension.

A dimension (`Parallelism`) may provide, all optional but `name` and `apply`:

    apply(model) -> model          shard or cut the model; return what this rank runs
    loss(loss_sum) -> loss_sum     wrap the token-loss function (tp: vocab-parallel cross-entropy)
    shard_batch(*t_bs) -> t_bs     the tokens of each sequence this rank holds, of each (b, S) tensor
                                   (tokens, targets, document positions; cp: its slice)
    positions                      their position ids (cp: zig-zag, not contiguous)
    forward_backward(...)          run the step's forward and backward itself (pp: the schedule)
    forward_only(...)              run an evaluation's forwards itself, no gradient (pp: F/SEND_F/RECV_F)
    schedules_backward: bool       its backwards interleave with other micro-batches' forwards, so the
                                   engine accumulates the step's gradients and reduces them once (pp)
    loss_group: str                a group whose ranks each hold part of the loss, summed for reporting
    gather_state / split_state     a full single-process state from this rank's pieces, and back
                                   (Trainer.full_state; checkpoints need neither: train/checkpoint.py
                                   writes each rank's pieces where the placements put them)
    checkpoint_aliases             {local name: checkpoint name} of copies (pp: tied head -> embed)
    write(out, gather_objects, rank)  files it reports after a run (pp: the timeline)

State flows out through the dimensions in the order they were applied (each widens the state by
gathering its own pieces: tp gathers the tp pieces of this stage's tensors, then pp gathers the stages)
and back in the reverse order. Context parallelism (context.py) swaps each attention core for the
Ulysses / ring / hybrid one, writes `reduce="dp_cp"` on the dense parameters, slices each micro-batch
along the sequence and hands the model its position ids. Expert parallelism (expert.py) comes after it:
it keeps this rank's experts of every MoE layer, writes `reduce="edp"` plus an "ep" `Shard` on their
weights and swaps in the all-to-all dispatcher; the MoE load-balance loss goes through `model.aux`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from .. import comm
from ..config import Config
from ..model.documents import documents_of
from .engine import Engine, sum_tied_grads

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Parallelism(Protocol):
    name: str

    def apply(self, model: nn.Module) -> nn.Module: ...


def parallelize(model: nn.Module, mesh, cfg: Config) -> tuple[nn.Module, list]:
    """Apply every dimension with degree > 1, in the order tp → cp → ep → pp; return the module this rank
    runs and the applied dimension objects."""
    from .context import ContextParallelism
    from .expert import ExpertParallelism
    from .tensor import TensorParallelism

    p, t = cfg.parallel, cfg.train
    dims = []
    if p.tp > 1:
        dims.append(TensorParallelism(mesh, p.sp_mode == "megatron", t.seed))
    if p.cp > 1:
        dims.append(ContextParallelism(mesh, cfg))
    if p.ep > 1:
        dims.append(ExpertParallelism(mesh, cfg))
    if p.pp > 1:
        dims.append(PipelineParallelism(mesh, cfg))
    for d in dims:
        model = d.apply(model)
    if p.pp == 1:   # the pipeline runtime recomputes its own stages (recompute.py names both)
        from .recompute import apply_recompute
        apply_recompute(model, t.recompute)
    return model, dims


def loss_function(dims: list, loss_sum: LossSum) -> LossSum:
    for d in dims:
        if hasattr(d, "loss"):
            loss_sum = d.loss(loss_sum)
    return loss_sum


def gather_state(dims: list, state: dict) -> dict:
    for d in dims:
        if hasattr(d, "gather_state"):
            state = d.gather_state(state)
    return state


def split_state(dims: list, state: dict) -> dict:
    for d in reversed(dims):
        if hasattr(d, "split_state"):
            state = d.split_state(state)
    return state


class PipelineParallelism:
    """The pipeline dimension (pipeline/runtime.py): cuts the (tp-sharded) model to this rank's stage,
    runs the step's forward and backward by the schedule's action list, sums tied embedding copies,
    and gathers the stages' states into one."""

    name = "pp"
    loss_group = "pp"          # only the last stage computes the loss
    schedules_backward = True  # micro-batch backwards spread over the step: engines reduce once, at its end

    def __init__(self, mesh, cfg: Config):
        from .pipeline import Schedule

        self.mesh, self.cfg = mesh, cfg
        self.schedule = Schedule.of(cfg)            # one value: the lists, the report and pipeline.json
        self.partition = self.schedule.partition
        self.rank = mesh.coords["pp"]
        self.actions = self.schedule.actions()[self.rank]

    def apply(self, model: nn.Module) -> nn.Module:
        from .pipeline.runtime import Stage, stage_names

        self.names = stage_names(model, self.partition)   # (name, piece shape) per stage, before the cut
        from .pipeline.runtime import PipelineRuntime

        self.stage = Stage(model, self.partition, self.rank)
        # the last stage's copy of a tied embedding is the embedding in a checkpoint
        self.checkpoint_aliases = {"head.weight": "embed.weight"} if self.stage.tied_copy is not None else {}
        p = self.cfg.parallel
        self.stage.seq_split = p.tp if p.sp_mode == "megatron" else 1
        dtype = next(self.stage.parameters()).dtype
        self.runtime = PipelineRuntime(self.stage, self.actions, self.mesh["pp"], None, self.cfg.train.recompute, dtype)
        return self.stage

    def forward_backward(self, model: nn.Module, loss_sum: LossSum, engine: Engine, micro_batches: list,
                         n_tokens: int, positions=None) -> torch.Tensor:
        """Every micro-batch's forward and backward by the schedule, gradients accumulating locally and
        each chunk's reduced after its last backward (`parallel.overlap_grad_reduce`; engine.py); then the
        tied copies' gradients are summed (dim "embed") and the engine reduces what is left."""
        self.runtime.loss_fn = loss_sum
        self.runtime.sync = engine.set_sync if self.cfg.parallel.overlap_grad_reduce else None
        engine.set_sync(False)
        loss_local = self.runtime.run(micro_batches, n_tokens, positions)
        sum_tied_grads(engine, self.mesh)
        engine.set_sync(True)
        engine.end_backward()
        return loss_local

    def forward_only(self, model: nn.Module, loss_sum: LossSum, micro_batches: list, n_tokens: int,
                     positions=None) -> torch.Tensor:
        """An evaluation: every micro-batch's forward through the stages (the forward-only action list),
        no gradient; this rank's share of the loss (nonzero on the last stage)."""
        self.runtime.loss_fn = loss_sum
        return self.runtime.run_forward(micro_batches, n_tokens, positions)

    def gather_state(self, state: dict) -> dict:
        from .pipeline.runtime import gather_stages

        return gather_stages(self.stage_state(state, with_copy=False), self.names, self.mesh["pp"])

    def split_state(self, state: dict) -> dict:
        return self.stage_state(state, with_copy=True)

    def stage_state(self, state: dict, with_copy: bool) -> dict:
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
        from .pipeline.runtime import report, write_report

        timelines = gather_objects([tuple(b) for b in self.runtime.timeline])
        if rank == 0:
            rows = [timelines[r] for r in self.mesh["pp"].ranks]
            info = report(rows, self.schedule)
            write_report(out, info)
            if draw is not None:
                draw(out, info)


def direct_forward_backward(model: nn.Module, loss_sum: LossSum, engine: Engine, micro_batches: list,
                            n_tokens: int, positions=None) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn; only the last one's backward reduces."""
    loss_local = torch.zeros(1, dtype=torch.float64, device=micro_batches[0][0].device)
    for i, mb in enumerate(micro_batches):
        engine.set_sync(i == len(micro_batches) - 1)
        x_bs, y_bs = mb[0], mb[1]
        loss = loss_sum(model(x_bs, positions, documents=documents_of(mb)), y_bs) / n_tokens
        loss.backward()
        engine.end_backward()
        loss_local += loss.detach().double()
    return loss_local


@torch.no_grad()
def direct_forward(model: nn.Module, loss_sum: LossSum, micro_batches: list, n_tokens: int,
                   positions=None) -> torch.Tensor:
    """An evaluation's forward of each micro-batch in turn, no gradient: the sum of their token losses
    over `n_tokens`, as `direct_forward_backward` reports it."""
    loss_local = torch.zeros(1, dtype=torch.float64, device=micro_batches[0][0].device)
    for mb in micro_batches:
        loss_local += (loss_sum(model(mb[0], positions, documents=documents_of(mb)), mb[1]) / n_tokens).double()
    return loss_local


def sum_loss(loss_local: torch.Tensor, mesh, dims: list) -> None:
    """The step's loss on every rank: summed over dp × cp (each rank's share of the batch's sequences
    and tokens) and over the groups of the dimensions that split it further (pp: only the last stage)."""
    comm.all_reduce(loss_local, mesh["dp_cp"], dim="loss")
    for d in dims:
        if getattr(d, "loss_group", None):
            comm.all_reduce(loss_local, mesh[d.loss_group], dim="loss")
