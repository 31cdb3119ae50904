"""A layout to plan: degrees, ZeRO stage, schedule, recompute; the workload; the rules they must obey.

`Layout` mirrors the runtime's `ParallelConfig` (tp, pp, dp, cp, ep, zero, sp_mode, order, schedule,
vpp, microbatches) and adds what only the planner chooses: the micro-batch size, activation recompute
and a Llama-3 style uneven pipeline split. `Workload` holds what does not depend on the layout:
sequence length, global batch (in sequences), dtypes, flash attention, FP8 dispatch, capacity factor.
`from_config(cfg)` builds both from a runtime `Config`, so the planner and a real run describe the
same thing.

`check(model, layout, workload, gpus)` raises `ConfigError` naming the broken rule and the nearest
valid values, like `Config.validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ..config import DIMS, SCHEDULES, Config, ConfigError, divisors, nearest
from .models import PlanModel, cached_hash

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "fp8": 1}
RECOMPUTE = ("none", "selective", "full")
CP_MODES = ("ring", "ulysses")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False               # Megatron sequence parallel (with tp > 1)
    cp_mode: str = "ring"          # "ring" attention or "ulysses" all-to-all, when cp > 1
    vpp: int = 1
    micro_batch: int = 1           # sequences per micro-batch per data-parallel rank
    schedule: str = "1f1b"
    recompute: str = "none"
    order: str = "tp-cp-ep-dp-pp"
    uneven: bool = False           # Llama-3 split: first and last stage one layer fewer
    bucket_mb: float = 25.0        # DDP / ZeRO-1/2 bucket size (sets where flat buffers are padded)
    reshard: bool = True           # ZeRO-3: free gathered parameters after forward (False: keep them to backward)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: experts are sharded over ep ranks carved out of dp·cp."""
        return self.dp * self.cp // self.ep

    @property
    def sp_mode(self) -> str:
        if self.cp > 1:
            return self.cp_mode
        return "megatron" if self.sp and self.tp > 1 else "none"

    def short(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}{'u' if self.cp_mode == 'ulysses' else ''}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"z{self.zero}")
        if self.sp and self.tp > 1:
            parts.append("sp")
        if self.vpp > 1:
            parts.append(f"v{self.vpp}")
        parts.append(f"mb{self.micro_batch}")
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep, "zero": self.zero,
                "sp_mode": self.sp_mode, "vpp": self.vpp, "micro_batch": self.micro_batch,
                "schedule": self.effective_schedule, "recompute": self.recompute, "order": self.order,
                "uneven": self.uneven}

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
    grad_dtype: str = "fp32"       # gradient accumulation: "fp32" main grads, or "param" (= dtype)
    flash: bool = True             # flash attention: no s^2 score matrix stored
    fp8_dispatch: bool = False     # MoE dispatch all-to-all in FP8 (combine stays in dtype)
    capacity_factor: float = 1.0   # MoE tokens per expert relative to perfect balance
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
    return work.global_batch // (layout.dp * layout.micro_batch)


def from_config(cfg: Config) -> tuple[Layout, Workload]:
    """The layout and workload of a runtime `Config` (non-flash math attention, as the runtime runs)."""
    p, t = cfg.parallel, cfg.train
    per_dp = t.global_batch // p.dp
    layout = Layout(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, zero=p.zero, sp=p.sp_mode == "megatron",
                    cp_mode="ulysses" if p.sp_mode == "ulysses" else "ring", vpp=p.vpp,
                    micro_batch=max(per_dp // p.microbatches, 1), schedule=p.schedule, order=p.order,
                    bucket_mb=p.bucket_mb, reshard=p.reshard_after_forward, uneven=p.partition == "llama3",
                    recompute=t.recompute)
    work = Workload(seq=t.seq_len, global_batch=t.global_batch, dtype=t.dtype, flash=False)
    return layout, work


# -- rules ---------------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def valid_tp(model: PlanModel) -> list[int]:
    """tp values that split heads, kv heads (or replicate them evenly) and every MLP width."""
    ok = []
    for d in divisors(model.heads):
        if not model.mla and model.kv_heads % d and d % model.kv_heads:
            continue
        if model.ffn % d or (model.moe and model.moe_ffn % d):
            continue
        ok.append(d)
    return tuple(ok)


def check(model: PlanModel, layout: Layout, work: Workload, gpus: int | None = None) -> None:
    """Raise ConfigError for the first rule the layout breaks, naming it and the nearest valid values."""
    L = layout
    for name in ("tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch"):
        if getattr(L, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(L, name)}")
    if gpus is not None and L.gpus != gpus:
        rest = L.tp * L.pp * L.cp
        raise ConfigError(f"GPU count {gpus} must equal tp*cp*dp*pp = {L.tp}*{L.cp}*{L.dp}*{L.pp} = {L.gpus}; "
                          f"{'with the other degrees fixed dp = ' + str(gpus // rest) if gpus % rest == 0 else f'tp*cp*pp = {rest} does not divide {gpus}; valid tp*cp*pp: {nearest(rest, divisors(gpus))}'}")
    if L.zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero must be one of 0, 1, 2, 3 (ZeRO stage), got {L.zero}")
    if L.recompute not in RECOMPUTE:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {L.recompute!r}")
    if L.schedule not in SCHEDULES + ("interleaved",):
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {L.schedule!r}")
    if L.cp_mode not in CP_MODES:
        raise ConfigError(f"cp mode must be one of {', '.join(CP_MODES)}, got {L.cp_mode!r}")
    if sorted(L.order.split("-")) != sorted(DIMS):
        raise ConfigError(f"order must name each of {', '.join(DIMS)} once, innermost first, got {L.order!r}")
    ok_tp = list(valid_tp(model))
    if L.tp not in ok_tp:
        raise ConfigError(f"tp ({L.tp}) must divide heads ({model.heads}), divide kv_heads ({model.kv_heads}) or be a "
                          f"multiple of it, and divide the MLP widths ({model.ffn}"
                          f"{', ' + str(model.moe_ffn) if model.moe else ''}); valid tp: {nearest(L.tp, ok_tp)}")
    if model.layers < L.pp * L.vpp:
        ok = [d for d in range(1, model.layers + 1) if d * L.vpp <= model.layers]
        raise ConfigError(f"layers ({model.layers}) must be >= pp*vpp = {L.pp}*{L.vpp}: each (virtual) stage needs "
                          f"a layer; valid pp: {nearest(L.pp, ok)}")
    if L.uneven and L.pp > 1 and model.layers + 2 < 3 * L.pp:
        raise ConfigError(f"an uneven (Llama-3) split needs layers + 2 >= 3*pp so no stage is empty; "
                          f"valid pp: {nearest(L.pp, [d for d in range(1, model.layers) if model.layers + 2 >= 3 * d])}")
    if L.cp > 1:
        if L.cp_mode == "ring" and work.seq % (2 * L.cp):
            ok = [d for d in divisors(work.seq) if work.seq % (2 * d) == 0]
            raise ConfigError(f"ring attention splits the sequence in 2*cp zig-zag chunks: seq ({work.seq}) must "
                              f"divide by 2*cp = {2 * L.cp}; valid cp: {nearest(L.cp, ok)}")
        if L.cp_mode == "ulysses":
            n = L.tp * L.cp
            if model.heads % n:
                ok = divisors(model.heads // L.tp if model.heads % L.tp == 0 else 1)
                raise ConfigError(f"Ulysses gives each of tp*cp = {n} ranks whole heads: heads ({model.heads}) must "
                                  f"divide by tp*cp; valid cp: {nearest(L.cp, ok)}")
            if work.seq % L.cp:
                raise ConfigError(f"seq ({work.seq}) must divide by cp ({L.cp}); valid cp: "
                                  f"{nearest(L.cp, divisors(work.seq))}")
    if L.ep > 1 and not model.moe:
        raise ConfigError(f"ep ({L.ep}) needs a mixture-of-experts model; {model.name} is dense: valid ep: [1]")
    if model.moe:
        if model.experts % L.ep:
            raise ConfigError(f"experts ({model.experts}) must divide by ep ({L.ep}); valid ep: "
                              f"{nearest(L.ep, [d for d in divisors(model.experts) if (L.dp * L.cp) % d == 0])}")
        if (L.dp * L.cp) % L.ep:
            raise ConfigError(f"ep ({L.ep}) must divide dp*cp ({L.dp * L.cp}): experts are sharded across data/"
                              f"context-parallel ranks; valid ep: {nearest(L.ep, divisors(L.dp * L.cp))}")
    per = L.dp * L.micro_batch
    if work.global_batch % per:
        ok = nearest(work.global_batch, [k * per for k in range(1, work.global_batch // per + 3)])
        raise ConfigError(f"global batch ({work.global_batch} sequences) must divide by dp*micro_batch = "
                          f"{L.dp}*{L.micro_batch} = {per}; valid global batches: {ok}")
    m = microbatches(L, work)
    if L.pp > 1 and m < L.pp and L.effective_schedule != "gpipe":
        raise ConfigError(f"schedule {L.effective_schedule} needs microbatches >= pp ({L.pp}), got "
                          f"{m} = global_batch/(dp*micro_batch); valid micro_batch: "
                          f"{[d for d in divisors(work.global_batch // L.dp) if work.global_batch // (L.dp * d) >= L.pp][-3:]}")


def with_(layout: Layout, **kw) -> Layout:
    return replace(layout, **kw)
