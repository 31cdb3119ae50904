"""What a step holds beyond the model states and the saved activations: ZeRO's buffers, the backward's,
the loss's, the edges' and the optimizer step's scratch; and what offload moves off the device.

Buffers: the larger of the backward's (`zero_buffers` plus the backward's working set beyond what it
saved: gradients, receive buffers, a norm's or an MLP's temporaries, `backward_scratch`), the loss's
backward on the last stage (`loss_scratch` beside `zero_at_loss`), the embedding's and the head's
(`edge_scratch` beside `zero_at_edge`) and the optimizer step's scratch (`step_scratch`: one bounded pass of
rules.STEP_CHUNK elements). `zero_buffers` is what ZeRO-2/3 hold during a step beyond the states between steps. ZeRO-3's
gathered units (the root unit of embedding, final norm and head included), gradient buffers and
reduce-scatters in flight are replayed in the runtime's order (parallel/zero/engine.py), so the peak is the
runtime's to the byte (tests/ranks/test_plan_memory.py measures it from the runtime's tensors).

Offload (`Layout.offload`, docs/plan.md "Offload"): the optimizer state leaves the device (`offloaded`)
for host memory or a file (`offload_bytes`, the runtime's parallel/zero/offload.py to the byte); the device's
total no longer counts it, the row's `host` and `disk` do. ZeRO-3 with nvme (`ZeroSpec.params_on_disk`) moves the
parameter shards to the file too: the device's `weights` are 0 (`offloaded_params`: what left), and only
the gathered units `zero_buffers` replays hold parameters on the device.
"""
from __future__ import annotations

import math
from functools import lru_cache

from .. import rules
from ..parallel.zero.order import (MAX_INFLIGHT, backward_prefetch, backward_slots, forward_prefetch,
                                   frees_after_forward)
from ..parallel.pipeline.schedules import build_schedule, receives_alive_in_backward
from ..parallel.zero.reduce import LANDING
from ..shapes import padded, padded_vocab, shard_size
from .activations import hidden_tensor_bytes, rank_tokens, routed_per_token
from .layout import Layout, Workload, microbatches
from .models import PlanModel
from .units import ExpertSplit, block_rank_params, head_stage, held_root, is_frozen, layout_blocks, root_tensors, stage_params, zero_units


# -- ZeRO's buffers during a step ---------------------------------------------------------------------
# MAX_INFLIGHT and the gather/free order are the runtime's (parallel/zero/order.py), not mirrored here


class BufferTimeline:
    """Bytes alive while a step is replayed, and their peak. A reduce-scatter in flight holds its unit's
    full gradient and a shard-sized result until it is folded in, which happens to the oldest once more
    than MAX_INFLIGHT are in flight (parallel/zero/order.py; zero.py `_reduce`)."""

    def __init__(self):
        self.live = self.peak = 0
        self.inflight: list[int] = []

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def drop(self, nbytes: int) -> None:
        self.live -= nbytes

    def reduce(self, grad: int, result: int, freed: int = 0) -> None:
        """Launch one unit's reduce-scatter (its `grad` bytes already alive): the result buffer appears,
        the unit's gathered parameters (`freed` bytes) go, then the oldest reductions are folded in."""
        self.add(result)
        self.inflight.append(grad + result)
        self.drop(freed)
        while len(self.inflight) > MAX_INFLIGHT:
            self.drop(self.inflight.pop(0))


def zero3_slots(model: PlanModel, layout: Layout, stage: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """ZeRO-3's gather slots on one rank of `stage` (parallel/zero/units.py `block_slots`): the root
    (every parameter outside the blocks: embedding on the first stage, final norm and untied head on the
    last), then each block (the MTP modules' last, `units.mtp_blocks`), each slot's units as (elements,
    group size): dense over dp·cp, routed experts over edp. Every unit is a flat buffer padded to a
    multiple of its group size."""
    L = layout
    n_dense, n_expert = L.dp * L.cp, L.edp
    root = sum(n for n, _ in root_tensors(model, L.tp, L.pp, stage, L.head_first))
    slots = [((root, n_dense),) if root else ()]
    for i in layout_blocks(model, L, stage):
        dense, expert = block_rank_params(model, i, L.tp, ExpertSplit.of(L))
        slots.append(tuple(u for u in ((dense, n_dense), (expert, n_expert)) if u[0]))
    return tuple(slots)


def _replay_direct(slots: tuple, w: int, g: int, reshard: bool, micro: int, depth: int = 1) -> int:
    """Peak bytes of ZeRO-3 outside a pipeline, replaying `micro` micro-batches as `ShardedParams` runs them.

    Forward: the root is gathered for the whole forward (its hook wraps the model), each block is
    gathered with the next `depth` prefetched, and freed after its forward (reshard_after_forward; else
    kept). Backward: the root again (the head's and final norm's gradients come first, the embedding's
    last, so the root's gradient lives through the whole backward), each block gathered with the `depth`
    whose backwards come next prefetched; a block's gradient buffer fills, is reduce-scattered and the block
    freed.
    Reductions of the last micro-batch stay in flight into the next."""
    t = BufferTimeline()
    held: set = set()

    def gather(k: int) -> None:
        for j, u in enumerate(slots[k]):
            if (k, j) not in held:
                held.add((k, j))
                t.add(w * padded(*u))

    def free(k: int, j: int) -> int:
        if (k, j) not in held:
            return 0
        held.discard((k, j))
        return w * padded(*slots[k][j])

    def reduce_slot(k: int) -> None:
        for j in reversed(range(len(slots[k]))):        # routed experts finish before the dense part
            u = slots[k][j]
            t.reduce(g * padded(*u), g * shard_size(*u), free(k, j))

    def gather_with(k: int, ahead: list[int]) -> None:
        gather(k)
        for j in ahead:
            gather(j)

    def free_slot(k: int) -> None:
        if frees_after_forward(k, reshard, pipeline=False):
            t.drop(sum(free(k, j) for j in range(len(slots[k]))))

    last = len(slots) - 1
    for _ in range(micro):
        for k in range(last + 1):                       # the root's hooks wrap the blocks'
            gather_with(k, forward_prefetch(k, last, False, depth))
            if k:
                free_slot(k)
        free_slot(0)
        for k in backward_slots(len(slots)):
            gather_with(k, backward_prefetch(k, len(slots), False, depth))
            t.add(sum(g * padded(*u) for u in slots[k]))
            if k:
                reduce_slot(k)
        reduce_slot(0)
    return t.peak


def _replay_buckets(units: tuple, g: int, micro: int) -> int:
    """Peak bytes of ZeRO-2's gradient buckets outside a pipeline, replaying `micro` micro-batches as the
    engine runs them (parallel/zero/engine.py `_on_grad`, `_reduce`, `_fold`): in backward order each bucket's
    full gradient fills, is reduce-scattered into a shard-sized result, and is freed with the result once
    it is folded in, which happens to the oldest once more than MAX_INFLIGHT are in flight. `units`:
    (elements, group size) in the engine's order. With streamed gradients (offload) nothing else of the
    gradient stays on the device: this is its device gradient, about (MAX_INFLIGHT + 1)·(B + B/n)."""
    t = BufferTimeline()
    for _ in range(micro):
        for u in units:
            t.add(g * padded(*u))
            t.reduce(g * padded(*u), g * shard_size(*u))
    return t.peak


def _replay_pipeline(slots: tuple, w: int, g: int, micro: int, head_first: bool) -> int:
    """Peak bytes of ZeRO-3 under a pipeline: the root stays gathered for the step, one block at a time
    is gathered (no prefetch: the next module depends on the schedule), every unit's full gradient
    accumulates over the micro-batches, and `end_backward` reduce-scatters the units in order (root, then
    the blocks) once the step's last backward is done."""
    t = BufferTimeline()
    t.add(sum(w * padded(*u) for u in slots[0]))
    grads = [sum(g * padded(*u) for u in s) for s in slots]
    alive: set = set()

    def grad(k: int) -> None:
        if k not in alive:
            alive.add(k)
            t.add(grads[k])

    if micro > 1:                      # an earlier backward allocated every unit's gradient
        for k in range(len(slots)):
            grad(k)
    if head_first:                     # final norm and head: the first gradients of the backward
        grad(0)
    for k in range(len(slots) - 1, 0, -1):
        block = sum(w * padded(*u) for u in slots[k])
        t.add(block)
        grad(k)
        t.drop(block)
    grad(0)
    for s in slots:
        for u in s:
            t.reduce(g * padded(*u), g * shard_size(*u))
    return t.peak


def _replay_each_microbatch(slots: tuple, w: int, g: int, held: bool) -> int:
    """Peak bytes of ZeRO-2/3 reducing every micro-batch under a pipeline (`reduce_each_microbatch`): the
    root gathered all step (ZeRO-3, w > 0), one block gathered, a held root's full gradient for the whole
    step (a tied copy, reduced once), the block whose gradient is filling and the two reductions still in
    flight behind it (each a full gradient and its shard; parallel/zero/order.py MAX_INFLIGHT)."""
    root = sum(padded(*u) for u in slots[0])
    units = [sum(padded(*u) for u in s) for s in slots[1:]] + ([] if held else [root])
    shards = [sum(shard_size(*u) for u in s) for s in slots[1:]] + ([] if held else [sum(shard_size(*u) for u in slots[0])])
    big = max(units, default=0)
    flight = sorted((u + k for u, k in zip(units, shards)), reverse=True)[:MAX_INFLIGHT]
    return w * (root + big) + g * (root if held else 0) + g * big + g * sum(flight)


@lru_cache(maxsize=16384)
def _zero3_buffers(model: PlanModel, layout: Layout, stage: int, w: int, g: int, micro: int) -> int:
    slots, z = zero3_slots(model, layout, stage), layout.zero_spec
    if z.pipeline and z.each_microbatch:
        return _replay_each_microbatch(slots, w if z.shards_params else 0, g, held_root(model, layout, stage))
    if z.pipeline:
        return _replay_pipeline(slots, w, g, micro, head_first=stage == head_stage(layout.pp, layout.head_first))
    return _replay_direct(slots, w, g, layout.reshard_after_forward, micro, z.prefetch)


def zero_buffers(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """What ZeRO-2/3 hold beyond the model states between steps, at their peak during a step.

    ZeRO-3 (parallel/zero/stages.py, `ShardedParams`) is replayed event by event on its padded units (`zero3_slots`):
    gathered parameters (w bytes each), full gradient buffers and reduce-scatters in flight (g bytes;
    each keeps its unit's full gradient and a shard-sized result until folded). The root unit (embedding,
    final norm, head) counts in full: outside a pipeline it is gathered for the whole forward and the
    whole backward, and its gradient buffer lives through the whole backward (its first gradients, the
    head's, come first; its last, the embedding's, last). With root R, uniform blocks B (elements per
    rank), shards r = R/n, b = B/n, reshard_after_forward, at least two blocks and two micro-batches the
    peak is at the first block reduction of a micro-batch:

        w·(R + 2B) + g·R + g·(R + r) + 2·g·(B + b)

    (root and two blocks gathered, the root's new gradient, the previous micro-batch's root reduction
    and two blocks' reductions in flight). Under a pipeline the root stays gathered all step, one block
    is gathered at a time and the stage's full gradient G accumulates, reduced at the step's end in
    unit order: about w·(R + B) + g·G plus up to three shard results. Micro-batches after the second
    repeat the second's peak, so at most two are replayed. ZeRO-2 under a pipeline accumulates the
    stage's full gradient (g·G); ZeRO-2's transient buckets outside a pipeline are counted only when the
    gradients stream to the host (offload, `_replay_buckets`: then they are all the device holds of the
    gradient; without offload the shards, g·Φ/n, dominate them and they are not counted). With
    `reduce_each_microbatch` under a pipeline (ZeRO-2 or 3) see `_replay_each_microbatch`: about
    w·(R + B) (ZeRO-3) + g·R (a tied root) + g·B + 2·g·(B + b), no full gradient."""
    z = layout.zero_spec
    if not z.shards_grads:
        return 0.0
    if not z.shards_params and not z.pipeline and z.streams_grads:
        micro = min(microbatches(layout, work), 2)
        return float(_replay_buckets(offload_units(model, layout, work, stage), work.grad_bytes, micro))
    if z.block_units:   # ZeRO-3, or ZeRO-2 reducing every micro-batch under a pipeline
        micro = min(microbatches(layout, work), 2)
        return float(_zero3_buffers(model, _buffer_key(layout), stage, work.param_bytes, work.grad_bytes, micro))
    if not z.pipeline:
        return 0.0
    dense, expert = stage_params(model, layout, stage)
    return float(dense + expert) * work.grad_bytes


def zero_at_loss(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """ZeRO's buffers while the loss's backward runs. ZeRO-3 outside a pipeline: the root unit gathered
    (its gradient buffer comes with the head's backward, after the loss's) and, from the second
    micro-batch on, the previous one's last two reductions in flight (the root's and the first block's);
    elsewhere the step's peak (`zero_buffers`: under a pipeline the gradients accumulate all step)."""
    if not layout.zero_spec.shards_params or layout.zero_spec.pipeline:
        return zero_buffers(model, layout, work, stage)
    slots = zero3_slots(model, _buffer_key(layout), stage)
    w, g = work.param_bytes, work.grad_bytes
    out = sum(w * padded(*u) for u in slots[0])
    if microbatches(layout, work) > 1:
        out += sum(g * (padded(*u) + shard_size(*u)) for k in (0, 1)[:len(slots)] for u in slots[k])
    return float(out)


def zero_at_edge(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """ZeRO's buffers while the embedding's (or head's) gradient is made: ZeRO-3 outside a pipeline holds
    no gathered block then (the step's peak has two), elsewhere the step's peak (`zero_buffers`)."""
    peak = zero_buffers(model, layout, work, stage)
    if not layout.zero_spec.shards_params or layout.zero_spec.pipeline:
        return peak
    blocks = sorted((sum(padded(*u) for u in slot) for slot in zero3_slots(model, _buffer_key(layout), stage)[1:]),
                    reverse=True)
    return peak - work.param_bytes * sum(blocks[:2])


def _buffer_key(layout: Layout) -> Layout:
    """The layout fields ZeRO-3's buffers depend on (a smaller cache key)."""
    L = layout
    return Layout(tp=L.tp, pp=L.pp, dp=L.dp, cp=L.cp, ep=L.ep, etp=L.etp, zero=L.zero, vpp=L.vpp, partition=L.partition,
                  reshard_after_forward=L.reshard_after_forward, reduce_each_microbatch=L.reduce_each_microbatch,
                  head_first=L.head_first, zero_prefetch=L.zero_prefetch)


# -- offload: optimizer state in host memory or on disk ----------------------------------------------------
def offload_units(model: PlanModel, layout: Layout, work: Workload, stage: int) -> tuple[tuple[int, int], ...]:
    """(elements, group size n) of every ZeRO unit one rank of `stage` holds: the units the runtime's ZeRO
    engine builds and the offload engine copies one by one (dense over dp·cp, routed experts over
    edp; `zero_units`), with a group of one rank too (ZeRO at dp = 1 still makes its units)."""
    L = layout
    _, expert = stage_params(model, L, stage)
    units = [(u, L.dp * L.cp) for u in zero_units(model, L, work.grad_bytes, stage)]
    if expert:
        units += [(u, L.edp) for u in zero_units(model, L, work.grad_bytes, stage, True)]
    return tuple(units)



def offload_bytes(model: PlanModel, layout: Layout, work: Workload, stage: int) -> dict:
    """What rank 0 of `stage` keeps off the device under `layout.offload`, as the runtime's offloaded state
    reports it (parallel/zero/offload.py, `bytes()`): {"optimizer": 0, "host": {params, grads, optimizer, total}, "disk": {...}}.
    Per unit of shard k elements (padded), mb / g / w bytes per master / gradient / parameter element,
    s = w when the parameters are not in the master dtype (their staging copy for the copy up), else 0:

        cpu   host  Σ (3·mb + g + s)·k        master, exp_avg, exp_avg_sq, the reduced gradient shard, staging
        nvme  disk  Σ 3·mb·k                  master, exp_avg, exp_avg_sq in one file
              host  2·(3·mb + g + s)·k_max    two slots of the largest unit: the one updated, the one read ahead
        ZeRO-2/3 (`ZeroSpec.streams_grads`), the gradients instead:
              host  grads g·Σ k + LANDING·g·k_max   every reduced shard (streamed in during the backward,
                                                    both modes) and the buffers a shard lands in first
        ZeRO-3 nvme, in addition (`ZeroSpec.params_on_disk`):
              disk  params Σ w·k              the parameter shards
              host  params w·k_max            the buffer a shard passes through on its way to an all-gather
    The device keeps ZeRO's weights (none with ZeRO-3 nvme) and gradients and no optimizer state."""
    none = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    if layout.offload == "none":
        return {"host": dict(none), "disk": dict(none)}
    mb, g = work.master_bytes, work.grad_bytes
    s = work.param_bytes if work.param_bytes != mb else 0
    shards = [shard_size(u, n) for u, n in offload_units(model, layout, work, stage)]
    k = sum(shards) if layout.offload == "cpu" else 2 * max(shards, default=0)
    on_disk = layout.zero_spec.params_on_disk
    w = work.param_bytes
    grads = g * (sum(shards) + LANDING * max(shards, default=0)) if layout.zero_spec.streams_grads else g * k
    host = {"params": s * k + (w * max(shards, default=0) if on_disk else 0), "grads": grads, "optimizer": 3 * mb * k}
    disk = {"params": w * sum(shards) if on_disk else 0, "grads": 0,
            "optimizer": 3 * mb * sum(shards) if layout.offload == "nvme" else 0}
    return {where: {**d, "total": sum(d.values())} for where, d in (("host", host), ("disk", disk))}


# -- scratch: the backward's, the loss's, the edges' and the step's working sets --------------------
def pipeline_receives(layout: Layout, work: Workload, stage: int) -> int:
    """Receive buffers of one micro-batch's boundary alive beside a backward on `stage` (not saved
    activations), counted on the runtime's own action list: the most posted and not yet consumed while
    one of the stage's backwards runs, with the receives posted one compute ahead
    (`schedules.receives_alive_in_backward`). 1F1B: 2 on the first stage (the gradient it consumes and the
    next one, posted ahead), 2 in the middle, 1 on the last; interleaved: 2-5 by stage (pp <= 8)."""
    if layout.pp == 1:
        return 0
    return _receives_alive(layout.schedule, layout.pp, steady_microbatches(
        layout.pp, microbatches(layout, work), layout.interleaved, layout.microbatch_group), layout.vpp,
        layout.microbatch_group)[stage]


def steady_microbatches(pp: int, m: int, interleaved: bool, group: int = 0) -> int:
    """`m` micro-batches, or fewer where the count of receives alive no longer changes: the lists reach
    their steady state by 2·pp micro-batches (two whole groups of N for interleaving), and from there
    more micro-batches repeat it (tests/unit/test_pipeline_schedules.py holds this up to 8x). The search
    plans thousands of layouts; building their whole lists cost it 4x its time."""
    if interleaved:
        unit = math.lcm(pp, group or pp)
        return min(m, 2 * unit * -(-pp // unit))
    return min(m, 2 * pp)


@lru_cache(maxsize=1024)
def _receives_alive(kind: str, pp: int, micro: int, vpp: int, group: int) -> tuple[int, ...]:
    if kind == rules.ONE_F_ONE_B:
        return one_f_one_b_receives(pp, micro)
    return receives_alive_on_lists(kind, pp, micro, vpp, group)


def receives_alive_on_lists(kind: str, pp: int, micro: int, vpp: int, group: int = 0) -> tuple[int, ...]:
    """Per stage, `schedules.receives_alive_in_backward` of the runtime's own action lists."""
    return tuple(receives_alive_in_backward(actions, pp, pp * vpp)
                 for actions in build_schedule(kind, pp, micro, vpp, microbatch_group=group))


def one_f_one_b_receives(pp: int, micro: int) -> tuple[int, ...]:
    """1F1B's receives alive beside a backward, in closed form (the lists' count, held equal to it by
    tests/unit/test_plan_receives.py): every stage but the last holds the gradient it consumes and, from
    the second micro-batch on, the next one posted ahead (2; one micro-batch: 1); the last stage the one
    activation it consumes (1; one micro-batch: none left beside its backward). Building the lists cost
    the search a third of its time."""
    return (2 if micro > 1 else 1,) * (pp - 1) + (1 if micro > 1 else 0,)


def mlp_width_per_token(model: PlanModel, work: Workload, tp: int) -> float:
    """The widest SwiGLU a token passes through on one rank, in hidden units per token of the micro-batch:
    a dense layer's ffn, a shared expert's, or the routed experts' (top_k · capacity rows per token)."""
    widths = [model.ffn] if not model.moe or model.dense_layers else []
    if model.moe:
        widths += [model.shared_experts * model.moe_ffn, routed_per_token(model, work) * model.moe_ffn]
    return max(widths) / tp


def backward_scratch(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """The largest working set of a micro-batch's backward beyond its saved activations, on one rank of
    `stage`. Always alive: the residual stream's gradient and the pipeline's receive buffers
    (`pipeline_receives`), one hidden-wide tensor each (/t with sequence parallelism). Then the largest
    of these moments (model/transformer.py, model/moe.py, parallel/tensor.py):
    - the RMSNorm backward (`_RMSNorm`): its incoming gradient, the fp32 input gradient and one fp32
      product, and the input's fp32 copy unless activations are fp32 (e + 8 or e + 12 bytes per element);
    - the SwiGLU backward (`_SiluMul`): its incoming gradient and three temporaries, ffn-wide
      (`mlp_width_per_token`);
    - an MoE layer's backward: three dispatch-sized buffers (top_k · capacity rows of hidden per token,
      etp times that with expert tensor parallelism, whose ranks gather each other's rows: the combine's
      gradient, the experts' input gradients and their concatenation);
    - a layer weight's whole gradient before it is accumulated (`largest_layer_weight`).
    With ZeRO-2/3 `zero_buffers` comes on top (`stage_memory`); the embedding's and head's backward are
    `edge_scratch`, the loss's `loss_scratch`: moments of their own, with ZeRO's buffers of that moment."""
    e, T = work.act_bytes, rank_tokens(layout, work)
    hidden = hidden_tensor_bytes(model, layout, work)
    receives = pipeline_receives(layout, work, stage) * hidden
    fp32 = 8 + (4 if e != 4 else 0)
    norm = hidden * (1 + fp32 / e)                 # its incoming gradient and the fp32 set
    mlp = 4 * e * T * mlp_width_per_token(model, work, layout.tp)
    dispatch = 3 * e * T * routed_per_token(model, work) * model.hidden * layout.etp / layout.tp if model.moe else 0.0
    weight_grad = work.param_bytes * largest_layer_weight(model, layout)
    return receives + hidden + max(norm, mlp, dispatch, weight_grad)


def largest_layer_weight(model: PlanModel, layout: Layout) -> float:
    """Elements of a layer's largest weight gradient on one rank before the engine adds it to the
    gradient buffer: autograd makes it whole, in the weights' dtype (a matrix); the routed experts'
    three weights each come per expert, then the experts' unbind stacks them, so at the stack of the
    last one its E/ep experts' three matrices and the stacked result are alive (4 · E/ep · f/etp · h)."""
    tp, h = layout.tp, model.hidden
    out = [h * model.ffn / tp, h * model.q_width / tp]
    if model.moe:
        out.append(4 * h * model.moe_ffn * model.experts / (layout.ep * layout.etp))
    return max(out)


def edge_scratch(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """The larger of `edge_moments`: the embedding's or the head's backward (0 on a stage with neither)."""
    return max(edge_moments(model, layout, work, stage))


def edge_moments(model: PlanModel, layout: Layout, work: Workload, stage: int) -> tuple[float, float]:
    """(the embedding's backward on the first stage, the head's on the last; 0 where the stage has none):
    the table's dense gradient, whole in the weights' dtype (vocab/t x hidden), where that table trains
    (LoRA and train.freeze may freeze it), beside the residual gradient and the posted receives; the
    head's also beside the logits' gradient it reads (the activations' dtype: the loss's saved gradient
    itself, or its 16-bit cast), which the embedding's, at the backward's end, no longer has."""
    head = head_stage(layout.pp, layout.head_first)
    if stage not in (0, head):
        return 0.0, 0.0
    base = (pipeline_receives(layout, work, stage) + 1) * hidden_tensor_bytes(model, layout, work)

    def table(name: str) -> float:
        return 0.0 if is_frozen(model, name) else work.param_bytes * model.hidden * vocab_slice(model, layout)

    embed = base + table("embed.weight") if stage == 0 else 0.0
    logits_grad = work.act_bytes * rank_logits(model, layout, work)
    head_part = base + table("embed.weight" if model.tie_embeddings else "head.weight") + logits_grad \
        if stage == head else 0.0
    return embed, head_part


def loss_scratch(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """The loss on the last stage (0 elsewhere), at the end of its forward, beside the posted receives: the
    logits (the weights' dtype) and the loss's gradient, softmax − one-hot, which the forward makes whole
    in fp32 (fp64 for fp64 models) before it saves it (model/loss.py; vocab-parallel: parallel/tensor.py)
    — per token of the rank's vocabulary slice. The backward needs nothing more: it scales the saved
    gradient in place and, for 16-bit logits, casts it to their dtype (as large as the logits, which are
    gone by then). ZeRO's buffers of that moment are `zero_at_loss`; a block's own temporaries are per row."""
    if stage != head_stage(layout.pp, layout.head_first):
        return 0.0
    hidden = hidden_tensor_bytes(model, layout, work)
    return pipeline_receives(layout, work, stage) * hidden + \
        (work.act_bytes + loss_grad_bytes(work)) * rank_logits(model, layout, work)


def vocab_slice(model: PlanModel, layout: Layout) -> float:
    """Vocabulary rows one rank holds (the padded vocabulary split over tp)."""
    return padded_vocab(model.vocab, layout.tp) / layout.tp


def rank_logits(model: PlanModel, layout: Layout, work: Workload) -> float:
    """Logits one rank of the head stage makes per micro-batch: its tokens × its vocabulary slice."""
    return rank_tokens(layout, work) * vocab_slice(model, layout)


def loss_grad_bytes(work: Workload) -> int:
    """Bytes per logit of the loss's gradient as the forward makes it: fp32, or fp64 for fp64 models."""
    return max(4, work.act_bytes)


def loss_saved(model: PlanModel, layout: Layout, work: Workload, stage: int) -> float:
    """The part of `loss_scratch` that is also a saved activation (0 off the head stage): the loss's
    gradient, which `activations.head_acts` counts once saved. The stage's total is the peak of the sum,
    so it counts these bytes once (`memory.stage_memory`); `buffers`, the peak of what is alive and not
    saved, has them while the forward makes them (as the dry run measures)."""
    if stage != head_stage(layout.pp, layout.head_first):
        return 0.0
    return loss_grad_bytes(work) * rank_logits(model, layout, work)


def step_scratch(owned: float, work: Workload) -> float:
    """What the optimizer step holds beyond the states, per rank updating `owned` elements: one pass of
    rules.STEP_CHUNK elements (train/optim.py) at a time, the gradient norm's fp64 copy (8 bytes) or
    AdamW's denominators and low-precision gradients' upcast copies (master bytes each). The step runs
    after the backward has freed its activations and ZeRO's buffers, so a stage's buffers are the larger
    of the two (`stage_memory`), not their sum."""
    upcast = work.master_bytes if work.grad_bytes != work.master_bytes else 0
    return max(8, work.master_bytes + upcast) * min(rules.STEP_CHUNK, owned)


def offload_memory(model: PlanModel, layout: Layout, work: Workload, stage: int) -> dict:
    """{"host": bytes, "disk": bytes} per GPU of `stage` (`offload_bytes`' totals)."""
    out = offload_bytes(model, layout, work, stage)
    return {"host": float(out["host"]["total"]), "disk": float(out["disk"]["total"])}
