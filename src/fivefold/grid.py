"""The rank grid, torch-free: order string → strides → named groups of global ranks.

The order string names the dimensions innermost first (default `DEFAULT_ORDER`, ``tp-cp-ep-dp-pp``): the
first dimension's ranks are contiguous (stride 1), the next one's stride is the size of the first, and
so on. Two grids share one order string (as in Megatron-Core):

- the *dense* grid ``tp × cp × dp × pp`` (ep = 1) for attention, norms, embeddings and dense MLPs;
- the *expert* grid ``etp × ep × edp × pp`` (cp = 1), where ``etp · ep · edp = tp · cp · dp`` (MoE
  parallel folding, Liu et al. 2025, as Megatron-Core's `--expert-tensor-parallel-size` and
  `--expert-model-parallel-size`): the same ranks of a stage re-cut for the expert layers. Routed experts are
  split over ``ep`` ranks (whole experts) and each one's width over ``etp`` ranks; each piece is
  replicated ``edp`` times. The expert grid reads the order string with etp in tp's place, edp in dp's
  and cp of size 1 (stored under the names "tp" and "dp"), so ep may span ranks that attention uses for
  tp, cp or dp: with tp2 × dp2 and order tp-cp-ep-dp-pp, ep4 (etp 1) holds all four ranks, ep2 (etp 1) the
  tp pair, and ep2 with etp2 the dp pair (each expert's width over the tp pair, as tp cuts a dense MLP).

`GROUP_SPECS` names every group the mesh makes by a `GroupSpec`: its grid, the dimensions it spans, the
ledger dim its Group records under, and how it is cut from those groups (whole; runs of `width`
consecutive ranks; every `width`-th rank; the first and last rank), with `width` and whether it exists
at all taken from facts passed as arguments (`Widths`: the Ulysses degree, the K/V replicas of tensor
parallelism). `spec_groups` lists a spec's rank lists: `fivefold.mesh.ParallelMesh` makes its process
groups from them and nothing else, and the planner places the same groups on network tiers
(`group_block`). See mesh.py for a worked example (16 ranks, rank 5's groups).

Nodes: with `ranks_per_node` = K > 0 node i holds the consecutive ranks iK .. iK+K-1 (how torchrun numbers
the ranks of its agents); 0 means unknown, taken as one node. `tier_of_ranks(ranks, K)` names the tier a
group spans: "intra" when all its ranks share a node, "inter" when it spans nodes (`TIERS`);
`tier_of_pair(a, b, K)` the tier of the link a byte from rank a to rank b takes, which is where the
ledger and the planner put each byte (a ring over a group that spans nodes crosses between them only
on some of its hops: comm/volume.py `peer_bytes`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

from .rules import ConfigError, Dim, check_expert_grid, choices, expert_data_parallel

DIMS: tuple[str, ...] = choices(Dim)
DEFAULT_ORDER = "tp-cp-ep-dp-pp"   # Megatron-Core's default: the heaviest traffic innermost, pp outermost
TIERS = ("intra", "inter")         # inside one node, between nodes (the ledger's network tiers)

class Widths(NamedTuple):
    """Facts of other dimensions that cut sub-groups: the Ulysses degree of context parallelism
    (`rules.cp_degrees`) and the ranks holding one K/V head under tensor parallelism (`rules.kv_replicas`)."""
    ulysses: int = 1
    kv_replicas: int = 1


@dataclass(frozen=True)
class GroupSpec:
    """One kind of group: every group that varies along `dims` on `grid` (others fixed), cut by `split`:
    "" whole; "runs": runs of `width` consecutive members; "strided": members `width` apart (j, j + width,
    ...); "ends": the first and last member (the others alone). `dim`: the ledger dim a call on it records
    under by default (the Group's name). `made(degrees, widths)`: whether the mesh makes it at all.
    `shares`: a group with the ranks of one already made reuses its process group."""
    grid: str
    dims: tuple[str, ...]
    dim: str
    split: str = ""
    width: str = ""
    made: Callable | None = None
    shares: bool = False

    def exists(self, p: "Degrees", widths: Widths = Widths()) -> bool:
        return self.made is None or self.made(p, widths)


# name -> spec. "world" is every rank; "dp_cp" carries data parallelism's gradients (dim "dp"); the
# sub-groups of cp and tp record under their dimension.
GROUP_SPECS: dict[str, GroupSpec] = {
    "tp": GroupSpec("dense", ("tp",), "tp"),
    "cp": GroupSpec("dense", ("cp",), "cp"),
    "dp": GroupSpec("dense", ("dp",), "dp"),
    "pp": GroupSpec("dense", ("pp",), "pp"),
    "dp_cp": GroupSpec("dense", ("dp", "cp"), "dp"),
    "tp_cp": GroupSpec("dense", ("tp", "cp"), "tp_cp"),
    "mp": GroupSpec("dense", ("tp", "cp", "pp"), "mp"),
    "ep": GroupSpec("expert", ("ep",), "ep"),
    "edp": GroupSpec("expert", ("dp",), "edp"),
    "etp": GroupSpec("expert", ("tp",), "etp"),      # expert tensor parallelism: one expert's width
    "world": GroupSpec("dense", DIMS, "world"),
    # tied embeddings: the first and last stage of each pp group (pp <= 2: the pp group itself)
    "embed": GroupSpec("dense", ("pp",), "embed", split="ends", shares=True),
    # hybrid CP: Ulysses over runs of `ulysses` consecutive cp ranks, the ring over the ranks at one
    # position of those runs (pure Ulysses: a ring of one; pure ring: runs of one)
    "cp_ulysses": GroupSpec("dense", ("cp",), "cp", split="runs", width="ulysses", made=lambda p, w: p.cp > 1),
    "cp_ring": GroupSpec("dense", ("cp",), "cp", split="strided", width="ulysses", made=lambda p, w: p.cp > 1),
    # K/V heads replicated over kv_replicas consecutive tp ranks (tp > kv_heads), which sum their
    # partial K/V weight gradients
    "tp_kv": GroupSpec("dense", ("tp",), "tp", split="runs", width="kv_replicas",
                       made=lambda p, w: 1 < w.kv_replicas < p.tp),
}


class Degrees(Protocol):
    """Anything with the five degrees and the experts' tensor-parallel degree: `ParallelConfig`, the
    planner's `Layout`, `Sizes`."""
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    etp: int


class Sizes(NamedTuple):
    """The five degrees alone, and etp (a `Degrees` that costs nothing to build)."""
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    etp: int = 1


def parse_order(order: str) -> list[str]:
    """The dimensions of an order string, innermost first; each of tp, cp, ep, dp, pp exactly once."""
    dims = order.split("-")
    if sorted(dims) != sorted(DIMS):
        raise ConfigError(f"parallel.order must name each of {', '.join(DIMS)} once, innermost first "
                          f"(default {DEFAULT_ORDER!r}), got {order!r}")
    return dims


def check_grids_agree(p: Degrees, order: str | list[str]) -> None:
    """The expert grid must give every rank the pp coordinate the dense grid gives it (a rank runs one
    stage, whichever grid a layer uses): pp's stride must be equal on both. It differs when a dimension of
    size > 1 sits inside pp in the order and the two grids size it differently, e.g. tp-pp-cp-ep-dp with
    tp 2 and etp 1: the dense grid's stages are 2 ranks apart, the expert grid's 1, so an expert
    all-to-all would join ranks of different stages."""
    if p.pp <= 1 or p.ep * p.etp == 1:   # ep = etp = 1: the experts are dense weights, no expert group is used
        return
    dims = parse_order(order) if isinstance(order, str) else order
    dense, expert = grid_sizes(p)
    sd, se = strides(dense, dims), strides(expert, dims)
    if sd["pp"] != se["pp"]:
        raise ConfigError(f"parallel.order {'-'.join(dims)!r} gives pp a stride of {sd['pp']} ranks on the dense grid "
                          f"and {se['pp']} on the expert grid (etp {p.etp}, ep {p.ep} fold over tp x cp x dp "
                          f"{p.tp * p.cp * p.dp}): put pp outermost, e.g. {DEFAULT_ORDER!r}")


def grid_sizes(p: Degrees) -> tuple[dict[str, int], dict[str, int]]:
    """Sizes of the dense and the expert grids, keyed by the names in the order string (the expert grid's
    "tp" is etp, its "dp" edp)."""
    check_expert_grid(p.ep, p.dp, p.cp, p.tp, p.etp)
    dense = {"tp": p.tp, "cp": p.cp, "ep": 1, "dp": p.dp, "pp": p.pp}
    expert = {"tp": p.etp, "cp": 1, "ep": p.ep, "dp": expert_data_parallel(p.tp, p.cp, p.dp, p.ep, p.etp), "pp": p.pp}
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
    return dense if GROUP_SPECS[name].grid == "dense" else expert


def spec_groups(p: Degrees, name: str, order: str | list[str], widths: Widths = Widths()) -> list[list[int]]:
    """Every group of spec `name`, each a list of global ranks in order: the whole groups of its
    dimensions, cut by the spec's split. Together they hold every rank once."""
    spec = GROUP_SPECS[name]
    dims = parse_order(order) if isinstance(order, str) else order
    whole = rank_groups(group_sizes(p, name), dims, spec.dims)
    w = getattr(widths, spec.width) if spec.width else 1
    if spec.split == "runs":
        return [g[i:i + w] for g in whole for i in range(0, len(g), w)]
    if spec.split == "strided":
        return [g[j::w] for g in whole for j in range(min(w, len(g)))]
    if spec.split == "ends":
        return [g if len(g) <= 2 else [g[0], g[-1]] for g in whole] + [[r] for g in whole for r in g[1:-1]]
    return whole


def group_size(p: Degrees, name: str, widths: Widths = Widths()) -> int:
    """Ranks in one group called `name` (a key of GROUP_SPECS; "embed": its two ends)."""
    spec, sizes, n = GROUP_SPECS[name], group_sizes(p, name), 1
    for d in spec.dims:
        n *= sizes[d]
    w = getattr(widths, spec.width) if spec.width else 1
    if spec.split == "runs":
        return min(w, n)
    if spec.split == "strided":
        return n // w
    return min(n, 2) if spec.split == "ends" else n


def group_block(p: Degrees, name: str, order: str, widths: Widths = Widths()) -> int:
    """Span of consecutive ranks that holds one group whole: the stride of its outermost dimension of
    size > 1 times that size (1 for a group of one rank); a run of `width` members: its dimension's
    stride times width. Strided members and the two ends span their dimension's whole block."""
    spec, sizes = GROUP_SPECS[name], group_sizes(p, name)
    if group_size(p, name, widths) <= 1:
        return 1
    stride, block = 1, 1
    for d in parse_order(order):
        if d in spec.dims and sizes[d] > 1:
            block = stride * sizes[d]
            if spec.split == "runs":
                block = stride * getattr(widths, spec.width)
        stride *= sizes[d]
    return block


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node holding global `rank` (0 for every rank when ranks_per_node is 0: one node)."""
    return rank // ranks_per_node if ranks_per_node else 0


def tier_of_pair(a: int, b: int, ranks_per_node: int) -> str:
    """The tier a byte from global rank a to global rank b crosses: "intra" on one node, else "inter"."""
    return TIERS[node_of(a, ranks_per_node) != node_of(b, ranks_per_node)]


def tier_of_ranks(ranks: list[int], ranks_per_node: int) -> str:
    """The tier a group of global ranks crosses: "intra" when they share one node, else "inter"."""
    return TIERS[len({node_of(r, ranks_per_node) for r in ranks}) > 1]
