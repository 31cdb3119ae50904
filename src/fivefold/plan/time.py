"""Step time, tokens/s and MFU from FLOPs, bytes per tier, and the pipeline schedule.

Compute: forward FLOPs per token are 2 per weight multiplied (routed experts: top_k of them; the LM
head included, the embedding lookup free) plus causal attention 2·s·a·(d_qk + d_v)/2 per layer
(Kaplan et al. 2020; the causal mask halves the attention FLOPs, as FlashAttention computes them and
Megatron-LM counts them; PaLM, Chowdhery et al. 2022, App. B, does not halve: estimate.py reports that
convention beside it as `mfu_attention_full`); backward is twice forward. Recompute adds a
forward (full), the attention core's forward (selective), or MLA's up-projections (`recompute_norm_mla`,
`light_recompute_flops`), which count for hardware FLOPs but not for MFU. Kernels reach `efficiency` ×
the accelerator's peak for the dtype; with `fp8_gemm` the linear layers' GEMMs (forward, dgrad, wgrad)
run at `efficiency` × the FP8 peak while attention and the LM head
stay in dtype (DeepSeek-V3 §3.3). MFU and HFU are always against the dtype's peak. GEMMs by shape:
plan/gemm.py. A model's multi-token-prediction modules (DeepSeek-V3 §2.2, `PlanModel.mtp_depth`) run on
the last stage: one more block, the 2h -> h projection and the head's second pass (`units.mtp_blocks`).

Communication: a collective takes bytes_sent / (tier bandwidth / oversubscription) + latency hops
(see topology.collective_latency) on the slowest tier its group crosses. What overlaps, and what not
(the formulas: docs/plan.md, "Mechanisms"):
- tp, sp, Ulysses cp, ep: inside each layer, on the critical path: added to the stage's compute.
  Ring-attention sends overlap with the attention compute of the block before; only the excess shows.
  With `ep_overlap` (DualPipe-style) a forward chunk's expert all-to-alls hide behind another
  micro-batch's backward compute and the backward's behind its forward compute (`ep_exposed`). The two
  parts of a node-limited all-to-all (between nodes, inside them) run together: the longer counts.
- pp: each send on the pipeline's critical path (the schedule simulator takes it as transfer time;
  with the closed forms, 2(p-1) transfers for fill and drain).
- dp/edp gradient reduction: once per step (DDP, ZeRO-1; ZeRO-2/3 under a pipeline, which accumulate
  over the micro-batches), bucket by bucket on one stream. With `overlap_grad_reduce` a chunk's buckets
  become final one by one during its last backward (Megatron-Core, FSDP), each reduction group's apart
  (`grad_streams`, `bucket_groups`); without it all at the end of
  the stage's schedule (the runtime under a pipeline). What ends after the whole pipeline has drained is
  exposed: stage s's last backward ends before stage 0's by the drain, and its reduction hides there
  (`reduction_end`, `chunk_ready`); the part that runs beside the last backward slows it
  (`beside_backward`, `interfered`). ZeRO-2 without a pipeline, and ZeRO-2/3 under one with
  `reduce_each_microbatch`, reduce-scatter every micro-batch behind its own backward. ZeRO-1/2's parameter all-gather after the step: bucket by bucket behind each chunk's
  first forward of the next step (`overlap_param_gather`; `gather_delay`), or exposed. ZeRO-3 gathers
  are prefetched behind the previous unit without a pipeline and exposed under one (not prefetched).
- loss, grad_norm, tied-embedding reductions: exposed (small).
- optimizer step: memory bound, reads and writes every model-state byte once (fused), or the runtime's
  eager AdamW passes (`optimizer_seconds`).
- offload (`Layout.offload`, docs/plan.md "Offload"): after the reduction and clipping the step runs on
  the host, unit by unit: the reduced gradient shard comes to the host (d2h), the host's Adam (memory
  bound at the host's bandwidth, `host_step_seconds`) updates it, the updated parameter shard goes back
  (h2d); nvme reads each unit's state ahead and writes it behind. `offload_exposed`: all of it is past
  the backward (the runtime copies after clipping), only the copies and updates of different units overlap;
  ZeRO-2/3 stream the gradients down during the backward instead (`ZeroSpec.streams_grads`): only the last copy waits.
  ZeRO-3 nvme also reads each parameter shard from disk and copies it up before each all-gather, on the
  gather's critical path (the host reads, copies up with a blocking copy, then issues the gather): every
  such read and copy is exposed, the slowest stage's (`stage_param_reads`).

Pipeline bubble: the schedule simulator `fivefold.parallel.pipeline.schedules` (pure Python), with
per-stage forward/backward costs (uneven stages, embedding and head included); when the schedule is too
long to simulate quickly, or the schedule does not apply (interleaved with m % p != 0), the closed forms (Narayanan et al. 2021):
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, and ZB-H1's (p-1)(F+I-W) idle
(Qi et al. 2023).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .. import rules
from ..comm import volume
from ..parallel.pipeline import schedules as _schedules
from ..parallel.zero.order import MAX_INFLIGHT, backward_slots
from ..rules import INTERLEAVED, ONE_F_ONE_B, ZB
from ..shapes import padded, shard_size
from .buffers import zero3_slots
from .dualpipe import is_dualpipe, one_way, stages_of
from .dualpipe import pipeline_seconds as dualpipe_seconds
from .gemm import fp8_cast_elements, gemm_seconds, linear_rate, linear_seconds, shaped
from .layout import Layout, Workload, microbatches, schedule_of
from .units import (frozen_prefix_layers, frozen_share, head_stage, held_root, layout_blocks, root_units, stage_layers,
                    zero_units)
from .models import PlanModel
from .topology import Topology, collective_latency
from .traffic import KIND, Flow, tp_overlapped_merged

SIMULATE_MAX_ACTIONS = 4096   # 2·p·m·v compute actions; longer schedules use the closed forms (speed)


# -- FLOPs ---------------------------------------------------------------------------------------------
def stage_flops(model: PlanModel, layout: Layout, work: Workload, stage: int) -> tuple[float, float, float]:
    """(linear layers, attention core, LM head) forward FLOPs of one micro-batch on one rank of `stage`."""
    tokens = layout.micro_batch * work.seq / (layout.tp * layout.cp)
    n_layers = stage_blocks(model, layout, stage)
    attn = model.attention_flops_per_token(work.attention_span, work.causal) / model.layers
    body, head = _stage_active_weights(model, layout.pp, layout.vpp, layout.partition, layout.head_first)[stage]
    return tokens * 2.0 * body, tokens * attn * n_layers, tokens * 2.0 * head


def stage_blocks(model: PlanModel, layout: Layout, stage: int) -> int:
    """Transformer blocks one rank of `stage` runs: its layers and the MTP modules' blocks (`units.layout_blocks`)."""
    return len(layout_blocks(model, layout, stage))


def elementwise_seconds(model: PlanModel, layout: Layout, work: Workload, acc, stage: int) -> float:
    """Forward + backward seconds of one micro-batch's element-wise work on one rank of `stage`: each layer's
    `elementwise_per_token` elements at the activation dtype's bytes over `hbm_bandwidth`, times the
    accelerator's `elementwise` share, plus its `layer_overhead` per layer (both 0 for datasheet
    accelerators, measured by `fivefold calibrate`). Replicated parts are split over tp only with
    sequence parallelism; tokens are split over cp."""
    if not (acc.elementwise or acc.layer_overhead):
        return 0.0
    tokens = layout.micro_batch * work.seq / layout.cp
    sp = layout.sp_mode == "megatron"
    elements = 0.0
    layers = layout_blocks(model, layout, stage)
    for i in layers:
        whole, split = model.elementwise_per_token(i)
        elements += tokens * (whole / (layout.tp if sp else 1) + split / layout.tp)
    return acc.elementwise * elements * work.act_bytes / acc.hbm_bandwidth + acc.layer_overhead * len(layers)


def stage_gemm_seconds(model: PlanModel, layout: Layout, work: Workload, acc, stage: int) -> tuple[float, float]:
    """(linear layers, LM head) forward seconds of one micro-batch on one rank of `stage` (`gemm.linear_seconds`:
    flat, or by shape with the MoE layers' GEMMs apart from the dense ones)."""
    lin, _, head = stage_flops(model, layout, work, stage)
    n_moe = sum(1 for i in layout_blocks(model, layout, stage) if model.is_moe_layer(i))   # MTP blocks too
    tokens = layout.micro_batch * work.seq / (layout.tp * layout.cp)
    moe = tokens * 2.0 * model.layer_params(model.dense_layers, model.top_k) * n_moe if n_moe else 0.0
    return linear_seconds(model, work, acc, layout.micro_batch * work.seq / layout.cp, layout.tp, layout.ep,
                          lin - moe, moe, head, layout.etp)


def fp8_cast_seconds(model: PlanModel, layout: Layout, work: Workload, acc, stage: int, m: int) -> tuple[float, float]:
    """(forward, backward) seconds of FP8's quantization in one micro-batch on one rank of `stage` with
    `fp8_gemm` (`gemm.fp8_cast_elements`, memory bound at `hbm_bandwidth`): the inputs' and the output
    gradients' casts, each read in the activation dtype and written twice in FP8 (as is and transposed),
    and the weights' (read in the parameter dtype, written twice) once a step of `m` micro-batches, a 1/m
    share in each forward. (0, 0) without FP8 GEMMs."""
    if not work.fp8_gemm:
        return 0.0, 0.0
    rows = layout.micro_batch * work.seq / layout.cp
    blocks = layout_blocks(model, layout, stage)
    n_moe = sum(1 for i in blocks if model.is_moe_layer(i))
    fwd = bwd = 0.0
    for moe, n in ((False, len(blocks) - n_moe), (True, n_moe)):
        if n:
            x, dy, w = fp8_cast_elements(model, moe, rows, layout.tp, layout.ep, layout.etp)
            fwd += n * ((work.act_bytes + 2) * x + (work.param_bytes + 2) * w / m)
            bwd += n * (work.act_bytes + 2) * dy
    return fwd / acc.hbm_bandwidth, bwd / acc.hbm_bandwidth


def light_recompute_flops(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """Forward FLOPs `recompute_norm_mla` repeats in one micro-batch's backward on one rank of `stage`
    (DeepSeek-V3 §3.4): MLA's up-projections, q (q_lora_rank → heads·d_qk) and kv (kv_lora_rank →
    heads·(d_nope + d_v)), 2 FLOPs per weight per token; the norms' element-wise work is not counted.
    Nothing under full recompute, which repeats the whole forward anyway."""
    tokens = layout.micro_batch * work.seq / (layout.tp * layout.cp)
    return tokens * 2.0 * _light_weights(model, layout) * stage_blocks(model, layout, stage)


def _light_weights(model: PlanModel, layout: Layout) -> int:
    """Weights per layer whose forward `recompute_norm_mla` repeats (0 when it does not apply)."""
    if not (layout.recompute_norm_mla and model.mla) or layout.recompute == "full":
        return 0
    return model.q_lora_rank * model.heads * model.qk_head_dim + \
        model.kv_lora_rank * model.heads * (model.qk_nope_dim + model.v_head_dim)


@lru_cache(maxsize=4096)
def _stage_active_weights(model: PlanModel, pp: int, vpp: int, partition: str, head_first: bool = False) -> tuple:
    """Per stage, (layer weights, LM-head weights) one token multiplies by (top_k routed experts; the head
    on `units.head_stage`, with the MTP modules' blocks, projections and extra head passes)."""
    out = []
    for j, rng in enumerate(stage_layers(model.layers, pp, vpp, partition)):
        w = sum(model.layer_params(i, model.top_k if model.is_moe_layer(i) else None) for i in rng)
        last = j == head_stage(pp, head_first)
        out.append((w + (model.mtp_active_weights() if last else 0),
                    model.vocab * model.hidden + model.mtp_head_weights if last else 0))
    return tuple(out)


def forward_seconds(model: PlanModel, work: Workload, topo: Topology, tokens: float, body: float, n_layers: int,
                    head: float) -> float:
    """Forward compute seconds of `tokens` tokens on a rank holding `n_layers` layers whose active weights
    sum to `body` (and `head` LM-head weights), every GEMM at the flat rate: `step_time`'s t_f with flat GEMMs,
    a lower bound on it by shape (`gemm.gemm_factor` >= 1), from `_stage_active_weights` directly."""
    peak = topo.accelerator.peak(work.dtype) * work.efficiency
    peak_mm = linear_rate(topo.accelerator, work)
    attn = model.attention_flops_per_token(work.attention_span, work.causal) / model.layers
    return tokens * 2.0 * body / peak_mm + (tokens * attn * n_layers + tokens * 2.0 * head) / peak


def stage_weights(model: PlanModel, pp: int, vpp: int = 1, partition: str = "even", head_first: bool = False) -> tuple:
    """Per stage, (layer weights, LM-head weights) one token multiplies (`_stage_active_weights`)."""
    return _stage_active_weights(model, pp, vpp, partition, head_first)


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 2.0) -> float:
    """Bubble fraction of the papers: (p-1)/(m+p-1); interleaved (p-1)/(v·m+p-1); ZB-H1 with I = W = B/2:
    (p-1)(F+I-W) / (m(F+B) + (p-1)(F+I-W))."""
    if p == 1:
        return 0.0
    if schedule == ZB:
        idle = (p - 1) * f
        return idle / (m * (f + b) + idle)
    return (p - 1) / ((v if schedule == INTERLEAVED else 1) * m + p - 1)


def _simulate(actions: list, p: int, m: int, v: int, cost_f: list[float], cost_b: list[float],
              comm: float) -> _schedules.Simulation | None:
    """Simulate a schedule's action lists (None when too long: the closed forms) with per-stage costs."""
    if p == 1 or 2 * p * m * v > SIMULATE_MAX_ACTIONS:
        return None
    actions = actions() if callable(actions) else actions
    chunks = p * v
    f = [cost_f[c % p] / v for c in range(chunks)]
    b = [cost_b[c % p] / v for c in range(chunks)]
    half = [x / 2 for x in b]
    return _schedules.simulate(actions, cost_f=f, cost_b=b, cost_i=half, cost_w=half, comm=comm)


def simulate_pipeline(schedule: str, p: int, m: int, v: int, cost_f: list[float], cost_b: list[float],
                      comm: float) -> tuple[float, float] | None:
    """(makespan, bubble) from the schedule simulator with per-stage costs, or None when the schedule is
    too long to simulate or does not apply to (p, m, v)."""
    sim = _simulate(lambda: _schedules.build_schedule(schedule, p, m, v), p, m, v, cost_f, cost_b, comm)
    return None if sim is None else (float(sim.makespan), float(sim.bubble))


# -- gradient reduction ---------------------------------------------------------------------------------
def reduction_end(free: float, ready: list[tuple[float, float, float, float]]) -> float:
    """When a stream of bucketed reductions ends. `ready` lists, in the order they are launched, groups of
    buckets (t, d, R, u): u buckets taking R seconds in all that become final one by one, evenly, during a
    backward of d seconds ending at t (bucket k at t - d + k·d/u). Buckets run one at a time in launch
    order, from `free` on; the end is max(free + R, t - d + d/u + R, t + R/u) per group, chained."""
    for t, d, r_sum, u in ready:
        if r_sum <= 0:
            continue
        u = max(1.0, u)
        free = max(free + r_sum, t - d + d / u + r_sum, t + r_sum / u)
    return free


def chunk_ready(sim: _schedules.Simulation | None, schedule: str, p: int, v: int, stage: int, end: float,
                cost_b: dict[int, float], t_send: float) -> list[tuple[float, float]]:
    """Per chunk of `stage`, (end, duration) of the last backward that makes its gradients final (B; W
    under zero-bubble schedules), in the order they end. From the simulator when it ran; otherwise the
    closed form: the last micro-batch's backward walks the chunks from the last (global chunk p·v-1)
    down to 0, so global chunk q = c·p + s finishes the sum over q' < q of (B_q' + send) before `end`
    (ZB-H1 fills the drain with deferred W passes: every stage ends at `end`)."""
    if sim is not None:
        last: dict[int, tuple[float, float]] = {}
        for blk in sim.timeline[stage]:
            if blk.kind in (_schedules.B, _schedules.W) and blk.end >= last.get(blk.chunk, (-1.0, 0.0))[0]:
                last[blk.chunk] = (blk.end, blk.end - blk.start)
        return sorted(last.values())
    b = cost_b.get(stage, max(cost_b.values()))
    if schedule == ZB or p == 1:
        return [(end, b / 2 if schedule == ZB else b)]
    return sorted((end - t, b / v) for t in _chain(p, v, stage, cost_b, t_send))


def backward_blocks(sim: _schedules.Simulation | None, stage: int, ready: list[tuple[float, float]], m: int,
                    period: float) -> list[tuple[float, float]]:
    """(end, duration) of every action of `stage` that accumulates weight gradients (B; W under zero
    bubble), in order: from the simulator, or from `chunk_ready`'s last backward of each chunk with the
    m micro-batches' backwards of that chunk one steady-state `period` (F + B) apart before it."""
    if sim is not None:
        return sorted((blk.end, blk.end - blk.start) for blk in sim.timeline[stage]
                      if blk.kind in (_schedules.B, _schedules.W))
    return sorted((t - k * period, d) for t, d in ready for k in range(m))


def chunk_first_use(sim: _schedules.Simulation | None, p: int, v: int, stage: int, cost_f: dict[int, float],
                    t_send: float) -> list[tuple[float, float]]:
    """Per chunk of `stage`, (start, duration) of its first forward, in order: from the simulator, or the
    closed form mirroring `chunk_ready`: the first micro-batch's forward reaches global chunk q after the
    sum over q' < q of (F_q' + send)."""
    if sim is not None:
        first: dict[int, tuple[float, float]] = {}
        for blk in sim.timeline[stage]:
            if blk.kind == _schedules.F and blk.start < first.get(blk.chunk, (float("inf"), 0.0))[0]:
                first[blk.chunk] = (blk.start, blk.end - blk.start)
        return sorted(first.values())
    f = cost_f.get(stage, max(cost_f.values()))
    return sorted((t, f / v) for t in _chain(p, v, stage, cost_f, t_send))


def _chain(p: int, v: int, stage: int, cost: dict[int, float], t_send: float) -> list[float]:
    """Sum over the global chunks q' < q of (cost_q' / v + send), for each chunk q of `stage` (stages not
    in `cost` cost as the slowest one given)."""
    slow, out, t = max(cost.values()), [], 0.0
    for q in range(p * v):
        if q % p == stage:
            out.append(t)
        t += cost.get(q % p, slow) / v + t_send
    return out


def gather_delay(first_use: list[tuple[float, float]], a_sum: float, calls: float) -> float:
    """How long a stage's first forwards wait for the parameter all-gathers launched when the step starts
    (time 0), one bucket at a time in the order the chunks first run: bucket k of u of a chunk whose first
    forward starts at t and lasts d is needed at t + (k-1)·d/u, so each chunk asks
    max(F + A/u - t, F + A - t - (u-1)·d/u) with F when its first bucket may start (chained)."""
    if a_sum <= 0:
        return 0.0
    k = len(first_use)
    a, u, free, late = a_sum / k, max(1.0, calls / k), 0.0, 0.0
    for t, d in first_use:
        late = max(late, free + a / u - t, free + a - t - (u - 1) * d / u)
        free += a
    return max(0.0, late)


def grad_totals(flows: list[Flow]) -> tuple[float, float, float, float]:
    """(reduction seconds, reduction calls, gather seconds, gather calls) of a stage's dp/edp rows."""
    grad = [f for f in flows if KIND.get(f.dim) == "grad"]
    red = [f for f in grad if f.op in ("all_reduce", "reduce_scatter")]
    gat = [f for f in grad if f.op == "all_gather"]
    return (sum(f.seconds for f in red), sum(f.calls for f in red),
            sum(f.seconds for f in gat), sum(f.calls for f in gat))


def stage_grad_exposed(flows: list[Flow], layout: Layout, m: int, end: float, ready: list[tuple[float, float]],
                       first_use: list[tuple[float, float]], t_f: float, t_b: float,
                       backwards: list[tuple[float, float]] | None = None, overlap: float = 1.0,
                       share: float = 0.0, slots: tuple | None = None) -> tuple[float, float]:
    """`_grad_exposed`, with only `overlap` (the tier's measured share) of what it hides really hidden: a
    collective that needs the compute's own core (gloo on CPU) hides partly; on GPUs (1.0) fully. `share`:
    the compute rate the accelerator gives collectives that overlap it (`interfered`)."""
    reduction, gather = _grad_exposed(flows, layout, m, end, ready, first_use, t_f, t_b, backwards, share, slots)
    if overlap >= 1.0:
        return reduction, gather
    rs, _, ag, _ = grad_totals(flows)
    if layout.zero_spec.shards_params and not layout.zero_spec.pipeline:   # one figure for both (prefetched gathers and reductions)
        return reduction + (1.0 - overlap) * max(0.0, rs + ag - reduction), gather
    return (reduction + (1.0 - overlap) * max(0.0, rs - reduction),
            gather + (1.0 - overlap) * max(0.0, ag - gather))


def _grad_exposed(flows: list[Flow], layout: Layout, m: int, end: float, ready: list[tuple[float, float]],
                  first_use: list[tuple[float, float]], t_f: float, t_b: float,
                  backwards: list[tuple[float, float]] | None = None, share: float = 0.0,
                  slots: tuple | None = None) -> tuple[float, float]:
    """(reduction, gather) time of one stage exposed past its compute (docs/plan.md, "Mechanisms"). The
    reduction is counted from `end`, when the whole pipeline has drained; `ready`: (end, duration) of the
    backward that makes each of the stage's chunks final (`chunk_ready`). The gather delays the stage's
    first forwards, `first_use` (`chunk_first_use`). t_f, t_b: one micro-batch's forward and backward.
    `backwards` (`backward_blocks`, with `reduce_each_microbatch` under a pipeline): every backward of the
    stage, each launching its share of the reduce-scatters, which run one at a time on their own stream
    through the rest of the schedule. The collectives hidden behind compute (ZeRO-3's prefetched gathers and
    reductions, the per-micro-batch reduce-scatters) cost `share` of their time in slower compute at least
    (`interfered`); the once-per-step reduction, the part of it that runs beside the last backwards
    (`beside_backward`), not what runs in the drain, where the stage is idle. `slots`: ZeRO-3 outside a
    pipeline, (each gather slot's share of the gathered bytes, the head's forward seconds) for
    `prefetch_exposed`; absent, the gathers are spread evenly over the compute."""
    L, z = layout, layout.zero_spec
    rs, calls, ag, ag_calls = grad_totals(flows)
    if z.shards_params:
        if not z.pipeline:   # per micro-batch: gathers prefetched behind the units' compute
            g, r = ag / (2 * m), rs / m
            if slots is None:
                fwd, bwd = max(0.0, g - t_f), max(0.0, g + r - t_b)
            else:
                fwd, bwd = prefetch_exposed(slots[0], g, r, t_f, t_b, slots[1], z.prefetch)
            return m * (interfered(fwd, g, share) + interfered(bwd, g + r, share)), 0.0
        gather = ag     # under a pipeline each use gathers, not prefetched (the next module is not known)
    else:               # ZeRO-1/2: the updated parameters, behind the next step's first forwards
        gather = gather_delay(first_use, ag, ag_calls) if L.overlap_param_gather else ag
    if z.reduces_each_microbatch and z.pipeline and backwards:
        k = len(backwards)
        late = max(0.0, reduction_end(float("-inf"), [(t, d, rs / k, calls / k) for t, d in backwards]) - end)
        return interfered(late, rs, share), gather
    if z.reduces_each_microbatch and not z.pipeline:   # per micro-batch, behind its own backward
        return m * interfered(max(0.0, reduction_end(0.0, [(t_b, t_b, rs / m, calls / m)]) - t_b), rs / m, share), gather
    # once per step: buckets of each chunk as its last backward makes them final, or all at the end of
    # the stage's schedule (overlap_grad_reduce=False); either way inside the drain other stages still run
    if not L.overlap_grad_reduce:
        ready = [(max(t for t, _ in ready), 0.0)]
    spans = bucket_groups(ready, grad_streams(flows))
    groups = [g for g, _ in spans]
    late = max(0.0, reduction_end(float("-inf"), groups) - end)
    return interfered(late, beside_backward(groups, [e for _, e in spans]), share), gather


def zero3_gather_slots(model: PlanModel, L: Layout, work: Workload, acc, stage: int) -> tuple | None:
    """ZeRO-3 outside a pipeline: (each gather slot's padded elements, the head's forward seconds) of one rank
    of `stage`, for `prefetch_exposed`; None otherwise."""
    z = L.zero_spec
    if not z.shards_params or z.pipeline:
        return None
    weights = [float(sum(padded(*u) for u in slot)) for slot in zero3_slots(model, L, stage)]
    return weights, stage_gemm_seconds(model, L, work, acc, stage)[1]


def prefetch_exposed(weights: list[float], gather: float, reduce: float, t_f: float, t_b: float, t_head: float,
                     depth: int) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's ZeRO-3 collectives past its compute outside a
    pipeline, as `ShardedParams` orders them (parallel/zero/order.py): `gather` seconds of all-gathers each pass and
    `reduce` of reduce-scatters, split over the slots by `weights` (their shares of the bytes; slot 0 the
    root), all on one stream in the order they are issued.

    A slot's hook issues its own gather, waits for it, issues the next `depth` slots' (those not yet
    issued) and computes. Forward: the root first (its compute, the embedding, ~0), the blocks at
    (t_f - t_head)/L each, the head at the end with the root still held. Backward: the root first (the
    head's backward, 2·t_head), then the blocks from last to first at (t_b - 2·t_head)/L each; a block's
    reduce-scatter goes on the stream when its backward ends, the root's after the last (the embedding's
    gradient comes last); with more than MAX_INFLIGHT reductions in flight the compute waits for the oldest. Depth 0 waits for every gather; a deep prefetch approaches the gathers spread
    over the compute."""
    last = len(weights) - 1
    total = sum(weights) or 1.0
    g = [gather * w / total for w in weights]
    r = [reduce * w / total for w in weights]
    blocks = max(1, last)

    def run(order, compute, reduces: bool) -> float:
        stream, clock, ends, inflight = 0.0, 0.0, {}, []
        for i, k in enumerate(order):
            for a in [k] + order[i + 1:i + 1 + depth]:
                if a not in ends:
                    stream = max(stream, clock) + g[a]
                    ends[a] = stream
                if a == k:
                    clock = max(clock, ends[k])
            clock += compute[k]
            if reduces and k:
                stream = max(stream, clock) + r[k]
                inflight.append(stream)
                while len(inflight) > MAX_INFLIGHT:   # the oldest reduction is waited for (parallel/zero/engine.py)
                    clock = max(clock, inflight.pop(0))
        if reduces:
            stream = max(stream, clock) + r[0]
        return max(clock, stream if reduces else 0.0)

    forward = [0.0] + [max(0.0, t_f - t_head) / blocks] * last
    backward = [min(t_b, 2 * t_head)] + [max(0.0, t_b - 2 * t_head) / blocks] * last
    fwd = run(list(range(last + 1)), forward, False) - sum(forward)
    bwd = run(backward_slots(last + 1), backward, True) - sum(backward)
    return max(0.0, fwd), max(0.0, bwd)


def grad_streams(flows: list[Flow]) -> list[tuple[float, float]]:
    """(seconds, buckets) of each gradient reduction's own bucket series: one per (dim, group, op) of the
    stage's dp/edp reductions. The runtime fills each group's buckets apart, in backward order
    (parallel/engine.py: buckets never mix groups), so each series' buckets become final one by one
    through the backward on their own: a group whose gradients fit one bucket (a MoE's dense dp
    gradients, say, beside its experts' edp ones) is final only when the backward ends."""
    streams: dict[tuple, list[float]] = {}
    for f in flows:
        if KIND.get(f.dim) == "grad" and f.op in ("all_reduce", "reduce_scatter"):
            row = streams.setdefault((f.dim, f.group, f.op), [0.0, 0.0])
            row[0] += f.seconds
            row[1] = max(row[1], f.calls)     # a group's rows by tier are the same calls
    return [(r, u) for r, u in streams.values() if r > 0]


# A series of u buckets is cut into min(u, MERGE_GROUPS) spans of consecutive buckets when series are
# merged: the spans go in the order they end. Where every series has at most MERGE_GROUPS buckets each
# span is one bucket and that is the bucket queue exactly; beyond, a span runs whole before the next, so
# where two series' buckets interleave inside a span the stream ends later than the queue (by less than
# a span's seconds).
MERGE_GROUPS = 16


def bucket_groups(ready: list[tuple[float, float]], streams: list[tuple[float, float]]
                  ) -> list[tuple[tuple[float, float, float, float], float]]:
    """`reduction_end`'s groups (t, d, R, u), each with the end of the backward it belongs to, for a stage
    whose chunks become final at `ready` ((end, duration) of each chunk's last backward) and whose
    gradients go in `streams` ((seconds, buckets) per bucket series, `grad_streams`): each chunk holds
    1/k of every series. One series keeps its groups as they are (a group a chunk); several are each cut
    into min(buckets, MERGE_GROUPS) spans of consecutive buckets, and the spans of all series are
    launched in the order they end."""
    k = len(ready)
    if len(streams) == 1:
        r_sum, u = streams[0]
        return [((t, d, r_sum / k, u / k), t) for t, d in ready]
    spans = []
    for t, d in ready:
        for r_sum, u in streams:
            u = max(1.0, u / k)
            n = max(1, min(MERGE_GROUPS, int(u)))
            spans += [((t - d + (i + 1) * d / n, d / n, r_sum / k / n, u / n), t) for i in range(n)]
    return sorted(spans, key=lambda g: g[0][0])


def beside_backward(groups: list[tuple[float, float, float, float]], ends: list[float] | None = None) -> float:
    """Seconds of a bucket stream (`reduction_end`'s groups, chained) that run before their backward ends,
    beside its compute: each group's R less what runs after the backward's end T (`ends`, one per group;
    absent: the group's own t, its chunk's end). From its t on every bucket of a group is final, so the
    stream is busy from t (≤ T) to the group's end E without a gap: R − (E − T)⁺, in [0, R]."""
    free, inside = float("-inf"), 0.0
    for i, (t, d, r_sum, u) in enumerate(groups):
        if r_sum <= 0:
            continue
        free = reduction_end(free, [(t, d, r_sum, u)])
        until = ends[i] if ends is not None else t
        inside += min(r_sum, max(0.0, r_sum - max(0.0, free - until)))
    return inside


def grad_overlap(flows: list[Flow], topo: Topology) -> float:
    """The smallest `Tier.overlap` among the tiers the stage's dp/edp collectives cross (1.0: none)."""
    tiers = {f.tier for f in flows if KIND.get(f.dim) == "grad"}
    return min((t.overlap for t in topo.tiers if t.name in tiers), default=1.0)


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
    offload_s: float = 0.0           # exposed host step and its copies (offload; `offload_exposed`)
    first_touch_s: float = 0.0       # the slowest stage's fresh ZeRO buffers (host devices; `first_touch_bytes`)
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    hfu: float = 0.0
    exposed: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _per_dim_seconds(flows: list[Flow]) -> dict[str, float]:
    """Seconds per dimension; the two parts of a node-limited all-to-all overlap (the network part and
    the forwarding inside nodes run together), so only the longer counts."""
    out: dict[str, float] = {}
    parts: dict[tuple[str, str], float] = {}
    for fl in flows:
        if fl.part in ("inter", "intra"):
            parts[(fl.dim, fl.part)] = parts.get((fl.dim, fl.part), 0.0) + fl.seconds
        else:
            out[fl.dim] = out.get(fl.dim, 0.0) + fl.seconds
    for dim in {d for d, _ in parts}:
        out[dim] = out.get(dim, 0.0) + max(parts.get((dim, "inter"), 0.0), parts.get((dim, "intra"), 0.0))
    return out


def wire_share(flows: list[Flow], topo: Topology) -> float:
    """The share of a stage's layer collectives (tp, cp, ep; the seconds the plan charges them) that runs
    on tiers beyond the first: between hosts, on links whose rate no core of this host sets. Used only
    where ranks share cores (`shared_cores_makespan`): there the first tier is the host's loopback, whose
    transfers are core work."""
    layer = [f for f in flows if KIND.get(f.dim) == "layer" and f.op not in ("send", "recv")]
    total = sum(f.seconds for f in layer)
    if total <= 0:
        return 0.0
    return sum(f.seconds for f in layer if f.tier != topo.tiers[0].name) / total


def call_seconds(row: Flow, topo: Topology, message: float) -> float:
    """Seconds of one call of `row`'s collective with `message` bytes at the rate `place` gave the row:
    its tier's latency hops per call (topology.collective_latency), the rest of its seconds per byte sent."""
    tier = next(t for t in topo.tiers if t.name == row.tier)
    per_call = collective_latency(row.op, row.n, tier.fit(row.op)[0], row.backend)
    per_byte = max(0.0, row.seconds - row.calls * per_call) / row.bytes_sent if row.bytes_sent else 0.0
    return volume.bytes_sent(row.op, message, row.n, row.backend) * per_byte + per_call


def tp_hidden(model: PlanModel, L: Layout, work: Workload, topo: Topology, flows: list[Flow], stage: int
              ) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's tp collectives that hide behind the GEMMs beside
    them (`traffic.tp_overlapped`, merged; parallel/tensor_overlap.py): each call c beside a GEMM
    of t seconds hides o·min(t, (1 - share)·c), `interfered`'s complement scaled by the tier's measured
    `overlap` o (what really hides on a host whose collectives take the compute's cores)."""
    if L.tp == 1:
        return 0.0, 0.0
    rows = {f.op: f for f in flows if f.dim == "tp" and f.group == "tp" and not f.part and f.calls}   # not tp_kv's
    acc = topo.accelerator
    rate = linear_rate(acc, work)
    fwd = bwd = 0.0
    for direction, op, message, calls, (mm, nn, kk) in tp_overlapped_merged(model, L, work, stage):
        row = rows.get(op)
        if row is None:
            continue
        c = call_seconds(row, topo, message)
        t = gemm_seconds(mm, nn, kk, rate, acc.hbm_bandwidth, work.act_bytes, acc.gemm_kernel) \
            if shaped(work, acc) else 2.0 * mm * nn * kk / rate
        o = next(tier.overlap for tier in topo.tiers if tier.name == row.tier)
        hidden = calls * o * min(t, (1.0 - acc.comm_share) * c)
        if direction == "forward":
            fwd += hidden
        else:
            bwd += hidden
    return fwd, bwd


def interfered(exposed: float, comm: float, share: float) -> float:
    """Exposed seconds of `comm` seconds of collectives run beside compute, of which `exposed` show past it
    when overlap is free, with `share` of the compute rate given to communication (`Accelerator.
    comm_share`: SMs and their memory bandwidth). Compute t beside a collective c runs at (1 - share) while
    the collective lasts, so the pair takes max(c, t + share·c): exposed max(c - t, share·c) = max(exposed,
    share·c) (docs/plan.md, "Overlap is not free")."""
    return max(exposed, share * comm)


def ep_exposed(a2a: float, t_f: float, t_b: float, passes: int, overlap: bool, m: int, share: float = 0.0) -> float:
    """Exposed expert all-to-all time of one micro-batch on one stage (a2a seconds in all). Without
    overlap all of it. With DualPipe-style two-stream overlap (DeepSeek-V3 §3.2.1) a forward chunk of one
    micro-batch runs beside a backward chunk of another: the forward's all-to-alls (dispatch and combine,
    1/(passes+1) of the calls) hide behind the other's backward compute t_b, the backward's (the rest:
    both gradients, and the recomputed forward's) behind the other's forward compute t_f; only the excess
    shows, or `share` of each part (`interfered`: the compute beside it loses that share of its SMs). One
    micro-batch has no partner."""
    if not overlap or m < 2:
        return a2a
    fwd = a2a / (passes + 1)
    return interfered(max(0.0, fwd - t_b), fwd, share) + interfered(max(0.0, a2a - fwd - t_f), a2a - fwd, share)


def optimizer_seconds(work: Workload, acc, states_bytes: float, owned: float) -> float:
    """The optimizer step, memory bound: a fused optimizer reads and writes every model-state byte once
    (2·states / HBM bandwidth); the runtime's eager AdamW makes rules.EAGER_ADAMW_ACCESSES passes over
    each of the `owned` elements' master precision, and the gradient norm its own (EAGER_GRAD_NORM_BYTES
    plus one read of the gradient)."""
    if work.fused_optimizer:
        return 2 * states_bytes / acc.hbm_bandwidth
    per = rules.EAGER_ADAMW_ACCESSES * work.master_bytes + rules.EAGER_GRAD_NORM_BYTES + work.grad_bytes
    return owned * per / acc.hbm_bandwidth


def host_step_seconds(work: Workload, acc, shard: float) -> float:
    """The optimizer step on the host for `shard` elements, memory bound at `acc.host_bandwidth`: a fused
    CPU Adam (ZeRO-Offload's CPU-Adam) reads the gradient and reads and writes master, m and v once, and
    writes the parameter in the weights' dtype for the copy up: 6·mb + g + w bytes per element; the
    runtime's eager AdamW makes rules.EAGER_ADAMW_ACCESSES master-precision passes instead of the 6."""
    mb = work.master_bytes
    passes = 6 if work.fused_optimizer else rules.EAGER_ADAMW_ACCESSES
    return shard * (passes * mb + work.grad_bytes + work.param_bytes) / acc.host_bandwidth


def offload_exposed(units: int, d2h: float, host: float, h2d: float, read: float = 0.0, write: float = 0.0) -> float:
    """Seconds the offloaded optimizer step takes after the gradients are reduced and clipped, as the
    runtime runs it (parallel/zero/offload.py), for `units` ZeRO units taken as equal parts; d2h, host (the
    host's Adam), h2d, read and write are the seconds of all units.

    cpu: every gradient copy is issued at once on a side stream, the host updates unit j as soon as its
    copy has landed, and unit j's parameter copy runs while the host updates unit j + 1: a flow shop of u
    identical jobs on three resources (down link, host, up link), all ready at the start:

        (d2h + host + h2d)/u + (1 - 1/u)·max(d2h, host, h2d)

    nvme: the host copies, updates and copies back one unit at a time (d2h + host + h2d in turn) while a
    worker thread reads the next unit's state ahead and writes the last one behind (read + write on one
    disk); the first read and the last write are not hidden:

        (read + write)/u + max(d2h + host + h2d, read + write)
    """
    if units <= 0:
        return 0.0
    u = float(units)
    if read or write:
        return (read + write) / u + max(d2h + host + h2d, read + write)
    return (d2h + host + h2d) / u + (1 - 1 / u) * max(d2h, host, h2d)


def _offload_parts(flows: list[Flow], work: Workload, streamed: int = 0) -> dict[str, float] | None:
    """The seconds of one stage's placed "offload" rows split into the optimizer step's part and the
    parameter reads before ZeRO-3 all-gathers (parameters on disk). The step reads 3·K·mb (K = d2h bytes
    / g, the shard elements); the rest of nvme_read, and as much of h2d, are the gathers' reads and copies
    up. Copies have no latency, so seconds split as bytes do."""
    rows = {f.op: f for f in flows if f.dim == "offload"}
    if "d2h" not in rows:
        return None
    per = max(streamed, 1)   # streamed gradients: d2h copies per unit per step
    k = rows["d2h"].message_bytes / work.grad_bytes / per
    part = lambda op, nbytes: rows[op].seconds * nbytes / rows[op].message_bytes if op in rows else 0.0  # noqa: E731
    gather = rows["nvme_read"].message_bytes - 3 * k * work.master_bytes if "nvme_read" in rows else 0.0
    h2d = rows["h2d"].message_bytes if "h2d" in rows else 0.0
    return {"units": max(1, round(rows["d2h"].calls / per)), "d2h": rows["d2h"].seconds, "k": k,
            "h2d": part("h2d", h2d - gather), "read": part("nvme_read", 3 * k * work.master_bytes),
            "write": rows["nvme_write"].seconds if "nvme_write" in rows else 0.0,
            "gather": part("nvme_read", gather) + part("h2d", gather)}


def stage_offload_exposed(flows: list[Flow], work: Workload, acc, streamed: int = 0) -> float:
    """`offload_exposed` of one stage from its placed "offload" rows (units: the d2h calls; the host's Adam
    over the shard, d2h bytes / g elements, `host_step_seconds`). ZeRO-3 nvme: the step's part only (its
    nvme_write includes the parameter shards; the gathers' reads are `stage_param_reads`).

    `streamed` > 0: ZeRO-2/3 gradients streamed to the host during the backward, `streamed` copies per unit
    (`ZeroSpec.reductions`; ZeRO-Offload, Ren et al. 2021, §4.1): each copy runs behind its bucket's
    reduce-scatter while the backward goes on, so the step waits only for the last one (d2h / calls), and
    the host's step starts with every gradient in host memory. Taken as hidden: the backward makes a
    bucket's gradient no faster than PCIe moves its shard (true when PCIe bandwidth · backward time
    exceeds the gradient shard's bytes)."""
    p = _offload_parts(flows, work, streamed)
    if p is None:
        return 0.0
    host = host_step_seconds(work, acc, p["k"])
    if streamed:
        last = p["d2h"] / max(1, round(p["units"] * streamed))
        return last + offload_exposed(p["units"], 0.0, host, p["h2d"], p["read"], p["write"])
    return offload_exposed(p["units"], p["d2h"], host, p["h2d"], p["read"], p["write"])


def stage_param_reads(flows: list[Flow], work: Workload, streamed: int = 0) -> float:
    """ZeRO-3 nvme: seconds one stage spends reading parameter shards from disk and copying them up before
    its all-gathers (each gather waits for its own read and copy; nothing of it is hidden). 0 otherwise.
    `streamed`: as `stage_offload_exposed`."""
    p = _offload_parts(flows, work, streamed)
    return p["gather"] if p else 0.0


def first_touch_bytes(model: PlanModel, layout: Layout, work: Workload, stage: int) -> tuple[float, float]:
    """(gathered, gradient) bytes of fresh host pages one rank of `stage` writes per step in ZeRO's units.
    A host block of at least `rules.MMAP_THRESHOLD_BYTES` is mapped on its own and unmapped when freed
    (train/malloc.py), so every such block allocated anew is faulted in page by page on first touch. ZeRO-3
    frees each gathered unit and re-gathers it into a re-grown storage (parallel/zero/stages.py `free_bytes`,
    `regather_buffer`) `ZeroSpec.gathers` times a step (the root once under a pipeline); ZeRO-2 and
    3 make each unit's whole gradient buffer (parallel/zero/engine.py `_unit_grad`, zeroed) for every reduction
    and free it after (`ZeroSpec.reductions` a step). Units under the threshold come from the heap,
    whose pages stay. Without ZeRO-2/3 nothing is fresh: DDP's buckets and ZeRO-1's gradients live for
    the run. Activations above the threshold are fresh too and are not counted here."""
    L, z = layout, layout.zero_spec
    if not z.shards_grads:
        return 0.0, 0.0
    m = microbatches(L, work)
    gathered = grads = 0.0
    root = root_units(model, L, stage)
    for expert, n in ((False, L.dp * L.cp), (True, L.edp)):
        if n <= 1:
            continue
        units = zero_units(model, L, work.grad_bytes, stage, expert)
        for i, u in enumerate(units):
            padded = shard_size(u, n) * n
            if z.shards_params and padded * work.param_bytes >= rules.MMAP_THRESHOLD_BYTES:
                gathered += padded * work.param_bytes * z.gathers(m, not expert and i < root)
            if padded * work.grad_bytes >= rules.MMAP_THRESHOLD_BYTES:
                grads += padded * work.grad_bytes * z.reductions(m, held=not expert and i < root
                                                                 and held_root(model, L, stage))
    return gathered, grads


def shared_cores_makespan(makespan: float, busy: list[float], ranks_per_core: float, stages: int = 0,
                          wire: list[float] | None = None, wire_fixed: float = 0.0) -> float:
    """The pipeline's makespan when local ranks share cores (`Accelerator.ranks_per_core` = o > 1: N ranks
    on N/o cores, every rate measured with all N busy, so each action's cost is at 1/o of a core). The
    simulated makespan M is a rank's busy time B (the mean over stages of `busy`, at the shared rate) plus
    its bubble M − B. In the steady phase every rank is busy and shares its core; the bubble is the fill
    and drain, where a rank waiting on a receive leaves its core to the few busy ones, which then run up
    to o times faster (the kernel's scheduler is work-conserving). At least one stage's ranks, N/p of them,
    are busy in the bubble, so they gain at most p: the bubble shrinks by s = min(o, p) (`stages` = p; 0:
    o alone):

        B + (M − B) / s

    which lies between the two lower bounds, the cores' work B and the critical path at whole cores M / s
    (the search's bound divides by s). Exact when no more ranks than cores are busy in fill and drain. (8
    ranks on 2 cores in two stages: in the bubble 4 ranks share the 2 cores, twice, not four times, the
    calibrated rate.) The bubble reported (the idle share of each rank's timeline) is the simulator's.
    o = 1 (a device or core per rank): M unchanged.

    Only what the cores do shrinks. `wire` (per stage, beside `busy`): the part of each stage's busy time
    spent waiting on links a core does not drive (a shaped network tier between hosts; the ranks' own
    loopback is core work), w = Σwire / Σbusy over the stages given (the bubble's actions taken as their
    mix); `wire_fixed`: the bubble's own seconds on such links (the pipeline's sends across them). Then

        B + F + (M − B − F) · ((1 − w) / s + w)"""
    speedup = min(ranks_per_core, stages) if stages else ranks_per_core
    if speedup <= 1.0 or not busy:
        return makespan
    mean = min(makespan, sum(busy) / len(busy))
    w = min(1.0, sum(wire) / sum(busy)) if wire and sum(busy) > 0 else 0.0
    fixed = min(max(0.0, wire_fixed), makespan - mean)
    return mean + fixed + (makespan - mean - fixed) * ((1.0 - w) / speedup + w)


def stage_compute_seconds(model: PlanModel, L: Layout, work: Workload, acc, j: int, m: int) -> tuple[float, float, float]:
    """(forward, backward, attention core) compute seconds of one micro-batch on one rank of stage `j`:
    GEMMs, attention, element-wise work, FP8's casts, recompute; frozen weights and prefixes skip theirs."""
    _, attn, _ = stage_flops(model, L, work, j)
    t_lin, t_head = stage_gemm_seconds(model, L, work, acc, j)
    t_attn = attn / (acc.attention_peak(work.dtype) * work.efficiency)
    t_ew = elementwise_seconds(model, L, work, acc, j)
    cast_f, cast_b = fp8_cast_seconds(model, L, work, acc, j, m)   # FP8's quantization (0 without)
    t_f = t_lin + t_head + t_attn + t_ew / 3 + cast_f
    extra = t_f if L.recompute == "full" else (t_attn if L.recompute == "selective" else 0.0)
    extra += light_recompute_flops(model, L, work, j) / linear_rate(acc, work)
    # element-wise work: a third forward; the backward casts its output gradients, not the inputs again
    t_b = 2 * (t_f - t_ew / 3 - cast_f) + t_ew * 2 / 3 + extra + cast_b
    layers_frozen, head_frozen = frozen_share(model, L, j)   # LoRA, train.freeze: no wgrad for frozen weights
    t_b -= t_lin * layers_frozen + (t_head if head_frozen else 0.0)
    blocks = layout_blocks(model, L, j)
    quiet = sum(1 for i in blocks if i < frozen_prefix_layers(model)) / max(1, len(blocks))
    # a frozen prefix runs no backward at all: beyond its wgrad (above), its dgrad, attention and element-wise
    t_b -= quiet * (t_lin + 2 * t_attn + t_ew * 2 / 3)
    return t_f, t_b, t_attn


def step_time(model: PlanModel, layout: Layout, work: Workload, topo: Topology,
              flows_by_stage: dict[int, list[Flow]], states_bytes: float, simulate: bool = True,
              owned: float = 0.0) -> StepTime:
    """Step time of the layout: pipeline makespan (bubble included) plus what does not overlap.
    `flows_by_stage` maps stage -> its flows: every stage (then the simulator can run), or only the
    candidates for the slowest (closed-form bubble)."""
    L, out = layout, StepTime()
    m = microbatches(L, work)
    acc = topo.accelerator
    passes = 2 if L.recompute == "full" else 1
    cost_f, cost_b, compute_f, compute_b, layer_comm, touch, wire_mb = {}, {}, {}, {}, {}, {}, {}
    dual = is_dualpipe(L)   # each rank holds two one-way stages: per micro-batch their mean (plan/dualpipe.py)
    one = one_way(L) if dual else L

    def per_rank(fn, j):
        if not dual:
            return fn(L, j)
        return tuple(sum(x) / 2 for x in zip(*(fn(one, s) for s in stages_of(L, j))))

    for j, flows in flows_by_stage.items():
        t_f, t_b, t_attn = per_rank(lambda lay, s: stage_compute_seconds(model, lay, work, acc, s, m), j)
        ring = sum(f.seconds for f in flows if f.dim == "cp" and f.op in ("send", "recv"))
        secs = _per_dim_seconds([f for f in flows if KIND.get(f.dim) == "layer" and f.op not in ("send", "recv")])
        ep = ep_exposed(secs.pop("ep", 0.0) / m, t_f, t_b, passes, L.ep_overlap, m, acc.comm_share)
        hid_f, hid_b = per_rank(lambda lay, s: tp_hidden(model, lay, work, topo, flows, s), j)
        # ring sends hide behind the attention of the block before: forward, and backward at 2x forward
        comm_mb = sum(secs.values()) / m + ep + max(0.0, ring / m - 3 * t_attn) - hid_f - hid_b
        wire_mb[j] = comm_mb * wire_share(flows, topo) if acc.ranks_per_core > 1 else 0.0   # only shared cores use it
        # the runtime's host time per compute action (calibrated; 0 on datasheet accelerators): one F
        # and one B (or I and W) per chunk and micro-batch
        action = acc.action_overhead * L.vpp if L.pp > 1 else 0.0   # vpp > 1: interleaved (rules.check_schedule)
        # fresh host pages of ZeRO's buffers (0 off a calibrated host): gathers before forward and backward,
        # gradient buffers in the backward
        gathers_s, grads_s = (b / acc.fresh_bandwidth for b in per_rank(
            lambda lay, s: first_touch_bytes(model, lay, work, s), j)) if acc.fresh_bandwidth else (0.0, 0.0)
        touch[j] = gathers_s + grads_s
        # the layer collectives split half and half over forward and backward, less what hides in each
        cost_f[j] = t_f + (comm_mb + hid_f + hid_b) / 2 - hid_f + action + gathers_s / 2 / m
        cost_b[j] = t_b + (comm_mb + hid_f + hid_b) / 2 - hid_b + action * (2 if L.schedule == ZB else 1) \
            + (gathers_s / 2 + grads_s) / m
        compute_f[j], compute_b[j] = t_f, t_b
        layer_comm[j] = comm_mb
    first = flows_by_stage[min(flows_by_stage)]
    send = [f for f in first if f.dim == "pp" and f.op == "send"] if L.pp > 1 else []
    t_send = send[0].seconds / send[0].calls if send else 0.0
    slow = max(flows_by_stage, key=lambda j: cost_f[j] + cost_b[j])
    pipeline = None if dual else schedule_of(model, L, work)   # the runtime's Schedule (parallel/pipeline/spec.py)
    schedule, v = (ONE_F_ONE_B, 1) if dual else (pipeline.kind, pipeline.vpp)
    sim = None
    if simulate and not dual and len(flows_by_stage) == L.pp:
        sim = _simulate(pipeline.actions, L.pp, m, v, [cost_f[j] for j in range(L.pp)],
                        [cost_b[j] for j in range(L.pp)], t_send)
    if sim is not None:
        out.pipeline_s, out.bubble = float(sim.makespan), float(sim.bubble)
        out.bubble_source = "simulator"
    elif dual:
        out.pipeline_s, out.bubble, slow = dualpipe_seconds(cost_f, cost_b, m, L.pp, t_send)
        out.bubble_source = "DualPipe's closed form"
    else:
        c = cost_f[slow] + cost_b[slow]
        out.bubble = closed_form_bubble(schedule, L.pp, m, v, cost_f[slow], cost_b[slow])
        out.pipeline_s = m * c / (1 - out.bubble) + 2 * (L.pp - 1) * t_send
    # the gradients' timeline (when each chunk's last backward ends, against the pipeline's end) is the
    # simulator's clock: exposure is measured on it, before shared cores shrink the makespan
    clock = out.pipeline_s
    sends_on_wire = bool(send) and send[0].tier != topo.tiers[0].name
    out.pipeline_s = shared_cores_makespan(out.pipeline_s, [m * (cost_f[j] + cost_b[j]) for j in flows_by_stage],
                                           acc.ranks_per_core, L.pp, [m * wire_mb[j] for j in flows_by_stage],
                                           2 * (L.pp - 1) * t_send if sends_on_wire else 0.0)
    out.compute_s = m * (compute_f[slow] + compute_b[slow])
    out.layer_comm_s = m * layer_comm[slow]
    out.first_touch_s = touch[slow]
    each = L.zero_spec.pipeline and L.zero_spec.reduces_each_microbatch
    grads = []
    for j, flows in flows_by_stage.items():
        ready = chunk_ready(sim, schedule, L.pp, v, j, clock, cost_b, t_send)
        backwards = backward_blocks(sim, j, ready, m, cost_f[j] + cost_b[j]) if each else None
        grads.append(stage_grad_exposed(flows, L, m, clock, ready, chunk_first_use(sim, L.pp, v, j, cost_f, t_send),
                                        compute_f[j], cost_b[j], backwards, grad_overlap(flows, topo),
                                        acc.comm_share, zero3_gather_slots(model, L, work, acc, j)))
    # the slowest stage's reduction ends the step; the latest first forward delays the pipeline
    out.grad_comm_s = max(r for r, _ in grads) + max(g for _, g in grads)
    worst = flows_by_stage[slow]
    out.step_comm_s = sum(f.seconds for f in worst if KIND.get(f.dim) == "step")
    if L.offload == "none":
        out.optimizer_s = optimizer_seconds(work, acc, states_bytes, owned)
    else:
        # the step runs on the host; the device keeps the gradient norm (eager: its passes over the shard)
        out.optimizer_s = 0.0 if work.fused_optimizer else \
            owned * (rules.EAGER_GRAD_NORM_BYTES + work.grad_bytes) / acc.hbm_bandwidth
        # each stage's host step follows its own reduction (r) and clipping; the step ends with the latest
        streamed = L.zero_spec.reductions(m) if L.zero_spec.streams_grads else 0   # ZeRO-2/3: d2h during the backward
        ends = [r + stage_offload_exposed(flows, work, acc, streamed) for (r, _), flows in zip(grads, flows_by_stage.values())]
        out.offload_s = max(0.0, max(ends) - max(r for r, _ in grads))
        # ZeRO-3 nvme: the parameter reads before the gathers, on the slowest stage's path
        out.offload_s += max(stage_param_reads(flows, work, streamed) for flows in flows_by_stage.values())
    out.step_time_s = out.pipeline_s + out.grad_comm_s + out.step_comm_s + out.optimizer_s + out.offload_s
    out.exposed = {"layer": out.layer_comm_s, "grad": out.grad_comm_s, "step": out.step_comm_s,
                   "offload": out.offload_s}
    out.tokens_per_s = work.tokens / out.step_time_s
    # MFU and HFU against the peak of the model's dtype, whatever dtype the GEMMs run in
    model_flops = model.flops_per_token(work.attention_span, work.causal) * work.tokens
    full = acc.peak(work.dtype) * L.gpus * out.step_time_s
    out.mfu = model_flops / full
    hw = {"none": 0.0, "selective": model.blocks_attention_flops_per_token(work.attention_span, work.causal),
          "full": model.flops_per_token(work.attention_span, work.causal) / 3}[L.recompute]  # recomputed forward
    hw += 2.0 * _light_weights(model, L) * (model.layers + model.mtp_depth)
    out.hfu = (model_flops + hw * work.tokens) / full
    return out
