"""ParallelMesh: the world's ranks arranged on a grid, one named process group per dimension.

The grid maths (order, strides, which ranks form each named group) live in `fivefold.grid`, torch-free,
so the planner places the very same groups; this module makes their process groups. The order string names the dimensions innermost first (default ``tp-cp-ep-dp-pp``): the first
dimension's ranks are contiguous (stride 1), the next one's stride is the size of the first, and so
on. Put the dimension with the most traffic innermost so its group lands inside one NVLink domain.

Two grids share one order string (as in Megatron-Core; MoE parallel folding):
- the *dense* grid ``tp × cp × dp × pp`` (ep = 1) for attention, norms, embeddings and dense MLPs;
- the *expert* grid ``etp × ep × edp × pp`` (cp = 1), where ``etp · ep · edp = tp · cp · dp``: the same
  ranks of a stage re-cut for the routed experts, read from the order string with etp in tp's place and
  edp in dp's (grid.py). Experts are split over ``ep`` ranks, each expert's width over ``etp`` ranks,
  and each piece is replicated ``edp`` ("expert-dp") times.

Worked example: 16 ranks, tp=2, cp=1, dp=4, pp=2, ep=2 (etp=1), order ``tp-cp-ep-dp-pp``.

Dense grid strides: tp 1, cp 2, dp 2, pp 8 (ep=1 and cp=1 take no room)::

    rank  = tp + 2·dp + 8·pp
    tp groups : [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]
    dp groups : [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]
    pp groups : [0,8] [1,9] [2,10] ... [7,15]

Expert grid (etp=1, ep=2, edp=2·1·4/2=4) strides: etp 1, ep 1, edp 2, pp 8::

    rank  = ep + 2·edp + 8·pp
    ep groups  : [0,1] [2,3] [4,5] [6,7] [8,9] ...      (folded onto the tp pairs)
    edp groups : [0,2,4,6] [1,3,5,7] [8,10,12,14] ...

Rank 5 is therefore tp=1, dp=2, pp=0 in the dense grid; ep=1, edp=2 in the expert grid. Its tp group is
[4,5], dp group [1,3,5,7], pp group [5,13], ep group [4,5], expert-dp group [1,3,5,7]. With etp=2 instead,
the expert grid is etp 2 × ep 2 × edp 2: etp group [4,5], ep group [5,7], edp group [1,5]. The ``dp_cp`` group
(gradient reduction when cp > 1) joins dp and cp; ``mp`` joins tp, cp and pp (the ranks that hold
different parts of one model replica; used for the global grad norm). ``embed`` holds the first and the
last rank of each pp group, which keep the two copies of tied input/output embeddings and sum their
gradients (in the example: [0,8], [1,9], ...; with pp = 4 and pp groups [r, r+4, r+8, r+12] it is
[r, r+12], and ranks of the middle stages get a group of their own rank only).

Nodes. `parallel.ranks_per_node` = K puts ranks iK .. iK+K-1 on node i (torchrun numbers each agent's
workers consecutively; the CLI fills K from torchrun's LOCAL_WORLD_SIZE, or `--set
parallel.ranks_per_node=K` emulates nodes locally; 0: one node). Each group's `tier` is then "intra" when
its ranks share a node and "inter" when they span nodes (`fivefold.grid.tier_of_ranks`), and the ledger
records every call on it under that tier. In the example with K = 8: the tp, dp, ep and edp groups above are
"intra", the pp groups ([5,13]) "inter"; `tiers()` lists them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .comm import CommLedger, Group
from .config import ParallelConfig
from .comm.volume import backend_of
from .grid import (GROUP_SPECS, Widths, coords, grid_sizes, parse_order, rank_groups, spec_groups, strides, tier_of_pair,
                   tier_of_ranks)
from .rules import check_world_size

__all__ = ["GROUP_SPECS", "ParallelMesh", "coords", "grid_sizes", "rank_groups", "spec_groups", "strides"]


@dataclass
class ParallelMesh:
    """Every group a rank needs, built from a ParallelConfig.

    `groups` maps a name (tp, cp, dp, pp, dp_cp, tp_cp, mp, ep, edp, etp, embed, world) to this rank's `Group`,
    each made from its spec (`grid.GROUP_SPECS`, `grid.spec_groups`) and nothing else. With `kv_replicas` > 1 (tp > kv_heads: `rules.kv_replicas`) and smaller than tp, "tp_kv" is also
    made: each run of kv_replicas consecutive tp ranks that hold the same K/V head, which sum their
    partial K/V weight gradients (recorded under "tp": it is tensor parallelism's traffic). With
    cp > 1 it also makes "cp_ulysses" (runs of `ulysses` consecutive cp ranks: the all-to-all's inner
    group) and "cp_ring" (the cp ranks that hold the same position in those runs: the ring), both recorded
    under "cp"; pure Ulysses has the ring of one, pure ring the runs of one (rules.cp_degrees). "dp_cp"
    is recorded under "dp": it carries the gradient traffic of data parallelism. All groups record into
    one `ledger`, each under its tier ("intra" | "inter": config.ranks_per_node, module docstring). With
    world size 1 no process group is created.
    """

    config: ParallelConfig
    rank: int = 0
    ledger: CommLedger = field(default_factory=CommLedger)
    groups: dict[str, Group] = field(default_factory=dict)
    kv_replicas: int = 1
    ulysses: int = 1
    backend: str = "gloo"       # whose algorithms the groups run (comm/volume.py); the process group's when there is one

    def __post_init__(self):
        p = self.config
        self.order = parse_order(p.order)
        self.dense, self.expert = grid_sizes(p)
        self.world_size = p.world_size
        self.ranks_per_node = p.ranks_per_node
        self.ledger.rank, self.ledger.world_size = self.rank, self.world_size
        self.coords = coords(self.rank, self.dense, self.order)
        ecoords = coords(self.rank, self.expert, self.order)
        self.coords.update({"ep": ecoords["ep"], "edp": ecoords["dp"], "etp": ecoords["tp"]})
        distributed = dist.is_available() and dist.is_initialized() and self.world_size > 1
        self.backend = backend_of(str(dist.get_backend())) if distributed else self.backend
        if distributed:
            check_world_size(dist.get_world_size(), p.tp, p.cp, p.dp, p.pp)
        widths = Widths(ulysses=self.ulysses, kv_replicas=self.kv_replicas)
        made: dict[tuple[int, ...], object] = {}   # rank list -> process group, for specs that share
        for name, spec in GROUP_SPECS.items():
            if not spec.exists(p, widths):
                continue
            lists = spec_groups(p, name, self.order, widths)
            pgs = [self._process_group(g, distributed, made if spec.shares else {}) for g in lists]
            if not spec.shares:
                made.update(zip(map(tuple, lists), pgs))
            self.groups[name] = self._mine(spec.dim, lists, pgs)

    def _process_group(self, ranks: list[int], distributed: bool, shared: dict):
        """The process group of one rank list: none for a single rank or without torch.distributed, the
        world's for every rank, one a shared spec already has, else a new one (every rank must create
        every group, in the same order)."""
        if not distributed or len(ranks) == 1:
            return None
        if tuple(ranks) in shared:
            return shared[tuple(ranks)]
        return dist.group.WORLD if len(ranks) == self.world_size else dist.new_group(ranks)

    def _mine(self, name: str, lists: list[list[int]], pgs: list) -> Group:
        """This rank's Group among one spec's rank lists, recording under `name` on its tier."""
        ranks, pg = next((g, pg) for g, pg in zip(lists, pgs) if self.rank in g)
        tier = self.tier(ranks)    # a group inside one node sends every byte on its tier: no per-peer tiers
        peers = tuple(tier_of_pair(self.rank, r, self.ranks_per_node) for r in ranks) if tier != "intra" else ()
        return Group(name, ranks, ranks.index(self.rank), pg, self.ledger, tier, peers, self.backend)

    def tier(self, ranks: list[int]) -> str:
        """The tier a group of global ranks crosses: "intra" (one node) or "inter"."""
        return tier_of_ranks(ranks, self.ranks_per_node)

    def tiers(self) -> dict[str, str]:
        """This rank's groups of more than one rank -> the tier each crosses."""
        return {name: g.tier for name, g in self.groups.items() if g.size > 1}

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]

    def describe(self) -> str:
        c = self.coords
        return " ".join(f"{d}={c[d]}" for d in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"))
