"""DualPipe, planned: DeepSeek-V3's bidirectional pipeline (DeepSeek-V3 Technical Report, arXiv 2412.19437,
§3.2.1 and Table 2; deepseek-ai/DualPipe). The runtime does not run it (`fivefold train` refuses the
schedule); the planner prices it so that a published DualPipe layout can be compared with the others.

Micro-batches enter from both ends of a pipeline of p (even) ranks: half run stage 0 → p−1 on ranks
0 → p−1, half the same stages on ranks p−1 → 0. So rank j holds two stages, j and p−1−j, each for half of
the m micro-batches (m even, m >= 2p), and every stage lives on two ranks (two copies of the parameters,
their gradients summed between the pair). Rank 0 holds the embedding and the head (stages 0 and p−1),
as DualPipe intends. Each rank's step is planned from the one-way 1F1B stages it holds:

- memory (`device_memory`): weights, gradients and optimizer state of both stages (the report's "2×
  parameters"; the optimizer state sharded over dp as each stage's is); the activations of p + 1
  micro-batches of a stage (the report's "PP+1"), (p + 1)/2 in flight on each of the two stages, the
  head's for one (its forward and backward back to back, as on a 1F1B last stage); the larger of the two
  stages' buffers;
- traffic (`device_flows`): each stage's flows for its m/2 micro-batches (layer collectives, pipeline
  sends, its own gradient reduction over dp), the step's scalars once, no tied-embedding sum between
  ranks (rank 0 holds both ends), and the pair's gradient sum: one all-reduce over the 2 ranks holding
  the same stages, of both stages' gradients (dim "dualpipe", a gradient reduction on the pp tier);
- time (`pipeline_seconds`): per micro-batch a rank computes the mean of its two stages' forward F and
  backward B; the makespan is m(F + B) plus the report's bubble (p/2 − 1)(F&B + B − 3W) with F&B = F + B
  (a forward and a backward chunk overlapped: their compute adds, their all-to-alls hide behind each
  other, which `ep_overlap` charges) and W = B/2 (the weight-gradient half, as the planner's zero-bubble
  schedule splits it), that is (p/2 − 1)(F + B/2); plus p pipeline hops of latency (fill from both ends
  to the middle and back).
"""
from __future__ import annotations

from dataclasses import replace

from ..rules import DUALPIPE, ONE_F_ONE_B
from .activations import stage_activations
from .layout import Layout, Workload
from .models import PlanModel
from .traffic import Flow, Flows
from .units import stage_params

PAIR_DIM = "dualpipe"       # the pair's gradient sum, a gradient reduction (traffic.KIND names it so)
STEP_ONCE = ("loss", "grad_norm", "control", "moe_stats")   # a rank's step scalars: once, not per stage


def is_dualpipe(layout: Layout) -> bool:
    return layout.schedule == DUALPIPE and layout.pp > 1


def one_way(layout: Layout) -> Layout:
    """The layout of the stages a DualPipe rank holds, each run as in a one-way 1F1B pipeline."""
    return replace(layout, schedule=ONE_F_ONE_B)


def half(work: Workload) -> Workload:
    """The workload of one direction: half of the micro-batches (each of the same size)."""
    return replace(work, global_batch=work.global_batch // 2)


def devices(layout: Layout) -> range:
    """The distinct ranks of a DualPipe pipeline: rank j and rank p−1−j hold the same two stages."""
    return range(layout.pp // 2)


def stages_of(layout: Layout, device: int) -> tuple[int, int]:
    return device, layout.pp - 1 - device


def device_memory(stage_memory, model: PlanModel, layout: Layout, work: Workload, device: int) -> dict:
    """Rank `device`'s bytes (module docstring) from `stage_memory` (plan/memory.py) of its two stages."""
    L1 = one_way(layout)
    rows = [stage_memory(model, L1, work, s) for s in stages_of(layout, device)]
    out = {k: sum(r.get(k, 0.0) for r in rows) for k in ("weights", "grads", "optimizer", "offloaded",
                                                         "offloaded_params", "offloaded_grads", "host", "disk")}
    flight = (layout.pp + 1) / 2   # each stage's share of the rank's pp + 1 micro-batches
    out["activations"] = sum(stage_activations(model, L1, work, s, flight) for s in stages_of(layout, device))
    out["buffers"] = max(r["buffers"] for r in rows)
    # the total is the peak of the sum, as for a stage: each stage's buffers as they stand beside its
    # activations' peak (`memory.stage_memory`: its total less its other columns)
    beside = max(r["total"] - sum(r[c] for c in ("weights", "grads", "optimizer", "activations")) for r in rows)
    out["total"] = sum(out[c] for c in ("weights", "grads", "optimizer", "activations")) + beside
    out["stage"] = device
    out["layers"] = sum(r["layers"] for r in rows)
    return out


def device_flows(stage_flows, model: PlanModel, layout: Layout, work: Workload, device: int) -> list[Flow]:
    """Rank `device`'s flows in one step (module docstring) from `stage_flows` (plan/traffic.py) of its two
    stages, each over half of the micro-batches."""
    L1, w = one_way(layout), half(work)
    rows: dict[tuple, Flow] = {}
    for k, s in enumerate(stages_of(layout, device)):
        for f in stage_flows(model, L1, w, s):
            if f.dim == "embed" or (k and f.dim in STEP_ONCE):
                continue
            key = (f.dim, f.op, f.part, f.group)
            if key in rows:
                r = rows[key]
                rows[key] = replace(r, calls=r.calls + f.calls, message_bytes=r.message_bytes + f.message_bytes,
                                    bytes_sent=r.bytes_sent + f.bytes_sent)
            else:
                rows[key] = replace(f)
    grads = sum(sum(stage_params(model, L1, s)) for s in stages_of(layout, device))
    pair = Flows(work.backend)
    pair.add(PAIR_DIM, "all_reduce", "pp", 2, grads * work.reduce_bytes, 1)
    return list(rows.values()) + pair.list()


def pipeline_seconds(cost_f: dict[int, float], cost_b: dict[int, float], m: int, p: int,
                     t_send: float) -> tuple[float, float, int]:
    """(makespan, bubble share, the slowest rank) of DualPipe with the given per-micro-batch costs of each
    rank (the mean of its two stages'): m(F + B) + (p/2 − 1)(F + B/2) + p·t_send on the slowest rank."""
    slow = max(cost_f, key=lambda j: cost_f[j] + cost_b[j])
    f, b = cost_f[slow], cost_b[slow]
    idle = (p // 2 - 1) * (f + b / 2)
    busy = m * (f + b)
    return busy + idle + p * t_send, idle / (busy + idle) if busy + idle > 0 else 0.0, slow


def rank_flows(stage_flows, model: PlanModel, layout: Layout, work: Workload, rank: int) -> list[Flow]:
    """`stage_flows` of pipeline rank `rank`: under DualPipe its two stages' (`device_flows`)."""
    if is_dualpipe(layout):
        return device_flows(stage_flows, model, layout, work, rank)
    return stage_flows(model, layout, work, rank)


def ranks_or(layout: Layout, stages) -> range | tuple:
    """The pipeline ranks to plan: `stages`, or under DualPipe its distinct ranks (`devices`)."""
    return devices(layout) if is_dualpipe(layout) else stages
