"""Bytes per step that one rank sends, per parallel dimension and collective (the flows); which tier each
lands on, the bytes on each tier's links and the rank order are plan/tiers.py's.

Every byte count goes through `fivefold.comm.volume`, the functions the runtime's ledger records with,
so a row here — (dim, op): calls, message bytes, bytes sent — means what a ledger row means (summed over
one optimizer step, for one rank). Dimension names are the ledger's: "dp" (gradient reduction, ZeRO
gathers), "loss", "grad_norm", "tp", "cp", "pp", "ep", "edp" (expert gradients), "embed" (tied
embedding gradients between the first and last pipeline stage).

Per micro-batch of T tokens per rank (T = b·s/cp), e bytes per activation element, per layer:

- TP (Shoeybi et al. 2019): 2 all-reduces of T·h·e forward (after attention and MLP; g) and 2 backward
  (before them; f). Latent attention (MLA) enters on its latents instead (Megatron-Core's MLA): its f is
  an all-reduce of T·(q_lora + kv_lora + rope)·e (and, without a q latent, one of x for q_proj). Vocab-parallel embedding: 1 all-reduce forward; LM head input: 1 backward; vocab-parallel
  cross-entropy: an all-reduce of T fp32 maxima, then one of 2T (sum of exponentials, target logit)
  (fp64 for an fp64 model).
- SP (Korthikanti et al. 2022): each all-reduce becomes an all-gather and a reduce-scatter of the same
  tensor, forward and backward (same bytes; MLA: of its latents, whose down-projection and latent-norm
  weights then get partial gradients, summed over tp with the norms'); the embedding's g a reduce-scatter forward and an
  all-gather backward, the head input's f an all-gather forward and a reduce-scatter backward.
- Partial gradients of tp-replicated weights, summed once per step after the dp reduction: under SP the
  norm weights (each tp rank saw only its tokens), all-reduced over tp; when tp > kv_heads the K/V
  weights, all-reduced over the tp/kv_heads ranks sharing a head (over all of tp when kv_heads = 1,
  together with the norms). Message: the owned gradients in the gradient dtype (ZeRO: the rank's shard
  segments of them, so it differs by dp rank; see `_tp_sync_flows`), in windows of rules.STEP_CHUNK
  elements (`shapes.windows`: one call per window).
- Full recompute re-runs the forward, and with it the forward collectives of TP/SP/CP/EP.
- MTP modules (DeepSeek-V3 §2.2; `units.mtp_blocks`): on the last stage, each block's collectives as a
  layer's, the head's input f and cross-entropy reductions once more per module (`head_passes`); the
  module's M and norms, whole on every tp rank, join the norms' partial gradients under SP.
- Ulysses (Jacobs et al. 2023): 4 all-to-alls forward (q, k, v; output) and 4 backward, each of the
  rank's local tensor. Ring attention (Liu et al. 2023): cp-1 sends of the local K,V block forward,
  cp-1 of K,V and cp-1 of dK,dV backward.
- EP (Lepikhin et al. 2020; DeepSeek-V3 for FP8 dispatch): per MoE layer, dispatch and combine
  all-to-alls forward and backward of top_k·capacity·(T/tp)·h elements (each tp rank sends only its
  own tokens), over the ep group of the expert grid (MoE parallel folding: it may hold tp, cp or dp ranks).
  ETP (expert tensor parallelism, Megatron-Core's): the R rows a rank received gathered on every etp
  rank and the partial outputs reduce-scattered back, each as one all-to-all of etp·R·h·e bytes, forward
  and backward, under dim "etp" (dropless adds an all-gather of the etp·E int64 counts). Node-limited
  routing (`Workload.moe_route_nodes`, DeepSeek-V3): the routed rows split by tier at placement, each
  token crossing the network once per remote node it selects and reaching its experts over the
  innermost tier (`split_routed`).
- PP (Narayanan et al. 2021): one send of T·h·e (/t with SP) per micro-batch per boundary each way,
  × v with interleaving; the matching receives are recorded with 0 bytes sent, as the ledger does.
- DP: one call per bucket of at most bucket_mb (DDP, ZeRO-1/2) or per unit (ZeRO-3: a block, and the
  root: embedding, final norm, head). DDP all-reduces every gradient once per step (after the last
  micro-batch). ZeRO-1: reduce-scatter of gradients and all-gather of parameters, once per step.
  ZeRO-2: the reduce-scatter per micro-batch (a rank keeps only its gradient shard while accumulating).
  ZeRO-3: all-gather of parameters before each micro-batch's forward and again before its backward
  (once without resharding after forward), reduce-scatter per micro-batch (Rajbhandari et al. 2020,
  §7: 3Φ vs DDP's 2Φ). ZeRO buffers padded to a multiple of n. Under a pipeline every stage reduces
  its gradients once per step (DDP, ZeRO-1/2/3: accumulated over the micro-batches first). Gradients
  travel in `Workload.reduce_dtype` (fp32 by default, as the runtime's main_grads_fp32).
- loss: one all-reduce of a float64 over dp, and over pp (only the last stage has it); grad_norm: one float64 over the model-parallel ranks
  (tp·cp·pp, and dp too when ZeRO shards the gradients), when that group has more than one rank.
- offload (`Layout.offload`, docs/plan.md "Offload"): copies, not collectives, under dim "offload" on the
  tiers "pcie" (device <-> host) and "nvme" (host <-> disk), which are the accelerator's links, not
  network tiers. Per ZeRO unit (shard of k elements) per step: "d2h" k·g (the reduced gradient shard),
  "h2d" k·w (the updated parameter shard); nvme adds "nvme_read" and "nvme_write" of 3·k·mb (master,
  exp_avg, exp_avg_sq). ZeRO-3 nvme keeps the parameter shards on disk: before each of the unit's G
  all-gathers (`ZeroSpec.gathers`, the counts of the dp all_gather rows) "nvme_read" and "h2d" of k·w,
  after the step "nvme_write" of k·w instead of the step's h2d. bytes sent = message (`comm.volume.copy`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from math import lcm
from functools import lru_cache

from .. import grid
from ..comm import volume
from ..rules import (STEP_CHUNK, cp_degrees, kv_replicas, moe_capacity, moe_sequence_group,
                     moe_sequence_parts, moe_splits_rows, overlaps_tp_input, reduces_only_over_dp)
from ..shapes import padded_vocab, shard_size, windows
from .layout import Layout, Workload, microbatches
from .buffers import offload_units
from .units import (ExpertSplit, exact_tensors, held_root, is_frozen, layer_names, layer_tensors, layout_blocks,
                    head_stage, mtp_blocks, owned_tagged, root_tensors, root_units,
                    stage_params, unit_sums, unit_tensors, zero_units)
from .models import PlanModel

VOLUME = {op: getattr(volume, op) for op in volume.OPS}   # comm/volume.py's formula for each op
VOLUME.update({op: volume.copy for op in volume.COPIES})   # offload copies: every byte moves

# how exposed a dimension's time is (see time.py)
KIND = {"tp": "layer", "cp": "layer", "ep": "layer", "etp": "layer", "pp": "pipeline", "dp": "grad", "edp": "grad", "dualpipe": "grad",
        "loss": "step", "grad_norm": "step", "embed": "step", "moe_stats": "step", "offload": "offload"}


@dataclass
class Flow:
    """One (dim, op) row for one rank over one step: what a ledger row records, plus where it runs."""

    dim: str
    op: str
    group: str
    n: int
    calls: int = 0
    message_bytes: float = 0.0
    bytes_sent: float = 0.0
    tier: str = ""
    seconds: float = 0.0
    part: str = ""             # "": the whole group's collective; node-limited expert all-to-alls (see
                               # `place`): "routed" before placement, then "inter" (one rank per node,
                               # between nodes) and "intra" (inside each node, on the innermost tier)
    route: tuple = ()          # "routed": (max nodes per token, rows per token) for `place` to split
    width: int = 0             # a sub-group's run length (its spec's `width`: the Ulysses degree for
                               # cp_ulysses / cp_ring, kv_replicas for tp_kv), which places it (`place`)
    backend: str = "nccl"      # whose algorithm runs it: its bytes (Flows) and latency hops (`place`)

    def to_dict(self) -> dict:
        return asdict(self)


class Flows:
    """Accumulates calls into rows keyed (dim, op) (and part, when a row is one part of a collective),
    each sent through comm.volume."""

    def __init__(self, backend: str = "nccl"):
        self.rows: dict[tuple, Flow] = {}
        self.backend = backend                      # whose algorithms count the bytes (comm/volume.py ALGORITHMS)

    def sent(self, op: str, message_bytes: float, n: int) -> float:
        return volume.bytes_sent(op, message_bytes, n, self.backend)

    def add(self, dim: str, op: str, group: str, n: int, message_bytes: float, calls: float = 1,
            part: str = "", route: tuple = (), width: int = 0) -> None:
        if n <= 1 or calls <= 0 or message_bytes <= 0:
            return
        key = (dim, op, part) if part else (dim, op)
        row = self.rows.get(key)
        if row is not None and row.group != group:   # the same (dim, op) over another group (the loss is
            key = (dim, op, part, group)               # summed over dp·cp and over pp): a row of its own,
            row = self.rows.get(key)                   # placed on that group's tier
        if row is None:
            row = self.rows[key] = Flow(dim, op, group, n, part=part, route=route, width=width, backend=self.backend)
        row.calls += int(calls)
        row.message_bytes += calls * message_bytes
        row.bytes_sent += calls * self.sent(op, message_bytes, n)

    def add_total(self, dim: str, op: str, group: str, n: int, total_message_bytes: float, calls: int) -> None:
        """`calls` calls whose messages sum to `total_message_bytes` (bytes sent are linear in the message)."""
        if n <= 1 or calls <= 0 or total_message_bytes <= 0:
            return
        row = self.rows.get((dim, op))
        if row is None:
            row = self.rows[(dim, op)] = Flow(dim, op, group, n, backend=self.backend)
        row.calls += int(calls)
        row.message_bytes += total_message_bytes
        row.bytes_sent += self.sent(op, total_message_bytes, n)

    def add_copy(self, dim: str, op: str, tier: str, total_message_bytes: float, calls: int) -> None:
        """`calls` copies (not collectives: one rank's own bytes over `tier`, a key of COPY_TIERS) whose
        messages sum to `total_message_bytes`."""
        if calls <= 0 or total_message_bytes <= 0:
            return
        row = self.rows.get((dim, op))
        if row is None:
            row = self.rows[(dim, op)] = Flow(dim, op, tier, 1, tier=tier)
        row.calls += int(calls)
        row.message_bytes += total_message_bytes
        row.bytes_sent += VOLUME[op](total_message_bytes, 1)

    def list(self) -> list[Flow]:
        return [self.rows[k] for k in sorted(self.rows, key=lambda k: (k[0], k[1], k[2] if len(k) > 2 else ""))]


def group_size(layout: Layout, group: str) -> int:
    """Ranks in a mesh group (`fivefold.grid.GROUP_SPECS`) under this layout."""
    return grid.group_size(layout, group)


# -- per dimension ------------------------------------------------------------------------------------
def _tp_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, stage: int, m: int, T: float) -> None:
    if L.tp == 1:
        return
    rng = layout_blocks(model, L, stage)
    moe = sum(1 for i in rng if model.is_moe_layer(i))
    _tp_layer_flows(f, model, L, w, len(rng), moe, stage == 0, head_passes(model, L, stage), m, T)
    _moe_sequence_flows(f, model, L, w, moe, m, 2 if L.recompute == "full" else 1)


def head_passes(model: PlanModel, L: Layout, stage: int) -> int:
    """Passes of the output head on one rank of `stage`: on the last stage one, and one more per MTP module
    (`units.mtp_blocks`); none elsewhere."""
    return 1 + len(mtp_blocks(model, L.pp, stage, L.head_first)) if stage == head_stage(L.pp, L.head_first) else 0


def lora_frozen_prefix(model: PlanModel, n_layers: int) -> tuple[int, int]:
    """(entries, exits) of the first stage's tensor-parallel regions, from layer 0 on, whose backward
    collective never runs: every weight before the first trained one is frozen (LoRA: all but the
    adapters; train.freeze: what its patterns match), so no gradient flows into those regions' inputs. A
    region's entry (f) is needed once anything before it trains, its norm included; its exit (g) once
    anything in it or before it does. With LoRA on attention (the default) that is layer 0's attention
    entry alone. An MoE layer, which has no region, ends the walk."""
    if not (model.lora_rank or model.frozen) or not is_frozen(model, "embed.weight"):
        return 0, 0
    if model.lora_rank:
        trains = {"attn_norm": False, "mlp_norm": False,
                  "attn": any(t in model.lora_targets for t in ("wq", "wk", "wv", "wo")),
                  "mlp": any(t in model.lora_targets for t in ("gate", "up", "down"))}
    entries = exits = 0
    for i in range(n_layers):
        if not model.lora_rank:
            names = [n for n in layer_names(model, i) if not is_frozen(model, f"layers.{i}.{n}")]
            trains = {"attn_norm": "attn_norm.weight" in names, "mlp_norm": "mlp_norm.weight" in names,
                      "attn": any(n.startswith("attn.") for n in names), "mlp": any(n.startswith("mlp.") for n in names)}
        if trains["attn_norm"]:
            return entries, exits
        entries += 1
        if trains["attn"]:
            return entries, exits
        exits += 1
        if model.is_moe_layer(i) or trains["mlp_norm"]:
            return entries, exits
        entries += 1
        if trains["mlp"]:
            return entries, exits
        exits += 1
    return entries, exits


def _tp_layer_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, n_layers: int, moe: int, first: bool,
                    last: int, m: int, T: float) -> None:
    """The tp collectives of a stage holding `n_layers` blocks (`moe` of them MoE), the embedding when
    `first`, the head and cross-entropy `last` times (`head_passes`; True: once)."""
    t = L.tp
    if t == 1:
        return
    e, h = w.act_bytes, model.hidden
    act = T * h * e
    fwd_passes = 2 if L.recompute == "full" else 1
    regions = 2 * n_layers - moe                       # attention and dense MLP; an MoE layer has none
    # latent attention with a q latent enters on its latents, not on x (parallel/tensor.py): its region's
    # f (or SP all-gather) carries T·(q_lora + kv_lora + rope) elements; without a q latent x enters too
    # (for q_proj) and the latents c_kv, k_pe beside it
    latent = n_layers if model.mla else 0
    entries = regions - (latent if model.q_lora_rank else 0)   # f / SP all-gathers of x
    lat = T * model.mla_latent_width() * e
    # LoRA on the first stage: nothing before the first adapter needs a gradient, so the backward collectives
    # of the regions ahead of it never run (autograd prunes them): the entries' (f) and exits' (g)
    skip_in, skip_out = lora_frozen_prefix(model, n_layers) if first else (0, 0)
    if L.seq_parallel:  # g: reduce-scatter forward, all-gather backward; f: all-gather forward, reduce-scatter back
        f.add("tp", "all_gather", "tp", t, act, (regions - skip_out + entries * fwd_passes) * m)
        f.add("tp", "reduce_scatter", "tp", t, act, (regions * fwd_passes + entries - skip_in) * m)
        f.add("tp", "all_gather", "tp", t, lat, latent * fwd_passes * m)
        f.add("tp", "reduce_scatter", "tp", t, lat, latent * m)
    else:
        f.add("tp", "all_reduce", "tp", t, act, (regions * fwd_passes + entries - skip_in) * m)
        f.add("tp", "all_reduce", "tp", t, lat, latent * m)
        if moe:  # EP x TP: each rank's sequences' outputs all-gathered (and the input gradient, backward)
            f.add("tp", "all_gather", "tp", t, act, (fwd_passes + 1) * m * moe)
    if first:  # vocab-parallel embedding: g forward (SP: reduce-scatter forward, all-gather backward)
        if L.seq_parallel:
            f.add("tp", "reduce_scatter", "tp", t, act, m)
            f.add("tp", "all_gather", "tp", t, act, 0 if is_frozen(model, "embed.weight") else m)   # frozen: no backward
        else:
            f.add("tp", "all_reduce", "tp", t, act, m)
    if last:  # head input: f (SP: all-gather forward, reduce-scatter backward); CE reductions
        if L.seq_parallel:
            f.add("tp", "all_gather", "tp", t, act, m * last)
            f.add("tp", "reduce_scatter", "tp", t, act, m * last)
        else:
            f.add("tp", "all_reduce", "tp", t, act, m * last)
        f.add("tp", "all_reduce", "tp", t, T * w.master_bytes, m * last)          # max logit
        f.add("tp", "all_reduce", "tp", t, 2 * T * w.master_bytes, m * last)      # sum of exp, target logit


def tp_overlapped(model: PlanModel, L: Layout, w: Workload, stage: int, bound: bool = False
                  ) -> list[tuple[str, str, float, float, tuple[float, float, float]]]:
    """The tp collectives the runtime overlaps with GEMMs on one rank of `stage` (parallel/tensor_overlap.py,
    under rules.overlaps_tp_input), per micro-batch, as (pass, op, message bytes of one call, calls, (M, N,
    K) of the GEMM each call runs beside; pass "forward" or "backward"):

    * backward, every part's entry (attention's q/k/v, a dense MLP's gate and up, the head): the input
      gradient's all-reduce (SP: reduce-scatter), beside the part's weight-gradient GEMM (the forward's
      shape) — where those weights train (LoRA freezes them; so may train.freeze) and no adapter sits on
      them (the plain path);
    * under SP, a dense MLP's entry forward: the all-gather, beside the projection of this rank's own rows;
    * under SP on gloo (whose reduce-scatter takes a rank's own chunk after the launch), every exit without
      an adapter (attention's wo, a dense MLP's down projection): forward the reduce-scatter beside the own
      tokens' projection, backward (where the projection trains) the all-gather of the output gradient
      beside the own tokens' input and weight gradients (two GEMMs of that shape).

    On the first stage the entries and exits of a frozen prefix (`lora_frozen_prefix`: nothing before them
    trains) run no backward, so nothing of theirs hides. Latent attention's entries take the plain path.
    `bound`: every entry of a part as if it trained, for the search's lower bound (plan/search.py), which
    must not count less hidden than any layout's."""
    if L.tp == 1 or not overlaps_tp_input(L.pp, L.schedule, L.tp_overlap):
        return []
    t, h = L.tp, model.hidden
    T = L.micro_batch * w.seq / L.cp
    act = T * h * w.act_bytes
    back = "reduce_scatter" if L.seq_parallel else "all_reduce"
    fwd_passes = 2 if L.recompute == "full" else 1
    mats = 2 if model.mlp == "swiglu" else 1
    lora = set(model.lora_targets) if model.lora_rank else set()
    exits = L.seq_parallel and volume.ALGORITHMS[w.backend]["reduce_scatter"][0] == "pairwise"
    blocks = [i for i in layout_blocks(model, L, stage) if i < model.layers]   # MTP blocks: not here
    # the first stage's frozen prefix: entries and exits whose backward never runs (`lora_frozen_prefix`)
    skip_in, skip_out = lora_frozen_prefix(model, len(blocks)) if stage == 0 and not bound else (0, 0)
    entry = exit_ = 0                          # regions walked: each layer's attention, then its dense MLP
    out = []

    def trains(name: str) -> bool:
        return bound or not is_frozen(model, name)

    for i in blocks:
        if (not model.mla and not lora & {"wq", "wk", "wv"} and trains(f"layers.{i}.attn.wq.weight")
                and entry >= skip_in):
            out.append(("backward", back, act, 1, (T, (model.q_width + model.kv_width + model.v_width) / t, h)))
        if exits and "wo" not in lora:      # attention's exit, decomposed as the MLP's
            out.append(("forward", "reduce_scatter", act, fwd_passes, (T / t, h, model.attn_out_width / t)))
            if trains(f"layers.{i}.attn.wo.weight") and exit_ >= skip_out:
                out.append(("backward", "all_gather", act, 1, (2 * T / t, h, model.attn_out_width / t)))
        entry, exit_ = entry + 1, exit_ + 1
        if model.is_moe_layer(i):
            continue
        width = mats * model.ffn / t
        if not lora & {"gate", "up"}:
            if trains(f"layers.{i}.mlp.gate.weight") and entry >= skip_in:
                out.append(("backward", back, act, 1, (T, width, h)))
            if L.seq_parallel:
                out.append(("forward", "all_gather", act, fwd_passes, (T / t, width, h)))
        if exits and "down" not in lora:
            out.append(("forward", "reduce_scatter", act, fwd_passes, (T / t, h, model.ffn / t)))
            if trains(f"layers.{i}.mlp.down.weight") and exit_ >= skip_out:
                out.append(("backward", "all_gather", act, 1, (2 * T / t, h, model.ffn / t)))
        entry, exit_ = entry + 1, exit_ + 1
    last = head_passes(model, L, stage)
    if last and trains("embed.weight" if model.tie_embeddings else "head.weight"):
        out.append(("backward", back, act, last, (T, padded_vocab(model.vocab, t) / t, h)))
    return out


@lru_cache(maxsize=4096)
def tp_overlapped_merged(model: PlanModel, L: Layout, w: Workload, stage: int
                         ) -> tuple[tuple[str, str, float, float, tuple[float, float, float]], ...]:
    """`tp_overlapped` with the rows that differ only in calls merged (every dense layer lists the same
    ones): what the step time prices, a handful of rows instead of several per layer."""
    merged: dict[tuple, float] = {}
    for direction, op, message, calls, gemm in tp_overlapped(model, L, w, stage):
        key = (direction, op, message, gemm)
        merged[key] = merged.get(key, 0.0) + calls
    return tuple((d, op, message, calls, gemm) for (d, op, message, gemm), calls in merged.items())


def _moe_sequence_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, moe: int, m: int, passes: int) -> None:
    """When SP or cp splits sequences, each MoE layer sums its per-sequence balance statistics (counts,
    score sums: b × E in the router's fp32) over the ranks holding a sequence's parts (the group of
    rules.moe_sequence_group, as the runtime's MoE.configure): 2 all-reduces forward (per forward pass), 1
    backward (model/moe.py load_balance_loss, comm/autograd.py sum_across)."""
    group = moe_sequence_group(L.tp, L.sp_mode, L.cp)
    if not moe or model.router_bias or group is None:
        return
    n = moe_sequence_parts(L.tp, L.sp_mode, L.cp)
    sequences = L.micro_batch // L.tp if moe_splits_rows(L.tp, L.sp_mode) else L.micro_batch   # a tp rank's
    msg = sequences * model.experts * w.master_bytes
    f.add(group, "all_reduce", group, n, msg, (2 * passes + 1) * m * moe)


def model_kv_replicas(model: PlanModel, tp: int) -> int:
    """`rules.kv_replicas` for a model (latent attention splits its up-projected K/V by heads: 1)."""
    return 1 if model.mla else kv_replicas(tp, model.kv_heads)


def partial_grad_params(model: PlanModel, L: Layout, stage: int) -> dict[str, int]:
    """Parameters per rank of `stage` whose gradients are partial sums over tp replicas, by tag: "norm"
    (replicated on every tp rank and seeing only its sequence shard under SP: norm weights, and
    row-parallel biases and MoE routers where the model has them) and "kv" (K/V weights of a head
    shared by tp/kv_heads ranks, each computing the part of its own query heads)."""
    return dict(_partial_grad_params(model, L.tp, L.pp, L.vpp, L.partition, L.seq_parallel, stage, ExpertSplit.of(L),
                                     L.head_first))


@lru_cache(maxsize=16384)
def _partial_grad_params(model: PlanModel, tp: int, pp: int, vpp: int, partition: str, sp: bool, stage: int,
                         ep: ExpertSplit = ExpertSplit(), head_first: bool = False) -> tuple:
    if tp == 1:
        return ()
    h, rng = model.hidden, layout_blocks(model, Layout(pp=pp, vpp=vpp, partition=partition, head_first=head_first),
                                         stage)
    last = stage == head_stage(pp, head_first)   # the final norm's stage
    out = {}
    if model.lora_rank or model.frozen:   # what trains, by tag: LoRA's adapters, or what train.freeze leaves
        kv = model_kv_replicas(model, tp) > 1
        tensors = [(n, tag) for i in rng for n, _, tag in layer_tensors(model, i, tp, ep)]
        tensors += root_tensors(model, tp, pp, stage, head_first) if last else []   # the final norm
        for n, tag in tensors:
            if (tag == "norm" and sp) or tag == "moe" or (tag == "kv" and kv):
                out[tag] = out.get(tag, 0) + n
        return tuple(out.items())
    moe = sum(1 for i in rng if model.is_moe_layer(i))
    if moe:   # routers, shared experts and unfolded routed experts, whole on every tp rank, each seeing its own
        # tokens (folded routed experts: the expert grid's, summed over edp)
        routed = 0 if ep.folded else model.experts
        out["moe"] = moe * (model.router_params() + (model.shared_experts + routed) * model.expert_params())
    if model.qk_norm_params():   # Qwen3's q/k norms: whole on every tp rank, each rank's heads add to them
        out["moe"] = out.get("moe", 0) + model.qk_norm_params() * len(rng)
    if sp:
        per = {False: 2 * model._norm(h) + (2 * h if model.linear_bias else 0),
               True: 2 * model._norm(h) + (h if model.linear_bias else 0)}
        out["norm"] = sum(per[model.is_moe_layer(i)] + model.mla_replicated_params() for i in rng) + \
            (model._norm(h) if last else 0) + \
            model.mtp_projection_params() * sum(1 for i in rng if i >= model.layers)   # MTP's M and norms
    if model_kv_replicas(model, tp) > 1:
        out["kv"] = len(rng) * 2 * model._linear(h, model.kv_heads * model.head_dim, model.qkv_bias) // model.kv_heads
    return tuple(out.items())


def _tp_sync_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, stage: int,
                   dp_rank: int | None) -> None:
    """Partial gradients of tp-replicated parameters summed over their replicas once per step, after the
    data-parallel reduction (parallel/tensor.py, `TensorParallel.sync_grads`): one all-reduce over tp of
    the "norm" set (and of K/V when kv_heads == 1, every tp rank then holding the one head), one over the
    tp/kv_heads ranks sharing a K/V head otherwise. Each rank sends the gradients it owns: all of them
    without ZeRO; with ZeRO its shard's segments of them, so the message differs by dp rank (summing to
    the whole set over the dp·cp ranks) and a rank that owns none skips the call. With `dp_rank` those are
    that rank's exact segments; without it, the mean over dp ranks (one call)."""
    parts = partial_grad_params(model, L, stage)
    if not parts:
        return
    r = model_kv_replicas(model, L.tp)
    n_zero = L.dp * L.cp if L.zero_spec.shards_states else 1
    if n_zero > 1 and dp_rank is not None and exact_tensors(model):
        owned = owned_tagged(unit_tensors(model, L, w.grad_bytes, stage), n_zero, dp_rank)
        if not L.seq_parallel:
            owned.pop("norm", None)
    else:
        owned = {tag: count / n_zero for tag, count in parts.items()}
    full = owned.get("norm", 0) + owned.get("moe", 0) + (owned.get("kv", 0) if r == L.tp else 0)
    for n, calls in windows(full, STEP_CHUNK):   # window by window (parallel/engine.py all_reduce_windows)
        f.add("tp", "all_reduce", "tp", L.tp, n * w.grad_bytes, calls)
    if 1 < r < L.tp:  # recorded under "tp" too, over the mesh's "tp_kv" groups: a row of its own, on their tier
        for n, calls in windows(owned.get("kv", 0), STEP_CHUNK):
            f.add("tp", "all_reduce", "tp_kv", r, n * w.grad_bytes, calls, width=r)


def _cp_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, stage: int, m: int, T: float) -> None:
    """Ulysses all-to-alls over its degree u and ring sends over its degree r (u·r = cp; see
    `rules.cp_degrees`: hybrid runs both, Ulysses inside each ring rank's u contiguous ranks)."""
    if L.cp > 1:
        _cp_layer_flows(f, model, L, w, len(layout_blocks(model, L, stage)), m, T)


def _cp_layer_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, n_layers: int, m: int, T: float,
                    ring: bool = True, ulysses: bool = True, backward: bool = True) -> None:
    """`_cp_flows` for a stage of `n_layers` layers; without `ring` the Ulysses all-to-alls only, without
    `ulysses` the ring sends only, without `backward` the forward's only (an evaluation)."""
    if L.cp == 1:
        return
    e = w.act_bytes
    fwd_passes = 2 if L.recompute == "full" else 1
    u, r = cp_degrees(L.cp_mode, L.cp, model.heads, L.tp, L.ulysses)
    kv_split = L.tp if model.mla else min(L.tp, model.kv_heads)
    kv = T * (model.kv_width + model.v_width) / kv_split * e       # local K and V, before Ulysses
    if u > 1 and not model.mla:
        # K/V heads a tp rank holds, repeated to lcm(heads, u) when u does not divide them (context.py)
        kh = max(model.kv_heads // L.tp, 1)
        kv *= lcm(kh, u) // kh
    if u > 1 and ulysses:
        q = T * model.q_width / L.tp * e
        o = T * model.attn_out_width / L.tp * e
        k = kv * model.kv_width / (model.kv_width + model.v_width)   # K's share (MLA: its head dim is wider)
        for msg in (q, k, kv - k, o):  # q, k, v forward in; output back (and their gradients)
            f.add("cp", "all_to_all", "cp_ulysses", u, msg, (fwd_passes + backward) * m * n_layers, width=u)
    if r > 1 and ring:  # after Ulysses a ring rank's block holds u times the tokens and 1/u of the heads: same bytes
        sends = (r - 1) * m * n_layers * (fwd_passes + 2 * backward)   # K,V forward; K,V and dK,dV backward
        f.add("cp", "send", "cp_ring", r, kv, sends, width=u)
        f.add("cp", "recv", "cp_ring", r, kv, sends, width=u)


def _ep_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, stage: int, m: int, T: float) -> None:
    if not model.moe or L.ep * L.etp == 1:
        return
    rng = layout_blocks(model, L, stage)
    _ep_layer_flows(f, model, L, w, sum(1 for i in rng if model.is_moe_layer(i)), m, T)


def _ep_layer_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, moe: int, m: int, T: float,
                    backward: bool = True) -> None:
    """The expert all-to-alls of a stage holding `moe` MoE layers (without `backward`: the forward's only):
    over ep the dispatch and combine, over etp the gathered rows and the reduce-scattered partial outputs
    (parallel/expert.py)."""
    if not model.moe or L.ep * L.etp == 1 or not moe:
        return
    fwd_passes = 2 if L.recompute == "full" else 1
    # GShard capacity: each expert's buffer holds C rows per sequence, zero-padded (rules.moe_capacity,
    # the runtime's rule); dropless routing is planned as perfectly balanced (k rows per token)
    seqs = L.micro_batch
    cap = moe_capacity(w.capacity_factor, w.seq // L.cp, model.top_k, model.experts)
    tokens = (model.experts * seqs * cap if cap else model.top_k * T) / L.tp
    msg = tokens * model.hidden * w.act_bytes
    # FP8 dispatch: one e4m3 byte an element plus an fp32 scale a row (comm/autograd.py)
    dispatch = tokens * (model.hidden + 4) if w.fp8_dispatch else tokens * model.hidden * w.act_bytes
    calls = m * moe
    if L.etp > 1:   # the rows a rank received (balanced: as many as it sent) go to every etp rank and back
        if not cap:   # dropless: first the (ep, E/ep) counts each etp rank received
            f.add("etp", "all_gather", "etp", L.etp, L.etp * model.experts * 8, fwd_passes * calls)
        f.add("etp", "all_to_all", "etp", L.etp, L.etp * msg, (2 * fwd_passes + 2 * backward) * calls)
    if L.ep == 1:
        return
    if not cap:   # dropless: each rank first tells the others how many rows it sends to each expert
        f.add("ep", "all_to_all", "ep", L.ep, model.experts * 8, fwd_passes * calls)
    # node-limited routing: the routed rows are split between nodes and inside them by `place`
    part, route = ("routed", (w.moe_route_nodes, tokens * L.tp / T)) if w.moe_route_nodes else ("", ())
    f.add("ep", "all_to_all", "ep", L.ep, dispatch, fwd_passes * calls, part, route)   # dispatch forward
    f.add("ep", "all_to_all", "ep", L.ep, msg, (fwd_passes + 2 * backward) * calls, part, route)  # combine fwd; both bwd


def pp_hops(stage: int, p: int, m: int, v: int, head_first: bool = False) -> tuple[int, int]:
    """(to_next, to_prev): how many of `stage`'s micro-batch chunks cross its boundary with the next stage
    (activations forward; under interleaving the last stage's chunks go on to the first) and with the
    previous one (gradients backward), out of m·v each: the last chunk of the last stage sends nothing
    forward, nor the first chunk of the first stage backward. The stage receives the same counts the
    other way: to_prev forward from the previous stage, to_next backward from the next. With `head_first`
    (the head on the first stage) the last stage sends its final hidden states on to the first, which
    sends their gradient back: every stage crosses both boundaries m·v times."""
    if head_first:
        return m * v, m * v
    return m * v - (m if stage == p - 1 else 0), m * v - (m if stage == 0 else 0)


def _pp_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, stage: int, m: int, T: float) -> None:
    p, v = L.pp, L.vpp   # vpp > 1: interleaved chunks (rules.check_schedule)
    if p == 1:
        return
    act = T * model.hidden * w.act_bytes / (L.tp if L.seq_parallel else 1)
    to_next, to_prev = pp_hops(stage, p, m, v, L.head_first)
    f.add("pp", "send", "pp", p, act, to_next + to_prev)   # forward to the next stage, backward to the previous
    f.add("pp", "recv", "pp", p, act, to_prev + to_next)   # forward from the previous, backward from the next
    if model.tie_embeddings and not L.head_first and stage in (0, p - 1) and not is_frozen(model, "embed.weight"):
        emb = padded_vocab(model.vocab, L.tp) // L.tp * model.hidden
        f.add("embed", "all_reduce", "embed", 2, emb * w.grad_bytes, 1)


def _grad_flows(f: Flows, dim: str, group: str, n: int, params: int, L: Layout, w: Workload, m: int,
                units: tuple[int, ...], root: int = 0, held: bool = False) -> None:
    """Gradient reduction and ZeRO gathers for `params` parameters over n ranks: one call per bucket
    (DDP, ZeRO-1/2) or unit (ZeRO-3), `units` their sizes (the first `root` of them ZeRO-3's root unit);
    ZeRO's are padded to a multiple of n (parallel/zero/engine.py). Gradients travel in the reduce dtype
    (`Workload.reduce_bytes`); bucket boundaries follow the accumulation dtype."""
    if n == 1 or params == 0:
        return
    u = len(units) or 1
    r = w.reduce_bytes
    z = L.zero_spec
    if not z.shards_states:
        f.add_total(dim, "all_reduce", group, n, params * r, u)
        return
    padded = unit_sums(units, n)[0]
    if z.pipeline and z.each_microbatch:
        # every micro-batch's backward reduce-scatters the units it completes; a held root (tied copy)
        # accumulates and goes once, after the copies' sum
        once = root if held else 0
        once_padded = unit_sums(units[:once], n)[0] if once else 0
        f.add_total(dim, "reduce_scatter", group, n, (once_padded + m * (padded - once_padded)) * r,
                    once + m * (u - once))
        if not z.shards_params:
            f.add_total(dim, "all_gather", group, n, padded * w.param_bytes, u)
            return
        per_use = z.gathers(m)
        root_padded = unit_sums(units[:root], n)[0] if root else 0
        f.add_total(dim, "all_gather", group, n, (root_padded + per_use * (padded - root_padded)) * w.param_bytes,
                    root + per_use * (u - root))
        return
    if not z.shards_params and z.once_per_step:
        # once per step: ZeRO-1 always; ZeRO-2 under a pipeline accumulates over the micro-batches
        f.add_total(dim, "reduce_scatter", group, n, padded * r, u)
        f.add_total(dim, "all_gather", group, n, padded * w.param_bytes, u)
    elif not z.shards_params:
        f.add_total(dim, "reduce_scatter", group, n, m * padded * r, m * u)
        f.add_total(dim, "all_gather", group, n, padded * w.param_bytes, u)
    elif z.pipeline:
        # under a pipeline: each block gathered before every forward and backward it runs, the root
        # unit once for the step; each unit reduce-scattered once
        per_use = z.gathers(m)
        root_padded = unit_sums(units[:root], n)[0] if root else 0
        gathers = root + per_use * (u - root)
        f.add_total(dim, "all_gather", group, n, (root_padded + per_use * (padded - root_padded)) * w.param_bytes,
                    gathers)
        f.add_total(dim, "reduce_scatter", group, n, padded * r, u)
    else:  # gathered before each forward and (resharded after it) again before each backward
        gathers = z.gathers(m)
        f.add_total(dim, "all_gather", group, n, gathers * padded * w.param_bytes, gathers * u)
        f.add_total(dim, "reduce_scatter", group, n, m * padded * r, m * u)


def stage_flows(model: PlanModel, layout: Layout, work: Workload, stage: int,
                dp_rank: int | None = None) -> list[Flow]:
    """Every (dim, op) row one rank of `stage` records in one optimizer step. Rows are the same on every
    rank of a stage except the tp gradient sync under ZeRO (see `_tp_sync_flows`): for it `dp_rank`
    picks the data-parallel rank (its index in the dp·cp group), None the mean over them."""
    L, f = layout, Flows(work.backend)
    m = microbatches(L, work)
    T = L.micro_batch * work.seq / L.cp
    _tp_flows(f, model, L, work, stage, m, T)
    _tp_sync_flows(f, model, L, work, stage, dp_rank)
    _cp_flows(f, model, L, work, stage, m, T)
    _ep_flows(f, model, L, work, stage, m, T)
    _pp_flows(f, model, L, work, stage, m, T)
    dense, expert = stage_params(model, L, stage)
    units = (lambda ex, n: zero_units(model, L, work.grad_bytes, stage, ex) if n > 1 else ())
    root = root_units(model, L, stage)
    _grad_flows(f, "dp", "dp_cp", L.dp * L.cp, dense, L, work, m, units(False, L.dp * L.cp), root,
                held_root(model, L, stage))
    _grad_flows(f, "edp", "edp", L.edp, expert, L, work, m, units(True, L.edp))
    f.add("loss", "all_reduce", "dp_cp", L.dp * L.cp, 8, 1)
    if model.moe:   # routing statistics: (layers, E + 1) float64 over the world (parallel/expert.py)
        f.add("moe_stats", "all_reduce", "world", group_size(L, "world"), model.layers * (model.experts + 1) * 8, 1)
    f.add("loss", "all_reduce", "pp", L.pp, 8, 1)      # only the last stage computed it
    # (dense gradients are reduced over dp×cp when cp > 1, expert ones over expert-dp when ep > 1)
    norm_group = L.zero_spec.norm_group(only_dp=reduces_only_over_dp(L.cp, model.experts, L.ep, L.etp))
    f.add("grad_norm", "all_reduce", norm_group, group_size(L, norm_group), 8, 1)
    # whether a stop signal arrived and the ranks' largest peak memory: two int64, max over the world
    # (train/trainer.py agree_stop)
    f.add("control", "all_reduce", "world", group_size(L, "world"), 24, 1)   # stop, peak memory, straggler
    _offload_flows(f, model, L, work, stage, m, root)
    return f.list()


# -- evaluations ---------------------------------------------------------------------------------------
def eval_stage_flows(model: PlanModel, layout: Layout, work: Workload, stage: int, batches: int) -> list[Flow]:
    """Every (dim, op) row one rank of `stage` records in one evaluation of `batches` global batches
    (train/trainer.py `evaluate`, what comm.json's "eval" section holds per evaluation): forward passes
    only, without autograd, so nothing is recomputed and no gradient moves. Per forward micro-batch: tp's
    forward collectives (g all-reduces, or SP's all-gather before and reduce-scatter after each region;
    the embedding's g; the cross-entropy's two reductions; the head input's f is the identity forward),
    Ulysses' 4 all-to-alls and ring's cp-1 K,V sends per layer, the pipeline's activation sends (the
    forward-only action list). ZeRO-3 gathers each unit before each forward and frees it after (the
    pipeline's root unit stays for the evaluation), or once per evaluation with reshard_after_forward
    off (everything is freed at its end); with params on disk each gather first reads its shard. Then
    the loss is summed once, over dp·cp and pp. MoE layers: the expert dispatch and combine all-to-alls
    (and dropless routing's counts) of each forward, exact in capacity mode as for training; no balance
    loss, so no statistics are summed."""
    L, f = replace(layout, recompute="none"), Flows(work.backend)
    m = microbatches(L, work) * batches
    T = L.micro_batch * work.seq / L.cp
    rng = layout_blocks(model, L, stage)
    moe = sum(1 for i in rng if model.is_moe_layer(i))
    _tp_forward_flows(f, model, L, work, len(rng), moe, stage == 0, head_passes(model, L, stage), m, T)
    _ep_layer_flows(f, model, L, work, moe, m, T, backward=False)
    if L.cp > 1:
        _cp_layer_flows(f, model, L, work, len(rng), m, T, backward=False)
    if L.pp > 1:
        act = T * model.hidden * work.act_bytes / (L.tp if L.seq_parallel else 1)
        to_next, to_prev = pp_hops(stage, L.pp, m, L.vpp, L.head_first)   # forward only: sends on, receives from before
        f.add("pp", "send", "pp", L.pp, act, to_next)
        f.add("pp", "recv", "pp", L.pp, act, to_prev)
    if L.zero_spec.shards_params:
        _eval_gather_flows(f, model, L, work, stage, m)
    f.add("loss", "all_reduce", "dp_cp", L.dp * L.cp, 8, 1)
    f.add("loss", "all_reduce", "pp", L.pp, 8, 1)
    return f.list()


def _tp_forward_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, n_layers: int, moe: int, first: bool,
                      last: int, m: int, T: float) -> None:
    """The forward half of `_tp_layer_flows`, for `m` forward micro-batches."""
    t = L.tp
    if t == 1:
        return
    act = T * model.hidden * w.act_bytes
    regions = 2 * n_layers - moe                       # attention and dense MLP; an MoE layer has none
    if L.seq_parallel:
        f.add("tp", "all_gather", "tp", t, act, regions * m + m * last)
        f.add("tp", "reduce_scatter", "tp", t, act, regions * m + (m if first else 0))
    else:
        f.add("tp", "all_reduce", "tp", t, act, regions * m + (m if first else 0))
        if moe:   # EP x TP: each rank's sequences' outputs all-gathered
            f.add("tp", "all_gather", "tp", t, act, m * moe)
    if last:
        f.add("tp", "all_reduce", "tp", t, T * w.master_bytes, m * last)          # max logit
        f.add("tp", "all_reduce", "tp", t, 2 * T * w.master_bytes, m * last)      # sum of exp, target logit


def _eval_gather_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, stage: int, m: int) -> None:
    """ZeRO-3's all-gathers in an evaluation (and, with params on disk, the reads before them)."""
    n = L.dp * L.cp
    units = zero_units(model, L, w.grad_bytes, stage)
    root = 1 if any(k for k, _ in root_tensors(model, L.tp, L.pp, stage, L.head_first)) else 0
    per_unit = [(m if L.reshard_after_forward and not (L.pp > 1 and i < root) else 1) for i in range(len(units))]
    if n > 1:
        padded = [unit_sums((u,), n)[0] for u in units]
        f.add_total("dp", "all_gather", "dp_cp", n, sum(g * p for g, p in zip(per_unit, padded)) * w.param_bytes,
                    sum(per_unit))
    if L.zero_spec.params_on_disk:
        shards = [shard_size(u, k) for u, k in offload_units(model, L, w, stage)]
        read = sum(g * k for g, k in zip(per_unit, shards)) * w.param_bytes
        f.add_copy("offload", "nvme_read", "nvme", read, sum(per_unit))
        f.add_copy("offload", "h2d", "pcie", read, sum(per_unit))


def eval_all_ranks(model: PlanModel, layout: Layout, work: Workload, batches: int) -> dict[tuple[str, str], dict]:
    """(dim, op) -> calls, message_bytes, bytes_sent summed over every rank for one evaluation of `batches`
    global batches (`eval_stage_flows`): what comm.json's "eval" rows show per evaluation."""
    out: dict[tuple[str, str], dict] = {}
    for j in range(layout.pp):
        for fl in eval_stage_flows(model, layout, work, j, batches):
            add_weighted(out, (fl.dim, fl.op), fl, layout.gpus // layout.pp)
    return out


def _offload_flows(f: Flows, model: PlanModel, L: Layout, w: Workload, stage: int, m: int = 1,
                   root: int = 0) -> None:
    """Offload copies of one rank of `stage` in one step (parallel/zero/offload.py): once per ZeRO unit
    (`buffers.offload_units`, shard k elements), "d2h" of the reduced gradient shard (k·g bytes) and "h2d"
    of the updated parameter shard (k·w); with nvme also "nvme_read" and "nvme_write" of the master,
    exp_avg and exp_avg_sq (3·k·mb each way). ZeRO-2/3 stream the gradients (`ZeroSpec.streams_grads`):
    a "d2h" of k·g after each of the unit's reduce-scatters (`ZeroSpec.reductions`: m per step outside a
    pipeline, 1 under one; a held root once), during the backward. ZeRO-3 nvme (`ZeroSpec.params_on_disk`):
    no h2d after the step but an "nvme_write" of k·w, and before each of the unit's all-gathers
    (`ZeroSpec.gathers`; the first `root` units are the root) an "nvme_read" and an "h2d" of k·w."""
    if L.offload == "none":
        return
    units = offload_units(model, L, w, stage)
    shards = [shard_size(u, n) for u, n in units]
    k = sum(shards)
    if L.zero_spec.streams_grads:
        held = held_root(model, L, stage)
        copies = [L.zero_spec.reductions(m, held and i < root) for i in range(len(shards))]
        f.add_copy("offload", "d2h", "pcie", sum(c * ku for c, ku in zip(copies, shards)) * w.grad_bytes, sum(copies))
    else:
        f.add_copy("offload", "d2h", "pcie", k * w.grad_bytes, len(units))
    if L.offload == "nvme":
        f.add_copy("offload", "nvme_read", "nvme", 3 * k * w.master_bytes, len(units))
        f.add_copy("offload", "nvme_write", "nvme", 3 * k * w.master_bytes, len(units))
    if not L.zero_spec.params_on_disk:
        f.add_copy("offload", "h2d", "pcie", k * w.param_bytes, len(units))
        return
    gathers = [L.zero_spec.gathers(m, i < root) for i in range(len(shards))]
    read = sum(g * ku for g, ku in zip(gathers, shards)) * w.param_bytes
    f.add_copy("offload", "nvme_read", "nvme", read, sum(gathers))
    f.add_copy("offload", "h2d", "pcie", read, sum(gathers))
    f.add_copy("offload", "nvme_write", "nvme", k * w.param_bytes, len(units))


def layer_flows(model: PlanModel, layout: Layout, work: Workload, n_layers: int, moe: int, first: bool, last: bool,
                m: int = 1, dims: tuple[str, ...] = ("tp", "cp", "ep")) -> list[Flow]:
    """The rows inside the layers that no overlap hides, for `m` micro-batches on a stage holding `n_layers`
    layers (`moe` of them MoE; the embedding when `first`, the head when `last`): tp collectives, Ulysses
    all-to-alls and expert all-to-alls, as `stage_flows` counts them. Left out: what may hide or depends on
    the ZeRO stage (ring sends, the tp gradient sync) and the MoE balance statistics. Calls and bytes are
    linear in the counts and in m, and in the micro-batch size at a fixed number of sequences per step
    (except the dropless token counts, which fall with it): search.py's lower bound on step time. `dims`:
    the dimensions to list."""
    L, f = layout, Flows(work.backend)
    T = L.micro_batch * work.seq / L.cp
    if "tp" in dims:
        _tp_layer_flows(f, model, L, work, n_layers, moe, first, last, m, T)
    if "cp" in dims:
        _cp_layer_flows(f, model, L, work, n_layers, m, T, ring=False)
    if "ep" in dims:
        _ep_layer_flows(f, model, L, work, moe, m, T)
    return f.list()


def ring_flows(model: PlanModel, layout: Layout, work: Workload, n_layers: int, m: int = 1) -> list[Flow]:
    """The ring-attention sends (and their receives) of `m` micro-batches through `n_layers` layers."""
    L, f = layout, Flows(work.backend)
    T = L.micro_batch * work.seq / L.cp
    if L.cp > 1:
        _cp_layer_flows(f, model, L, work, n_layers, m, T, ulysses=False)
    return f.list()


# -- sums over ranks ------------------------------------------------------------------------------------
def by_dim(flows: list[Flow]) -> dict[str, float]:
    out: dict[str, float] = {}
    for fl in flows:
        out[fl.dim] = out.get(fl.dim, 0.0) + fl.bytes_sent
    return out


def all_ranks(model: PlanModel, layout: Layout, work: Workload) -> dict[tuple[str, str], dict]:
    """(dim, op) -> calls, message_bytes, bytes_sent summed over every rank for one step (what a
    ledger gathered over ranks shows, per step); under ZeRO each data-parallel rank's own rows."""
    out: dict[tuple[str, str], dict] = {}
    for flows, weight in _rank_flows(model, layout, work):
        for fl in flows:
            add_weighted(out, (fl.dim, fl.op), fl, weight)
    return out


def _rank_flows(model: PlanModel, layout: Layout, work: Workload):
    """(flows of one rank, how many ranks have them) covering every rank once."""
    L = layout
    n = L.dp * L.cp
    ranks_per_stage = L.gpus // L.pp
    per_dp = L.zero_spec.shards_states and n > 1 and L.tp > 1
    for j in range(L.pp):
        if per_dp:
            yield from ((stage_flows(model, L, work, j, r), ranks_per_stage // n) for r in range(n))
        else:
            yield stage_flows(model, L, work, j), ranks_per_stage


def add_weighted(out: dict, key: tuple, fl: Flow, weight: int) -> None:
    row = out.setdefault(key, {"calls": 0, "message_bytes": 0.0, "bytes_sent": 0.0})
    row["calls"] += fl.calls * weight
    row["message_bytes"] += fl.message_bytes * weight
    row["bytes_sent"] += fl.bytes_sent * weight
