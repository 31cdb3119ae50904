"""The rank grid, torch-free: order string → strides → named groups of global ranks.

The order string names the dimensions innermost first (default `DEFAULT_ORDER`, ``tp-cp-ep-dp-pp``): the
first dimension's ranks are contiguous (stride 1), the next one's stride is the size of the first, and
so on. Two grids share one order string (as in Megatron-Core):

- the *dense* grid ``tp × cp × dp × pp`` (ep = 1) for attention, norms, embeddings and dense MLPs;
- the *expert* grid ``tp × ep × edp × pp`` (cp = 1), where ``ep · edp = cp · dp``: experts are sharded
  across ``ep`` ranks carved out of the data/context-parallel ranks, each shard replicated ``edp`` times
  (the expert grid stores edp under the name "dp").

`GROUP_SPECS` names every group by (grid, dimensions it spans). `fivefold.mesh.ParallelMesh` makes the
process groups from these lists; the planner places the same groups on network tiers. See mesh.py for a
worked example (16 ranks, rank 5's groups).

Nodes: with `ranks_per_node` = K > 0 node i holds the consecutive ranks iK .. iK+K-1 (how torchrun numbers
the ranks of its agents); 0 means unknown, taken as one node. `tier_of_ranks(ranks, K)` names the tier a
group crosses: "intra" when all its ranks share a node, "inter" when it spans nodes (`TIERS`).
"""
from __future__ import annotations

import itertools
from typing import Protocol

from .rules import ConfigError, Dim, check_expert_grid, choices

DIMS: tuple[str, ...] = choices(Dim)
DEFAULT_ORDER = "tp-cp-ep-dp-pp"   # Megatron-Core's default: the heaviest traffic innermost, pp outermost
TIERS = ("intra", "inter")         # inside one node, between nodes (the ledger's network tiers)

# name -> (grid, dims varied). "world" is every rank.
GROUP_SPECS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("dense", ("tp",)),
    "cp": ("dense", ("cp",)),
    "dp": ("dense", ("dp",)),
    "pp": ("dense", ("pp",)),
    "dp_cp": ("dense", ("dp", "cp")),
    "tp_cp": ("dense", ("tp", "cp")),
    "mp": ("dense", ("tp", "cp", "pp")),
    "ep": ("expert", ("ep",)),
    "edp": ("expert", ("dp",)),
    "world": ("dense", DIMS),
}


class Degrees(Protocol):
    """Anything with the five degrees: `ParallelConfig`, the planner's `Layout`."""
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int


def parse_order(order: str) -> list[str]:
    """The dimensions of an order string, innermost first; each of tp, cp, ep, dp, pp exactly once."""
    dims = order.split("-")
    if sorted(dims) != sorted(DIMS):
        raise ConfigError(f"parallel.order must name each of {', '.join(DIMS)} once, innermost first "
                          f"(default {DEFAULT_ORDER!r}), got {order!r}")
    return dims


def grid_sizes(p: Degrees) -> tuple[dict[str, int], dict[str, int]]:
    """Sizes of the dense and the expert grids, keyed by the names in the order string."""
    check_expert_grid(p.ep, p.dp, p.cp)
    dense = {"tp": p.tp, "cp": p.cp, "ep": 1, "dp": p.dp, "pp": p.pp}
    expert = {"tp": p.tp, "cp": 1, "ep": p.ep, "dp": p.dp * p.cp // p.ep, "pp": p.pp}
    return dense, expert


def strides(sizes: dict[str, int], order: list[str]) -> dict[str, int]:
    """Distance in global ranks between neighbours along each dimension."""
    out, s = {}, 1
    for d in order:
        out[d] = s
        s *= sizes[d]
    return out


def coords(rank: int, sizes: dict[str, int], order: list[str]) -> dict[str, int]:
    """Coordinates of a global rank on a grid."""
    st = strides(sizes, order)
    return {d: (rank // st[d]) % sizes[d] for d in order}


def rank_groups(sizes: dict[str, int], order: list[str], dims: tuple[str, ...]) -> list[list[int]]:
    """All groups that vary along `dims` (others fixed); each group lists global ranks in order."""
    st = strides(sizes, order)
    others = [d for d in order if d not in dims]
    inner = [d for d in order if d in dims]
    groups = []
    for fixed in itertools.product(*(range(sizes[d]) for d in others)):
        base = sum(c * st[d] for d, c in zip(others, fixed))
        members = [base + sum(c * st[d] for d, c in zip(inner, idx))
                   for idx in itertools.product(*(range(sizes[d]) for d in inner))]
        groups.append(sorted(members))
    return sorted(groups)


def group_sizes(p: Degrees, name: str) -> dict[str, int]:
    """The grid sizes a named group lives on."""
    dense, expert = grid_sizes(p)
    return dense if GROUP_SPECS[name][0] == "dense" else expert


def group_size(p: Degrees, name: str) -> int:
    """Ranks in one group called `name` (a key of GROUP_SPECS)."""
    sizes, n = group_sizes(p, name), 1
    for d in GROUP_SPECS[name][1]:
        n *= sizes[d]
    return n


def group_block(p: Degrees, name: str, order: str) -> int:
    """Span of consecutive ranks that holds one group whole: the stride of its outermost dimension of
    size > 1 times that size (1 for a group of one rank)."""
    sizes, dims = group_sizes(p, name), GROUP_SPECS[name][1]
    stride, block = 1, 1
    for d in parse_order(order):
        if d in dims and sizes[d] > 1:
            block = stride * sizes[d]
        stride *= sizes[d]
    return block


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node holding global `rank` (0 for every rank when ranks_per_node is 0: one node)."""
    return rank // ranks_per_node if ranks_per_node else 0


def tier_of_ranks(ranks: list[int], ranks_per_node: int) -> str:
    """The tier a group of global ranks crosses: "intra" when they share one node, else "inter"."""
    return TIERS[len({node_of(r, ranks_per_node) for r in ranks}) > 1]
