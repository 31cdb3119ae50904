"""Configuration: what model, which parallel layout, how to train.

Three dataclasses (`ModelConfig`, `ParallelConfig`, `TrainConfig`) grouped in `Config`. They load from a
TOML file with one table per part::

    [model]
    hidden = 256
    layers = 4
    [parallel]
    dp = 2
    [train]
    steps = 100

and take overrides from the command line (`--dp 2`, `--steps 10`, ...). `Config.validate(world_size)`
checks every rule at start and raises `ConfigError` naming the rule and the nearest valid values, so a
bad layout fails before any process waits on another.
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration breaks a rule; the message names the rule and suggests valid values."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest(value: int, candidates: list[int], k: int = 3) -> list[int]:
    """The k candidates closest to value, in ascending order."""
    return sorted(sorted(candidates, key=lambda c: (abs(c - value), c))[:k])


@dataclass
class ModelConfig:
    """A Llama-style decoder. MoE fields are used when `experts > 0`."""

    vocab: int = 256
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 352
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq: int = 256
    init_std: float = 0.02
    dropout: float = 0.0          # residual dropout after attention and MLP (0: off, as in Llama)
    # Mixture of experts (room for the expert-parallel issue): 0 experts means a dense model.
    experts: int = 0
    top_k: int = 2
    moe_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        """Parameters of the dense model (each tied weight counted once)."""
        h, f, v = self.hidden, self.ffn, self.vocab
        kv = self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h
        mlp = 3 * h * f
        per_layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + embed + h

    def validate(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ConfigError(
                f"model.hidden ({self.hidden}) must divide by model.heads ({self.heads}); "
                f"valid heads: {nearest(self.heads, divisors(self.hidden))}")
        if self.head_dim % 2:
            raise ConfigError(f"head dim hidden/heads = {self.head_dim} must be even for RoPE")
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model.heads ({self.heads}) must divide by model.kv_heads ({self.kv_heads}) for GQA; "
                f"valid kv_heads: {nearest(self.kv_heads, divisors(self.heads))}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"model.top_k ({self.top_k}) must be between 1 and model.experts ({self.experts})")


SP_MODES = ("none", "megatron", "ulysses", "ring")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
DIMS = ("tp", "cp", "ep", "dp", "pp")
RECOMPUTE = ("none", "full", "selective")


@dataclass
class ParallelConfig:
    """Degrees of the five parallelisms and how ranks are ordered.

    world = tp * cp * dp * pp. Expert parallelism is carved out of dp * cp (as in Megatron-Core):
    ep must divide dp * cp, and the expert data-parallel degree is dp * cp / ep.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp_mode: str = "none"
    order: str = "tp-cp-ep-dp-pp"
    microbatches: int = 1
    schedule: str = "1f1b"
    vpp: int = 1
    bucket_mb: float = 25.0
    reshard_after_forward: bool = True   # ZeRO-3: free gathered params after forward (False: keep them)
    partition: str = "even"              # layers to pipeline stages: even | llama3 | counts "3,5,5,3"

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def validate(self, world_size: int | None = None) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "microbatches", "vpp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero must be one of 0, 1, 2, 3 (ZeRO stage), got {self.zero}")
        if self.sp_mode not in SP_MODES:
            raise ConfigError(f"parallel.sp_mode must be one of {', '.join(SP_MODES)}, got {self.sp_mode!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        dims = self.order.split("-")
        if sorted(dims) != sorted(DIMS):
            raise ConfigError(
                f"parallel.order must name each of {', '.join(DIMS)} once, innermost first "
                f"(default 'tp-cp-ep-dp-pp'), got {self.order!r}")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(
                f"parallel.ep ({self.ep}) must divide dp*cp ({self.dp * self.cp}): experts are sharded across "
                f"data/context-parallel ranks; valid ep: {nearest(self.ep, divisors(self.dp * self.cp))}")
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(
                f"world size {world_size} must equal tp*cp*dp*pp = {self.tp}*{self.cp}*{self.dp}*{self.pp} "
                f"= {self.world_size}; with the other degrees fixed, dp = {world_size / (self.tp * self.cp * self.pp):g} "
                f"(valid world sizes near {world_size}: "
                f"{nearest(world_size, [k * self.tp * self.cp * self.pp for k in range(1, 2 * world_size + 2)])})")


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "fp32"
    main_grads_fp32: bool = True          # bf16 compute: accumulate and reduce gradients in fp32
    data: list[str] = field(default_factory=list)
    data_limit_mb: float = 8.0
    out: str = "runs/latest"
    log_every: int = 1
    checkpoint: bool = True
    recompute: str = "none"               # activation checkpointing: none | full | selective

    def validate(self) -> None:
        if self.dtype not in ("fp32", "bf16", "fp64"):
            raise ConfigError(f"train.dtype must be 'fp32', 'bf16' or 'fp64' (for exactness checks), got {self.dtype!r}")
        for name in ("steps", "global_batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= train.min_lr <= train.lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup < 0:
            raise ConfigError(f"train.warmup must be >= 0, got {self.warmup}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"train.recompute must be one of {', '.join(RECOMPUTE)} (full: recompute each pipeline "
                              f"chunk in backward; selective: only the attention core), got {self.recompute!r}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self, world_size: int | None = None) -> "Config":
        """Check every rule; raise ConfigError naming the first broken one."""
        m, p, t = self.model, self.parallel, self.train
        m.validate()
        p.validate(world_size)
        t.validate()
        if t.seq_len > m.max_seq:
            raise ConfigError(f"train.seq_len ({t.seq_len}) must be <= model.max_seq ({m.max_seq}); "
                              f"raise model.max_seq or use seq_len {m.max_seq}")
        per = p.dp * p.microbatches
        if t.global_batch % per:
            ok = nearest(t.global_batch, [k * per for k in range(1, t.global_batch // per + 3)])
            raise ConfigError(
                f"train.global_batch ({t.global_batch}) must divide by dp*microbatches = {p.dp}*{p.microbatches} "
                f"= {per}; valid global batches: {ok}")
        if p.tp > 1:
            if m.heads % p.tp:
                raise ConfigError(f"model.heads ({m.heads}) must divide by tp ({p.tp}); valid tp: "
                                  f"{nearest(p.tp, divisors(m.heads))}")
            if m.kv_heads % p.tp and p.tp % m.kv_heads:
                ok = [d for d in divisors(m.heads) if m.kv_heads % d == 0 or d % m.kv_heads == 0]
                raise ConfigError(f"tp ({p.tp}) must divide kv_heads ({m.kv_heads}) or be a multiple of it; "
                                  f"valid tp: {nearest(p.tp, ok)}")
            if m.ffn % p.tp:
                raise ConfigError(f"model.ffn ({m.ffn}) must divide by tp ({p.tp}); valid tp: "
                                  f"{nearest(p.tp, divisors(m.ffn))}")
            if p.sp_mode == "megatron" and t.seq_len % p.tp:
                raise ConfigError(f"sequence parallelism splits the sequence over tp: train.seq_len ({t.seq_len}) "
                                  f"must divide by tp ({p.tp}); valid seq_len: "
                                  f"{nearest(t.seq_len, [k * p.tp for k in range(1, t.seq_len // p.tp + 3)])}")
        if p.pp > 1 and m.layers < p.pp * p.vpp:
            raise ConfigError(f"model.layers ({m.layers}) must be >= pp*vpp = {p.pp * p.vpp}: each (virtual) "
                              f"stage needs a layer; valid pp: {[d for d in range(1, m.layers + 1) if d * p.vpp <= m.layers][-3:]}")
        if p.pp > 1 and p.microbatches < p.pp and p.schedule != "gpipe":
            raise ConfigError(f"schedule {p.schedule} needs microbatches >= pp ({p.pp}), got {p.microbatches}")
        if p.cp > 1 and t.seq_len % (2 * p.cp):
            raise ConfigError(f"train.seq_len ({t.seq_len}) must divide by 2*cp = {2 * p.cp}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Config":
        cfg = Config()
        for part in ("model", "parallel", "train"):
            apply_overrides(cfg, {f"{part}.{k}": v for k, v in d.get(part, {}).items()})
        unknown = set(d) - {"model", "parallel", "train"}
        if unknown:
            raise ConfigError(f"unknown config tables {sorted(unknown)}; valid tables: model, parallel, train")
        return cfg


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Set dotted keys like 'parallel.dp' on cfg, converting to each field's type."""
    for key, value in overrides.items():
        if value is None:
            continue
        part, _, name = key.partition(".")
        obj = getattr(cfg, part, None)
        if obj is None or not dataclasses.is_dataclass(obj):
            raise ConfigError(f"unknown config table {part!r}; valid tables: model, parallel, train")
        fields = {f.name: f for f in dataclasses.fields(obj)}
        if name not in fields:
            raise ConfigError(f"unknown key {key!r}; valid keys in [{part}]: {', '.join(sorted(fields))}")
        current = getattr(obj, name)
        setattr(obj, name, _convert(value, current, key))
    return cfg


def _convert(value: Any, current: Any, key: str) -> Any:
    try:
        if isinstance(current, bool):
            if isinstance(value, str):
                return value.lower() in ("1", "true", "yes", "on")
            return bool(value)
        if isinstance(current, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if isinstance(current, float):
            return float(value)
        if isinstance(current, list):
            return list(value) if isinstance(value, (list, tuple)) else [value]
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be of type {type(current).__name__}, got {value!r}") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read a TOML file (or start from the defaults) and apply dotted-key overrides."""
    cfg = Config()
    if path is not None:
        with open(path, "rb") as f:
            cfg = Config.from_dict(tomllib.load(f))
    return apply_overrides(cfg, overrides or {})
