"""Placement: what every parameter carries about how it is laid out over the parallel groups.

One record per parameter (`param.placement`), written by the dimension that shards or copies it and read
by everything that must treat parameters differently: the gradient engines (which group to sum over),
the global gradient norm (who counts it), the partial-gradient sums after the reduction, and the
checkpoint (how to gather full tensors and split them back). References: nanotron's parameters that
carry their sharding (`mark_as_sharded`, `mark_as_tied`) and DTensor's placements (Shard/Replicate/Partial).

Fields (group names are names of `ParallelMesh` groups, so a record is the same on every rank):

    shards   how the full tensor is cut: one `Shard` per sharding group (tp today, ep with experts)
    reduce   the group the engine sums the gradient over: the ranks that see different data and hold
             the same piece ("dp"; "dp_cp" with context parallelism; "edp" for experts)
    partial  a group whose ranks each computed part of this gradient (Megatron-SP norms: "tp"; K/V
             heads replicated because tp > kv_heads: "tp_kv"); summed after the engine's reduction
    tied     a group holding copies of one weight (tied embedding and head on the first and last
             pipeline stage: "embed"); their local gradients are summed before the engine's reduction
    counted  whether this rank counts the gradient in the global norm: of replicas made by a sharding
             dimension (tp replicas, tied copies) exactly one rank counts it

Example (tp = 2, pp = 2, tied embeddings, Megatron SP), on the last pipeline stage, tp rank 1:

    layers.3.attn.wq.weight  Placement(shards=(Shard("tp", dim=0, full=128),))
    layers.3.attn_norm.weight Placement(shards=(Shard("tp", None, replicas=2),), partial="tp", counted=False)
    head.weight              Placement(shards=(Shard("tp", dim=0, full=256),), tied="embed", counted=False)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Shard:
    """How one parameter is laid out over the n ranks of a sharding group.

    dim: dimension of the full tensor split into pieces (None: the whole tensor on every rank).
    full: size of that dimension in the single-process model (before padding).
    replicas: consecutive ranks holding the same piece (n for a replicated tensor; n/kv_heads for
        K/V when tp > kv_heads; else 1). Rank r holds piece r // replicas of n / replicas pieces.
    """

    group: str
    dim: int | None
    full: int = 0
    replicas: int = 1

    def size(self, n: int) -> int:
        """Length along `dim` of every rank's piece (the last pieces are zero-padded to it)."""
        return -(-self.full // (n // self.replicas))

    def extent(self, rank: int, n: int) -> tuple[int, int]:
        """(start, length) along `dim` of the full tensor's part that this rank's piece holds; the
        piece's first `length` rows are that part, the rest is padding (length 0: padding only)."""
        size = self.size(n)
        start = (rank // self.replicas) * size
        return start, max(0, min(size, self.full - start))

    def piece(self, full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
        """This rank's piece of the full tensor, zero-padded to the common piece size."""
        if self.dim is None:
            return full.clone()
        start, length = self.extent(rank, n)
        shape = list(full.shape)
        shape[self.dim] = self.size(n)
        out = torch.zeros(shape, dtype=full.dtype, device=full.device)
        if length:
            out.narrow(self.dim, 0, length).copy_(full.narrow(self.dim, start, length))
        return out

    def assemble(self, pieces_n: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's piece, stacked along a new dim 0 in rank order."""
        if self.dim is None:
            return pieces_n[0].clone()
        distinct = pieces_n[:: self.replicas]
        return torch.cat(list(distinct), dim=self.dim).narrow(self.dim, 0, self.full).clone()


@dataclass(frozen=True)
class Placement:
    shards: tuple[Shard, ...] = ()
    reduce: str = "dp"
    partial: str | None = None
    tied: str | None = None
    counted: bool = True

    def shard(self, group: str) -> Shard | None:
        return next((s for s in self.shards if s.group == group), None)


REPLICATED = Placement()


def placement_of(param: torch.Tensor) -> Placement:
    """The parameter's record (a plain replicated parameter reduced over dp when none was written)."""
    return getattr(param, "placement", REPLICATED)


def place(param: torch.Tensor, **changes) -> torch.Tensor:
    """Update the parameter's record (fields as in `Placement`); returns the parameter."""
    param.placement = replace(placement_of(param), **changes)
    return param


def add_shard(param: torch.Tensor, shard: Shard) -> torch.Tensor:
    p = placement_of(param)
    return place(param, shards=tuple(s for s in p.shards if s.group != shard.group) + (shard,))


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's shape in the single-process model: each sharded dim at its full size."""
    shape = list(param.shape)
    for s in placement_of(param).shards:
        if s.dim is not None:
            shape[s.dim] = s.full
    return torch.Size(shape)


def by_group(params: list, field: str) -> dict[str, list]:
    """Parameters grouped by the value of a placement field (e.g. "reduce"), in first-seen order;
    parameters whose field is None are left out."""
    out: dict[str, list] = {}
    for p in params:
        key = getattr(placement_of(p), field)
        if key is not None:
            out.setdefault(key, []).append(p)
    return out
