"""Where a rank's flows land: the tier each group's collectives cross and their seconds there (`place`), the
bytes every tier's links carry over all ranks (`all_ranks_by_tier`, `link_bytes`: what an emulated
cluster's link counters read), node-limited expert routing split by tier (`split_routed`), and the rank
order that puts the heaviest blocking traffic innermost (`recommend_order`, `placement`). The flows
themselves, per dimension and collective, are plan/traffic.py's; the tiers, bandwidths and latencies
plan/topology.py's; which ranks form a group the grid's (`fivefold.grid`), as the runtime's mesh.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from .. import grid
from ..comm import volume
from .layout import Layout, Workload, microbatches
from .models import PlanModel
from .topology import Topology, collective_latency, collective_loss, group_bandwidth
from .traffic import VOLUME, Flow, add_weighted, group_size, pp_hops, stage_flows

# the accelerator's own links that offload copies cross (not network tiers): tier name -> Accelerator field
COPY_TIERS = {"pcie": "pcie_bandwidth", "nvme": "nvme_bandwidth"}


# -- where the groups land ----------------------------------------------------------------------------
def group_block(layout: Layout, group: str, order: str | None = None, width: int = 0) -> int:
    """Span of consecutive ranks that holds one group whole (`fivefold.grid.group_block`, from the spec the
    mesh builds the group from); `width`: a sub-group's run length (`Flow.width`)."""
    L = layout
    return group_block_of(L.tp, L.pp, L.dp, L.cp, L.ep, group, order or L.order, width, L.etp)


@lru_cache(maxsize=65536)
def group_block_of(tp: int, pp: int, dp: int, cp: int, ep: int, group: str, order: str, width: int = 0,
                   etp: int = 1) -> int:
    """`group_block` from the degrees (cached)."""
    spec = grid.GROUP_SPECS[group]
    widths = grid.Widths(**{spec.width: width}) if spec.width and width else grid.Widths()
    return grid.group_block(grid.Sizes(tp, pp, dp, cp, ep, etp), group, order, widths)


def place(flows: list[Flow], layout: Layout, topo: Topology, order: str | None = None,
          duty: dict[int, float] | None = None) -> list[Flow]:
    """Fill each flow's tier (slowest it crosses) and seconds (bytes over that tier's bandwidth plus the
    algorithm's latency hops, plus on a lossy tier its lost frames' recovery: topology.collective_loss).
    `duty`: per oversubscribed tier (index), the share of the step other pipeline stages spend crossing it
    (topology.group_bandwidth; absent: 1, every rank of a domain crossing at once).
    Node-limited expert all-to-alls ("routed" rows) become two rows, see
    `split_routed`. Offload copies (group "pcie" or "nvme", COPY_TIERS) stay on that link of the
    accelerator: bytes over its `pcie_bandwidth` or `nvme_bandwidth`, no latency. Returns the placed rows."""
    world, tiers = layout.gpus, {}
    out = []
    for fl in flows:
        if fl.group in COPY_TIERS:   # offload copies: the accelerator's own link, no latency hops
            fl.tier = fl.group
            fl.seconds = fl.bytes_sent / getattr(topo.accelerator, COPY_TIERS[fl.group])
            out.append(fl)
            continue
        parts = split_routed(fl, layout, topo, order) if fl.part == "routed" else [fl]
        for p in parts:
            if (p.group, p.width) not in tiers:
                block = group_block(layout, p.group, order, p.width)
                tiers[(p.group, p.width)] = (block, topo.tier_index(block, world))
            block, i = tiers[(p.group, p.width)]
            if p.part == "intra":
                i, block = 0, topo.tiers[0].size or block
            tier = topo.tiers[i]
            p.tier = tier.name
            latency, own = tier.fit(p.op)
            stages = domain_stages(layout, topo, i, p.group, order) if duty and i in duty else 1
            bw = group_bandwidth(topo, i, p.op, p.n, block, stages, (duty or {}).get(i, 1.0)) * own / tier.bandwidth
            crossing = p.bytes_sent
            seconds = p.bytes_sent / bw
            if p.op == "all_to_all" and i > 0 and not p.part:   # only the rows to other domains cross the tier
                crossing, inside = crossing_share(p, block, topo.tiers[i - 1].size)
                below = topo.tiers[i - 1]
                seconds = max(crossing / bw, inside / (below.fit(p.op)[1] or below.bandwidth))
            p.seconds = (seconds + p.calls * collective_latency(p.op, p.n, latency, p.backend)
                         + collective_loss(p.op, p.n, crossing, p.calls, tier, p.backend))
            out.append(p)
    return out


def crossing_share(fl: Flow, block: int, inner: int | None) -> tuple[float, float]:
    """(bytes that leave the rank's domain, bytes that stay inside it) of an all-to-all's `bytes_sent` on a
    group of n ranks spanning `block` consecutive ranks, over domains of `inner` ranks: each rank sends
    every other member an equal share, so of its n-1 peers the g-1 in its own domain (g = the group's
    ranks a domain holds) take (g-1)/(n-1) of the bytes over the tier below and the rest crosses. The
    ledger and `link_bytes` count the same split per peer (grid.tier_of_pair); the row keeps the whole."""
    n = fl.n
    if not inner or n <= 1:
        return fl.bytes_sent, 0.0
    stride = max(1, block // n)
    g = max(1, min(n, inner // stride))
    if g <= 1 or g >= n:
        return fl.bytes_sent, 0.0
    inside = fl.bytes_sent * (g - 1) / (n - 1)
    return fl.bytes_sent - inside, inside


def least_duty(topo: Topology) -> dict[int, float]:
    """Every oversubscribed tier at duty 0: the fewest crossers pipeline stages sharing a domain can give
    (`place`'s duty; a lower bound's, plan/search.py)."""
    return {i: 0.0 for i, t in enumerate(topo.tiers) if i > 0 and t.oversubscription > 1}


def domain_stages(layout: Layout, topo: Topology, tier_index: int, group: str, order: str | None = None) -> int:
    """The pipeline stages among the ranks of one domain below tier `tier_index` (topology.group_bandwidth),
    for a group inside one stage; 1 for a group across stages (pp's sends, the tied embedding's
    reduction, world) and where the domain's size is not known."""
    inner = topo.tiers[tier_index - 1].size if tier_index > 0 else None
    spec = grid.GROUP_SPECS.get(group)
    if layout.pp <= 1 or not inner or spec is None or "pp" in spec.dims:
        return 1
    between = group_block(layout, "pp", order) // layout.pp    # ranks from one stage's to the next's
    return max(1, min(layout.pp, inner // between))


def ep_nodes(layout: Layout, topo: Topology, order: str | None = None) -> tuple[int, int]:
    """(nodes an ep group spans, its ranks in each): nodes are the innermost tier's domains."""
    n, node = layout.ep, topo.tiers[0].size
    if node is None or n <= 1:
        return 1, n
    stride = max(1, group_block(layout, "ep", order) // n)
    g = max(1, min(n, node // stride))
    return -(-n // g), g


def split_routed(fl: Flow, layout: Layout, topo: Topology, order: str | None = None) -> list[Flow]:
    """Node-limited routing (DeepSeek-V3 §2.1.2, §3.2.2): each token's experts lie on at most M of the k
    nodes its ep group spans; a token crosses the network once per remote node it selects (to the rank
    of the same in-node index) and is forwarded inside the node to each target expert's GPU; combine
    reverses the path. With D = min(M, k, rows per token) nodes per token, of which on average D(k-1)/k
    remote, and g ranks of the group per node, one call whose message (all rows the rank sends) is x:
      inter (between nodes, n = k):  x·D/rows · (k-1)/k  = all_to_all(x·D/rows, k)
      intra (inside a node, n = g):  x · (g-1)/g          = all_to_all(x, g)
    (an upper bound on the network share: a token whose experts fall on fewer nodes sends less). When
    the group fits in one node nothing crosses the network: the row stays whole."""
    k, g = ep_nodes(layout, topo, order)
    whole = replace(fl, part="", route=())
    if k <= 1:
        return [whole]
    limit, rows = fl.route
    d = min(limit, k, rows)
    inter = replace(whole, part="inter", n=k, message_bytes=fl.message_bytes * d / rows,
                    bytes_sent=VOLUME[fl.op](fl.message_bytes * d / rows, k))
    if g <= 1:
        return [inter]
    intra = replace(whole, part="intra", n=g, bytes_sent=VOLUME[fl.op](fl.message_bytes, g))
    return [inter, intra]


def by_tier(flows: list[Flow], topo: Topology) -> dict[str, float]:
    out = {t.name: 0.0 for t in topo.tiers}
    for fl in flows:
        out[fl.tier] = out.get(fl.tier, 0.0) + fl.bytes_sent
    return out


def all_ranks_by_tier(model: PlanModel, layout: Layout, work: Workload, topo: Topology,
                      order: str | None = None) -> dict[tuple[str, str, str], dict]:
    """(dim, op, tier) -> calls, message_bytes, bytes_sent summed over every rank for one step, each byte on
    the tier of the link it takes and each call on the tier its group spans, as the runtime's ledger
    records them (comm/ops.py): rank by rank, each rank's group of each flow found on the grid (`order`: the
    layout's), the bytes sent to each peer by the backend's algorithm (`volume.peer_bytes`: a ring's to the
    next rank, an all-to-all's to each, a pipeline send to the next stage forward and the previous one
    backward, a ring-attention send to the next cp rank), each placed on the innermost tier of `topo` whose
    domain holds both ends. With `topology.node_topology(K)` the tiers are the ledger's ("intra",
    "inter"): what comm.json's "tiers" rows show per step for a run with parallel.ranks_per_node = K.
    Walks every rank: for the fabrics a run can have, not for a 16,384-GPU search (`place` is that)."""
    order = order or layout.order
    links = _Links(layout, topo, order, microbatches(layout, work), work.backend)
    out: dict[tuple[str, str, str], dict] = {}
    for flows, ranks in _rank_flow_ranks(model, layout, work, order):
        for fl in flows:
            if fl.group in COPY_TIERS or fl.part:
                for p in place([replace(fl)], layout, topo, order):
                    add_weighted(out, (p.dim, p.op, p.tier), p, len(ranks))
                continue
            for rank in ranks:
                for tier, calls, message, sent in links.split(fl, rank):
                    row = out.setdefault((fl.dim, fl.op, tier), {"calls": 0, "message_bytes": 0.0, "bytes_sent": 0.0})
                    row["calls"] += calls
                    row["message_bytes"] += message
                    row["bytes_sent"] += sent
    return out


def link_bytes(model: PlanModel, layout: Layout, work: Workload, topo: Topology, order: str | None = None) -> dict[str, float]:
    """Bytes per step over all ranks that cross each tier's links (`all_ranks_by_tier`): tier i's links (a
    node's uplink for the second tier, a leaf's for the third) carry every byte placed on tier i or above;
    the first tier (inside a node) is every byte that stays inside one."""
    rows = all_ranks_by_tier(model, layout, work, topo, order)
    names = [t.name for t in topo.tiers]
    placed = {t: 0.0 for t in names}
    for (_, _, tier), row in rows.items():
        if tier in placed:
            placed[tier] += row["bytes_sent"]
    return {t: placed[t] if i == 0 else sum(placed[u] for u in names[i:]) for i, t in enumerate(names)}


class _Links:
    """Which tier each byte of a rank's flow crosses, found on the grid (see `all_ranks_by_tier`)."""

    def __init__(self, layout: Layout, topo: Topology, order: str, m: int, backend: str):
        self.layout, self.order, self.m, self.backend = layout, order, m, backend
        self.sizes = [t.size for t in topo.tiers]
        self.names = [t.name for t in topo.tiers]
        self.members: dict[tuple, dict[int, list[int]]] = {}

    def tier(self, ranks) -> str:
        """The innermost tier whose aligned domains hold all `ranks` in one."""
        for name, size in zip(self.names, self.sizes):
            if size is None or len({r // size for r in ranks}) == 1:
                return name
        return self.names[-1]

    def group(self, fl: Flow, rank: int) -> list[int]:
        key = (fl.group, fl.width)
        if key not in self.members:
            spec = grid.GROUP_SPECS[fl.group]
            widths = grid.Widths(**{spec.width: fl.width}) if spec.width and fl.width else grid.Widths()
            self.members[key] = {r: g for g in grid.spec_groups(self.layout, fl.group, self.order, widths) for r in g}
        return self.members[key][rank]

    def split(self, fl: Flow, rank: int) -> list[tuple[str, float, float, float]]:
        """(tier, calls, message bytes, bytes sent) of `rank`'s share of `fl`."""
        ranks = self.group(fl, rank)
        n, i = len(ranks), ranks.index(rank)
        if fl.op in ("send", "recv"):
            return [(self.tier((rank, ranks[j])), fl.calls * w, fl.message_bytes * w, fl.bytes_sent * w)
                    for j, w in self.directions(fl, i, n) if w]
        out = [(self.tier(ranks), fl.calls, fl.message_bytes, 0.0)]
        shares = volume.peer_bytes(fl.op, 1.0, n, i, self.backend)
        total = sum(b for _, b in shares) or 1.0
        for j, b in shares:
            out.append((self.tier((rank, ranks[j])), 0, 0.0, fl.bytes_sent * b / total))
        return out

    def directions(self, fl: Flow, i: int, n: int) -> list[tuple[int, float]]:
        """(peer, share of the flow) of a point-to-point flow: a ring-attention send goes to the next cp rank
        and a receive comes from the previous one; a pipeline stage sends forward to the next stage (the
        last stage's later chunks to the first) and backward to the previous one, receiving the other way."""
        nxt, prv = (i + 1) % n, (i - 1) % n
        if fl.dim != "pp":
            return [(nxt if fl.op == "send" else prv, 1.0)]
        to_next, to_prev = pp_hops(i, n, self.m, self.layout.vpp, self.layout.head_first)
        total = to_next + to_prev
        return [(nxt, to_next / total), (prv, to_prev / total)] if total else []   # sends and receives alike


def _rank_flow_ranks(model: PlanModel, layout: Layout, work: Workload, order: str):
    """(flows of one rank, the global ranks that have them) covering every rank once: the ranks of each
    stage, and under ZeRO with tp > 1 each data-parallel index's (`_rank_flows`)."""
    L = layout
    n = L.dp * L.cp
    per_dp = L.zero_spec.shards_states and n > 1 and L.tp > 1
    dense, _ = grid.grid_sizes(L)
    dims = grid.parse_order(order)
    dp_cp = {r: g.index(r) for g in grid.spec_groups(L, "dp_cp", dims) for r in g}
    stage_of = {r: grid.coords(r, dense, dims)["pp"] for r in range(L.gpus)}
    for j in range(L.pp):
        ranks = [r for r in range(L.gpus) if stage_of[r] == j]
        if per_dp:
            for d in range(n):
                yield stage_flows(model, L, work, j, d), [r for r in ranks if dp_cp[r] == d]
        else:
            yield stage_flows(model, L, work, j), ranks



# -- rank order -------------------------------------------------------------------------------------------
# ledger dim -> the order field its groups vary along (embed: pp, edp: the expert grid's dp), from the specs
MESH_DIM = {name: grid.GROUP_SPECS[name].dims[0] for name in ("tp", "cp", "ep", "pp", "embed", "dp", "edp", "etp")}
FIELD_ORDER = ("tp", "cp", "ep", "pp", "dp")   # practice (Llama-3 §3.3.2; DESIGN): heaviest innermost


def blocking_bytes(flows: list[Flow]) -> dict[str, float]:
    """Per mesh dimension, bytes per rank per step."""
    out = {d: 0.0 for d in FIELD_ORDER}
    for fl in flows:
        d = MESH_DIM.get(fl.dim)
        if d is not None:
            out[d] += fl.bytes_sent
    return out


def recommend_order(flows: list[Flow]) -> str:
    """Order string, innermost first. Dimensions whose traffic blocks compute (tp, cp, ep inside every
    layer; pp between stages) sorted by bytes, heaviest innermost; data parallelism outermost whatever its
    bytes, since its gradient reduction overlaps the backward and tolerates latency (Dubey et al. 2024,
    §3.3.2: order [TP, CP, PP, DP]). Dimensions that send nothing keep the field's slots. cp and ep live
    in different grids (the expert grid has no cp, the dense grid no ep), so their relative order never
    changes a group: when adjacent they are written cp first, as Megatron-Core does."""
    weight = blocking_bytes(flows)
    blocking = list(FIELD_ORDER[:-1])
    live = [d for d in blocking if weight[d] > 0]
    ranked = iter(sorted(live, key=lambda d: (-weight[d], FIELD_ORDER.index(d))))
    dims = [next(ranked) if d in live else d for d in blocking]
    for i in range(len(dims) - 1):
        if dims[i] == "ep" and dims[i + 1] == "cp":
            dims[i], dims[i + 1] = "cp", "ep"
    return "-".join(dims + ["dp"])


def placement(layout: Layout, topo: Topology, order: str) -> dict[str, str]:
    """Tier each group of size > 1 lands on for a given order."""
    out = {}
    for g in ("tp", "cp", "ep", "etp", "pp", "dp", "edp"):
        if group_size(layout, g) > 1 and (g != "edp" or layout.experts_folded):
            out[g] = topo.tier_of(group_block(layout, g, order), layout.gpus).name
    return out


def placement_warnings(layout: Layout, topo: Topology, order: str, recommended: str) -> list[str]:
    """Groups that cross a slow tier, and an order that puts some group on another tier than the
    recommended order would. The default order (tp-cp-ep-dp-pp, Megatron-Core's) differs from the
    recommendation (dp outermost) only in where dp and pp sit; where that moves no group to another
    tier — one node, or both groups across nodes — the planner's model gives both the same step, so
    it is no warning."""
    names = [t.name for t in topo.tiers]
    where = placement(layout, topo, order)
    out = []
    if "tp" in where and where["tp"] != names[0]:
        out.append(f"tp group crosses the {where['tp']} tier: tensor parallelism outside the {names[0]} domain")
    for g in ("cp", "ep"):
        if g in where and names.index(where[g]) > 1:
            out.append(f"{g} group crosses the {where[g]} tier: per-layer traffic beyond the first two tiers")
    for g, t in where.items():
        tier = topo.tiers[names.index(t)]
        if tier.oversubscription > 1 and g in ("tp", "cp", "ep", "pp"):
            out.append(f"{g} traffic crosses the {t} tier, oversubscribed 1:{tier.oversubscription:g}")
    best = placement(layout, topo, recommended)
    moved = [f"{g} on {where[g]} instead of {best[g]}" for g in where if where[g] != best.get(g, where[g])]
    if moved:   # an order that lands every group on the same tier as the recommended one costs nothing
        out.append(f"order {order} places groups on other tiers than the recommended {recommended} "
                   f"(blocking traffic innermost, dp outermost): {', '.join(moved)}")
    return out
