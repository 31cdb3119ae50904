"""Output: readable tables, JSON for machines, and a plot of memory per component and bytes per tier."""
from __future__ import annotations

import json
import re
from math import inf
from pathlib import Path

from ..comm.ledger import fmt_bytes
from .estimate import Estimate
from .layout import microbatches
from .memory import COMPONENTS
from .dualpipe import is_dualpipe, stages_of
from .reserve import reserve_text
from .search import Result, mechanisms
from .topology import GiB


def gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def _table(header: list[str], rows: list[list], align: str | None = None) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    align = align or "l" + "r" * (len(header) - 1)
    fmt = lambda r: "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align))
    return "\n".join([fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in cells[1:]])


def memory_table(est: Estimate, max_stages: int = 16) -> str:
    stages = est.memory.stages
    if len(stages) > max_stages:  # the first, the most loaded, the last
        keep = {0, est.memory.most_loaded["stage"], len(stages) - 1}
        stages = [s for s in stages if s["stage"] in keep]
    rows = [[s["stage"], s["layers"]] + [gib(s[c]) for c in COMPONENTS] + [gib(s["total"])] for s in stages]
    header = ["stage", "layers"] + list(COMPONENTS) + ["total GiB"]
    if is_dualpipe(est.layout):   # a row is pipeline ranks j and pp-1-j, each holding stages j and pp-1-j
        header[0] = "ranks"
        rows = [[",".join(map(str, stages_of(est.layout, r[0])))] + r[1:] for r in rows]
    if est.layout.offload != "none":   # off the device: not in the total
        header += ["host GiB", "disk GiB"]
        rows = [r + [gib(s.get("host", 0.0)), gib(s.get("disk", 0.0))] for r, s in zip(rows, stages)]
    return _table(header, rows)


def offload_text(est: Estimate) -> str:
    """One line on what offload moves: optimizer bytes off the device, host and disk bytes per GPU, bytes
    per rank per step over PCIe and to and from disk, and the seconds the step exposes."""
    o, acc = est.offload(), est.topo.accelerator
    moved = f"optimizer state {gib(o['moved_from_device'])} GiB"
    if o["params_moved_from_device"]:
        moved += f" and parameter shards {gib(o['params_moved_from_device'])} GiB"
    line = (f"offload {o['mode']}: {moved} off the device; host "
            f"{gib(o['host'])} GiB per GPU (limit {gib(o['host_limit'])})")
    if o["mode"] == "nvme":
        line += f", disk {gib(o['disk'])} GiB"
    if acc.host_is_device:   # a CPU device: the "pcie" rows are copies within host memory
        line += (f"; per step per rank {fmt_bytes(o['pcie_bytes'])} copied within host memory (the device is the "
                 f"CPU: host and device are the same memory, no PCIe; the traffic's tier pcie names these copies)")
    else:
        line += (f"; per step per rank {fmt_bytes(o['pcie_bytes'])} over PCIe ({acc.pcie_bandwidth / 1e9:g} GB/s "
                 f"each way)")
    if o["mode"] == "nvme":
        line += f", {fmt_bytes(o['nvme_bytes'])} to and from NVMe ({acc.nvme_bandwidth / 1e9:g} GB/s)"
    return line + f"; host step and copies expose {o['exposed_s']:.3f} s"


def traffic_table(est: Estimate) -> str:
    rows = [[f.dim, f.op, f.n, f.calls, fmt_bytes(f.message_bytes), fmt_bytes(f.bytes_sent), f.tier, f"{f.seconds:.4f}"]
            for f in est.flows]
    if not rows:
        return "(no communication)"
    return _table(["dim", "op", "group", "calls", "message", "sent/rank", "tier", "seconds"], rows, "llrrrrlr")


def estimate_text(est: Estimate, summary: bool = True, faster: Estimate | None = None) -> str:
    """The whole estimate of one layout as text: what to act on first (`summary_text`, unless `summary` is
    False: a search printed it already), then the model, the memory and traffic tables and the step's parts."""
    m, L, t, d = est.model, est.layout, est.time, est.to_dict()
    offload = [offload_text(est)] if L.offload != "none" else []
    lines = [summary_text(est, "layout", faster), ""] if summary else []
    lines += [
        f"model {m.name}: {m.num_params() / 1e9:.2f} B parameters ({m.active_params() / 1e9:.2f} B active)",
        f"cluster {est.topo.name}: {L.gpus} x {est.topo.accelerator.name}, tiers "
        + ", ".join(f"{x.name}({x.size or 'all'})" for x in est.topo.tiers),
        f"layout {L.short()}  schedule {L.schedule}  microbatches {microbatches(L, est.work)}  "
        f"seq {est.work.seq}  global batch {est.work.global_batch}  {est.work.dtype}",
        "",
        f"memory per rank (GiB; limit {gib(est.topo.accelerator.memory)}), most loaded: stage "
        f"{est.memory.most_loaded['stage']}",
        memory_table(est),
        reserve_text(est.reserve),
        *offload,
        "",
        f"traffic per rank per step (stage {_flows_stage(est)})",
        traffic_table(est),
        "bytes per tier: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d["bytes_per_tier"].items()),
        "",
        f"step {t.step_time_s:.3f} s = pipeline {t.pipeline_s:.3f} (compute {t.compute_s:.3f}, exposed tp/cp/ep "
        f"{t.layer_comm_s:.3f}, bubble {t.bubble:.1%} from the {t.bubble_source}) + grads {t.grad_comm_s:.3f} "
        f"+ step collectives {t.step_comm_s:.3f} + optimizer {t.optimizer_s:.3f}"
        + (f" + offload {t.offload_s:.3f}" if L.offload != "none" else ""),
        f"{t.tokens_per_s:,.0f} tokens/s   HFU {t.hfu:.1%}   {mfu_text(est)}",
        "",
        f"rank order {L.order} (innermost first): " + ", ".join(f"{g} on {tier}" for g, tier in est.placement.items()),
    ]
    lines += [f"warning: {w}" for w in est.warnings]
    return "\n".join(lines)


def faster_order_text(est: Estimate, faster: Estimate) -> str:
    """The order the planner recommends (blocking traffic innermost, dp outermost), where it is faster than the
    planner's default one: the flag, its step time and the groups it moves."""
    moved = ", ".join(f"{g} on {faster.placement[g]} instead of {tier}" for g, tier in est.placement.items()
                      if faster.placement.get(g, tier) != tier)
    return (f"faster with --order {faster.layout.order}: step {faster.time.step_time_s:.3f} s, MFU "
            f"{faster.time.mfu:.1%} ({moved})")


def mfu_text(est: Estimate) -> str:
    """MFU with the compute efficiency it assumed right beside it, then its convention: where the
    conventions differ (causal attention) the other one too."""
    mfu, full = est.time.mfu, est.mfu_attention_full
    text = f"MFU {mfu:.1%} (assumed: {efficiency_text(est)})"
    if full == mfu:
        return text
    return text + f", causal attention FLOPs halved; {full:.1%} not halved (6N + 12LHQT)"


def _flows_stage(est: Estimate) -> int:
    for j, flows in est.flows_by_stage.items():
        if flows is est.flows:
            return j
    return 0


def efficiency_text(est: Estimate) -> str:
    """The compute efficiency the step time assumed: GEMMs by shape up to `efficiency`, or flat."""
    from .gemm import shaped
    eff = est.work.efficiency
    if shaped(est.work, est.topo.accelerator):
        return f"GEMMs by shape, at most {eff:.0%} of peak"
    return f"every kernel at {eff:.0%} of peak"


def summary_text(est: Estimate, head: str = "best layout", faster: Estimate | None = None) -> str:
    """What a person acts on, first: the layout and its rank order, memory per device against the limit, step
    time, MFU with the assumed efficiency beside it, and the bytes a rank sends per step on each tier; then,
    where the planner's default order is not the fastest, the order that is (`faster_order_text`)."""
    t, mem, acc = est.time, est.memory.most_loaded, est.topo.accelerator
    fits = "fits" if est.device_fits else "does NOT fit"
    reserve = est.reserve["total"]
    line_mem = (f"memory per device: {gib(mem['total'])} GiB + reserve {gib(reserve)} GiB of {gib(acc.memory)} GiB "
                f"({fits}; most loaded: stage {mem['stage']})")
    if est.layout.offload != "none":
        o = est.offload()
        line_mem += f"; host {gib(o['host'])} GiB of {gib(o['host_limit'])} GiB (offload {est.layout.offload})"
    tiers = est.to_dict()["bytes_per_tier"]
    lines = [
        f"{head}: {est.layout.short()}  schedule {est.layout.schedule}  microbatches "
        f"{microbatches(est.layout, est.work)}  order {est.layout.order}",
        line_mem,
        f"step {t.step_time_s:.3f} s   {t.tokens_per_s:,.0f} tokens/s   {mfu_text(est)}",
        "traffic per rank per step: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in tiers.items()),
    ]
    return "\n".join(lines + ([faster_order_text(est, faster)] if faster else []))


def search_text(res: Result, top: int = 10, examples: int = 3, verbose: bool = False,
                faster: Estimate | None = None) -> str:
    """The best layout's summary first, then the ranking and the rejections; the branch and bound's proof
    ("bound: ...") and rejection examples only with `verbose` (when nothing fits always, those closest to
    fitting first: they are then what to act on); the best layout in full at the end. `faster`: the best layout in the order
    the planner recommends, where that is faster than the order searched."""
    rows = []
    for i, e in enumerate(res.best[:top]):
        rows.append([i + 1, e.layout.short(), f"{e.time.step_time_s:.3f}", f"{e.time.mfu:.1%}", f"{e.time.bubble:.1%}",
                     gib(e.memory.most_loaded["total"])])
    lines = [summary_text(res.best[0], faster=faster), ""] if res.best else []
    order = f" (rank order {res.best[0].layout.order})" if res.best else ""
    lines.append(f"searched {res.considered} layouts{order} in {res.seconds:.2f} s: {res.fit} fit, "
                 f"{len(res.rejected)} rejected")
    if res.best:
        lines.append(mechanisms_text(res))
    if verbose and (res.skipped_layouts or res.untimed):
        lines.append(bound_text(res))
    if res.offload:
        lines.append(search_offload_text(res))
    if rows:
        lines.append(_table(["#", "layout", "step s", "MFU", "bubble", "GiB"], rows, "rlrrrr"))
    else:
        lines.append("no layout fits")
    lines.append("rejected, by reason: " + ", ".join(f"{k} {v}" for k, v in res.reasons().items()))
    if not res.best:   # what to act on: the layouts that came closest to fitting
        lines.append("closest to fitting:" if any(_needs(w) for _, w in res.rejected) else "examples:")
    if verbose or not res.best:
        lines += rejection_examples(res, examples)
    if res.best:
        lines += ["", "best layout in full:", estimate_text(res.best[0], summary=False)]
    return "\n".join(lines)


def rejection_examples(res: Result, examples: int = 3) -> list[str]:
    """Up to `examples` rejected layouts per reason, in the order tried; when nothing fits, the ones that need
    the least memory first (the closest to fitting)."""
    rejected = res.rejected if res.best else sorted(res.rejected, key=lambda r: _needs(r[1]) or inf)
    seen: dict[str, int] = {}
    out = []
    for lay, why in rejected:
        key = why.split(":")[0]
        if seen.get(key, 0) < examples:
            seen[key] = seen.get(key, 0) + 1
            out.append(f"  {lay.short()}: {why}")
    return out


def _needs(why: str) -> float | None:
    """The GiB a memory rejection says its most loaded stage needs (search's "stage j needs X GiB > L GiB")."""
    found = re.search(r"needs ([\d.]+) GiB", why)
    return float(found.group(1)) if found else None


def mechanisms_text(res: Result) -> str:
    """The mechanisms of the best layout, which the search chose per layout (search.mechanisms), and how
    many layouts tied with the fastest (within 1%: fewest bytes on the slowest tier first)."""
    chosen = ", ".join(f"{k} {v}" for k, v in mechanisms(res.best[0].layout).items())
    tied = (f"; {res.tied} layouts within 1% of the fastest, fewest bytes on the slowest tier first"
            if res.tied > 1 else "")
    return f"mechanisms chosen: {chosen} (reduction and recompute searched per layout, offload when nothing fits){tied}"


def search_offload_text(res: Result) -> str:
    """What the search tried with offload, which it does only when no layout fits the device."""
    tried = ", ".join(f"{mode} for {n} structure{'s' * (n != 1)}" for mode, n in res.offload.items() if mode != "fit")
    return (f"offload: no layout fits the device with its optimizer state, so the search tried the state off the "
            f"device ({tried}; nvme only where cpu fit nowhere): {res.offload.get('fit', 0)} layouts fit")


def bound_text(res: Result) -> str:
    """What the branch and bound left unchecked or untimed, and why the best `top` are still exact."""
    parts = []
    if res.skipped:
        parts.append(f"{res.skipped} of {res.structures} structures (tp pp cp ep dp) skipped unchecked "
                     f"({res.skipped_layouts} more layouts, neither fit nor rejected above)")
    if res.untimed:
        parts.append(f"{res.untimed} of the {res.fit} that fit not timed")
    return (f"bound: {' and '.join(parts)}: a lower bound on their step time exceeds the {_ordinal(res.top)} "
            f"best, {res.bound_limit:.3f} s, so the best {res.top} are the exhaustive search's")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def search_dict(res: Result, max_rejected: int = 200) -> dict:
    """The best estimate's keys at the top level, plus the ranking and the rejections."""
    out = res.best[0].to_dict() if res.best else {}
    out["search"] = {
        "considered": res.considered, "fit": res.fit, "timed": len(res.ranked), "rejected_count": len(res.rejected),
        "seconds": res.seconds,
        "counts": "considered: layouts tried (rules, memory); fit and rejected_count split them; timed: the fits "
                  "whose step time was computed (bound.fit_untimed: the others). Layouts in structures skipped "
                  "by the bound were not tried and are in none of these (bound.skipped_layouts)",
        "bound": {"on": res.bounded, "top": res.top, "structures": res.structures,
                  "structures_tried": res.examined, "structures_skipped": res.skipped,
                  "skipped_layouts": res.skipped_layouts, "fit_untimed": res.untimed, "limit_s": res.bound_limit,
                  "meaning": "a lower bound on step time (compute, in-layer tp/cp/ep communication, bubble) exceeds "
                             "limit_s, the top-th best found, for the skipped structures and the untimed fits: they "
                             "cannot rank in the best `top`, which are those of the exhaustive search"},
        "ranked": [{"layout": e.layout.to_dict(), "step_time_s": e.time.step_time_s, "mfu": e.time.mfu,
                    "mfu_attention_full": e.mfu_attention_full, "memory_total": e.memory.most_loaded["total"],
                    "bubble": e.time.bubble} for e in res.best],
        "offload": {**res.offload, "meaning": "tried only because no layout fit the device: per mode, the "
                                                 "structures searched with it (nvme where cpu fit nowhere); "
                                                 "fit: layouts that fit with offload"} if res.offload else {},
        "mechanisms": mechanisms(res.best[0].layout) if res.best else {}, "tied": res.tied,
        "rejected_by_reason": res.reasons(),
        "rejected": [{"layout": lay.to_dict(), "reason": why} for lay, why in res.rejected[:max_rejected]],
    }
    return out


def to_json(d: dict) -> str:
    return json.dumps(d, indent=1, default=str)


def plot(est: Estimate, path: str | Path) -> Path:
    """Two panels, both in GiB (2**30 bytes, as the text output counts memory and traffic): memory per component
    per stage (stacked) and bytes per rank per tier. The file type is the path's suffix (png, svg, pdf, ...)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    stages = est.memory.stages
    xs = [str(s["stage"]) for s in stages]
    bottom = [0.0] * len(stages)
    for c in COMPONENTS:
        vals = [s[c] / GiB for s in stages]
        ax1.bar(xs, vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.axhline(est.topo.accelerator.memory / GiB, color="k", linestyle="--", linewidth=1,
                label=f"device memory, {gib(est.topo.accelerator.memory)} GiB")
    ax1.set_xlabel("pipeline stage")
    ax1.set_ylabel("GiB per rank")
    ax1.set_title(f"{est.model.name}: memory per rank")
    ax1.legend(fontsize=7)
    tiers = est.to_dict()["bytes_per_tier"]
    ax2.bar(list(tiers), [v / GiB for v in tiers.values()], color="tab:purple")
    ax2.set_ylabel("GiB sent per rank per step")
    ax2.set_title(f"bytes per tier ({est.layout.short()})", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
