"""Search every valid layout for a GPU count: those that fit ranked by step time, the rest with reasons.

The space: tp (valid for the heads, kv heads and MLP widths, within the innermost tier unless fixed),
pp, cp (ring, Ulysses, and hybrid where it differs from both), ep (MoE), dp = gpus/(tp·pp·cp), ZeRO 1-3
(ZeRO-1 sends the bytes of DDP and holds less, so stage 0 is searched only when fixed), micro-batch
size, virtual stages, recompute. Megatron sequence parallelism is on whenever tp > 1 (same bytes, less
memory) unless fixed off (sp_mode "none"). Micro-batch sizes and virtual stages are tried from
`POWERS` (1, 2, 4, 8): larger ones only add activation memory (micro-batch) or messages (vpp) for a
bubble that is already small.

GPU counts go up to `MAX_GPUS` (2**20; a larger one is refused at once, as is one above the topology's
size), and the degrees that divide them come from `rules.divisors` (prime factorisation, not a scan).

Mechanisms are choices of the search, per layout (`_one_layout`): recompute none → selective → full (for
an MLA model each with and without the norm/MLA recompute, `norm_mla_options`), at each the gradient
reduction once per step, then every micro-batch (`reduce_policies`: ZeRO-2/3 under a pipeline), the first
that fits kept (each later one only adds time or bytes); the expert all-to-all overlap on for ep > 1
(`ep_overlap_of`: it never costs time or memory in the plan); for a model with MTP modules both
placements of head and MTP (`head_options`: last stage, or DualPipe's with the embedding); offload below.
What the user gives is held. The best layout's choices are `mechanisms(layout)`, which the report prints.

Prunings, none of which drops a layout that could rank first: the mechanism ladder above; once a ZeRO
stage fits without recompute, higher stages are skipped (they only add traffic); and only the stages
that can be the most loaded (`units.candidate_stages`) or end the step last (`units.time_stages`) are
evaluated, with the closed-form bubble.

Branch and bound (`bound=True`, the default): every structure (tp, pp, cp, cp mode, ep, dp, etp) gets a lower
bound on the step time of each of its layouts, per (vpp, micro-batch, head placement) whatever the ZeRO stage, reduction
and recompute (`_Bound`): compute, in-layer tp/Ulysses/expert communication and exposed ring sends, which
are on the critical path whatever the rest, plus the bubble they imply; and, since a stage's gradient
reductions run one at a time inside the step, their least seconds (`_Bound._grad`; at 16,384 GPUs often
the larger part). The cheap part is computed for every structure, the reductions only for those that
reach the front of the queue (`_visit`). Structures are tried in the order of their bound; once `top`
layouts are timed, a structure or (vpp, micro-batch) pair whose bound exceeds the limit (the `top`-th best
step time found, or 1% above the fastest when that is higher, so every layout the tie rule may put first
is timed) cannot enter the best: it is skipped unchecked (no rules, no memory, no timing;
`Result.skipped_layouts` counts its layouts). A pair whose bound passes the limit when reached but not
after a layout of it was timed has the rest checked but not timed (`Result.untimed`). The ranking's first
`top` by step time, and the layouts tied with the fastest, are those of the exhaustive search
(`bound=False`); `Result.ranked` holds the layouts timed, `Result.fit` counts those that fit among the
layouts tried, timed or not. Timings per preset: benchmarks/README.md ("Planner search").

Ties (`tie_break`): among the layouts within `TIE` (1%) of the fastest step time, fewer bytes per rank on
the slowest tier any of them sends on come first, then fewer tier crossings (collective calls leaving
the innermost tier), then the faster (`traffic`, from the timed stages). The best `top` in that order are
then estimated in full on every stage (closed-form bubble); the figures shown are theirs.

Offload (`Layout.offload`, docs/plan.md "Offload") is a last resort: when no layout fits the device, the
search runs again over every structure with ZeRO's optimizer state in host memory ("cpu", ZeRO 1-3), and,
for a structure where that fits nowhere (device or host memory), on NVMe ("nvme"). So a search where
something fits without offload is the search without it, layout for layout; `Result.offload` says what
was tried. A fixed `offload` ("cpu", "nvme", or "none" for never) is held for every layout instead.
"""
from __future__ import annotations

import heapq
import time as _time
from dataclasses import dataclass, field
from typing import Iterable

from .. import rules
from ..grid import DEFAULT_ORDER
from ..rules import DUALPIPE, INTERLEAVED, ONE_F_ONE_B, ZB, ConfigError, Recompute, choices, cp_degrees, divisors
from ..parallel.zero.spec import ZeroSpec
from .estimate import Estimate, estimate, owned_elements, timed_stages
from .layout import Layout, Workload, check, valid_tp
from .memory import Memory, memory, stage_memory
from .units import (ExpertSplit, block_tensors, candidate_stages, head_stage, mtp_blocks, root_tensors, stage_layers, stage_params,
                    time_stages)
from .models import PlanModel
from .dualpipe import is_dualpipe, ranks_or
from .reserve import planned_limit
from .time import forward_seconds, stage_weights
from .topology import GiB, Topology
from ..comm import volume
from .traffic import Flow, layer_flows, ring_flows
from .tiers import group_block_of, least_duty, place

SEARCHED = ("tp", "pp", "dp", "cp", "ep", "etp", "zero", "vpp", "micro_batch", "recompute", "cp_mode", "sp_mode", "offload",
            "ep_overlap", "recompute_norm_mla", "head_first")
OFFLOADS = ("cpu", "nvme")   # tried in this order, per structure, when nothing fits the device
POWERS = (1, 2, 4, 8)   # micro-batch sizes and virtual stages tried
MAX_GPUS = 2**20        # the largest GPU count planned (about a million; larger clusters do not exist yet)


@dataclass
class Result:
    ranked: list[tuple[float, Layout]] = field(default_factory=list)   # (step time, layout), fastest first
    rejected: list[tuple[Layout, str]] = field(default_factory=list)
    best: list[Estimate] = field(default_factory=list)                 # the top ones, estimated in full
    considered: int = 0           # layouts tried (rules, then memory; timed when they fit)
    bounded: bool = True          # branch and bound on: layouts that cannot rank in the top are skipped
    top: int = 0                  # how many best layouts the bound keeps exact
    structures: int = 0           # (tp, pp, cp, cp mode, ep, dp, etp) combinations for the GPU count
    examined: int = 0             # structures with layouts tried
    skipped: int = 0              # structures skipped whole: their bound exceeds the top-th best step time
    skipped_layouts: int = 0      # layouts never tried: vpp × micro-batch × ZeRO × reduction × recompute
                                  # choices of the structures skipped, and those of the (vpp, micro-batch)
                                  # pairs skipped inside the structures examined
    untimed: int = 0              # layouts that fit but were not timed: their (vpp, micro-batch) bound
                                  # came to exceed the limit after the pair was reached (not in `ranked`)
    bound_limit: float | None = None   # the top-th best step time (or 1% above the fastest, if higher),
                                       # which the skipped layouts' bounds exceed
    bounds: list[float] = field(default_factory=list)   # per structure, in the exhaustive order
    offload: dict = field(default_factory=dict)   # offload mode -> structures searched with it (only when
                                                  # nothing fit without offload), and "fit": layouts that fit
    traffic: dict = field(default_factory=dict)   # timed layout -> `traffic` (bytes per tier, crossings)
    tied: int = 0                 # timed layouts within TIE of the fastest (ordered by `tie_break`)
    seconds: float = 0.0          # wall clock
    norm_mla: list = field(default_factory=lambda: [False])   # recompute_norm_mla choices (`norm_mla_options`)
    cpu_seconds: float = 0.0      # this process's CPU time (what a loaded machine does not inflate)

    @property
    def fit(self) -> int:
        """Layouts tried that fit: those timed (`ranked`) and those the bound left untimed."""
        return len(self.ranked) + self.untimed

    def reasons(self) -> dict[str, int]:
        """Rejections counted by the rule or limit they broke (text before the first colon)."""
        out: dict[str, int] = {}
        for _, why in self.rejected:
            key = why.split(":")[0]
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _options(name: str, fixed: dict, default: list) -> list:
    return [fixed[name]] if fixed.get(name) is not None else default


def _structures(model: PlanModel, work: Workload, topo: Topology, gpus: int, fixed: dict):
    """Yield (tp, pp, cp, cp_mode, ep, dp, etp) that divide the GPU count, and (Layout, reason) for tp beyond
    the first tier, in the order the exhaustive search meets them. A MoE model's experts fold over the
    stage's tp·cp·dp ranks (MoE parallel folding): ep up to tp·cp·dp, with etp 1 (Megatron-Core's advice:
    expert parallelism before expert tensor parallelism) or etp = tp (each expert cut as tp cuts a dense MLP)."""
    domain = topo.tiers[0].size or gpus
    for tp in _options("tp", fixed, [d for d in valid_tp(model) if gpus % d == 0]):
        if fixed.get("tp") is None and tp > domain:
            yield Layout(tp=tp), f"tp beyond the {topo.tiers[0].name} domain: tp={tp} > {domain} GPUs"
            continue
        if gpus % tp:
            continue
        for pp in _options("pp", fixed, [d for d in divisors(gpus // tp) if d <= model.layers]):
            if gpus % (tp * pp):
                continue
            for cp in _options("cp", fixed, [d for d in divisors(gpus // (tp * pp)) if d <= work.seq // 2 or d == 1]):
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if fixed.get("dp") is not None and dp != fixed["dp"]:
                    continue
                modes = ["ring"] if cp == 1 else _options("cp_mode", fixed, _cp_modes(model, tp, cp))
                etps = _options("etp", fixed, _etp_options(model, tp))
                for mode in modes:
                    for etp in etps:
                        eps = [1] if not model.moe else [d for d in divisors(model.experts)
                                                         if (tp * dp * cp) % (d * etp) == 0]
                        for ep in _options("ep", fixed, eps):
                            if model.moe and (tp * dp * cp) % (ep * etp):
                                continue   # a given ep this structure's experts cannot fold onto
                            yield tp, pp, cp, mode, ep, dp, etp


def _etp_options(model: PlanModel, tp: int) -> list[int]:
    """Expert tensor-parallel degrees searched: 1, and tp where it splits the expert width (a dense model: 1)."""
    return [1] + ([tp] if model.moe and tp > 1 and model.moe_ffn % tp == 0 else [])


def _cp_modes(model: PlanModel, tp: int, cp: int) -> list[str]:
    """Ring and Ulysses, and hybrid when its split differs from both (else it is one of them)."""
    u, _ = cp_degrees("hybrid", cp, model.heads, tp)
    return ["ring", "ulysses"] + (["hybrid"] if 1 < u < cp else [])


@dataclass
class _Space:
    """The choices searched inside one structure (degrees and cp mode)."""
    per_dp: int        # sequences per data-parallel rank per step (0: the global batch does not divide)
    mbs: list
    vpps: list
    zeros: list
    sp_mode: str
    base: dict         # the Layout fields the structure fixes
    heads: list = field(default_factory=lambda: [False])   # head_first choices at vpp 1 (`head_options`)

    def heads_at(self, v: int) -> list:
        """head_first choices at `v` virtual stages: DualPipe's placement needs one chunk a stage."""
        return self.heads if v == 1 else [False]

    def size(self, recomputes: list, norm_mla: list) -> int:
        return len(self.mbs) * sum(self.pair_size(recomputes, norm_mla, v) for v in self.vpps)

    def pair_size(self, recomputes: list, norm_mla: list, v: int = 1) -> int:
        """Layouts of one (vpp, micro-batch): head placements × ZeRO stages × reduction policies × recompute
        rungs (with the norm/MLA recompute's choices)."""
        rungs = sum(len(_norm_mla_rungs(rc, norm_mla)) for rc in recomputes)
        return len(self.heads_at(v)) * sum(len(reduce_policies({"zero": z, "pp": self.base["pp"]}))
                                           for z in self.zeros) * rungs


def schedule_for(vpp: int, given: str | None) -> str:
    """The schedule a searched layout with `vpp` runs: the one the user gave, else 1F1B, or the interleaved
    schedule where vpp > 1 (which needs it)."""
    return given if given is not None else (INTERLEAVED if vpp > 1 else ONE_F_ONE_B)


def _vpp_options(model: PlanModel, pp: int, given: str | None) -> list[int]:
    """Virtual stages tried when the user fixed none: 1 at pp = 1 or under a given schedule other than the
    interleaved one; else the powers of two up to a layer a chunk (only > 1 when the interleaved schedule
    was given)."""
    if pp == 1 or given not in (None, INTERLEAVED):
        return [1]
    vpps = [v for v in POWERS if pp * v <= model.layers and (v > 1 or given is None)]
    return vpps or [1]


def _space(model: PlanModel, work: Workload, fixed: dict, structure: tuple, order: str, partition: str,
           schedule: str | None = None) -> _Space:
    tp, pp, cp, mode, ep, dp, etp = structure
    per_dp = work.global_batch // dp if work.global_batch % dp == 0 else 0
    mbs = _options("micro_batch", fixed, [b for b in POWERS if per_dp and per_dp % b == 0] or [1])
    vpps = _options("vpp", fixed, _vpp_options(model, pp, schedule))
    offload = fixed.get("offload", "none")
    # offload needs ZeRO's shards: stages 1-3, even over one rank (ZeRO at dp = 1 still makes its units)
    zeros = _options("zero", fixed, [0] if dp * cp == 1 and offload == "none" else [1, 2, 3])
    sp_mode = fixed.get("sp_mode", "megatron") if tp > 1 else "none"
    base = dict(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, sp_mode=sp_mode, cp_mode=mode, order=order,
                partition=partition if pp > 1 else "even", offload=offload,
                ep_overlap=ep_overlap_of(model, ep, fixed))
    return _Space(per_dp, mbs, vpps, zeros, sp_mode, base, head_options(model, pp, fixed, schedule))


def head_options(model: PlanModel, pp: int, fixed: dict, schedule: str | None = None) -> list[bool]:
    """`Layout.head_first` choices: DualPipe's placement of the final norm, head and MTP modules with the
    embedding on the first stage (DeepSeek-V3 §3.2.1, §3.2.3), tried beside the last stage for a model with
    MTP modules under a pipeline (the published run that places them so), unless fixed; at vpp 1 only
    (`_Space.heads_at`). DualPipe places them with the embedding itself (plan/dualpipe.py): False."""
    if schedule == DUALPIPE:
        return [False]
    if "head_first" in fixed:
        return [bool(fixed["head_first"]) and pp > 1]
    return [False, True] if model.mtp_depth and pp > 1 else [False]


def ep_overlap_of(model: PlanModel, ep: int, fixed: dict) -> bool:
    """Expert all-to-alls overlapped with another micro-batch's compute (`Layout.ep_overlap`; DeepSeek-V3
    §3.2.1, DualPipe; Megatron-Core's --overlap-moe-expert-parallel-comm): on for a MoE layout with ep > 1
    unless fixed off. It never adds time or memory in the plan (`time.ep_exposed`: the exposed part is
    max(excess, comm_share x a2a) <= a2a), so trying it off as well could not rank better."""
    return bool(model.moe and ep > 1 and fixed.get("ep_overlap", True))


def norm_mla_options(model: PlanModel, fixed: dict) -> list[bool]:
    """`recompute_norm_mla` choices (DeepSeek-V3 §3.4: norms and MLA up-projections recomputed in the
    backward): off, then on, for an MLA model unless fixed; off for any other (it changes nothing there)."""
    if "recompute_norm_mla" in fixed:
        return [bool(fixed["recompute_norm_mla"])]
    return [False, True] if model.mla else [False]


class _Bound:
    """A lower bound on `_fast_time` of every layout of a structure, whatever its virtual stages,
    micro-batch size, ZeRO stage and recompute (the ones its `_Space` lists).

    `_fast_time` is pipeline + gradient + step collectives + optimizer, each >= 0, with pipeline =
    c·(m + (p-1)/v) under the closed-form bubble (ZB-H1: m·c + (p-1)·F), c = max over the timed stages
    (`time_stages`) of one micro-batch's F + B + in-layer communication C. So for each timed stage j

        step >= (m + (p-1)/v)·(F_j + B_j + C_j)       (ZB-H1: m·(F_j + B_j + C_j) + (p-1)·F_j)

    with B >= 2F (recompute only adds) and C_j at least the rows of `traffic.layer_flows` (tp, Ulysses
    and expert all-to-alls; without recompute, which only adds calls; the expert all-to-alls whole, or with
    ep_overlap the share `comm_share` of them that shows at least) plus ring sends beyond what the attention hides,
    max(0, ring - 3·attention). All are linear in the layers of each kind, so they are
    computed per dense layer, MoE layer, embedding and head, per dimension, once per (degrees, micro-batch,
    placement of that dimension's group) and scaled. The tp gradient sync, pipeline sends, gradient
    reduction, step collectives and the optimizer count as 0. The bound is the minimum over v and the
    micro-batch size. Where local ranks share cores (`ranks_per_core` o > 1) a pipeline's bound is divided
    by min(o, pp), as `time.shared_cores_makespan` may divide its makespan."""

    SLACK = 1 - 1e-9   # floating-point sums in another order must not lift the bound above a real time

    def __init__(self, model: PlanModel, work: Workload, topo: Topology, gpus: int, schedule: str, partition: str,
                 order: str):
        self.model, self.work, self.topo, self.gpus = model, work, topo, gpus
        self.schedule, self.partition, self.order = schedule, partition, order
        self.peak = topo.accelerator.peak(work.dtype) * work.efficiency
        # ranks sharing cores: a pipeline's makespan may shrink by up to this (time.shared_cores_makespan)
        self.shared = max(1.0, topo.accelerator.ranks_per_core)
        # pipeline stages sharing an oversubscribed tier: the fewest crossers they can give (duty 0)
        self.least = least_duty(topo)
        self.attn = model.attention_flops_per_token(work.attention_span, work.causal) / model.layers   # per layer
        self.rows: dict = {}     # (pp, vpp) -> per timed stage (layers, MoE layers, first, last, F per token)
        self.tp: dict = {}       # one micro-batch's tp seconds: per dense layer, MoE layer, embedding, head
        self.cp: dict = {}       # per layer: Ulysses, plus ring sends beyond the attention
        self.ep: dict = {}       # per MoE layer: expert all-to-alls
        self.grad: dict = {}     # (degrees, vpp, ZeRO stages) -> least gradient reduction seconds
        self.rates: dict = {}    # (group, size, op, block) -> (seconds per byte sent, per call)
        self.big: dict = {}      # (tp, ep, expert, MoE layer, bucket) -> (tensors larger, their bytes)
        self.stages: dict = {}   # (tp, pp, vpp, ep, partition, ZeRO stages) -> `_grad_stages`

    def _stage_rows(self, pp: int, v: int, head_first: bool = False):
        key = (pp, v, head_first)
        if key not in self.rows:
            model, part = self.model, self.partition if pp > 1 else "even"
            try:
                ranks = stage_layers(model.layers, pp, v, part)
                weights = stage_weights(model, pp, v, part, head_first)
                timed = time_stages(model, pp, v, part)
            except (ConfigError, ValueError):   # the partition rule rejects every such layout
                self.rows[key] = None
                return None
            out = []
            for j in timed:
                blocks = ranks[j] + mtp_blocks(model, pp, j, head_first)   # the MTP modules' with the head
                n = len(blocks)
                body, head = weights[j]
                out.append((n, sum(1 for i in blocks if model.is_moe_layer(i)), j == 0, j == head_stage(pp, head_first),
                            forward_seconds(model, self.work, self.topo, 1.0, body, n, head)))
            self.rows[key] = tuple(out)
        return self.rows[key]

    def _seconds(self, probe: Layout, dim: str, n: int, moe: int, first: bool, last: bool) -> float:
        """One micro-batch's seconds of `dim`'s in-layer rows; the two parts of a node-limited all-to-all
        overlap (`time._per_dim_seconds`): the longer counts."""
        plain, parts = 0.0, {"inter": 0.0, "intra": 0.0}
        for fl in place(layer_flows(self.model, probe, self.work, n, moe, first, last, dims=(dim,)), probe,
                        self.topo, duty=self.least):
            if fl.part in parts:
                parts[fl.part] += fl.seconds
            else:
                plain += fl.seconds
        return plain + max(parts.values())

    def _basis(self, tp: int, pp: int, dp: int, cp: int, mode: str, ep: int, sp_mode: str, b: int,
               blocks: tuple, ep_factor: float = 1.0, etp: int = 1) -> tuple:
        """(dense layer, MoE layer, embedding, head) seconds of one micro-batch of b sequences; `blocks`:
        the tp, cp and ep groups' blocks (`group_block_of`), which place them. `ep_factor`: the share of
        the expert all-to-alls that shows at least (1 exposed; with ep_overlap the SMs' share they take
        from the compute beside them, `time.interfered`)."""
        probe = None
        k_tp = (tp, cp, sp_mode, b, blocks[0])
        k_cp = (tp, cp, mode, b, blocks[1])
        k_ep = (tp, cp, ep, etp, b, blocks[2])
        if k_tp not in self.tp or k_cp not in self.cp or k_ep not in self.ep:
            probe = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, cp_mode=mode, sp_mode=sp_mode, micro_batch=b,
                           order=self.order)
        if k_tp not in self.tp:
            whole = [self._seconds(probe, "tp", *x) for x in
                     ((1, 0, False, False), (1, 1, False, False), (0, 0, True, False), (0, 0, False, True))]
            self.tp[k_tp] = tuple(max(0.0, w - h) for w, h in zip(whole, self._tp_hideable(probe)))
        if k_cp not in self.cp:
            ring = sum(fl.seconds for fl in place(ring_flows(self.model, probe, self.work, 1), probe, self.topo,
                                                  duty=self.least))
            hidden = 3 * b * self.work.seq / (tp * cp) * self.attn / self.peak   # attention of one layer
            self.cp[k_cp] = self._seconds(probe, "cp", 1, 0, False, False) + max(0.0, ring - hidden)
        if k_ep not in self.ep:
            self.ep[k_ep] = self._seconds(probe, "ep", 1, 1, False, False) if self.model.moe else 0.0
        dense, moe, first, last = self.tp[k_tp]
        layer = self.cp[k_cp]
        return dense + layer, moe + layer + ep_factor * self.ep[k_ep], first, last

    def _tp_hideable(self, probe: Layout) -> tuple[float, float, float, float]:
        """The most of one micro-batch's tp seconds that can hide behind column GEMMs (`time.tp_hidden`: each
        call at most (1 - comm_share) of itself) per dense layer, MoE layer, embedding and head: every entry
        counted as if its weights trained and it ran fused, so the bound stays below every timed layout."""
        if probe.tp == 1:
            return 0.0, 0.0, 0.0, 0.0
        h = self.model.hidden
        act = probe.micro_batch * self.work.seq / probe.cp * h * self.work.act_bytes
        back = self._one_call(probe, "tp", probe.tp, "reduce_scatter" if probe.seq_parallel else "all_reduce", act)
        gather = self._one_call(probe, "tp", probe.tp, "all_gather", act) if probe.seq_parallel else 0.0
        attn = 0.0 if self.model.mla else back
        exit_ = 0.0     # an exit under SP on gloo: its reduce-scatter forward, all-gather backward
        if probe.seq_parallel and volume.ALGORITHMS[self.work.backend]["reduce_scatter"][0] == "pairwise":
            exit_ = self._one_call(probe, "tp", probe.tp, "reduce_scatter", act) + gather
        free = 1.0 - self.topo.accelerator.comm_share
        # a dense layer: attention's entry and exit, the MLP's entry, gather and exit; an MoE layer: attention's
        return free * (attn + back + gather + 2 * exit_), free * (attn + exit_), 0.0, free * back

    def _grad(self, tp: int, pp: int, dp: int, cp: int, ep: int, v: int, zeros: list, heads: tuple = (False,),
              etp: int = 1) -> float:
        """The least seconds of the timed stages' gradient reductions (dp·cp and expert-dp), the most
        loaded of them: each stage's reductions run one at a time on one stream inside the step, so the
        step lasts at least their sum whatever hides behind what. At least the stage's parameters once
        (ZeRO pads them up, per-micro-batch reduction sends them m times) in as few calls
        as its units can be (each pays its latency): ZeRO-3's blocks one per layer holding such parameters,
        buckets at least one per tensor larger than bucket_mb plus the rest's bytes over bucket_mb (`_big`),
        reduce-scattered (ZeRO 1-3) or all-reduced (ZeRO-0), whichever is cheaper among the stages
        searched."""
        key = (tp, pp, dp, cp, ep, etp, v, tuple(zeros), tuple(heads))
        if key not in self.grad:
            ops = sorted({"all_reduce" if z == 0 else "reduce_scatter" for z in zeros})
            least = []   # per head placement: the most loaded timed stage's least reduction seconds
            for hf in heads:
                probe = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vpp=v,
                               partition=self.partition if pp > 1 else "even",
                               order=self.order, head_first=hf)
                groups = (("dp_cp", dp * cp), ("edp", probe.edp))
                worst = 0.0
                for stage in self._grad_stages(probe, tuple(zeros)):   # per timed stage: (message, calls) per group
                    each = [sum(self._one_call(probe, group, n, op, message, calls)
                                for (group, n), (message, calls) in zip(groups, stage)) for op in ops]
                    worst = max(worst, min(each, default=0.0))
                least.append(worst)
            self.grad[key] = min(least)
        return self.grad[key]

    def _grad_stages(self, probe: Layout, zeros: tuple) -> list:
        """Per timed stage of `probe`'s pipeline, ((bytes, least calls) of the dense gradients, (bytes,
        least calls) of the expert ones): the same for every dp and cp (cached without them)."""
        tp, pp, v, ep, part, hf = probe.tp, probe.pp, probe.vpp, ExpertSplit.of(probe), probe.partition, probe.head_first
        key = (tp, pp, v, ep, part, zeros, hf)
        if key not in self.stages:
            blocks = {rules.block_units(z, pp, each) for z in zeros for each in reduce_policies({"zero": z, "pp": pp})}
            bucket, r, g = probe.bucket_mb * 2**20, self.work.reduce_bytes, self.work.grad_bytes
            out = []
            for j, (n_layers, n_moe, *_) in zip(time_stages(self.model, pp, v, part), self._stage_rows(pp, v, hf)):
                roots = [n for n, _ in root_tensors(self.model, tp, pp, j, hf)]
                row = []
                mtp = len(mtp_blocks(self.model, pp, j, hf))
                mtp_moe = mtp if self.model.is_moe_layer(self.model.layers) else 0
                for expert, k in zip((False, True), stage_params(self.model, probe, j)):
                    units = n_moe if expert else n_layers   # blocks: one per block holding such parameters
                    big, big_bytes = self._big(tp, ep, expert, n_layers - n_moe - (mtp - mtp_moe), n_moe - mtp_moe,
                                               mtp, () if expert else roots, bucket)
                    buckets = big + -(-max(0, k * g - big_bytes) // bucket)
                    row.append((k * r, max(1, min(units if blk else buckets for blk in blocks))))
                out.append(tuple(row))
            self.stages[key] = out
        return self.stages[key]

    def refine(self, structure: tuple, sp: _Space, table: dict) -> tuple[float, dict]:
        """`__call__`'s bound and table raised to the gradient reductions' least seconds (`_grad`)."""
        tp, pp, cp, mode, ep, dp, etp = structure
        reduce = {(v, hf): self._grad(tp, pp, dp, cp, ep, v, sp.zeros, (hf,), etp) * self.SLACK
                  for v in sp.vpps for hf in sp.heads_at(v)}
        table = {(v, b, hf): max(t, reduce[v, hf]) for (v, b, hf), t in table.items()}
        return min(table.values()), table

    def _big(self, tp: int, ep: ExpertSplit, expert: bool, dense: int, moe: int, mtp: int, roots: tuple | list,
             bucket: float) -> tuple[int, float]:
        """(gradient tensors larger than a `bucket` of bytes, their bytes) of a stage with `dense` dense and
        `moe` MoE layers, `mtp` MTP modules and the `roots` (embedding, norm, head sizes), expert tensors or
        the others. Each such tensor is a bucket of its own; the rest fill buckets of at most `bucket`
        (`shapes.bucket_ranges`), so a stage makes at least big + (the rest's bytes / bucket) of them."""
        g = self.work.grad_bytes
        out_n, out_b = 0, 0.0
        for kind, count in ((False, dense), (True, moe), ("mtp", mtp)):
            if count:
                key = (tp, ep, expert, kind, bucket)
                if key not in self.big:
                    i = self.model.layers if kind == "mtp" else \
                        next(i for i in range(self.model.layers) if self.model.is_moe_layer(i) == kind)
                    sizes = [n * g for n, ex, _ in block_tensors(self.model, i, tp, ep)
                             if ex == expert and n * g > bucket]
                    self.big[key] = len(sizes), sum(sizes)
                n, b = self.big[key]
                out_n, out_b = out_n + count * n, out_b + count * b
        sizes = [n * g for n in roots if n * g > bucket]
        return out_n + len(sizes), out_b + sum(sizes)

    def _one_call(self, probe: Layout, group: str, n: int, op: str, message: float, calls: int = 1) -> float:
        """Seconds of `calls` `op`s of `message` bytes in all over `group` (n ranks) as `place` times them:
        bytes sent over the group's bandwidth plus each call's latency, both linear, so placed once per
        group block."""
        if n <= 1 or message <= 0:
            return 0.0
        block = group_block_of(probe.tp, probe.pp, probe.dp, probe.cp, probe.ep, group, self.order, 0, probe.etp)
        key = (group, n, op, block)
        if key not in self.rates:
            per_byte, per_call = (place([Flow("dp", op, group, n, calls=c, bytes_sent=b, backend=self.work.backend)],
                                        probe, self.topo, duty=self.least)[0].seconds
                                  for c, b in ((0, 1.0), (1, 0.0)))
            self.rates[key] = per_byte, per_call
        per_byte, per_call = self.rates[key]
        return volume.bytes_sent(op, message, n, self.work.backend) * per_byte + calls * per_call

    def __call__(self, structure: tuple, sp: _Space) -> tuple[float, dict | None]:
        """(bound of the structure, bound per (vpp, micro-batch, head placement) or None: examine every one), the
        gradient reductions counted 0 (`refine` adds them)."""
        tp, pp, cp, mode, ep, dp, etp = structure
        if not sp.per_dp or any(sp.per_dp % b for b in sp.mbs):
            return 0.0, None    # a rule rejects these at once: examine them
        per_token = self.work.seq / (tp * cp)
        rows_v = [(v, hf, self._stage_rows(pp, v, hf)) for v in sp.vpps for hf in sp.heads_at(v)]
        if any(rows is None for *_, rows in rows_v):
            return 0.0, None
        blocks = tuple(group_block_of(tp, pp, dp, cp, ep, g, self.order, 0, etp) for g in ("tp", "cp", "ep"))
        table = {}
        # with ep_overlap the all-to-alls show at least comm_share of themselves (`time.ep_exposed`)
        ep_factor = self.topo.accelerator.comm_share if sp.base.get("ep_overlap") else 1.0
        for b in sp.mbs:
            per_layer, per_moe, first, last = self._basis(tp, pp, dp, cp, mode, ep, sp.sp_mode, b, blocks, ep_factor,
                                                          etp)
            m, tokens = sp.per_dp // b, b * per_token
            for v, hf, rows in rows_v:
                c = c_first = c_last = 0.0        # the slowest timed stage (a plain loop: the search's hottest)
                for n, moe, fst, lst, f in rows:
                    x = 3 * f * tokens + (n - moe) * per_layer + moe * per_moe + fst * first + lst * last
                    if x > c:
                        c = x
                    if fst:
                        c_first = x
                    if lst:
                        c_last = x
                if pp == 1:
                    t = m * c
                elif schedule_for(v, self.schedule) == DUALPIPE:
                    # rank 0 holds the first and last stages, each for half the micro-batches (plan/dualpipe.py)
                    c = (c_first + c_last) / 2
                    t = (m * c + (pp // 2 - 1) * c / 2) / min(self.shared, pp)
                elif schedule_for(v, self.schedule) == ZB:
                    t = (m * c + (pp - 1) * min(f * tokens for *_, f in rows)) / min(self.shared, pp)
                else:
                    t = c * (m + (pp - 1) / (v if schedule_for(v, self.schedule) == INTERLEAVED else 1)) / min(self.shared, pp)
                table[v, b, hf] = t * self.SLACK   # per (vpp, micro-batch, head placement)
        return min(table.values()), table


def _visit(model, work, topo, gpus, schedule, partition, order, structures, spaces, res: Result, tables: list,
           best: "_Top"):
    """Yield the structures to examine, most promising first, until the rest cannot enter the best `top`.
    Every structure starts with the bound without its gradient reductions (cheap); the one with the
    lowest bound, when not yet refined, gets the whole bound (`_Bound.refine`) and goes back in
    the queue; refined, it is examined. Once the lowest bound exceeds the `top`-th best step time found,
    so does every bound left. Fills `res.bounds` (the bound each structure reached) and `tables`."""
    lower = _Bound(model, work, topo, gpus, schedule, partition, order)
    pairs = [lower(s, sp) for s, sp in zip(structures, spaces)]
    res.bounds[:], tables[:] = [b for b, _ in pairs], [t for _, t in pairs]
    queue = [(b, i, False) for i, b in enumerate(res.bounds)]
    heapq.heapify(queue)
    while queue and queue[0][0] <= best.limit():
        b, i, whole = heapq.heappop(queue)
        if whole or tables[i] is None:
            yield i
            continue
        res.bounds[i], tables[i] = lower.refine(structures[i], spaces[i], tables[i])
        heapq.heappush(queue, (res.bounds[i], i, True))


class _Top:
    """The `keep` best step times found so far, and the fastest."""

    def __init__(self, keep: int):
        self.keep, self.heap, self.fastest = max(1, keep), [], float("inf")   # heap negated: a max-heap

    def push(self, t: float) -> None:
        self.fastest = min(self.fastest, t)
        if len(self.heap) < self.keep:
            heapq.heappush(self.heap, -t)
        elif t < -self.heap[0]:
            heapq.heapreplace(self.heap, -t)

    def limit(self) -> float:
        """A layout slower than this can neither enter the best `keep` by step time nor tie with the fastest
        (within `TIE`, where `tie_break` may put it first)."""
        return max(-self.heap[0], self.fastest * (1 + TIE)) if len(self.heap) >= self.keep else float("inf")


def _fast_time(model, layout, work, topo, mem) -> tuple[float, tuple]:
    """Step time from the stages that can end the step last (`units.time_stages`) and the closed-form
    bubble, and those stages' `traffic`."""
    stages = ranks_or(layout, time_stages(model, layout.pp, layout.vpp, layout.partition))
    states = sum(mem.most_loaded[c] for c in ("weights", "grads", "optimizer"))
    flows, t = timed_stages(model, layout, work, topo, stages, states, False, owned_elements(mem, work))
    return t.step_time_s, traffic(flows.values(), topo)


def traffic(stages: Iterable[list], topo: Topology) -> tuple[dict, int]:
    """(bytes a rank sends per step on each network tier, its tier crossings: the collective calls whose
    group leaves the innermost tier), the most any of the given stages' ranks does. Offload copies
    (PCIe, NVMe) are the accelerator's own links, not network tiers."""
    names = [t.name for t in topo.tiers]
    per_tier, crossings = dict.fromkeys(names, 0.0), 0
    for flows in stages:
        mine = dict.fromkeys(names, 0.0)
        calls = 0
        for fl in flows:
            if fl.tier in mine:
                mine[fl.tier] += fl.bytes_sent
                calls += fl.calls if fl.tier != names[0] else 0
        per_tier = {k: max(per_tier[k], mine[k]) for k in names}
        crossings = max(crossings, calls)
    return per_tier, crossings


def search(model: PlanModel, work: Workload, topo: Topology, gpus: int, fixed: dict | None = None,
           top: int = 5, order: str = DEFAULT_ORDER, partition: str = "even", schedule: str | None = None,
           bound: bool = True) -> Result:
    """All layouts for `gpus` GPUs with the `fixed` choices (keys of SEARCHED) held, ranks in `order`,
    layers split by `partition` (even or llama3; counts only with pp fixed), the pipeline `schedule` the user
    gave (None: 1F1B, interleaved where vpp > 1; a schedule given is kept, so vpp > 1 is tried only under
    the interleaved one); see module doc. With `bound`,
    structures whose lower bound on step time exceeds the `top`-th best found are skipped, and layouts
    that fit with such a bound are not timed (the best `top` are those of the exhaustive search,
    bound=False)."""
    t0, c0 = _time.perf_counter(), _time.process_time()
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    unknown = sorted(set(fixed) - set(SEARCHED))
    if unknown:
        raise ValueError(f"search: {unknown} are not layout choices the search holds; valid keys: {', '.join(SEARCHED)}")
    bound = bound and top >= 1
    if not 1 <= gpus <= MAX_GPUS:
        raise ConfigError(f"gpus must be between 1 and {MAX_GPUS} (the planner's limit), got {gpus}; "
                          f"valid: 1..{MAX_GPUS}")
    topo.check(gpus)
    # what a layout's planned bytes may fill: the device less its reserve (plan/reserve.py)
    res, limit = Result(bounded=bound, top=top), planned_limit(topo.accelerator, work)
    recomputes = _options("recompute", fixed, list(choices(Recompute)))
    res.norm_mla = norm_mla_options(model, fixed)
    structures, early = [], {}     # early[i]: rejections met before structure i
    for s in _structures(model, work, topo, gpus, fixed):
        if isinstance(s[0], Layout):
            early.setdefault(len(structures), []).append(s)
            res.considered += 1
        else:
            structures.append(s)
    spaces = [_space(model, work, fixed, s, order, partition, schedule) for s in structures]
    res.structures = len(structures)
    tables: list = [None] * len(structures)
    best = _Top(top if bound else 0)
    ranked: dict[int, list] = {}
    rejected: dict[int, list] = {}
    visit = []
    for i in _visit(model, work, topo, gpus, schedule, partition, order, structures, spaces, res, tables, best) \
            if bound else range(len(structures)):
        visit.append(i)
        ranked[i], rejected[i] = [], []
        _structure(model, work, topo, gpus, res, limit, recomputes, schedule, spaces[i], ranked[i], rejected[i],
                   tables[i], best)
    if bound:
        rest = [i for i in range(len(structures)) if i not in ranked]
        res.skipped = len(rest)
        res.skipped_layouts += sum(spaces[k].size(recomputes, res.norm_mla) for k in rest)
    if fixed.get("offload") is None and fixed.get("zero") != 0 and not any(ranked.values()) and not res.untimed:
        # nothing fits the device: every structure again with the optimizer state offloaded (cpu, then nvme)
        for i in visit:
            for mode in OFFLOADS:
                sp = _space(model, work, dict(fixed, offload=mode), structures[i], order, partition, schedule)
                res.offload[mode] = res.offload.get(mode, 0) + 1
                before = len(ranked[i]) + res.untimed
                _structure(model, work, topo, gpus, res, limit, recomputes, schedule, sp, ranked[i], rejected[i],
                           tables[i], best)
                if len(ranked[i]) + res.untimed > before:
                    res.offload["fit"] = res.offload.get("fit", 0) + len(ranked[i]) + res.untimed - before
                    break
    if res.skipped_layouts or res.untimed:
        res.bound_limit = best.limit()
    # in the exhaustive order: ties in step time rank as the exhaustive search ranks them
    for i in range(len(structures) + 1):
        res.rejected += early.get(i, [])
        if i in rejected:
            res.rejected += rejected[i]
            res.ranked += ranked[i]
    res.examined = len(ranked)
    res.ranked.sort(key=lambda x: x[0])
    chosen = tie_break(res.ranked, res.traffic, topo)
    res.tied = sum(1 for t, _ in res.ranked if t <= res.ranked[0][0] * (1 + TIE))
    res.best = [estimate(model, lay, work, topo, gpus, simulate=False) for _, lay in chosen[:top]]
    res.seconds = _time.perf_counter() - t0
    res.cpu_seconds = _time.process_time() - c0
    return res


def mechanisms(layout: Layout) -> dict[str, str]:
    """The mechanisms a layout runs with, as the search chose them: the gradient reduction (once per
    step, or every micro-batch: ZeRO-2/3 without a pipeline always, under one with
    `reduce_each_microbatch`), recompute, and offload of ZeRO's optimizer state."""
    each = layout.zero_spec.reduces_each_microbatch
    out = {"gradient reduction": "every micro-batch" if each else "once per step", "recompute": layout.recompute,
           "offload": layout.offload}
    if layout.ep > 1:
        out["expert all-to-all"] = "overlapped" if layout.ep_overlap else "exposed"
    if layout.recompute_norm_mla:
        out["recompute"] += " + norms and MLA up-projections"
    if layout.head_first:
        out["head"] = "with the embedding on the first stage (DualPipe's placement)"
    return out


TIE = 0.01   # step times within 1% of the fastest are a tie


def tie_break(ranked: list[tuple[float, Layout]], traffic_of: dict, topo: Topology) -> list[tuple[float, Layout]]:
    """`ranked` (step time, layout), fastest first, with the layouts within `TIE` of the fastest step time
    reordered: fewest bytes per rank on the slowest tier any of them sends on (the outermost of the
    topology's tiers), then fewest tier crossings (`traffic`), then the faster. `traffic_of`: layout ->
    `traffic`. A 2 ms win out of 43 s is noise in the model; 1.6 TiB more per rank on the spine is not."""
    ranked = sorted(ranked, key=lambda x: x[0])
    if not ranked:
        return ranked
    cut = ranked[0][0] * (1 + TIE)
    n = sum(1 for t, _ in ranked if t <= cut)
    tied = ranked[:n]
    slowest = tie_tier([traffic_of[lay] for _, lay in tied], topo)
    return sorted(tied, key=lambda x: (traffic_of[x[1]][0][slowest], traffic_of[x[1]][1], x[0])) + ranked[n:]


def tie_tier(traffics: list[tuple[dict, int]], topo: Topology) -> str:
    """The slowest tier any of the `traffic`s sends bytes on: the outermost used (the innermost if none)."""
    for tier in reversed(topo.tiers):
        if any(per_tier[tier.name] > 0 for per_tier, _ in traffics):
            return tier.name
    return topo.tiers[0].name


def _structure(model, work, topo, gpus, res: Result, limit: float, recomputes: list, schedule: str, sp: _Space,
               ranked: list, rejected: list, table: dict | None, best: _Top) -> None:
    """Every layout of one structure, with the prunings of the module doc; with a `table` of bounds per
    (vpp, micro-batch), the layouts of pairs whose bound exceeds the best's limit are not timed."""
    mbs, vpps, zeros, base = sp.mbs, sp.vpps, sp.zeros, sp.base
    for vi, v in enumerate(vpps):
        kw = dict(base, vpp=v, schedule=schedule_for(v, schedule))
        for i, mb in enumerate(mbs):
            status = []
            heads = sp.heads_at(v)
            if table is not None:      # a head placement whose bound exceeds the limit cannot rank: not tried
                kept = [hf for hf in heads if table[v, mb, hf] <= best.limit()]
                res.skipped_layouts += sp.pair_size(recomputes, res.norm_mla, v) * (len(heads) - len(kept)) // len(heads)
                heads = kept
            if not heads:
                continue
            for hf in heads:
                for z in zeros:
                    # timed only when it could still rank (the limit falls as layouts are timed)
                    timed = table is None or table[v, mb, hf] <= best.limit()
                    status.append(_one_layout(model, work, topo, gpus, res, ranked, rejected, limit, recomputes,
                                              dict(kw, zero=z, micro_batch=mb, head_first=hf), best, timed))
                    if status[-1] in (FIT_NO_RECOMPUTE, RULE):
                        break  # higher ZeRO stages only add traffic; a broken rule breaks them all
            if status and all(st == NO_FIT for st in status):
                # activations grow with the micro-batch and with v: the rest cannot fit either
                why = f"memory: does not fit even with micro_batch {mb}, vpp {v}, every ZeRO stage and recompute"
                rest = [(v, b) for b in mbs[i + 1:]] + ([(w, b) for w in vpps[vi + 1:] for b in mbs] if i == 0 else [])
                _reject_all(res, rejected, base, rest, zeros, recomputes, schedule, why, sp)
                break
        else:
            continue
        if i == 0:
            break


FIT_NO_RECOMPUTE, FIT, NO_FIT, RULE = "fit-no-recompute", "fit", "no-fit", "rule"


def _norm_mla_rungs(recompute: str, options: list[bool]) -> list[bool]:
    """The norm/MLA recompute choices at one recompute rung: all of them, except under full recompute, which
    repeats the whole forward already (the option changes nothing there: its first choice only)."""
    return options[:1] if recompute == "full" else options


def reduce_policies(kw: dict) -> list[bool]:
    """`reduce_each_microbatch` choices of a layout: once per step, then every micro-batch, where it means
    something (ZeRO-2/3 under a pipeline)."""
    return [False, True] if ZeroSpec(kw["zero"]).shards_grads and kw["pp"] > 1 else [False]


def _over(model, lay: Layout, work, limit: float) -> tuple[list, dict | None]:
    """(memory rows of the stages that can be the most loaded, the first over `limit` or None)."""
    rows = []
    if is_dualpipe(lay):
        rows = memory(model, lay, work).stages
        over = max(rows, key=lambda r: r["total"])
        return rows, over if over["total"] > limit else None
    for j in candidate_stages(model, lay.pp, lay.vpp, lay.partition):
        rows.append(stage_memory(model, lay, work, j))
        if rows[-1]["total"] > limit:
            return rows, rows[-1]
    return rows, None


def _memory_why(over: dict, limit: float, lean: bool = False) -> str:
    head = "memory: does not fit even with the least memory (full recompute, per-micro-batch reduction): " if lean \
        else "memory: "
    return f"{head}stage {over['stage']} needs {over['total'] / GiB:.1f} GiB > {limit / GiB:.1f} GiB free"


def _one_layout(model, work, topo, gpus, res: Result, ranked: list, rejected: list, limit: float, recomputes: list,
                kw: dict, best: _Top, timed: bool = True) -> str:
    """Try the mechanisms of one layout from the cheapest in time: recompute none → selective → full, at each
    the gradient reduction once per step, then every micro-batch (`reduce_policies`); keep the first that
    fits. When the first does not fit, the option holding the least memory (the last) is checked next: if it
    does not fit either, none does."""
    ladder = [(rc, nm, each) for rc in recomputes for nm in _norm_mla_rungs(rc, res.norm_mla)
              for each in reduce_policies(kw)]
    for i, (rc, nm, each) in enumerate(ladder):
        res.considered += 1
        lay = Layout(recompute=rc, recompute_norm_mla=nm, reduce_each_microbatch=each, **kw)
        if i == 0:  # the rules do not depend on recompute or the reduction
            try:
                check(model, lay, work, gpus)
            except ConfigError as e:
                rejected.append((lay, f"rule: {e}"))
                return RULE
        if i == 1 and len(ladder) > 2:
            rc_l, nm_l, each_l = ladder[-1]
            _, lean = _over(model, Layout(recompute=rc_l, recompute_norm_mla=nm_l, reduce_each_microbatch=each_l, **kw),
                            work, limit)
            if lean is not None:   # the least memory does not fit: neither does anything above it
                why = _memory_why(lean, limit, lean=True)
                rejected.append((lay, why))
                for rc2, nm2, each2 in ladder[2:]:
                    res.considered += 1
                    rejected.append((Layout(recompute=rc2, recompute_norm_mla=nm2, reduce_each_microbatch=each2,
                                            **kw), why))
                return NO_FIT
        rows, over = _over(model, lay, work, limit)
        if over is not None:
            rejected.append((lay, _memory_why(over, limit)))
            continue
        mem = Memory(rows)
        mem.worst = max(range(len(rows)), key=lambda k: rows[k]["total"])
        if mem.host > topo.accelerator.host_memory:   # offload: the host's share of RAM (recompute does not help)
            high = max(rows, key=lambda r: r["host"])
            rejected.append((lay, f"host memory: offload {lay.offload} on stage {high['stage']} needs "
                                  f"{high['host'] / GiB:.1f} GiB > {topo.accelerator.host_memory / GiB:.0f} GiB "
                                  f"per GPU"))
            continue
        if timed:
            t, res.traffic[lay] = _fast_time(model, lay, work, topo, mem)
            ranked.append((t, lay))
            best.push(t)
        else:
            res.untimed += 1
        return FIT_NO_RECOMPUTE if rc == "none" and not nm else FIT
    return NO_FIT


def _reject_all(res: Result, rejected: list, base: dict, pairs: list, zeros: list, recomputes: list, schedule: str,
                why: str, sp: _Space) -> None:
    for v, mb in pairs:
        for hf in sp.heads_at(v):
            for z in zeros:
                for rc in recomputes:
                    for nm in _norm_mla_rungs(rc, res.norm_mla):
                        for each in reduce_policies({"zero": z, "pp": base["pp"]}):
                            res.considered += 1
                            rejected.append((Layout(zero=z, vpp=v, micro_batch=mb, recompute=rc, recompute_norm_mla=nm,
                                                    reduce_each_microbatch=each, schedule=schedule_for(v, schedule),
                                                    head_first=hf, **base), why))
