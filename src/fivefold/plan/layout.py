"""A layout to plan: degrees, ZeRO stage, schedule, recompute; the workload; the rules they must obey.

`Layout` uses the runtime's names (`ParallelConfig` and `TrainConfig`): tp, pp, dp, cp, ep, zero,
sp_mode, cp_mode, order, schedule, vpp, partition, bucket_mb, reshard_after_forward, recompute. One
name differs in kind: the runtime counts `microbatches` per step, the planner chooses `micro_batch`, the
sequences in one micro-batch of one data-parallel rank; `microbatches(layout, work)` is the count,
global_batch / (dp · micro_batch). `Workload` holds what does not depend on the layout: sequence length,
global batch (in sequences), dtypes, flash attention, FP8 dispatch, capacity factor. `from_config(cfg)`
builds both from a runtime `Config`, so the planner and a real run describe the same thing: the layout
from one table, `LAYOUT_SOURCES`, giving each `Layout` field its source (a `ParallelConfig` or
`TrainConfig` field copied, a value computed from some, or the planner's own choice), with
`PARALLEL_ELSEWHERE` placing the `ParallelConfig` fields no layout field is made from
(tests/unit/test_plan_layout_fields.py keeps both whole as either class gains a field).

Mechanism options (docs/plan.md, "Mechanisms"): `Layout.overlap_grad_reduce` (a stage's bucketed
gradient reduction starts during each chunk's last backward, as Megatron-Core and FSDP do; False: when
the stage's schedule has ended, as the runtime does under a pipeline), `Layout.overlap_param_gather`
(ZeRO-1/2's updated parameters gathered behind the next step's first forwards), `Layout.ep_overlap` (expert
all-to-alls overlap another micro-batch's compute, DualPipe-style), `Workload.reduce_dtype` (the dtype
gradients are reduced in), `Workload.moe_route_nodes` (node-limited routing: each token to at most M
nodes), `Workload.fp8_gemm` (linear-layer GEMMs at the FP8 peak), `Workload.fp8_act_cache` (inputs
of the linear layers cached in FP8 for the backward), `Layout.microbatch_group` (the interleaved
schedule's micro-batches per group N, p..m; 0: p; with schedule, vpp and partition it is the runtime's
`Schedule` value, `schedule_of`), `Layout.recompute_norm_mla` (norms' outputs and MLA
up-projections recomputed in the backward, DeepSeek-V3) and `Layout.offload` (ZeRO's optimizer state and
step in host memory or on disk; docs/plan.md, "Offload").

`check(model, layout, workload, gpus)` raises `ConfigError` naming the broken rule and the nearest
valid values; the rules are `fivefold.rules`', the ones `Config.validate` applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Callable, Literal

from .. import rules
from ..config import Config
from ..grid import DEFAULT_ORDER, check_grids_agree, parse_order
from ..parallel.zero.spec import ZeroSpec
from ..rules import (DUALPIPE, INTERLEAVED, ONE_F_ONE_B, ConfigError, CpMode, Offload, PlannedScheduleKind, Recompute,
                     SpMode, ZeroStage)
from ..parallel.pipeline.spec import Schedule
from .models import PlanModel, cached_hash

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "fp8": 1}
GradDtype = Literal["fp32", "param"]   # gradient accumulation: fp32 main grads, or the weights' dtype
ReduceDtype = Literal["fp32", "bf16", "fp16"]   # gradient reduction over dp/edp: full precision or 16-bit


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: ZeroStage = 0
    sp_mode: SpMode = "none"       # "megatron": Megatron sequence parallelism (with tp > 1)
    etp: int = 1                   # expert tensor parallelism: ranks splitting each routed expert's width
    cp_mode: CpMode = "ring"       # how cp > 1 splits attention: ulysses | ring | hybrid
    ulysses: int = 0               # hybrid: Ulysses degree of the inner ranks (0: the largest possible)
    vpp: int = 1
    micro_batch: int = 1           # sequences per micro-batch per data-parallel rank (a size, not a count)
    schedule: PlannedScheduleKind = ONE_F_ONE_B   # with vpp, microbatch_group, partition: `schedule_of`
                                   # (rules.check_schedule); "dualpipe": planned only (plan/dualpipe.py)
    recompute: Recompute = "none"
    order: str = DEFAULT_ORDER
    partition: str = "even"        # layers to stages, as parallel.partition: even | llama3 | counts "3,5,5,3"
    bucket_mb: float = 25.0        # DDP / ZeRO-1/2 bucket size (sets where flat buffers are padded)
    reshard_after_forward: bool = True   # ZeRO-3: free gathered parameters after forward (False: keep them)
    zero_prefetch: int = 1               # ZeRO-3 without pp: units gathered ahead of the one running
    overlap_grad_reduce: bool = True     # buckets reduced as each chunk's last backward makes them final
                                         # (Megatron-Core, FSDP; the runtime's parallel.overlap_grad_reduce);
                                         # False: after the stage's schedule ends (without pp: always on)
    reduce_each_microbatch: bool = False  # ZeRO-2/3 under pp: reduce-scatter every micro-batch's gradients and
                                          # accumulate the shard (FSDP without no_sync): 1/d of the gradient
                                          # kept, m x the traffic; False: accumulate the full gradient, reduce once
    overlap_param_gather: bool = True    # ZeRO-1/2: the updated parameters gathered behind the next step's
                                         # first forwards (Megatron-Core); False: at the step's end (runtime)
    ep_overlap: bool = False             # MoE all-to-alls overlap another micro-batch's compute (DualPipe)
    tp_overlap: bool = True              # tp's input collectives overlap the column-parallel GEMMs beside them
                                         # (the runtime's parallel.tp_overlap; rules.overlaps_tp_input)
    head_first: bool = False             # the final norm, LM head and MTP modules on the first stage with the
                                         # embedding (DualPipe's placement, DeepSeek-V3 §3.2.1/§3.2.3); False: last
    microbatch_group: int = 0            # interleaved: micro-batches per group N, pp <= N <= m (0: pp, depth-
                                         # first; Llama 3 §3.3.2, Megatron-Core microbatch_group_size_per_vp_stage)
    recompute_norm_mla: bool = False     # norms' outputs and MLA up-projections recomputed in the backward:
                                         # MLA keeps its latents, not Q/K/V (DeepSeek-V3 §3.4)
    offload: Offload = "none"            # ZeRO's optimizer shards (fp32 masters, Adam moments) and step: on the
                                         # device, in host memory ("cpu", ZeRO-Offload) or on disk ("nvme",
                                         # ZeRO-Infinity); docs/plan.md "Offload"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: the experts' etp × ep × edp grid folds over tp·cp·dp (grid.py)."""
        return rules.expert_data_parallel(self.tp, self.cp, self.dp, self.ep, self.etp)

    @property
    def experts_folded(self) -> bool:
        """Whether the routed experts are on the expert grid (rules.experts_on_expert_grid: ep or etp > 1):
        their own units and gradients over edp; else they are dense weights."""
        return rules.experts_on_expert_grid(self.ep, self.etp)

    @property
    def seq_parallel(self) -> bool:
        """Whether activations between blocks are split over tp (Megatron SP with tp > 1)."""
        return self.sp_mode == "megatron" and self.tp > 1

    @cached_property
    def zero_spec(self) -> ZeroSpec:
        """ZeRO's composition (stage, pipeline, reduce policy, offload, resharding), the value the runtime's
        engine is built from (parallel/zero/spec.py)."""
        return ZeroSpec.of(self)

    def short(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}{'' if self.cp_mode == 'ring' else self.cp_mode[0]}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        parts.append(f"z{self.zero}")
        if self.seq_parallel:
            parts.append("sp")
        if self.vpp > 1:
            parts.append(f"v{self.vpp}")
            if self.microbatch_group:
                parts.append(f"n{self.microbatch_group}")
        if self.partition != "even" and self.pp > 1:
            parts.append(self.partition)
        parts.append(f"mb{self.micro_batch}")
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.recompute_norm_mla:
            parts.append("rc-norm-mla")
        if self.ep_overlap and self.ep > 1:
            parts.append("a2a-overlap")
        if self.head_first and self.pp > 1:
            parts.append("head-first")
        if self.schedule == DUALPIPE and self.pp > 1:
            parts.append("dualpipe")
        if not self.overlap_grad_reduce:
            parts.append("reduce-after")
        if self.reduce_each_microbatch and self.pp > 1:
            parts.append("reduce-each-mb")
        if not self.overlap_param_gather and self.zero_spec.shards_states and not self.zero_spec.shards_params:
            parts.append("gather-after")
        if self.offload != "none":
            parts.append(f"offload-{self.offload}")
        if not self.tp_overlap and self.tp > 1:
            parts.append("tp-blocking")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep, "etp": self.etp, "zero": self.zero,
                "sp_mode": self.sp_mode, "cp_mode": self.cp_mode, "vpp": self.vpp, "micro_batch": self.micro_batch,
                "schedule": self.schedule, "recompute": self.recompute, "order": self.order,
                "partition": self.partition, "bucket_mb": self.bucket_mb,
                "reshard_after_forward": self.reshard_after_forward, "zero_prefetch": self.zero_prefetch,
                "overlap_grad_reduce": self.overlap_grad_reduce, "overlap_param_gather": self.overlap_param_gather,
                "ep_overlap": self.ep_overlap, "tp_overlap": self.tp_overlap, "head_first": self.head_first,
                "microbatch_group": self.microbatch_group,
                "recompute_norm_mla": self.recompute_norm_mla, "reduce_each_microbatch": self.reduce_each_microbatch,
                "offload": self.offload}

    @property
    def interleaved(self) -> bool:
        """Chunks interleaved over the ranks (`Schedule.interleaved`; vpp > 1 needs it: rules.check_schedule)."""
        return self.schedule == INTERLEAVED and self.vpp > 1


@dataclass(frozen=True)
class Workload:
    seq: int = 4096
    global_batch: int = 512        # sequences per optimizer step
    dtype: str = "bf16"            # parameters and activations
    grad_dtype: GradDtype = "fp32"  # gradient accumulation: "fp32" main grads, or "param" (= dtype)
    optimizer_dtype: str = "fp32"  # Adam's moments: "fp32" (the master dtype, with a master copy of 16-bit weights;
                                   # the runtime's AdamW, Megatron's optimizers), or "bf16": both moments in bf16
                                   # and no master copy (Apex DistributedFusedAdam dtype=bf16, store_params=False)
    flash: bool = True             # flash attention: no s^2 score matrix stored
    fp8_dispatch: bool = False     # MoE dispatch all-to-all in FP8 (combine stays in dtype)
    capacity_factor: float = 1.0   # MoE tokens per expert relative to perfect balance (0: dropless,
                                   # planned as perfect balance); capacity groups are sequences (rules.py)
    efficiency: float = 0.6        # fraction of peak FLOP/s the compute kernels reach (GEMMs by shape: at most)
    gemm: str = "shape"            # "shape": GEMM time by roofline and per-kernel floor (plan/gemm.py); "flat"
    causal: bool = True
    reduce_dtype: ReduceDtype = "fp32"   # dp/edp gradient reduction: "fp32" = the main-gradient precision
                                         # (the runtime's main_grads_fp32; fp64 for an fp64 model), or 16-bit
    moe_route_nodes: int = 0       # node-limited routing (DeepSeek-V3): each token's experts on at most this
                                   # many nodes, sent once per node then forwarded over NVLink (0: off)
    fp8_gemm: bool = False         # linear-layer GEMMs (forward, dgrad, wgrad) at the accelerator's FP8 peak;
                                   # attention, embedding and LM head stay in dtype (DeepSeek-V3 §3.3)
    fp8_act_cache: bool = False    # linear-layer inputs cached in FP8 for the backward (activations.py applies it)
    fused_optimizer: bool = True   # the optimizer reads and writes each state once (False: the runtime's eager
                                   # AdamW and grad norm, rules.EAGER_ADAMW_ACCESSES passes)
    backend: str = "nccl"          # whose collective algorithms send the bytes (comm/volume.py ALGORITHMS): "nccl"
                                   # on GPUs, "gloo" for CPU ranks (fivefold's reduce-scatter there: pairwise)
    framework: str = "fivefold"    # whose process the plan is for: its device reserve (plan/reserve.py FRAMEWORKS)
    ds_bucket: float = 0.0         # DeepSpeed's allgather_bucket_size = reduce_bucket_size, elements (framework
                                   # deepspeed; 0: its default, plan/reserve.py DEEPSPEED_BUCKET)
    document_length: float = 0.0   # train.document_mask: attention stays inside each packed document of this
                                   # token-weighted mean length, sum(len^2)/sum(len) of the pieces a sequence
                                   # holds (0: no mask; attention spans the sequence)

    def __hash__(self) -> int:     # hashed often as a cache key: compute once
        return cached_hash(self)

    @property
    def attention_span(self) -> float:
        """The keys a query's attention row spans before the causal halving: the sequence, or with
        document masking the document (at most the sequence). A document of L tokens costs L²/2 causal
        pairs, so a sequence's attention work is the sum over its documents of len²/2 = (tokens) ·
        span/2 with span = sum(len²)/sum(len) (`document_length`)."""
        return min(self.document_length, self.seq) if self.document_length else self.seq

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def master_bytes(self) -> int:
        """fp32 master/optimizer math (fp64 when the model is fp64)."""
        return 8 if self.dtype == "fp64" else 4

    @property
    def grad_bytes(self) -> int:
        return self.param_bytes if self.grad_dtype == "param" else max(self.master_bytes, self.param_bytes)

    @property
    def reduce_bytes(self) -> int:
        """Bytes per gradient element in the dp/edp reduction: the master precision (fp32; fp64 for an fp64
        model) or 2 for a 16-bit reduction. Bucket sizes still follow the accumulation dtype (grad_bytes)."""
        return self.master_bytes if self.reduce_dtype == "fp32" else DTYPE_BYTES[self.reduce_dtype]

    @property
    def tokens(self) -> int:
        return self.seq * self.global_batch


def microbatches(layout: Layout, work: Workload) -> int:
    """Micro-batches per step (the runtime's `parallel.microbatches`)."""
    return work.global_batch // (layout.dp * layout.micro_batch)


def schedule_of(model: PlanModel, layout: Layout, work: Workload) -> Schedule:
    """The pipeline `Schedule` the layout runs: the value `Schedule.of(cfg)` gives the runtime. DualPipe,
    which the runtime does not run, gives the one-way 1F1B schedule of the stages its ranks hold (their
    layers; plan/dualpipe.py prices the two directions)."""
    kind = ONE_F_ONE_B if layout.schedule == DUALPIPE else layout.schedule
    return Schedule.build(kind, layout.pp, layout.vpp, microbatches(layout, work),
                          layout.microbatch_group, model.layers, layout.partition)


# -- where each field comes from ---------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """Where `from_config` takes one `Layout` field from. `reads` names config fields ("parallel.tp",
    "train.recompute"); `make` computes the value from them, in that order (None: the one field read is
    copied). With no reads, `make` gives the value the runtime always runs (`why` says so); with neither,
    the field is the planner's own choice, which a runtime config leaves at its default (`why`)."""

    reads: tuple[str, ...] = ()
    make: Callable[..., Any] | None = None
    why: str = ""

    @property
    def planner_only(self) -> bool:
        return not self.reads and self.make is None

    def value(self, cfg: Config) -> Any:
        args = [getattr(getattr(cfg, part), name) for part, _, name in (key.partition(".") for key in self.reads)]
        return self.make(*args) if self.make is not None else args[0]


def _copy(key: str) -> Source:
    return Source((key,))


# Every `Layout` field and its source; tests/unit/test_plan_layout_fields.py fails when a field of `Layout` has
# no row here, or a `ParallelConfig` field is neither read here nor placed in PARALLEL_ELSEWHERE.
LAYOUT_SOURCES: dict[str, Source] = {
    **{name: _copy(f"parallel.{name}") for name in (
        "tp", "pp", "dp", "cp", "ep", "etp", "zero", "sp_mode", "cp_mode", "ulysses", "vpp", "schedule", "order",
        "partition", "bucket_mb", "reshard_after_forward", "reduce_each_microbatch", "microbatch_group",
        "offload", "zero_prefetch")},
    "micro_batch": Source(("train.global_batch", "parallel.dp", "parallel.microbatches"),
                          lambda batch, dp, count: batch // (dp * count),
                          "the runtime counts micro-batches; the planner sizes one: global_batch / (dp · count)"),
    "recompute": _copy("train.recompute"),
    "overlap_grad_reduce": Source(("parallel.pp", "parallel.overlap_grad_reduce"), lambda pp, on: pp == 1 or on,
                                  "a chunk's buckets reduced after its last backward (pp = 1: the one backward)"),
    "overlap_param_gather": Source(make=lambda: False, why="the runtime gathers ZeRO-1/2's updated parameters "
                                                           "at the step's end"),
    "tp_overlap": Source(("parallel.pp", "parallel.schedule", "parallel.tp_overlap"), rules.overlaps_tp_input,
                         "on unless parallel.tp_overlap is off or the zb schedule splits the backward"),
    "ep_overlap": Source(why="DualPipe-style all-to-all overlap: a mechanism the planner weighs, not the runtime"),
    "head_first": Source(why="DualPipe's placement of head and MTP with the embedding: planned; the runtime keeps "
                             "them on the last stage"),
    "recompute_norm_mla": Source(why="DeepSeek-V3's norm/MLA recompute: planned, the runtime recomputes by "
                                     "train.recompute only"),
}

# `ParallelConfig` fields no `Layout` field is made from, and where each goes instead.
PARALLEL_ELSEWHERE: dict[str, str] = {
    "fp8_dispatch": "Workload.fp8_dispatch: how the dispatched tokens are encoded, not where ranks sit",
    "offload_dir": "the run's folder for offload = nvme; the planner writes no files",
    "ranks_per_node": "the machine's shape: plan.topology's nodes and tiers, not the layout",
}


def from_config(cfg: Config, backend: str | None = None) -> tuple[Layout, Workload]:
    """The layout and workload of a runtime `Config`: the layout field by field from LAYOUT_SOURCES.
    The collectives' backend (`Workload.backend`): `backend`, else NCCL for train.device = "cuda" and gloo
    otherwise (the dry run, whose fake process group stands for a GPU run, passes "nccl").
    Attention is flash-like, as the runtime runs it: SDPA takes its fused kernels on the CPU
    (`_scaled_dot_product_flash_attention_for_cpu`, with or without a mask) and on CUDA (flash or
    memory-efficient), and ring attention saves only q, k, v, o and the log-sum-exp, so no s x s scores
    are stored (`Workload.flash`). The micro-batch size is global_batch / (dp · microbatches), exact for a
    config that validates."""
    p, t = cfg.parallel, cfg.train
    rules.check_global_batch(t.global_batch, p.dp, p.microbatches)
    layout = Layout(**{name: src.value(cfg) for name, src in LAYOUT_SOURCES.items() if not src.planner_only})
    # the runtime reduces in the accumulation dtype: fp32 main grads, or the weights' dtype without them
    full = t.main_grads_fp32 or t.dtype in ("fp32", "fp64")
    work = Workload(seq=t.seq_len, global_batch=t.global_batch, dtype=t.dtype, flash=True,
                    capacity_factor=cfg.model.capacity_factor,   # 0: dropless (balanced routing assumed)
                    fp8_dispatch=cfg.parallel.fp8_dispatch, grad_dtype="fp32" if t.main_grads_fp32 else "param",
                    reduce_dtype="fp32" if full else t.dtype, fused_optimizer=False,
                    backend=backend or ("nccl" if t.device == "cuda" else "gloo"))
    return layout, work


# -- rules ---------------------------------------------------------------------------------------
def mlp_widths(model: PlanModel) -> dict[str, int]:
    """The MLP widths tensor parallelism splits (routed experts' are etp's, shared experts stay whole)."""
    return {"ffn": model.ffn}


@lru_cache(maxsize=256)
def valid_tp(model: PlanModel) -> tuple[int, ...]:
    """tp values that split heads, kv heads (or replicate them evenly) and every MLP width."""
    return tuple(rules.valid_tp(model.heads, None if model.mla else model.kv_heads, mlp_widths(model)))


def check(model: PlanModel, layout: Layout, work: Workload, gpus: int | None = None) -> None:
    """Raise ConfigError for the first rule the layout breaks, naming it and the nearest valid values."""
    L = layout
    for name in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "micro_batch"):
        rules.check_positive(name, getattr(L, name))
    if gpus is not None:
        rules.check_world_size(gpus, L.tp, L.cp, L.dp, L.pp)
    for name, kind in (("zero", ZeroStage), ("sp_mode", SpMode), ("cp_mode", CpMode),
                       ("schedule", PlannedScheduleKind), ("recompute", Recompute)):
        rules.check_choice(name, getattr(L, name), kind)
    parse_order(L.order)
    check_grids_agree(L, L.order)
    rules.check_tensor_parallel(L.tp, model.heads, None if model.mla else model.kv_heads, mlp_widths(model))
    rules.check_sequence_parallel(L.sp_mode, L.tp, work.seq)
    rules.check_partition(model.layers, L.pp, L.vpp, L.partition)
    rules.check_context_parallel(L.cp_mode, L.cp, L.tp, model.heads, work.seq, L.ulysses)
    rules.check_expert_parallel(L.ep, L.dp, L.cp, model.experts, L.tp, L.etp, model.moe_ffn)
    rules.check_global_batch(work.global_batch, L.dp, L.micro_batch, what="micro_batch")
    if L.schedule == DUALPIPE:
        rules.check_dualpipe(L.pp, L.vpp, microbatches(L, work))
    else:
        rules.check_schedule(L.schedule, L.pp, L.vpp, microbatches(L, work), L.microbatch_group)
    check_mechanisms(model, L, work)


def check_route_nodes(model: PlanModel, work: Workload) -> None:
    """Node-limited routing (`moe_route_nodes`): an integer >= 0, and only for a model with experts."""
    r = work.moe_route_nodes
    if type(r) is not int or r < 0:
        raise ConfigError(f"moe_route_nodes must be an integer >= 0 (0: routing not node-limited), got {r!r}")
    if r and not model.moe:
        raise ConfigError(f"moe_route_nodes={r} limits expert routing, but {model.name} has no experts")


def check_mechanisms(model: PlanModel, layout: Layout, work: Workload) -> None:
    """The mechanism options (docs/plan.md "Mechanisms") take values that mean something."""
    rules.check_choice("reduce_dtype", work.reduce_dtype, ReduceDtype)
    for obj, name in ((layout, "overlap_grad_reduce"), (layout, "overlap_param_gather"), (layout, "ep_overlap"),
                      (layout, "head_first"), (layout, "recompute_norm_mla"), (layout, "tp_overlap"), (layout, "reduce_each_microbatch"), (work, "fp8_gemm"), (work, "fp8_act_cache")):
        if type(getattr(obj, name)) is not bool:
            raise ConfigError(f"{name} must be true or false, got {getattr(obj, name)!r}")
    check_route_nodes(model, work)
    if layout.head_first and layout.schedule == DUALPIPE:
        raise ConfigError("head_first moves the head and MTP modules to the first stage under a one-way schedule; "
                          "dualpipe places them with the embedding itself (each rank holds stages j and pp-1-j); "
                          "valid: head_first false with schedule dualpipe")
    if layout.head_first and (layout.pp == 1 or layout.vpp > 1):
        raise ConfigError(f"head_first places the head and MTP modules on the first of several stages without "
                          f"virtual stages (DualPipe's placement); got pp={layout.pp}, vpp={layout.vpp}; valid: "
                          f"pp > 1 with vpp 1, or head_first false")
    rules.check_reduce_each_microbatch(layout.reduce_each_microbatch, layout.zero)
    rules.check_choice("offload", layout.offload, Offload)
    # the planner writes no files: the offload_dir rule is the run's (Config.validate), not the plan's
    rules.check_offload(layout.offload, layout.zero, offload_dir="(planned)")
