"""Step time, tokens/s and MFU from FLOPs, bytes per tier, and the pipeline schedule.

Compute: forward FLOPs per token are 2 per weight multiplied (routed experts: top_k of them; the LM
head included, the embedding lookup free) plus causal attention 2·s·a·(d_qk + d_v)/2 per layer
(Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, App. B); backward is twice forward. Recompute adds a
forward (full) or the attention core's forward (selective), which counts for hardware FLOPs but not for
MFU. Kernels reach `efficiency` × the accelerator's peak for the dtype.

Communication: a collective takes bytes_sent / (tier bandwidth / oversubscription) + latency hops
(see topology.collective_latency) on the slowest tier its group crosses. What overlaps, and what not:
- tp, sp, Ulysses cp, ep: inside each layer, on the critical path: added to the stage's compute.
  Ring-attention sends overlap with the attention compute of the block before; only the excess shows.
- pp: each send on the pipeline's critical path (the schedule simulator takes it as transfer time;
  with the closed forms, 2(p-1) transfers for fill and drain).
- dp/edp (DDP, ZeRO-1/2): the gradient reduction overlaps the last micro-batch's backward and the
  parameter all-gather the first micro-batch's forward (Megatron's overlap_grad_reduce and
  overlap_param_gather); ZeRO-2/3 per-micro-batch collectives overlap their own micro-batch. Under a
  pipeline the runtime reduces every gradient once, after the schedule has drained (exposed), and
  ZeRO-3's per-use gathers are not prefetched (exposed).
- loss, grad_norm, tied-embedding reductions: exposed (small).
- optimizer step: memory bound, reads and writes every model-state byte once.

Pipeline bubble: the schedule simulator `fivefold.parallel.pipeline.schedules` (pure Python), with
per-stage forward/backward costs (uneven stages, embedding and head included); when the schedule is too
long to simulate quickly, or the schedule does not apply (interleaved with m % p != 0), the closed forms (Narayanan et al. 2021):
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, and ZB-H1's (p-1)(F+I-W) idle
(Qi et al. 2023).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ..parallel.pipeline import schedules as _schedules
from ..rules import ConfigError
from .layout import Layout, Workload, microbatches
from .memory import layout_layers, stage_layers
from .models import PlanModel
from .topology import Topology
from .traffic import KIND, Flow

SIMULATE_MAX_ACTIONS = 4096   # 2·p·m·v compute actions; longer schedules use the closed forms (speed)


# -- FLOPs ---------------------------------------------------------------------------------------------
def stage_forward_flops(model: PlanModel, layout: Layout, work: Workload, stage: int) -> tuple[float, float]:
    """(all, attention-core) forward FLOPs of one micro-batch on one rank of `stage`."""
    tokens = layout.micro_batch * work.seq / (layout.tp * layout.cp)
    n_layers = len(layout_layers(model, layout)[stage])
    attn = model.attention_flops_per_token(work.seq, work.causal) / model.layers
    weights = _stage_active_weights(model, layout.pp, layout.vpp, layout.partition)[stage]
    return tokens * (2.0 * weights + attn * n_layers), tokens * attn * n_layers


@lru_cache(maxsize=4096)
def _stage_active_weights(model: PlanModel, pp: int, vpp: int, partition: str) -> tuple:
    """Per stage, the weights one token multiplies by (top_k routed experts; the head on the last)."""
    out = []
    for j, rng in enumerate(stage_layers(model.layers, pp, vpp, partition)):
        w = sum(model.layer_params(i, model.top_k if model.is_moe_layer(i) else None) for i in rng)
        out.append(w + (model.vocab * model.hidden if j == pp - 1 else 0))
    return tuple(out)


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 2.0) -> float:
    """Bubble fraction of the papers: (p-1)/(m+p-1); interleaved (p-1)/(v·m+p-1); ZB-H1 with I = W = B/2:
    (p-1)(F+I-W) / (m(F+B) + (p-1)(F+I-W))."""
    if p == 1:
        return 0.0
    if schedule == "zb":
        idle = (p - 1) * f
        return idle / (m * (f + b) + idle)
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)


def simulate_pipeline(schedule: str, p: int, m: int, v: int, cost_f: list[float], cost_b: list[float],
                      comm: float) -> tuple[float, float] | None:
    """(makespan, bubble) from the schedule simulator with per-stage costs, or None when the schedule is
    too long to simulate or does not apply to (p, m, v)."""
    if p == 1 or 2 * p * m * v > SIMULATE_MAX_ACTIONS:
        return None
    try:
        actions = _schedules.build_schedule(schedule, p, m, v)
    except ConfigError:  # e.g. interleaved with m % p != 0: the closed form
        return None
    chunks = p * v
    f = [cost_f[c % p] / v for c in range(chunks)]
    b = [cost_b[c % p] / v for c in range(chunks)]
    half = [x / 2 for x in b]
    sim = _schedules.simulate(actions, cost_f=f, cost_b=b, cost_i=half, cost_w=half, comm=comm)
    return float(sim.makespan), float(sim.bubble)


# -- step time ------------------------------------------------------------------------------------------
@dataclass
class StepTime:
    compute_s: float = 0.0           # busy compute time of the slowest stage over the step
    layer_comm_s: float = 0.0        # exposed tp/cp/ep time of that stage
    pipeline_s: float = 0.0          # forward+backward makespan, bubble included
    bubble: float = 0.0
    bubble_source: str = "closed form"
    grad_comm_s: float = 0.0         # exposed dp/edp time
    step_comm_s: float = 0.0         # loss, grad-norm, embedding reductions
    optimizer_s: float = 0.0
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    hfu: float = 0.0
    exposed: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _per_dim_seconds(flows: list[Flow]) -> dict[str, float]:
    out: dict[str, float] = {}
    for fl in flows:
        out[fl.dim] = out.get(fl.dim, 0.0) + fl.seconds
    return out


def _grad_exposed(flows: list[Flow], zero: int, m: int, t_fwd: float, t_bwd: float, pp: int = 1) -> float:
    """Exposed gradient-reduction and ZeRO-gather time, with the overlap windows stated in the module doc."""
    rs = sum(f.seconds for f in flows if KIND.get(f.dim) == "grad" and f.op in ("all_reduce", "reduce_scatter"))
    ag = sum(f.seconds for f in flows if KIND.get(f.dim) == "grad" and f.op == "all_gather")
    if pp > 1:   # reductions start when the schedule has drained; ZeRO-3 gathers are not prefetched
        return rs + (ag if zero == 3 else max(0.0, ag - t_fwd))
    if zero <= 1:
        return max(0.0, rs - t_bwd) + max(0.0, ag - t_fwd)
    if zero == 2:
        return m * max(0.0, rs / m - t_bwd) + max(0.0, ag - t_fwd)
    return m * (max(0.0, ag / (2 * m) - t_fwd) + max(0.0, ag / (2 * m) + rs / m - t_bwd))


def step_time(model: PlanModel, layout: Layout, work: Workload, topo: Topology,
              flows_by_stage: dict[int, list[Flow]], states_bytes: float, simulate: bool = True) -> StepTime:
    """Step time of the layout: pipeline makespan (bubble included) plus what does not overlap.
    `flows_by_stage` maps stage -> its flows: every stage (then the simulator can run), or only the
    candidates for the slowest (closed-form bubble)."""
    L, out = layout, StepTime()
    m = microbatches(L, work)
    peak = topo.accelerator.peak(work.dtype) * work.efficiency
    cost_f, cost_b, compute_f, layer_comm = {}, {}, {}, {}
    for j, flows in flows_by_stage.items():
        fwd, attn = stage_forward_flops(model, L, work, j)
        extra = fwd if L.recompute == "full" else (attn if L.recompute == "selective" else 0.0)
        ring = sum(f.seconds for f in flows if f.dim == "cp" and f.op in ("send", "recv"))
        secs = _per_dim_seconds([f for f in flows if KIND.get(f.dim) == "layer" and f.op not in ("send", "recv")])
        # ring sends hide behind the attention of the block before: forward, and backward at 2x forward
        comm_mb = sum(secs.values()) / m + max(0.0, ring / m - 3 * attn / peak)
        t_f = fwd / peak
        cost_f[j] = t_f + comm_mb / 2
        cost_b[j] = (2 * fwd + extra) / peak + comm_mb / 2
        compute_f[j] = t_f
        layer_comm[j] = comm_mb
    first = flows_by_stage[min(flows_by_stage)]
    send = [f for f in first if f.dim == "pp" and f.op == "send"] if L.pp > 1 else []
    t_send = send[0].seconds / send[0].calls if send else 0.0
    slow = max(flows_by_stage, key=lambda j: cost_f[j] + cost_b[j])
    schedule, v = L.effective_schedule, (L.vpp if L.effective_schedule == "interleaved" else 1)
    sim = None
    if simulate and len(flows_by_stage) == L.pp:
        sim = simulate_pipeline(schedule, L.pp, m, v, [cost_f[j] for j in range(L.pp)],
                                [cost_b[j] for j in range(L.pp)], t_send)
    if sim is not None:
        out.pipeline_s, out.bubble = sim
        out.bubble_source = "simulator"
    else:
        c = cost_f[slow] + cost_b[slow]
        out.bubble = closed_form_bubble(schedule, L.pp, m, v, cost_f[slow], cost_b[slow])
        out.pipeline_s = m * c / (1 - out.bubble) + 2 * (L.pp - 1) * t_send
    out.compute_s = m * (cost_f[slow] + cost_b[slow] - layer_comm[slow])
    out.layer_comm_s = m * layer_comm[slow]
    worst = flows_by_stage[slow]
    out.grad_comm_s = _grad_exposed(worst, L.zero, m, compute_f[slow], 2 * compute_f[slow], L.pp)
    out.step_comm_s = sum(f.seconds for f in worst if KIND.get(f.dim) == "step")
    out.optimizer_s = 2 * states_bytes / topo.accelerator.hbm_bandwidth
    out.step_time_s = out.pipeline_s + out.grad_comm_s + out.step_comm_s + out.optimizer_s
    out.exposed = {"layer": out.layer_comm_s, "grad": out.grad_comm_s, "step": out.step_comm_s}
    out.tokens_per_s = work.tokens / out.step_time_s
    model_flops = model.flops_per_token(work.seq, work.causal) * work.tokens
    full = topo.accelerator.peak(work.dtype) * L.gpus * out.step_time_s
    out.mfu = model_flops / full
    hw = {"none": 0.0, "selective": model.attention_flops_per_token(work.seq, work.causal),
          "full": model.flops_per_token(work.seq, work.causal) / 3}[L.recompute]  # recomputed forward
    out.hfu = (model_flops + hw * work.tokens) / full
    return out
