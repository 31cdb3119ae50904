"""The dimension contract: what every parallelism (tp, cp, ep, pp) offers the trainer and `parallelize`.

One seam for every parallelism, as torchtitan's parallelize_llama applies apply_tp → apply_cp → ... in one
place: each dimension is a `Dimension`, and the trainer and parallelize.py call its hooks directly, never
asking whether it has one. `name` and `apply` are required; every other hook is declared here with its
default, which changes nothing:

    hook                              default     what a dimension overrides it for
    name: str                         (required)  "tp", "cp", "ep", "pp"
    apply(model) -> model             (required)  shard or cut the model; return what this rank runs
    loss(loss_sum) -> loss_sum        identity    wrap the token-loss function (tp: vocab-parallel CE)
    shard_batch(*t_bs) -> t_bs        identity    the tokens of each sequence this rank holds, of each
                                                  (b, S) tensor (tokens, targets, document positions;
                                                  cp: its slice)
    positions                         None        their position ids (cp: zig-zag, not contiguous)
    forward_backward(...)             None        run the step's forward and backward itself (pp: the
                                                  schedule); None: the direct one (parallelize.py)
    forward_only(...)                 None        run an evaluation's forwards itself, no gradient (pp:
                                                  F/SEND_F/RECV_F); None: the direct one
    loss_group: str | None            None        a group whose ranks each hold part of the loss, summed
                                                  for reporting (pp: only the last stage has it)
    gather_state / split_state        identity    a full single-process state from this rank's pieces,
                                                  and back (Trainer.full_state; checkpoints need
                                                  neither: train/checkpoint.py writes each rank's pieces
                                                  where the placements put them)
    checkpoint_aliases                {}          {local name: checkpoint name} of copies (pp: the tied
                                                  head -> embed)
    write(out, gather_objects, rank, draw=None)   no-op   files it reports after a run (pp: the timeline)

A subclass (or a class it mixes in) that defines a public name outside this table fails when the class
is made (`__init_subclass__`), naming the hooks: a misspelt `shard_batches` would otherwise never be
called. Helpers are private (`_name`); per-instance state (meshes, groups, the pipeline's runtime) is
set in `__init__`/`apply`. A subclass without `name` or `apply` fails when it is instantiated.

Facts one dimension needs from another are passed as arguments, not written onto shared modules: the
MoE layers get one `MoE.configure(...)` call after every dimension applied (parallelize.configure_moe),
with the sequence group from one rule (rules.moe_sequence_group).

`ShardedState` is the gather/split pair of a dimension that shards parameters over one group (tp, ep).
"""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import torch
from torch import nn

HOOKS = ("name", "apply", "loss", "shard_batch", "positions", "forward_backward", "forward_only",
         "loss_group", "gather_state", "split_state", "checkpoint_aliases", "write")


class Dimension:
    """One parallel dimension (the module docstring is the contract)."""

    name: str = ""
    positions: torch.Tensor | None = None
    forward_backward = None
    forward_only = None
    loss_group: str | None = None
    checkpoint_aliases = MappingProxyType({})

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for klass in cls.__mro__:
            if klass in Dimension.__mro__:
                continue
            unknown = sorted(n for n in vars(klass) if not n.startswith("_") and n not in HOOKS)
            if unknown:
                raise TypeError(f"{cls.__name__}: {', '.join(unknown)} (from {klass.__name__}) is not a dimension "
                                f"hook; the hooks are {', '.join(HOOKS)} (parallel/dimension.py); name helpers "
                                f"with a leading underscore")

    def __new__(cls, *args, **kwargs):
        if not cls.name or cls.apply is Dimension.apply:
            raise TypeError(f"{cls.__name__} must set `name` and define `apply` (parallel/dimension.py)")
        return super().__new__(cls)

    def apply(self, model: nn.Module) -> nn.Module:
        raise TypeError(f"{type(self).__name__} defines no apply")

    def loss(self, loss_sum):
        return loss_sum

    def shard_batch(self, *tensors_bs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors_bs

    def gather_state(self, state: dict) -> dict:
        return state

    def split_state(self, state: dict) -> dict:
        return state

    def write(self, out: Path, gather_objects, rank: int, draw=None) -> None:
        return None


class ShardedState(Dimension):
    """Checkpoint state for a dimension that shards parameters over its groups (tp; the experts' ep and
    etp): full single-process tensors gathered from the pieces its ranks hold, and pieces split back out
    of them. A subclass sets `self.group` and `self.shards` (parameter name -> its `Shard` over that
    group, None if whole), or overrides `_sharded` to list several (group, shards) pairs, innermost
    split first."""

    def _sharded(self) -> list:
        return [(self.group, self.shards)]

    def gather_state(self, state: dict) -> dict:
        """A state full over the dimensions applied before (pieces over this one) made full here too."""
        for group, shards in self._sharded():
            state = {k: self._gather(v, group, shards) if isinstance(v, dict) else v for k, v in state.items()}
        return state

    def split_state(self, state: dict) -> dict:
        for group, shards in reversed(self._sharded()):
            state = {k: self._split(v, group, shards) if isinstance(v, dict) else v for k, v in state.items()}
        return state

    @staticmethod
    def _gather(tensors: dict[str, torch.Tensor], group, shards: dict) -> dict[str, torch.Tensor]:
        """Full tensors from this rank's pieces (all-gather over the group, dim "checkpoint")."""
        from .. import comm

        out = {}
        for name, t in tensors.items():
            shard = shards.get(name)
            if shard is None or shard.dim is None:
                out[name] = t.clone()
                continue
            t = t.contiguous()
            n = group.size
            flat = torch.empty((n * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            comm.all_gather(flat, t, group, dim="checkpoint")
            out[name] = shard.assemble(flat.view((n,) + tuple(t.shape)))
        return out

    @staticmethod
    def _split(tensors: dict[str, torch.Tensor], group, shards: dict) -> dict[str, torch.Tensor]:
        """This rank's pieces of full single-process tensors."""
        def piece(name, t):
            shard = shards.get(name)
            return t.clone() if shard is None else shard.piece(t, group.rank, group.size)
        return {name: piece(name, t) for name, t in tensors.items()}
