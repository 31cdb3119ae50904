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
bad layout fails before any process waits on another. The rules themselves live in `fivefold.rules`
(shared with the mesh, the runtime and the planner); choice fields are typed with its `Literal`s, and
overrides are converted strictly by those types (`--set train.checkpoint=ture` is an error). Every
float-typed field must also be finite (`--set train.lr=nan` is an error), and each part's `validate`
checks the ranges of its numbers (betas in [0, 1), eps > 0, ...).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Literal

from . import rules
from .grid import DEFAULT_ORDER, check_grids_agree, parse_order
from .rules import (ONE_F_ONE_B, ConfigError, CpMode, Device, Dtype, LrSchedule, Offload, RecordOverflow, Records,
                    Recompute, RouterKind, ScheduleKind,
                    SpMode, ZeroStage, check_choice, choices, divisors, nearest)

__all__ = ["Config", "ConfigError", "ModelConfig", "ParallelConfig", "TrainConfig", "apply_overrides",
           "divisors", "field_doc", "field_type", "load_config", "nearest"]


# Upper bounds of the model's sizes: far past any model trained so far (Llama 3 405B: 126 layers, hidden
# 16384, vocab 128256), low enough that a typo (or a crafted file) cannot make a loop over the layers or
# a shape computation run for hours before anything is allocated.
MODEL_LIMITS = {"vocab": 2**31, "hidden": 2**20, "layers": 2**16, "heads": 2**14, "kv_heads": 2**14, "ffn": 2**24,
                "max_seq": 2**30, "experts": 2**16, "moe_ffn": 2**24, "shared_experts": 2**10, "dense_layers": 2**16, "attn_head_dim": 2**14,
                "q_lora_rank": 2**20, "kv_lora_rank": 2**20, "qk_nope_dim": 2**14, "qk_rope_dim": 2**14,
                "v_head_dim": 2**14}
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim")


class HeadShapes:
    """The per-head widths of a decoder's attention and which layers are MoE, from its fields (hidden,
    heads, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim, experts, dense_layers): stated once for the
    runtime's `ModelConfig` and the planner's `PlanModel` (plan/models.py)."""

    @property
    def head_dim(self) -> int:
        """Per-head width of grouped-query attention's q, k and v: `attn_head_dim` when set (Qwen3: 128 for
        any hidden), else hidden / heads."""
        return self.attn_head_dim or self.hidden // self.heads

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys (MLA: nope + rope)."""
        return self.qk_nope_dim + self.qk_rope_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """Per-head width of values and of the attention output."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dims RoPE rotates per head (MLA: the rope part only)."""
        return self.qk_rope_dim if self.mla else self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.experts > 0 and i >= self.dense_layers


class ParameterCounts:
    """How many parameters a decoder of this shape has: the one formula for the runtime's `ModelConfig`
    (what it builds) and the planner's `PlanModel` (which also describes GPT-3's variants). Reads the
    shape fields and the variants `mlp` ("swiglu": gate, up, down; "gelu": up, down), `norm` ("rms": a
    weight; "layer": weight and bias), `linear_bias`, `learned_pos`, `router_bias` (a per-expert bias
    counted as a parameter) and `expert_ffn` (one routed expert's width); ModelConfig states its
    variants as class constants (the only architecture it builds). Tied weights count once."""

    def _norm(self, width: int) -> int:
        return width * (2 if self.norm == "layer" else 1)

    def _linear(self, n_in: int, n_out: int, bias: bool = False) -> int:
        return n_in * n_out + (n_out if (bias or self.linear_bias) else 0)

    def attention_params(self) -> int:
        h = self.hidden
        if self.mla:
            q = (self._linear(h, self.q_lora_rank) + self.q_lora_rank
                 + self._linear(self.q_lora_rank, self.heads * self.qk_head_dim)) if self.q_lora_rank \
                else self._linear(h, self.heads * self.qk_head_dim)
            kv = (self._linear(h, self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank
                  + self._linear(self.kv_lora_rank, self.heads * (self.qk_nope_dim + self.v_head_dim)))
            return q + kv + self._linear(self.heads * self.v_head_dim, h)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (self._linear(h, q, self.qkv_bias) + 2 * self._linear(h, kv, self.qkv_bias)
                + self._linear(q, h) + self.qk_norm_params())

    def qk_norm_params(self) -> int:
        """Qwen3's q and k norms: one RMSNorm weight of the head dim each (whole on every tp rank)."""
        return 2 * self._norm(self.head_dim) if self.qk_norm and not self.mla else 0

    def mlp_params(self, width: int) -> int:
        h = self.hidden
        if self.mlp == "gelu":
            return self._linear(h, width) + self._linear(width, h)
        return 2 * self._linear(h, width) + self._linear(width, h)

    def expert_params(self) -> int:
        """One routed (or shared) expert."""
        return self.mlp_params(self.expert_ffn)

    def router_params(self) -> int:
        """The router (and Qwen2-MoE's shared-expert gate): whole on every tensor-parallel rank."""
        gate = self.hidden if self.shared_expert_gate else 0
        return self.experts * self.hidden + (self.experts if self.router_bias else 0) + gate

    def layer_params(self, i: int, experts_held: int | None = None) -> int:
        """Parameters of layer i; `experts_held` routed experts instead of all (expert parallelism)."""
        base = self.attention_params() + 2 * self._norm(self.hidden)
        if not self.is_moe_layer(i):
            return base + self.mlp_params(self.ffn)
        e = self.experts if experts_held is None else experts_held
        return base + self.router_params() + (self.shared_experts + e) * self.expert_params()

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden + (self.max_seq * self.hidden if self.learned_pos else 0)

    @property
    def head_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied to the embedding)."""
        return self._norm(self.hidden) + (0 if self.tie_embeddings else self.vocab * self.hidden)

    def num_params(self) -> int:
        """Total parameters, tied weights once."""
        return self.embed_params + sum(self.layer_params(i) for i in range(self.layers)) + self.head_params


@dataclass
class ModelConfig(HeadShapes, ParameterCounts):
    """A Llama-style decoder. MoE fields are used when `experts > 0` (model/moe.py explains each), MLA
    fields when `kv_lora_rank > 0` (multi-head latent attention, model/latent_attention.py)."""

    vocab: int = 256              # token ids 0..vocab-1 (a tokenizer sets it: train.tokenizer)
    hidden: int = 128             # the residual stream's width
    layers: int = 4               # transformer blocks
    heads: int = 4                # attention (query) heads
    kv_heads: int = 2             # key/value heads (grouped-query attention: heads / kv_heads queries share one)
    ffn: int = 352                # the dense SwiGLU's hidden width
    rope_theta: float = 10000.0   # the rotary embedding's base (Llama 3: 500000)
    norm_eps: float = 1e-5        # RMSNorm's epsilon
    tie_embeddings: bool = True   # the LM head is the token embedding's transpose
    max_seq: int = 256            # the longest sequence the model takes (train.seq_len <= max_seq)
    init_std: float = 0.02        # the seeded init's standard deviation (output projections / sqrt(2 layers))
    dropout: float = 0.0          # residual dropout after attention and MLP (0: off, as in Llama)
    # Mixture of experts: 0 experts means a dense model.
    experts: int = 0              # routed experts per MoE layer
    top_k: int = 2                # experts per token
    moe_ffn: int = 0              # hidden width of one expert (0: ffn)
    shared_experts: int = 0       # always-on experts, run as one SwiGLU of width shared_experts * moe_ffn
    dense_layers: int = 0         # the first dense_layers layers keep the dense SwiGLU of width ffn
    router: RouterKind = "softmax_topk_norm"   # Mixtral | Qwen2-MoE (not renormalised) | DeepSeek-V3
    router_groups: int = 0        # group-limited routing: experts in this many consecutive groups (0: off)
    router_group_limit: int = 0   # group-limited routing: a token chooses only from its best this-many groups
    capacity_factor: float = 0.0  # per-sequence expert capacity ceil(factor*seq*top_k/experts) (0: dropless)
    random_routing: bool = False  # GShard: the 2nd expert gets a token with probability 2*w2/(w1+w2) (top_k 2)
    aux_loss_coef: float = 0.01   # Switch/GShard load-balance loss (softmax routers)
    z_loss_coef: float = 0.0      # ST-MoE router z-loss
    shared_expert_gate: bool = False   # Qwen2-MoE: shared output times sigmoid(Linear(h, 1))
    bias_update_rate: float = 0.001    # sigmoid_bias: expert-bias step per update (DeepSeek-V3's gamma)
    qkv_bias: bool = False        # Qwen2 / Qwen2-MoE: biases on the q, k, v projections
    attn_head_dim: int = 0        # per-head width of q, k, v (0: hidden / heads; Qwen3 sets 128 whatever hidden)
    qk_norm: bool = False         # Qwen3: an RMSNorm over each head's q and k (weights of the head dim) before RoPE
    routed_scaling_factor: float = 1.0   # routed experts' weights times this (DeepSeek-V3: 2.5)
    # Multi-head latent attention (DeepSeek-V2/V3): kv_lora_rank > 0 turns it on (0: GQA)
    q_lora_rank: int = 0          # query latent width (0: a plain q projection, as DeepSeek-V2-Lite)
    kv_lora_rank: int = 0         # key/value latent width
    qk_nope_dim: int = 0          # per-head query/key dims without RoPE
    qk_rope_dim: int = 0          # per-head query/key dims with RoPE (the key's one shared by all heads)
    v_head_dim: int = 0           # per-head value dim
    rope_interleave: bool = True  # MLA: RoPE dims in interleaved pairs (DeepSeek's layout; false: rotate-half)

    # the architecture the runtime builds, in the planner's names (ParameterCounts reads them; plan/models.py
    # PLAN_ONLY takes a runtime model's values from here): SwiGLU MLPs, RMSNorm, no biases beside Qwen2's
    # q/k/v, rotary positions, sequential residuals; the sigmoid router's expert bias is a buffer (no
    # parameter)
    mlp: ClassVar[str] = "swiglu"
    norm: ClassVar[str] = "rms"
    linear_bias: ClassVar[bool] = False
    learned_pos: ClassVar[bool] = False
    parallel_residual: ClassVar[bool] = False
    router_bias: ClassVar[bool] = False

    @property
    def expert_ffn(self) -> int:
        """Hidden width of one routed (or shared) expert."""
        return self.moe_ffn or self.ffn

    def validate_mla(self) -> None:
        """Latent attention: positive rope/nope/value dims, an even rope part (RoPE rotates pairs), one K/V
        head per query head (the up-projection makes per-head K and V), no q/k/v biases."""
        for name in ("qk_nope_dim", "qk_rope_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1 with latent attention (model.kv_lora_rank "
                                  f"{self.kv_lora_rank}); DeepSeek-V3: qk_nope_dim 128, qk_rope_dim 64, v_head_dim 128")
        if self.qk_rope_dim % 2:
            raise ConfigError(f"model.qk_rope_dim ({self.qk_rope_dim}) must be even (RoPE rotates pairs); "
                              f"valid: {self.qk_rope_dim - 1} or {self.qk_rope_dim + 1}")
        if self.kv_heads != self.heads:
            raise ConfigError(f"model.kv_heads ({self.kv_heads}) must equal model.heads ({self.heads}) with latent "
                              f"attention (every head gets its own up-projected K and V); valid kv_heads: {self.heads}")
        if self.qkv_bias:
            raise ConfigError("model.qkv_bias is not supported with latent attention (model.kv_lora_rank > 0); "
                              "valid: qkv_bias false")

    def validate(self) -> None:
        _check_choices(self, "model")
        _check_finite(self, "model")
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq"):
            rules.check_count(f"model.{name}", getattr(self, name), 1, MODEL_LIMITS[name])
        for name in ("experts", "moe_ffn", "shared_experts", "dense_layers", "attn_head_dim"):
            rules.check_count(f"model.{name}", getattr(self, name), 0, MODEL_LIMITS[name])
        for name in MLA_FIELDS:
            rules.check_count(f"model.{name}", getattr(self, name), 0, MODEL_LIMITS[name])
        if self.mla:
            self.validate_mla()
            if self.attn_head_dim or self.qk_norm:
                raise ConfigError("model.attn_head_dim and model.qk_norm shape grouped-query attention (Qwen3); latent "
                                  "attention (kv_lora_rank > 0) has its own head dims: valid: 0 and false with MLA")
        else:
            if any(getattr(self, name) for name in MLA_FIELDS):
                set_ = ", ".join(f"{n}={getattr(self, n)}" for n in MLA_FIELDS if getattr(self, n))
                raise ConfigError(f"model.{set_.split('=')[0]} is a latent-attention (MLA) size but model.kv_lora_rank "
                                  f"is 0 (MLA off); valid: kv_lora_rank >= 1, or {set_} set to 0")
            rules.check_attention(self.hidden, self.heads, self.kv_heads, self.attn_head_dim)
        _check_above_zero("model.routed_scaling_factor", self.routed_scaling_factor, "1, DeepSeek-V3: 2.5")
        _check_unit("model.dropout", self.dropout, "0: off")
        for name, typical in (("rope_theta", "10000 or 500000"), ("norm_eps", "1e-5 or 1e-6"), ("init_std", "0.02")):
            _check_above_zero(f"model.{name}", getattr(self, name), typical)
        for name in ("experts", "moe_ffn", "shared_experts", "dense_layers", "router_groups", "router_group_limit",
                     "capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            _check_at_least_zero(f"model.{name}", getattr(self, name))
        if not self.experts:
            return
        rules.check_moe_routing(self.experts, self.top_k, self.router_groups, self.router_group_limit)
        rules.check_random_routing(self.random_routing, self.top_k, self.router)
        if self.dense_layers > self.layers:
            raise ConfigError(f"model.dense_layers ({self.dense_layers}) counts the first layers that stay dense: "
                              f"valid dense_layers: 0..{self.layers}")
        if self.shared_expert_gate and not self.shared_experts:
            raise ConfigError("model.shared_expert_gate gates the shared experts' output: it needs "
                              "model.shared_experts >= 1; valid: shared_experts >= 1, or shared_expert_gate false")


@dataclass
class ParallelConfig:
    """Degrees of the five parallelisms and how ranks are ordered.

    world = tp * cp * dp * pp. The expert layers fold over the same ranks (MoE parallel folding, as in
    Megatron-Core): a stage's tp * cp * dp ranks are re-cut into etp * ep * edp, so etp * ep must divide
    tp * cp * dp and the expert data-parallel degree is tp * cp * dp / (etp * ep) (grid.py).
    """

    dp: int = 1                          # data-parallel degree: ranks that each take their share of a step's sequences
    tp: int = 1                          # tensor-parallel degree (Megatron: heads and MLP columns split)
    pp: int = 1                          # pipeline stages
    cp: int = 1                          # context-parallel degree: each rank holds seq_len / cp tokens of every sequence
    ep: int = 1                          # expert-parallel degree (MoE): experts spread over ep ranks, folded over the
                                         # tp x cp x dp ranks (etp x ep must divide them)
    etp: int = 1                         # expert tensor-parallel degree (MoE): each routed expert's width split over
                                         # etp ranks (1: whole experts)
    zero: ZeroStage = 0                  # ZeRO stage: 1 optimizer state, 2 also gradients, 3 also parameters sharded
                                         # over dp (0: plain data parallelism)
    sp_mode: SpMode = "none"             # Megatron sequence parallelism inside the tp group
    cp_mode: CpMode = "ring"             # how cp > 1 splits attention: Ulysses all-to-all, ring attention, or both
                                         # (hybrid)
    ulysses: int = 0                     # hybrid: Ulysses degree of the inner ranks (0: the largest possible)
    fp8_dispatch: bool = False           # MoE: send the expert-parallel dispatch in float8 e4m3 (+ a scale a row)
    order: str = DEFAULT_ORDER           # rank order, innermost (fastest-varying, nearest) dimension first
    microbatches: int = 1                # micro-batches per step on each data-parallel rank: a count (the planner's
                                         # --micro-batch-size is a size)
    schedule: ScheduleKind = ONE_F_ONE_B  # pipeline schedule (pp > 1): gpipe, 1f1b, interleaved (vpp > 1), zb (zero
                                         # bubble: backward split into input and weight gradients)
    vpp: int = 1                         # virtual pipeline stages (model chunks) per rank: the interleaved schedule
    microbatch_group: int = 0            # interleaved: micro-batches per group N, pp <= N <= microbatches (0: pp)
    bucket_mb: float = 25.0              # gradient bucket size in MiB (all-reduce / reduce-scatter overlapped with
                                         # the backward that fills it)
    overlap_grad_reduce: bool = True     # pp: reduce a chunk's gradients after its last backward (False: at the end)
    reduce_each_microbatch: bool = False  # ZeRO-2/3 under pp: reduce-scatter every micro-batch, keep only the shard
    reshard_after_forward: bool = True   # ZeRO-3: free gathered params after forward (False: keep them)
    zero_prefetch: int = 1               # ZeRO-3 without pp: units gathered ahead of the one running, 0-16 (deeper
                                         # hides slower gathers and holds more of them)
    tp_overlap: bool = True              # tp: each part's input collective overlaps its column GEMMs
                                         # (parallel/tensor_overlap.py; off under zb with pp > 1)
    partition: str = "even"              # layers to pipeline stages: even | llama3 | counts "3,5,5,3"
    offload: Offload = "none"            # ZeRO's optimizer shards and step: on the device | cpu (host) | nvme (files)
    offload_dir: str = ""                # offload = nvme: the folder for the files (scratch, rebuilt at start)
    ranks_per_node: int = 0              # ranks per node (0: unknown, one node); under torchrun its LOCAL_WORLD_SIZE

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def validate(self, world_size: int | None = None) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "etp", "microbatches", "vpp"):
            rules.check_positive(f"parallel.{name}", getattr(self, name))
        rules.check_zero_prefetch(self.zero_prefetch)
        _check_choices(self, "parallel")
        _check_finite(self, "parallel")
        _check_above_zero("parallel.bucket_mb", self.bucket_mb, "25")
        parse_order(self.order)
        rules.check_expert_grid(self.ep, self.dp, self.cp, self.tp, self.etp)
        check_grids_agree(self, self.order)
        rules.check_offload(self.offload, self.zero, self.offload_dir)
        if world_size is not None:
            rules.check_world_size(world_size, self.tp, self.cp, self.dp, self.pp)
        rules.check_ranks_per_node(self.ranks_per_node, self.world_size)


@dataclass
class TrainConfig:
    """The optimiser, the data, and how a run logs, checkpoints and survives bad steps."""

    steps: int = 200                      # optimizer steps the run trains to (a resumed run continues to this step)
    global_batch: int = 16                # sequences per optimizer step, over all data-parallel ranks
    seq_len: int = 128                    # tokens per sequence (<= model.max_seq)
    lr: float = 3e-3                      # peak learning rate (linear warmup over train.warmup steps, then
                                          # train.lr_schedule to train.min_lr)
    min_lr: float = 3e-4                  # learning rate at the last step (cosine, linear, wsd)
    warmup: int = 20                      # steps of linear warmup from lr / warmup to lr
    warmup_ratio: float = 0.0             # transformers' warmup_ratio: warmup = ceil(ratio x steps) steps, in place of
                                          # train.warmup (0: train.warmup)
    lr_schedule: LrSchedule = "cosine"   # after warmup: cosine | linear to min_lr, constant, or wsd (stable, then
                                          # linear to min_lr over the last train.decay_fraction of the steps); or
                                          # transformers' hf_linear, hf_cosine, constant_with_warmup (its warmup
                                          # from lr 0 at step 0, its decay to 0: min_lr unused), as get_scheduler
    decay_fraction: float = 0.2           # wsd: the share of the steps after warmup that decays
    weight_decay: float = 0.1             # decoupled weight decay (AdamW) of 2-D+ weights; norms and biases never
                                          # decay, embeddings unless train.decay_embeddings=false
    decay_embeddings: bool = True         # weight decay also on the token embedding and an untied LM head
    beta1: float = 0.9                    # AdamW's first-moment decay
    beta2: float = 0.95                   # AdamW's second-moment decay
    eps: float = 1e-8                     # AdamW's epsilon
    grad_clip: float = 1.0                # clip the global gradient norm to this (0: no clipping)
    seed: int = 1234                      # seed of the init, the data order, dropout and MoE random routing
    dtype: Dtype = "fp32"                 # compute dtype (bf16 keeps fp32 master weights and main gradients)
    main_grads_fp32: bool = True          # bf16 compute: accumulate and reduce gradients in fp32
    data: list[str] = field(default_factory=list)   # text files, or token files (fivefold tokenize's, .u16/.bin,
                                          # .u32, .npy) (none: the embedded default corpus)
    data_limit_mb: float = 8.0            # text data: read at most this many MiB (0: no limit)
    tokenizer: str = ""                   # a Hugging Face tokenizer.json or tiktoken BPE file ("": UTF-8 bytes);
                                          # model.vocab follows it unless set
    out: str = "runs/latest"              # run folder (metrics.jsonl, comm.json, run.json, checkpoints/); never
                                          # written over without --resume or --overwrite
    log_every: int = 0                    # steps between progress lines when stderr is not a terminal (0: ~20 a run)
    checkpoint: bool = True               # write checkpoints at all
    checkpoint_every: int = 100           # steps between periodic checkpoints (0: only at the end)
    keep_checkpoints: int = 2             # newest complete checkpoints kept on disk
    skip_nonfinite: bool = True           # skip an optimizer step whose loss or gradient norm is NaN/inf
    max_skips: int = 5                    # stop the run after this many consecutive skipped steps
    recompute: Recompute = "none"         # activation recomputation, any layout (parallel/recompute.py): full keeps
                                          # each block's input (each chunk's under the zb schedule with pp > 1),
                                          # selective each attention core's q, k, v
    device: Device = "auto"               # auto: CUDA under torchrun on a GPU machine, else the CPU
    compile: bool = False                 # torch.compile each transformer block in place (after parallelize)
    tensorboard: bool = False             # rank 0 also writes the console line's scalars to OUT/tensorboard/
    wandb: bool = False                   # rank 0 also writes them to Weights & Biases (WANDB_MODE=offline: no
                                          # network; the [wandb] extra)
    wandb_project: str = "fivefold"       # the W&B project of train.wandb
    calibration: str = "local.toml"       # CPU runs: `fivefold calibrate`'s topology, whose peak gives MFU (missing: no MFU)
    init_hf: str = ""                     # start from a Hugging Face folder (save_pretrained's: its config.json sets
                                          # [model], its safetensors are read slice by slice into each rank's
                                          # shards, its tokenizer becomes the run's; "": the seeded init). It
                                          # changes defaults: without train.lr the run fine-tunes at 5e-5 with
                                          # min_lr a tenth of lr; with lr below the default min_lr, min_lr = lr/10
    eos: str = ""                         # the tokenizer's end-of-text token, put after each text document and where
                                          # generate stops ("": found by name; none: no such token)
    bos: str = ""                         # a start-of-text token put before each text document ("": none)
    eval_data: list[str] = field(default_factory=list)   # evaluation files, read like train.data (or
                                          # train.eval_fraction: a held-out tail of the data)
    eval_fraction: float = 0.0            # evaluate on this last fraction of the training tokens, held out (0: none)
    eval_every: int = 0                   # steps between evaluations, and one at the end (0: no evaluation)
    eval_tokens: int = 65536              # tokens one evaluation covers (whole global batches of windows)
    records: Records = "stream"           # how records (a token file's documents) fill rows: stream (windows cut
                                          # anywhere), padded (a record a row, padded), packed (best-fit decreasing,
                                          # needs train.document_mask); never a record across rows but in stream
    record_overflow: RecordOverflow = "truncate"   # padded / packed: a record past seq_len + 1 tokens is cut to
                                          # them or dropped (counted on the console and in run.json)
    loss_mask: bool = True                # train only the tokens instruction data marks (assistant turns, completions:
                                          # TRL's assistant_only_loss / completion_only_loss); false: every token,
                                          # the loss over the whole conversation
    document_mask: bool = False           # attention stays inside each packed document, positions restart per
                                          # document (Llama 3 §3.2; needs document boundaries: model/documents.py)
    keep_best: bool = False               # checkpoint each evaluation that lowers the eval loss and keep the best
                                          # one beside keep_checkpoints (OUT/best.json names it)
    stop_after: int = 0                   # stop after this many evaluations without a lower eval loss (0: never)
    lora_rank: int = 0                    # LoRA: train rank-r adapters on train.lora_targets and freeze every other
                                          # weight (model/lora.py; 0: no LoRA; typical 8-64)
    lora_alpha: float = 16.0              # LoRA: the adapters' output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0             # LoRA: dropout on the adapters' input
    lora_targets: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo", "gate", "up", "down"])
                                          # LoRA: which linear layers of each block get adapters (ours, or Hugging
                                          # Face's q_proj ... down_proj)
    freeze: list[str] = field(default_factory=list)   # freeze the parameters whose names match these patterns
                                          # (fnmatch: 'embed.*' 'layers.0.*'): no gradient, no optimizer state, no
                                          # data-parallel traffic

    @property
    def warmup_steps(self) -> int:
        """The steps of warmup: ceil(warmup_ratio x steps) with a ratio (transformers' rule), else warmup."""
        return math.ceil(self.warmup_ratio * self.steps) if self.warmup_ratio > 0 else self.warmup

    def validate(self) -> None:
        _check_choices(self, "train")
        _check_finite(self, "train")
        for name in ("steps", "global_batch", "seq_len", "keep_checkpoints", "max_skips"):
            rules.check_positive(f"train.{name}", getattr(self, name))
        uses_min_lr = self.lr_schedule not in ("hf_linear", "hf_cosine", "constant_with_warmup")   # transformers': to 0
        if self.lr <= 0 or self.min_lr < 0 or (uses_min_lr and self.min_lr > self.lr):
            raise ConfigError(f"need 0 <= train.min_lr <= train.lr and lr > 0, got lr={self.lr:g}, min_lr={self.min_lr:g}"
                              f" (the default min_lr is {TrainConfig.min_lr:g}); valid: --min-lr from 0 to the lr, "
                              f"e.g. --min-lr {max(self.lr, 0) / 10:g}")
        for name, note in (("warmup", ""), ("weight_decay", ""), ("grad_clip", "0: no clipping"),
                           ("data_limit_mb", "0: no limit"), ("log_every", "0: about 20 lines a run"),
                           ("checkpoint_every", "0: only at the end")):
            _check_at_least_zero(f"train.{name}", getattr(self, name), note)
        _check_unit("train.decay_fraction", self.decay_fraction, "typical: 0.1-0.2")
        _check_unit("train.warmup_ratio", self.warmup_ratio, "0: train.warmup; typical 0.03-0.1")
        if self.records == "packed" and not self.document_mask:
            raise ConfigError("train.records = packed puts several records in a row: attention must stay inside "
                              "each (train.document_mask); valid: document_mask true, or records padded")
        _check_unit("train.beta1", self.beta1, "typical: 0.9")
        _check_unit("train.beta2", self.beta2, "typical: 0.95 or 0.999")
        _check_above_zero("train.eps", self.eps, "1e-8")
        self.validate_eval()
        self.validate_lora()

    def validate_lora(self) -> None:
        """LoRA's rank >= 0 (0: off), alpha > 0, dropout in [0, 1), known targets; freeze patterns are
        strings (each must match a parameter: checked against the model, model/lora.py)."""
        _check_at_least_zero("train.lora_rank", self.lora_rank, "0: no LoRA; typical: 8-64")
        _check_above_zero("train.lora_alpha", self.lora_alpha, "typical: 2 x lora_rank")
        _check_unit("train.lora_dropout", self.lora_dropout, "typical: 0-0.1")
        if self.lora_rank:
            rules.check_lora_targets(self.lora_targets)
        if any(not isinstance(p, str) or not p for p in self.freeze):
            raise ConfigError(f"train.freeze lists parameter name patterns, got {self.freeze!r}; e.g. "
                              f"[\"embed.*\", \"layers.0.*\"]")

    def validate_eval(self) -> None:
        """Evaluation: eval_every, eval_tokens >= 0 / > 0, eval_fraction in [0, 1), one source at most,
        and one when evaluations run."""
        _check_at_least_zero("train.eval_every", self.eval_every, "0: no evaluation")
        rules.check_positive("train.eval_tokens", self.eval_tokens)
        _check_unit("train.eval_fraction", self.eval_fraction, "0: no held-out split")
        if self.eval_data and self.eval_fraction:
            raise ConfigError("train.eval_data and train.eval_fraction both give evaluation data; valid: one of "
                              "them (eval_fraction = 0 with eval_data)")
        if self.eval_every and not (self.eval_data or self.eval_fraction):
            raise ConfigError(f"train.eval_every = {self.eval_every} needs evaluation data; valid: --eval-data FILE, "
                              f"train.eval_fraction in (0, 1), or eval_every = 0")
        _check_at_least_zero("train.stop_after", self.stop_after, "0: never stop early")
        if (self.keep_best or self.stop_after) and not self.eval_every:
            raise ConfigError("train.keep_best and train.stop_after judge evaluations; valid: train.eval_every > 0 "
                              "(with evaluation data), or keep_best = false and stop_after = 0")
        if self.keep_best and not self.checkpoint:
            raise ConfigError("train.keep_best keeps a checkpoint; valid: train.checkpoint = true, or keep_best = false")


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
        rules.check_seq_len(t.seq_len, m.max_seq)
        rules.check_lora_rank(t.lora_rank, m.hidden)
        rules.check_global_batch(t.global_batch, p.dp, p.microbatches)
        rules.check_tensor_parallel(p.tp, m.heads, m.kv_heads, {"ffn": m.ffn})   # experts: etp's (below)
        rules.check_sequence_parallel(p.sp_mode, p.tp, t.seq_len)
        rules.check_partition(m.layers, p.pp, p.vpp, p.partition)
        rules.check_schedule(p.schedule, p.pp, p.vpp, p.microbatches, p.microbatch_group)
        rules.check_reduce_each_microbatch(p.reduce_each_microbatch, p.zero)
        rules.check_context_parallel(p.cp_mode, p.cp, p.tp, m.heads, t.seq_len, p.ulysses)
        rules.check_expert_parallel(p.ep, p.dp, p.cp, m.experts, p.tp, p.etp, m.expert_ffn)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Config":
        cfg = Config()
        if not isinstance(d, dict):
            raise ConfigError(f"a config is a table of tables [model], [parallel], [train]; got {type(d).__name__}")
        for part in ("model", "parallel", "train"):
            table = d.get(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"[{part}] must be a table of keys, got {table!r:.60}")
            apply_overrides(cfg, {f"{part}.{k}": v for k, v in table.items()})
        unknown = set(d) - {"model", "parallel", "train"}
        if unknown:
            raise ConfigError(f"unknown config tables {sorted(unknown)}; valid tables: model, parallel, train")
        return cfg


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Set dotted keys like 'parallel.dp' on cfg, converting each value strictly to its field's type."""
    for key, value in overrides.items():
        if value is None:
            continue
        part, _, name = key.partition(".")
        obj = getattr(cfg, part, None)
        if obj is None or not dataclasses.is_dataclass(obj):
            raise ConfigError(f"unknown config table {part!r}; valid tables: model, parallel, train")
        hints = _hints(type(obj))
        if name not in hints:
            raise ConfigError(f"unknown key {key!r}; valid keys in [{part}]: {', '.join(sorted(hints))}")
        setattr(obj, name, _convert(value, hints[name], key))
    return cfg


def field_doc(key: str) -> str:
    """What a dotted config key means: its field's comment in this file, the one place an option's meaning
    is written (the help of `fivefold train`, `eval` and `plan` is made from it; `OUT/config.toml` lists the
    values). "" when the source cannot be read (an install without .py files)."""
    part, _, name = key.partition(".")
    return _field_docs({"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}[part]).get(name, "")


@cache
def _field_docs(cls: type) -> dict[str, str]:
    """{field: its comment}: the comment on the field's lines, then the comment-only lines right under it
    indented past the field (a comment at the field's own indentation begins a new section)."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: (tok.start[1], tok.string.lstrip("#").strip())
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    docs = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parts = [comments[row][1] for row in range(node.lineno, node.end_lineno + 1) if row in comments]
        row = node.end_lineno + 1
        while row in comments and lines[row - 1].lstrip().startswith("#") and comments[row][0] > node.col_offset:
            parts.append(comments[row][1])
            row += 1
        docs[node.target.id] = " ".join(parts)
    return docs


def field_type(key: str) -> Any:
    """The declared type of a dotted config key, e.g. field_type('parallel.zero') is `ZeroStage`."""
    part, _, name = key.partition(".")
    return _hints({"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}[part])[name]


@cache
def _hints(cls: type) -> dict[str, Any]:
    """The declared types of a config part's fields (its class constants, ClassVar, are none)."""
    return {name: kind for name, kind in typing.get_type_hints(cls).items() if typing.get_origin(kind) is not ClassVar}


def _check_choices(obj: Any, part: str) -> None:
    """Every Literal-typed field of a config part holds one of its values."""
    for name, kind in _hints(type(obj)).items():
        if typing.get_origin(kind) is Literal:
            check_choice(f"{part}.{name}", getattr(obj, name), kind)


def _check_finite(obj: Any, part: str) -> None:
    """Every float-typed field of a config part holds a finite number (no NaN, no inf)."""
    for name, kind in _hints(type(obj)).items():
        value = getattr(obj, name)
        if kind is float and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and math.isfinite(value)):
            raise ConfigError(f"{part}.{name} must be a finite number, got {value!r}")


def _note(note: str) -> str:
    return f" ({note})" if note else ""


def _check_at_least_zero(key: str, value: float, note: str = "") -> None:
    if value < 0:
        raise ConfigError(f"{key} must be >= 0{_note(note)}, got {value}")


def _check_above_zero(key: str, value: float, typical: str) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0 (typical: {typical}), got {value}")


def _check_unit(key: str, value: float, note: str = "") -> None:
    """0 <= value < 1 (a probability or an exponential-average decay)."""
    if not 0 <= value < 1:
        raise ConfigError(f"{key} must be in [0, 1){_note(note)}, got {value}")


TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _convert(value: Any, kind: Any, key: str) -> Any:
    """`value` (from TOML or the command line) as type `kind`; ConfigError if it is not one."""
    if typing.get_origin(kind) is Literal:
        ok = choices(kind)
        out = _convert(value, type(ok[0]), key) if not isinstance(value, type(ok[0])) else value
        check_choice(key, out, kind)
        return out
    bad = ConfigError(f"{key} must be of type {getattr(kind, '__name__', kind)}, got {value!r}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (str, int)) and str(value).strip().lower() in TRUE + FALSE:
            return str(value).strip().lower() in TRUE
        raise ConfigError(f"{key} must be a boolean ({'/'.join(TRUE)} or {'/'.join(FALSE)}), got {value!r}")
    if typing.get_origin(kind) is list:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        return [_convert(v, typing.get_args(kind)[0], key) for v in items]
    if isinstance(value, bool) or kind not in (int, float, str):
        raise bad
    try:
        if kind is int and isinstance(value, float):
            if not value.is_integer():
                raise bad
            return int(value)
        if kind is str and not isinstance(value, str):
            raise bad
        return kind(value)
    except (ValueError, TypeError, OverflowError):
        raise bad from None


def parse_sets(items: list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` items as dotted-key overrides (values still strings: apply_overrides converts
    them by the field's type); an item without "=" is one line."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read a TOML file (or start from the defaults) and apply dotted-key overrides."""
    cfg = Config() if path is None else Config.from_dict(read_toml(path))
    return apply_overrides(cfg, overrides or {})


def read_toml(path: str | Path) -> dict:
    """A config file's tables; a file that cannot be opened or is not TOML is a ConfigError (one line).
    A run's run.json (or its folder) is not a config: the error names the run's config.toml instead."""
    if Path(path).suffix == ".json" or Path(path).is_dir():
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        raise ConfigError(f"--config takes a TOML file, not {path}; a run keeps its resolved config as "
                          f"{folder / RUN_CONFIG}: pass --config {folder / RUN_CONFIG}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
        check_whole(path, text)
        return tomllib.loads(text)
    except OSError as e:
        raise ConfigError(f"config {path}: cannot open it ({e.strerror or type(e).__name__}); give the path of a "
                          f"fivefold TOML config") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"config {path} is not TOML ({e}); a fivefold config has [model], [parallel] and "
                          f"[train] tables") from None


RUN_CONFIG = "config.toml"   # the resolved config a run folder keeps (`write_run_config`)


def to_toml(cfg: Config) -> str:
    """The whole config as TOML, one table per part and every key (what `load_config` reads back to an
    equal Config)."""
    lines = []
    for part, table in cfg.to_dict().items():
        lines += ["" if lines else None, f"[{part}]"]
        lines += [f"{key} = {toml_value(v)}" for key, v in table.items()]
    return "\n".join(x for x in lines if x is not None) + "\n"


def toml_value(v: Any) -> str:
    """A TOML literal for a config value: bool, int, float (inf, nan), str, or a list of them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else "nan" if math.isnan(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(str(v))   # a TOML basic string: JSON's escapes are TOML's


def write_run_config(cfg: Config, out: str | Path) -> Path:
    """OUT/config.toml: the run's resolved config (file, flags and --set together), so that
    `fivefold train --config OUT/config.toml` trains the same run again. Written to a temporary name and
    renamed into place."""
    path = Path(out) / RUN_CONFIG
    tmp = path.with_name(f".{RUN_CONFIG}.{os.getpid()}.tmp")
    tmp.write_text(RUN_CONFIG_HEAD + str(path) + "\n" + to_toml(cfg) + RUN_CONFIG_END + "\n")
    tmp.replace(path)
    return path


RUN_CONFIG_HEAD = "# the resolved config of this run: fivefold train --config "
RUN_CONFIG_END = "# end of the resolved config"   # a copy cut short (at a line boundary: still TOML) lacks it


def check_whole(path: str | Path, text: str) -> None:
    """A run's config.toml (its first line says so) ends with RUN_CONFIG_END: one cut short would read as
    TOML and leave the missing keys at their defaults. Edits elsewhere are the user's to make."""
    if text.startswith(RUN_CONFIG_HEAD) and not text.rstrip().endswith(RUN_CONFIG_END):
        raise ConfigError(f"config {path} was written by a run but ends before its last line "
                          f"({RUN_CONFIG_END!r}): it was cut short, and its missing keys would silently take their "
                          f"defaults; restore it, or remove its first line to use what is left as your own config")
