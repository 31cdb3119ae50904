"""One layout, every estimate: memory per stage, traffic per dimension and tier, bubble, step time, MFU.

`estimate(model, layout, workload, topology)` validates the layout (ConfigError naming the rule), then
runs memory.py, traffic.py and time.py and returns an `Estimate`, whose `to_dict()` is what
`fivefold plan --json` prints.

MFU conventions. `mfu` counts model FLOPs per token as 6·N_matmul + 3·A, A the attention's forward
FLOPs 2·s·a·(d_qk + d_v) per layer, halved under a causal mask (the work flash attention does;
Megatron-LM's `num_floating_point_operations` today). Published MFUs often do not halve it: 6·N +
12·L·H·Q·T (PaLM, Chowdhery et al. 2022, App. B; Narayanan et al. 2021, eq. 3; nanoGPT, torchtitan).
`mfu_attention_full` is the same step under that convention,

    mfu_attention_full = mfu · (F + 3·(A_full - A_causal)) / F,   F = 6·N_matmul + 3·A_causal,

equal to `mfu` when attention is not causal. Compare a plan with a paper's MFU under the paper's one.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import permutations

from ..config import ConfigError
from ..grid import check_grids_agree
from ..parallel.pipeline.spec import Schedule
from .layout import Layout, Workload, check, microbatches, schedule_of
from .memory import Memory, memory
from .dualpipe import rank_flows, ranks_or
from .reserve import device_reserve
from .units import candidate_stages, optimizer_bytes_per_param
from .models import PlanModel
from .time import StepTime, step_time
from .topology import GiB, Topology
from .traffic import Flow, by_dim, stage_flows
from .tiers import by_tier, domain_stages, place, placement, placement_warnings, recommend_order


@dataclass
class Estimate:
    model: PlanModel
    layout: Layout
    work: Workload
    topo: Topology
    memory: Memory
    flows: list[Flow]                 # the most-loaded stage's rows (one rank, one step)
    flows_by_stage: dict[int, list[Flow]]
    time: StepTime
    recommended_order: str            # the byte ranking's (layout.order is the one planned)
    placement: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def schedule(self) -> Schedule:
        """The pipeline schedule planned: the value the runtime runs and pipeline.json records."""
        return schedule_of(self.model, self.layout, self.work)

    @property
    def mfu_attention_full(self) -> float:
        """MFU with attention FLOPs not halved for the causal mask (`mfu_attention_full`)."""
        return mfu_attention_full(self.model, self.work, self.time.mfu)

    @property
    def reserve(self) -> dict:
        """Device bytes kept free beyond the planned tensors (plan/reserve.py: CUDA context, framework buffers,
        the allocator's slack on the most loaded stage)."""
        return device_reserve(self.topo.accelerator, self.work, self.memory.most_loaded["total"])

    @property
    def device_fits(self) -> bool:
        """The most loaded stage's device bytes (COMPONENTS; offloaded state excluded) and the device reserve
        fit the accelerator."""
        return self.memory.most_loaded["total"] + self.reserve["total"] <= self.topo.accelerator.memory

    @property
    def host_fits(self) -> bool:
        """With offload, host bytes per GPU (`buffers.offload_memory`) fit its share of the host's RAM."""
        return self.memory.host <= self.topo.accelerator.host_memory

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    def offload(self) -> dict:
        """What offload moves (docs/plan.md, "Offload"): optimizer bytes that left the device (and weight
        bytes: ZeRO-3 nvme), host and disk bytes per GPU, bytes per rank per step over PCIe and to/from
        disk, the exposed seconds."""
        copies = [f for f in self.flows if f.dim == "offload"]
        tier = lambda name: sum(f.bytes_sent for f in copies if f.tier == name)
        return {"mode": self.layout.offload, "moved_from_device": self.memory.most_loaded.get("offloaded", 0.0),
                "params_moved_from_device": self.memory.most_loaded.get("offloaded_params", 0.0),
                "host": self.memory.host, "host_limit": self.topo.accelerator.host_memory, "host_fits": self.host_fits,
                "disk": self.memory.disk, "pcie_bytes": tier("pcie"), "nvme_bytes": tier("nvme"),
                "exposed_s": self.time.offload_s}

    def traffic(self) -> dict:
        """Per dimension: rows of op, calls, message bytes, bytes sent per rank per step, tier, seconds."""
        out: dict[str, list] = {}
        for fl in self.flows:
            out.setdefault(fl.dim, []).append({"op": fl.op, "calls": fl.calls, "message_bytes": fl.message_bytes,
                                               "bytes_sent": fl.bytes_sent, "group_size": fl.n, "tier": fl.tier,
                                               "seconds": fl.seconds})
        return out

    def to_dict(self) -> dict:
        t = self.time
        return {
            "model": {"name": self.model.name, "params": self.model.num_params(),
                      "active_params": self.model.active_params()},
            "topology": self.topo.name, "gpus": self.layout.gpus,
            "layout": {**self.layout.to_dict(), "microbatches": microbatches(self.layout, self.work)},
            "schedule": {**self.schedule.to_dict(), "schedule": self.layout.schedule},   # dualpipe: its one-way split
            "workload": {f: getattr(self.work, f) for f in self.work.__dataclass_fields__},
            "memory": self.memory.to_dict(), "memory_limit": self.topo.accelerator.memory, "fits": self.fits,
            "reserve": self.reserve,
            "device_fits": self.device_fits, "offload": self.offload(),
            "traffic": self.traffic(), "bytes_per_dim": by_dim(self.flows),
            "bytes_per_tier": by_tier(self.flows, self.topo),
            "bubble": t.bubble, "bubble_source": t.bubble_source, "step_time_s": t.step_time_s,
            "tokens_per_s": t.tokens_per_s, "mfu": t.mfu, "mfu_attention_full": self.mfu_attention_full,
            "mfu_convention": MFU_CONVENTIONS, "hfu": t.hfu, "time": t.to_dict(),
            "order_recommended": self.recommended_order, "layout_order": self.layout.order, "placement": self.placement,
            "placement_recommended": placement(self.layout, self.topo, self.recommended_order),
            "warnings": self.warnings,
        }


MFU_CONVENTIONS = {
    "mfu": "6N + 3A, attention FLOPs A halved for the causal mask (flash attention's work; Megatron-LM today)",
    "mfu_attention_full": "6N + 12LHQT, attention not halved (PaLM App. B; Narayanan et al. 2021; nanoGPT)",
}


def mfu_attention_full(model: PlanModel, work: Workload, mfu: float) -> float:
    """`mfu` (attention halved when causal) restated with the attention FLOPs not halved."""
    counted = model.flops_per_token(work.attention_span, work.causal)
    extra = 3.0 * (model.blocks_attention_flops_per_token(work.attention_span, causal=False)
                   - model.blocks_attention_flops_per_token(work.attention_span, work.causal))
    return mfu * (counted + extra) / counted


def owned_elements(mem: Memory, work: Workload) -> float:
    """Elements the most loaded stage's rank updates: its optimizer bytes, on the device or offloaded,
    over the optimizer bytes per parameter."""
    row = mem.most_loaded
    return (row["optimizer"] + row.get("offloaded", 0.0)) / optimizer_bytes_per_param(work)


def estimate(model: PlanModel, layout: Layout, work: Workload, topo: Topology, gpus: int | None = None,
             simulate: bool = True, all_stages: bool = True) -> Estimate:
    """Everything about one layout. Raises ConfigError if the layout breaks a rule. With
    all_stages=False only the stages that can be the most loaded are computed (fast; used by search)."""
    check(model, layout, work, gpus)
    topo.check(layout.gpus)
    mem = memory(model, layout, work, all_stages)
    stages = ranks_or(layout, range(layout.pp) if all_stages else
                      candidate_stages(model, layout.pp, layout.vpp, layout.partition))
    states = sum(mem.most_loaded[c] for c in ("weights", "grads", "optimizer"))
    by_stage, st = timed_stages(model, layout, work, topo, stages, states, simulate, owned_elements(mem, work))
    worst = max(by_stage, key=lambda j: sum(f.bytes_sent for f in by_stage[j]))
    order = runnable_order(layout, recommend_order(by_stage[worst]))
    warnings = placement_warnings(layout, topo, layout.order, order)
    if mem.host > topo.accelerator.host_memory:
        warnings.insert(0, f"does not fit the host: offload needs {mem.host / GiB:.1f} GiB of host memory per GPU, "
                           f"the topology gives {topo.accelerator.host_memory / GiB:.0f} GiB")
    reserve = device_reserve(topo.accelerator, work, mem.most_loaded["total"])["total"]
    if mem.most_loaded["total"] + reserve > topo.accelerator.memory:
        warnings.insert(0, f"does not fit: stage {mem.most_loaded['stage']} needs "
                           f"{mem.most_loaded['total'] / GiB:.1f} GiB and the device reserve "
                           f"{reserve / GiB:.2f} GiB, {topo.accelerator.name} has "
                           f"{topo.accelerator.memory / GiB:.0f} GiB")
    return Estimate(model, layout, work, topo, mem, by_stage[worst], by_stage, st, order,
                    placement(layout, topo, layout.order), warnings)


# Rounds of the crossing duty's fixed point (`timed_stages`): each re-places the flows at the duty the
# step before gives and re-times the step; it stops when the step moves by 1% or less.
DUTY_ROUNDS = 3


def timed_stages(model: PlanModel, layout: Layout, work: Workload, topo: Topology, stages, states: float,
                 simulate: bool, owned: float) -> tuple[dict[int, list[Flow]], StepTime]:
    """The given stages' placed flows and the step time. Where pipeline stages share an oversubscribed
    tier (`crossing_seconds`), their flows are placed again at the crossing duty the step before gives,
    a fixed point: at most DUTY_ROUNDS rounds on the closed-form step (the simulator's makespan moves
    with the costs alike), until the step moves by 1% or less; then the step as asked."""
    raw = {j: rank_flows(stage_flows, model, layout, work, j) for j in stages}   # placing fills tier and seconds
    by_stage = {j: place(raw[j], layout, topo) for j in stages}
    crossing = crossing_seconds(by_stage, layout, topo)
    if crossing:
        step = step_time(model, layout, work, topo, by_stage, states, False, owned).step_time_s
        for _ in range(DUTY_ROUNDS):
            duty = {i: min(1.0, sec / step) for i, sec in crossing.items()}
            by_stage = {j: place(raw[j], layout, topo, duty=duty) for j in stages}
            crossing = crossing_seconds(by_stage, layout, topo)
            before, step = step, step_time(model, layout, work, topo, by_stage, states, False, owned).step_time_s
            if abs(step - before) <= 0.01 * before:
                break
    return by_stage, step_time(model, layout, work, topo, by_stage, states, simulate, owned)


def crossing_seconds(by_stage: dict[int, list[Flow]], layout: Layout, topo: Topology) -> dict[int, float]:
    """Per oversubscribed tier that a domain shares between pipeline stages (`tiers.domain_stages` > 1
    for some group crossing it): the seconds a stage spends crossing it in a step, the mean over the
    stages of their in-stage groups' seconds there. Over the step time it is the crossing duty
    (topology.group_bandwidth). Empty where no such tier is crossed: then every rank of a domain crosses
    at once, as without a pipeline."""
    if layout.pp <= 1:
        return {}
    index = {t.name: i for i, t in enumerate(topo.tiers)}
    shared: dict[int, float] = {}
    for flows in by_stage.values():
        for f in flows:
            i = index.get(f.tier, 0)
            if i > 0 and topo.tiers[i].oversubscription > 1 and domain_stages(layout, topo, i, f.group) > 1:
                shared[i] = shared.get(i, 0.0) + f.seconds / len(by_stage)
    return shared


def runnable_order(layout: Layout, order: str) -> str:
    """`order`, or where its expert grid's stages would differ from the dense grid's (`grid.check_grids_agree`:
    the dimensions inside pp must have the same product on both grids, which folding's etp × ep × edp
    re-cut of tp × cp × dp breaks when pp stands among them) Megatron-Core's form with the cp / ep block in the ranking's order (tp, the block, dp, pp),
    else dp moved beside the block or ep, else ep beside dp; else the layout's own order."""
    dims = order.split("-")
    block = [d for d in dims if d in ("cp", "ep")]
    tries = [dims, ["tp", *block, "dp", "pp"]]     # tp inside the cp / ep block, dp right after it, pp outside
    last = max(("cp", "ep"), key=dims.index)
    for mover, anchor in (("dp", last), ("dp", "ep"), ("ep", "dp")):
        rest = [d for d in dims if d != mover]
        at = rest.index(anchor)
        tries += [[*rest[:at + 1], mover, *rest[at + 1:]], [*rest[:at], mover, *rest[at:]]]
    for t in tries:
        try:
            check_grids_agree(layout, t)
            return "-".join(t)
        except ConfigError:
            continue
    return layout.order


def order_candidates(layout: Layout, topo: Topology, first: str) -> list[str]:
    """Rank orders that place the groups on different tiers: the dimensions of size > 1 in every order
    (innermost first; those of size 1 after them, where they change nothing), one order per distinct
    placement (`tiers.placement`: the tier each group lands on), `first` leading."""
    sizes = {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "pp": layout.pp, "dp": layout.dp}
    live = [d for d in ("tp", "cp", "ep", "pp", "dp") if sizes[d] > 1]
    rest = [d for d in ("tp", "cp", "ep", "pp", "dp") if sizes[d] == 1]
    seen, out = set(), []
    for order in [first, *("-".join([*p, *rest]) for p in permutations(live))]:
        try:
            check_grids_agree(layout, order)    # (an expert grid whose stages differ from the dense grid's)
        except ConfigError:
            continue
        key = tuple(sorted(placement(layout, topo, order).items()))
        if key not in seen:
            seen.add(key)
            out.append(order)
    return out


def fastest_order(model: PlanModel, layout: Layout, work: Workload, topo: Topology, gpus: int | None = None,
                  first: str | None = None) -> tuple[str, "Estimate"]:
    """The order whose estimate is fastest among `order_candidates` (ties: the earlier, `first` leading:
    by default the byte-ranked `recommend_order`), and that estimate. The byte ranking keeps data
    parallelism outermost because its reduction overlaps the backward; on a network slow enough that the
    reduction no longer hides, the step times say otherwise (benchmarks/network.py: pp2 x dp2 on two
    nodes of a 200 Mbit/s link runs 2.4x faster with dp inside the nodes)."""
    first = first or estimate(model, layout, work, topo, gpus).recommended_order
    best = None
    for order in order_candidates(layout, topo, first):
        est = estimate(model, replace(layout, order=order), work, topo, gpus)
        if best is None or est.time.step_time_s < best[1].time.step_time_s:
            best = (order, est)
    return best
