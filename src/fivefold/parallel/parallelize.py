"""One seam for every parallelism: each dimension is an object with the same small interface, and
`parallelize` applies them to the full seeded model in one documented order.

    tp → cp → ep (the routed experts' ep and etp pieces) → pp        (as torchtitan's parallelize_llama: apply_tp → apply_cp → ... → apply_fsdp)

then the gradient engine (DDP or ZeRO, data.py / zero.py) wraps whatever parameters this rank holds,
partitioned by each parameter's `placement.reduce` group. Each dimension shards what it owns in place
and writes the parameters' placements (placement.py); the trainer never names a dimension.

Each dimension is a `Dimension` (dimension.py: the contract, its hooks and their defaults); this file
and the trainer call the hooks directly. After every dimension applied, `configure_moe` tells each MoE
layer, in one `MoE.configure` call, what they decided: the dispatcher (ep), the row split (tp without SP)
and the group its per-sequence statistics are summed over (rules.moe_sequence_group: tp under Megatron
SP, cp, tp × cp, or none), and the step's totals.

State flows out through the dimensions in the order they were applied (each widens the state by
gathering its own pieces: tp gathers the tp pieces of this stage's tensors, then pp gathers the stages)
and back in the reverse order. Context parallelism (context.py) swaps each attention core for the
Ulysses / ring / hybrid one, writes `reduce="dp_cp"` on the dense parameters, slices each micro-batch
along the sequence and hands the model its position ids. Expert parallelism (expert.py) comes after it, whenever
ep or etp > 1 (rules.experts_on_expert_grid): it keeps this rank's piece of the routed experts of every
MoE layer (E/ep experts, 1/etp of each one's width), writes `reduce="edp"` plus "ep" and "etp" `Shard`s on
their weights, and its all-to-all dispatcher reaches the layers through `configure_moe`; the MoE
load-balance loss goes through `model.aux`.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from .. import comm, rules
from ..config import Config
from ..model.moe import MoE
from .dimension import Dimension
from .engine import Engine
from .microbatch import LossSum, MicroBatch
from .pipeline.dimension import PipelineParallelism



def parallelize(model: nn.Module, mesh, cfg: Config, dry: bool = False) -> tuple[nn.Module, list[Dimension]]:
    """Apply every dimension with degree > 1, in the order tp → cp → ep → pp, then configure the MoE
    layers (`configure_moe`; `dry`: a dry run's shape-only dispatch); return the module this rank runs
    and the applied dimension objects."""
    from .context import ContextParallelism
    from .expert import ExpertParallelism
    from .tensor import TensorParallelism

    p, t = cfg.parallel, cfg.train
    dims = []
    if p.tp > 1:
        dims.append(TensorParallelism(mesh, p.sp_mode == "megatron", t.seed, rules.overlaps_tp_input(p.pp, p.schedule, p.tp_overlap),
                                      experts_folded=rules.experts_on_expert_grid(p.ep, p.etp)))
    if p.cp > 1:
        dims.append(ContextParallelism(mesh, cfg))
    if cfg.model.experts and rules.experts_on_expert_grid(p.ep, p.etp):
        dims.append(ExpertParallelism(mesh, cfg))   # the routed experts' own mapping (MoE parallel folding)
    if p.pp > 1:
        dims.append(PipelineParallelism(mesh, cfg))
    for d in dims:
        model = d.apply(model)
    configure_moe(model, mesh, cfg, dry)
    from .recompute import apply_recompute
    apply_recompute(model, rules.block_recompute(t.recompute, p.pp, p.schedule))   # once, after every dimension
    return model, dims


def configure_moe(model: nn.Module, mesh, cfg: Config, dry: bool = False) -> None:
    """One `MoE.configure` call per MoE layer of `model` (this rank's, after every dimension applied),
    with what the dimensions decided, each from one rule: the rows split over tp without SP
    (rules.moe_splits_rows), the group whose ranks hold parts of each sequence
    (rules.moe_sequence_group), the all-to-all dispatcher over ep (a dry run's shape-only one), and the
    step's sequences and tokens, which scale the auxiliary losses, and under random routing the view of
    the tokens' keys the layer routes (tp's row split or sequence shard) and the run's seed. `mesh`:
    anything that names groups."""
    from ..comm.autograd import sum_across
    from .expert import dispatcher
    from .tensor import moe_keys_view, moe_rows

    p, t = cfg.parallel, cfg.train
    group = rules.moe_sequence_group(p.tp, p.sp_mode, p.cp)
    parts = None if group is None else mesh[group]
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.configure(dispatcher=dispatcher(mesh["ep"] if p.ep > 1 else None, moe.n_experts, p.fp8_dispatch, dry,
                                            mesh["etp"] if p.etp > 1 else None),
                      rows=moe_rows(mesh["tp"]) if rules.moe_splits_rows(p.tp, p.sp_mode) else None,
                      sum_sequence_parts=None if parts is None else partial(sum_across, group=parts),
                      sequence_parts=rules.moe_sequence_parts(p.tp, p.sp_mode, p.cp),
                      global_sequences=t.global_batch, global_tokens=t.global_batch * t.seq_len,
                      keys_view=moe_keys_view(mesh["tp"], rules.moe_splits_rows(p.tp, p.sp_mode)) if p.tp > 1 else None,
                      seed=t.seed)


def loss_function(dims: list[Dimension], loss_sum: LossSum) -> LossSum:
    """The token-loss function, wrapped by each dimension in applied order (tp: vocab-parallel)."""
    for d in dims:
        loss_sum = d.loss(loss_sum)
    return loss_sum


def step_functions(dims: list[Dimension]) -> tuple[Callable, Callable]:
    """(forward_backward, forward_only) of a step: the first dimension's that runs them itself (pp), else
    the direct ones."""
    fb = next((d.forward_backward for d in dims if d.forward_backward is not None), direct_forward_backward)
    fo = next((d.forward_only for d in dims if d.forward_only is not None), direct_forward)
    return fb, fo


def positions_of(dims: list[Dimension]) -> torch.Tensor | None:
    """The position ids of this rank's tokens, when a dimension makes them not contiguous (cp), else None."""
    return next((d.positions for d in dims if d.positions is not None), None)


def shard_batch(dims: list[Dimension], *tensors_bs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's tokens of each (b, S) tensor, every dimension taking its part in applied order."""
    for d in dims:
        tensors_bs = d.shard_batch(*tensors_bs)
    return tensors_bs


def gather_state(dims: list[Dimension], state: dict) -> dict:
    for d in dims:
        state = d.gather_state(state)
    return state


def split_state(dims: list[Dimension], state: dict) -> dict:
    for d in reversed(dims):
        state = d.split_state(state)
    return state


def checkpoint_aliases(dims: list[Dimension]) -> dict[str, str]:
    """{local name: checkpoint name} of every dimension's copies."""
    return {k: v for d in dims for k, v in d.checkpoint_aliases.items()}


def direct_forward_backward(model: nn.Module, loss_sum: LossSum, engine: Engine, micro_batches: list[MicroBatch],
                            positions=None) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn; only the last one's backward reduces."""
    loss_local = torch.zeros(1, dtype=torch.float64, device=micro_batches[0].tokens.device)
    for i, mb in enumerate(micro_batches):
        engine.set_sync(i == len(micro_batches) - 1)
        loss = mb.loss(loss_sum, model(mb.tokens, positions, documents=mb.documents, keys_bs=mb.keys))
        loss.backward()
        engine.end_backward()
        loss_local += loss.detach().double()
    return loss_local


@torch.no_grad()
def direct_forward(model: nn.Module, loss_sum: LossSum, micro_batches: list[MicroBatch],
                   positions=None) -> torch.Tensor:
    """An evaluation's forward of each micro-batch in turn, no gradient: the sum of their shares of the
    mean token loss, as `direct_forward_backward` reports it."""
    loss_local = torch.zeros(1, dtype=torch.float64, device=micro_batches[0].tokens.device)
    for mb in micro_batches:
        loss_local += mb.loss(loss_sum, model(mb.tokens, positions, documents=mb.documents, keys_bs=mb.keys)).double()
    return loss_local


def sum_loss(loss_local: torch.Tensor, mesh, dims: list) -> None:
    """The step's loss on every rank: summed over dp × cp (each rank's share of the batch's sequences
    and tokens) and over the groups of the dimensions that split it further (pp: only the last stage)."""
    comm.all_reduce(loss_local, mesh["dp_cp"], dim="loss")
    for d in dims:
        if d.loss_group is not None:
            comm.all_reduce(loss_local, mesh[d.loss_group], dim="loss")
