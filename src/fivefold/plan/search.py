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

Prunings, none of which drops a layout that could rank first: recompute is tried none → selective →
full and the first that fits is kept (more recompute only adds time); once a ZeRO stage fits without
recompute, higher stages are skipped (they only add traffic); and only the stages that can be the most
loaded (`memory.candidate_stages`) or the slowest (`memory.time_stages`) are evaluated, with the
closed-form bubble. Every layout that fits is still timed: a dense preset at 16,384 GPUs takes about
0.5 s, a MoE one several seconds (ep multiplies the space). The top results are then
estimated in full on every stage (closed-form bubble, so ranking and figures agree).
"""
from __future__ import annotations

import time as _time
from dataclasses import dataclass, field

from ..grid import DEFAULT_ORDER
from ..rules import ConfigError, Recompute, choices, cp_degrees, divisors
from .estimate import Estimate, estimate
from .layout import Layout, Workload, check, valid_tp
from .memory import Memory, candidate_stages, stage_memory, time_stages
from .models import PlanModel
from .time import step_time
from .topology import GiB, Topology
from .traffic import place, stage_flows

SEARCHED = ("tp", "pp", "dp", "cp", "ep", "zero", "vpp", "micro_batch", "recompute", "cp_mode", "sp_mode")
POWERS = (1, 2, 4, 8)   # micro-batch sizes and virtual stages tried
MAX_GPUS = 2**20        # the largest GPU count planned (about a million; larger clusters do not exist yet)


@dataclass
class Result:
    ranked: list[tuple[float, Layout]] = field(default_factory=list)   # (step time, layout), fastest first
    rejected: list[tuple[Layout, str]] = field(default_factory=list)
    best: list[Estimate] = field(default_factory=list)                 # the top ones, estimated in full
    considered: int = 0
    seconds: float = 0.0          # wall clock
    cpu_seconds: float = 0.0      # this process's CPU time (what a loaded machine does not inflate)

    def reasons(self) -> dict[str, int]:
        """Rejections counted by the rule or limit they broke (text before the first colon)."""
        out: dict[str, int] = {}
        for _, why in self.rejected:
            key = why.split(":")[0]
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _options(name: str, fixed: dict, default: list) -> list:
    return [fixed[name]] if fixed.get(name) is not None else default


def _structures(model: PlanModel, work: Workload, topo: Topology, gpus: int, fixed: dict, res: Result):
    """Yield (tp, pp, cp, cp_mode, ep, dp) that divide the GPU count; reject tp beyond the first tier."""
    domain = topo.tiers[0].size or gpus
    for tp in _options("tp", fixed, [d for d in valid_tp(model) if gpus % d == 0]):
        if fixed.get("tp") is None and tp > domain:
            res.rejected.append((Layout(tp=tp), f"tp beyond the {topo.tiers[0].name} domain: tp={tp} > {domain} GPUs"))
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
                eps = [1] if not model.moe else [d for d in divisors(model.experts) if (dp * cp) % d == 0]
                for mode in modes:
                    for ep in _options("ep", fixed, eps):
                        yield tp, pp, cp, mode, ep, dp


def _cp_modes(model: PlanModel, tp: int, cp: int) -> list[str]:
    """Ring and Ulysses, and hybrid when its split differs from both (else it is one of them)."""
    u, _ = cp_degrees("hybrid", cp, model.heads, tp)
    return ["ring", "ulysses"] + (["hybrid"] if 1 < u < cp else [])


def _fast_time(model, layout, work, topo, mem) -> float:
    """Step time from the stages that can be slowest (most layers, or the head) and the closed-form bubble."""
    stages = time_stages(model, layout.pp, layout.vpp, layout.partition)
    flows = {j: place(stage_flows(model, layout, work, j), layout, topo) for j in stages}
    states = sum(mem.most_loaded[c] for c in ("weights", "grads", "optimizer"))
    return step_time(model, layout, work, topo, flows, states, simulate=False).step_time_s


def search(model: PlanModel, work: Workload, topo: Topology, gpus: int, fixed: dict | None = None,
           top: int = 5, order: str = DEFAULT_ORDER, partition: str = "even", schedule: str = "1f1b") -> Result:
    """All layouts for `gpus` GPUs with the `fixed` choices (keys of SEARCHED) held, ranks in `order`,
    layers split by `partition` (even or llama3; counts only with pp fixed); see module doc."""
    t0, c0 = _time.perf_counter(), _time.process_time()
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    if not 1 <= gpus <= MAX_GPUS:
        raise ConfigError(f"gpus must be between 1 and {MAX_GPUS} (the planner's limit), got {gpus}; "
                          f"valid: 1..{MAX_GPUS}")
    topo.check(gpus)
    res, limit = Result(), topo.accelerator.memory
    for tp, pp, cp, mode, ep, dp in _structures(model, work, topo, gpus, fixed, res):
        per_dp = work.global_batch // dp if work.global_batch % dp == 0 else 0
        mbs = _options("micro_batch", fixed, [b for b in POWERS if per_dp and per_dp % b == 0] or [1])
        vpps = _options("vpp", fixed, [1] if pp == 1 else [v for v in POWERS if pp * v <= model.layers])
        zeros = _options("zero", fixed, [0] if dp * cp == 1 else [1, 2, 3])
        recomputes = _options("recompute", fixed, list(choices(Recompute)))
        sp_mode = fixed.get("sp_mode", "megatron") if tp > 1 else "none"
        base = dict(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sp_mode=sp_mode, cp_mode=mode, order=order,
                    partition=partition if pp > 1 else "even")
        for vi, v in enumerate(vpps):
            kw = dict(base, vpp=v, schedule="interleaved" if v > 1 else schedule)
            for i, mb in enumerate(mbs):
                status = []
                for z in zeros:
                    status.append(_one_layout(model, work, topo, gpus, res, limit, recomputes,
                                              dict(kw, zero=z, micro_batch=mb)))
                    if status[-1] in (FIT_NO_RECOMPUTE, RULE):
                        break  # higher ZeRO stages only add traffic; a broken rule breaks them all
                if status and all(st == NO_FIT for st in status):
                    # activations grow with the micro-batch and with v: the rest cannot fit either
                    why = f"memory: does not fit even with micro_batch {mb}, vpp {v}, every ZeRO stage and recompute"
                    rest = [(v, b) for b in mbs[i + 1:]] + ([(w, b) for w in vpps[vi + 1:] for b in mbs] if i == 0 else [])
                    _reject_all(res, base, rest, zeros, recomputes, schedule, why)
                    break
            else:
                continue
            if i == 0:
                break
    res.ranked.sort(key=lambda x: x[0])
    res.best = [estimate(model, lay, work, topo, gpus, simulate=False) for _, lay in res.ranked[:top]]
    res.best.sort(key=lambda e: e.time.step_time_s)
    res.seconds = _time.perf_counter() - t0
    res.cpu_seconds = _time.process_time() - c0
    return res


FIT_NO_RECOMPUTE, FIT, NO_FIT, RULE = "fit-no-recompute", "fit", "no-fit", "rule"


def _one_layout(model, work, topo, gpus, res: Result, limit: float, recomputes: list, kw: dict) -> str:
    """Try recompute none → selective → full for one layout; keep the first that fits."""
    for i, rc in enumerate(recomputes):
        res.considered += 1
        lay = Layout(recompute=rc, **kw)
        if i == 0:  # the rules do not depend on recompute
            try:
                check(model, lay, work, gpus)
            except ConfigError as e:
                res.rejected.append((lay, f"rule: {e}"))
                return RULE
        over = None
        rows = []
        for j in candidate_stages(model, lay.pp, lay.vpp, lay.partition):
            rows.append(stage_memory(model, lay, work, j))
            if rows[-1]["total"] > limit:
                over = rows[-1]
                break
        if over is not None:
            res.rejected.append((lay, f"memory: stage {over['stage']} needs {over['total'] / GiB:.1f} GiB > "
                                      f"{limit / GiB:.0f} GiB"))
            continue
        mem = Memory(rows)
        mem.worst = max(range(len(rows)), key=lambda k: rows[k]["total"])
        res.ranked.append((_fast_time(model, lay, work, topo, mem), lay))
        return FIT_NO_RECOMPUTE if rc == "none" else FIT
    return NO_FIT


def _reject_all(res: Result, base: dict, pairs: list, zeros: list, recomputes: list, schedule: str, why: str) -> None:
    for v, mb in pairs:
        for z in zeros:
            for rc in recomputes:
                res.considered += 1
                res.rejected.append((Layout(zero=z, vpp=v, micro_batch=mb, recompute=rc,
                                            schedule="interleaved" if v > 1 else schedule, **base), why))
