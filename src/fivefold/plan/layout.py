"""A layout to plan: degrees, ZeRO stage, schedule, recompute; the workload; the rules they must obey.

`Layout` uses the runtime's names (`ParallelConfig` and `TrainConfig`): tp, pp, dp, cp, ep, zero,
sp_mode, cp_mode, order, schedule, vpp, partition, bucket_mb, reshard_after_forward, recompute. One
name differs in kind: the runtime counts `microbatches` per step, the planner chooses `micro_batch`, the
sequences in one micro-batch of one data-parallel rank; `microbatches(layout, work)` is the count,
global_batch / (dp · micro_batch). `Workload` holds what does not depend on the layout: sequence length,
global batch (in sequences), dtypes, flash attention, FP8 dispatch, capacity factor. `from_config(cfg)`
builds both from a runtime `Config`, so the planner and a real run describe the same thing.

`check(model, layout, workload, gpus)` raises `ConfigError` naming the broken rule and the nearest
valid values; the rules are `fivefold.rules`', the ones `Config.validate` applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from .. import rules
from ..config import Config
from ..grid import DEFAULT_ORDER, parse_order
from ..rules import CpMode, Recompute, Schedule, SpMode, ZeroStage
from .models import PlanModel, cached_hash

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "fp8": 1}
GradDtype = Literal["fp32", "param"]   # gradient accumulation: fp32 main grads, or the weights' dtype


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: ZeroStage = 0
    sp_mode: SpMode = "none"       # "megatron": Megatron sequence parallelism (with tp > 1)
    cp_mode: CpMode = "ring"       # how cp > 1 splits attention: ulysses | ring | hybrid
    ulysses: int = 0               # hybrid: Ulysses degree of the inner ranks (0: the largest possible)
    vpp: int = 1
    micro_batch: int = 1           # sequences per micro-batch per data-parallel rank (a size, not a count)
    schedule: Schedule = "1f1b"
    recompute: Recompute = "none"
    order: str = DEFAULT_ORDER
    partition: str = "even"        # layers to stages, as parallel.partition: even | llama3 | counts "3,5,5,3"
    bucket_mb: float = 25.0        # DDP / ZeRO-1/2 bucket size (sets where flat buffers are padded)
    reshard_after_forward: bool = True   # ZeRO-3: free gathered parameters after forward (False: keep them)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: experts are sharded over ep ranks carved out of dp·cp."""
        return self.dp * self.cp // self.ep

    @property
    def seq_parallel(self) -> bool:
        """Whether activations between blocks are split over tp (Megatron SP with tp > 1)."""
        return self.sp_mode == "megatron" and self.tp > 1

    def short(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}{'' if self.cp_mode == 'ring' else self.cp_mode[0]}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"z{self.zero}")
        if self.seq_parallel:
            parts.append("sp")
        if self.vpp > 1:
            parts.append(f"v{self.vpp}")
        if self.partition != "even" and self.pp > 1:
            parts.append(self.partition)
        parts.append(f"mb{self.micro_batch}")
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep, "zero": self.zero,
                "sp_mode": self.sp_mode, "cp_mode": self.cp_mode, "vpp": self.vpp, "micro_batch": self.micro_batch,
                "schedule": self.effective_schedule, "recompute": self.recompute, "order": self.order,
                "partition": self.partition, "bucket_mb": self.bucket_mb,
                "reshard_after_forward": self.reshard_after_forward}

    @property
    def effective_schedule(self) -> str:
        if self.vpp > 1 and self.schedule in ("1f1b", "interleaved"):
            return "interleaved"
        return "1f1b" if self.schedule == "interleaved" and self.vpp == 1 else self.schedule


@dataclass(frozen=True)
class Workload:
    seq: int = 4096
    global_batch: int = 512        # sequences per optimizer step
    dtype: str = "bf16"            # parameters and activations
    grad_dtype: GradDtype = "fp32"  # gradient accumulation: "fp32" main grads, or "param" (= dtype)
    flash: bool = True             # flash attention: no s^2 score matrix stored
    fp8_dispatch: bool = False     # MoE dispatch all-to-all in FP8 (combine stays in dtype)
    capacity_factor: float = 1.0   # MoE tokens per expert relative to perfect balance (0: dropless,
                                   # planned as perfect balance); capacity groups are sequences (rules.py)
    efficiency: float = 0.6        # fraction of peak FLOP/s the compute kernels reach
    causal: bool = True

    def __hash__(self) -> int:     # hashed often as a cache key: compute once
        return cached_hash(self)

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
    def tokens(self) -> int:
        return self.seq * self.global_batch


def microbatches(layout: Layout, work: Workload) -> int:
    """Micro-batches per step (the runtime's `parallel.microbatches`)."""
    return work.global_batch // (layout.dp * layout.micro_batch)


def from_config(cfg: Config) -> tuple[Layout, Workload]:
    """The layout and workload of a runtime `Config` (non-flash math attention, as the runtime runs).
    The micro-batch size is global_batch / (dp · microbatches), exact for a config that validates."""
    p, t = cfg.parallel, cfg.train
    rules.check_global_batch(t.global_batch, p.dp, p.microbatches)
    layout = Layout(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, zero=p.zero, sp_mode=p.sp_mode,
                    cp_mode=p.cp_mode, ulysses=p.ulysses, vpp=p.vpp, micro_batch=t.global_batch // (p.dp * p.microbatches), schedule=p.schedule,
                    recompute=t.recompute, order=p.order, partition=p.partition, bucket_mb=p.bucket_mb,
                    reshard_after_forward=p.reshard_after_forward)
    work = Workload(seq=t.seq_len, global_batch=t.global_batch, dtype=t.dtype, flash=False,
                    capacity_factor=cfg.model.capacity_factor,   # 0: dropless (balanced routing assumed)
                    fp8_dispatch=cfg.parallel.fp8_dispatch)
    return layout, work


# -- rules ---------------------------------------------------------------------------------------
def mlp_widths(model: PlanModel) -> dict[str, int]:
    """The MLP widths tensor parallelism splits."""
    return {"ffn": model.ffn, "moe_ffn": model.moe_ffn} if model.moe else {"ffn": model.ffn}


@lru_cache(maxsize=256)
def valid_tp(model: PlanModel) -> tuple[int, ...]:
    """tp values that split heads, kv heads (or replicate them evenly) and every MLP width."""
    return tuple(rules.valid_tp(model.heads, None if model.mla else model.kv_heads, mlp_widths(model)))


def check(model: PlanModel, layout: Layout, work: Workload, gpus: int | None = None) -> None:
    """Raise ConfigError for the first rule the layout breaks, naming it and the nearest valid values."""
    L = layout
    for name in ("tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch"):
        rules.check_positive(name, getattr(L, name))
    if gpus is not None:
        rules.check_world_size(gpus, L.tp, L.cp, L.dp, L.pp)
    for name, kind in (("zero", ZeroStage), ("sp_mode", SpMode), ("cp_mode", CpMode), ("schedule", Schedule),
                       ("recompute", Recompute)):
        rules.check_choice(name, getattr(L, name), kind)
    parse_order(L.order)
    rules.check_tensor_parallel(L.tp, model.heads, None if model.mla else model.kv_heads, mlp_widths(model))
    rules.check_sequence_parallel(L.sp_mode, L.tp, work.seq)
    rules.check_partition(model.layers, L.pp, L.vpp, L.partition)
    rules.check_context_parallel(L.cp_mode, L.cp, L.tp, model.heads, work.seq, L.ulysses)
    rules.check_expert_parallel(L.ep, L.dp, L.cp, model.experts)
    rules.check_global_batch(work.global_batch, L.dp, L.micro_batch, what="micro_batch")
    rules.check_microbatches(L.effective_schedule, L.pp, microbatches(L, work))
