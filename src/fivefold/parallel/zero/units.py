"""ZeRO's units: flat, padded groups of parameters, each sharded evenly over the ranks of its reduce group.

Paper: Rajbhandari et al., "ZeRO" (SC 2020). Parameters are partitioned by the group their gradient is
summed over (`placement.reduce`: dp, dp×cp, expert-dp) and each partition is packed into units, each a
flat buffer padded to a multiple of its group's size n; rank r of the group owns elements [r·k, (r+1)·k)
of every unit, k = padded/n. Bucket units (`bucket_units`) hold at most `bucket_mb` MiB in backward order,
like data.py's buckets; block units (`block_slots`) are one unit per transformer block (and group) plus
"root" units (embedding, final norm, head), so a block's weights can be gathered just before it runs.
No communication here: the engine (engine.py) and the stage (stages.py) move the units' bytes.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ...comm import Group
from ...model.init import is_placeholder
from ...shapes import padded, segments
from ..data import bucketize
from ..engine import backward_order, reduce_partitions, unique_params


class Unit:
    """A flat, padded group of parameters, sharded evenly over the ranks of `group`."""

    def __init__(self, name: str, params: list[nn.Parameter], names: list[str], group: Group):
        self.name, self.params, self.names, self.group = name, params, names, group
        self.shapes = [p.shape for p in params]
        numels = [p.numel() for p in params]
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        self.numel = sum(numels)
        self.padded = padded(self.numel, group.size)
        self.shard_size = self.padded // group.size
        self.lo, self.hi = group.rank * self.shard_size, (group.rank + 1) * self.shard_size
        self.segments = segments(numels, self.lo, self.hi)   # (param index, start in shard, length)
        self.index = {p: i for i, p in enumerate(params)}
        self.pos = 0                  # its index in the engine's units
        self.held = False             # holds a tied copy under a pipeline: reduced once, after the tied sum
        self.pending: set = set()     # parameters whose final gradient has not arrived
        self.seen: set = set()        # stage 3 under a pipeline: parameters done in this backward
        self.grad: torch.Tensor | None = None   # the unit's full gradient while it accumulates
        self.gathered = False
        self.gather_handle = None
        self.full: torch.Tensor | None = None

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype, device=None) -> torch.Tensor:
        """The unit's padded flat buffer holding `tensors`; a placeholder (a parameter not filled yet:
        model/init.py) leaves its part zero."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for t, o in zip(tensors, self.offsets):
            if not is_placeholder(t):
                flat[o:o + t.numel()].copy_(t.reshape(-1))
        return flat

    def shard_of(self, tensors: list[torch.Tensor], dtype: torch.dtype, device=None) -> torch.Tensor:
        """This rank's shard [lo, hi) of the unit's flat buffer, built from its segments only (the whole
        unit is never allocated); placeholders leave their segments zero."""
        shard = torch.zeros(self.shard_size, dtype=dtype, device=device)
        for i, a, n in self.segments:
            t = tensors[i]
            if not is_placeholder(t):
                start = self.lo + a - self.offsets[i]
                shard[a:a + n].copy_(t.reshape(-1)[start:start + n])
        return shard

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        """p's slice of the unit's full gradient (by its recorded shape: a ZeRO-3 parameter may be freed)."""
        i = self.index[p]
        return self.grad[self.offsets[i]:self.offsets[i] + self.shapes[i].numel()].view(self.shapes[i])


def bucket_units(params: list[nn.Parameter], names: dict, groups: Mapping[str, Group], bucket_mb: float,
                 itemsize: int) -> list[Unit]:
    """Units of at most bucket_mb MiB of gradients, in the order backward makes them final, per group."""
    units = []
    for group, ps in reduce_partitions(backward_order(params), groups):
        for bucket in bucketize(ps, int(bucket_mb * 2**20), itemsize):
            units.append(Unit(f"bucket{len(units)}", bucket, [names[id(p)] for p in bucket], group))
    return units


def block_slots(model: nn.Module, params: list[nn.Parameter], names: dict, groups: Mapping[str, Group],
                pipeline: bool) -> list[list[Unit]]:
    """Units that are whole modules (`rules.block_units`): a "slot" per module that runs as a whole
    (root, then each block), a unit per reduce group in it."""
    return [[Unit(name, ps, [names[id(p)] for p in ps], group) for group, ps in reduce_partitions(mine, groups)]
            for name, mine, _ in modules_to_gather(model, params, pipeline)]


def modules_to_gather(model: nn.Module, params: list[nn.Parameter],
                      pipeline: bool) -> list[tuple[str, list[nn.Parameter], list[nn.Module]]]:
    """(name, parameters, modules whose forward needs them): 'root' (everything outside the blocks;
    hooked on the model, or under a pipeline on each module holding root parameters), then one entry per
    block of `model.layers` (a ModuleList, or a pipeline stage's ModuleDict)."""
    blocks, in_blocks = [], set()
    layers = getattr(model, "layers", nn.ModuleList())
    for key, block in layers.named_children():
        mine = unique_params(block)
        blocks.append((f"layers.{key}", mine, [block]))
        in_blocks.update(id(p) for p in mine)
    root = [p for p in params if id(p) not in in_blocks]
    if pipeline:
        holders = [m for name, m in model.named_children() if name != "layers"
                   and any(id(p) not in in_blocks for p in m.parameters())]
    else:
        holders = [model]
    return [("root", root, holders)] + blocks
