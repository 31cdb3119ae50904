"""Model shapes for planning: presets, Hugging Face `config.json`, and our own `ModelConfig`.

`PlanModel` extends the runtime's `ModelConfig` fields with what published models add: GPT-style
LayerNorm with biases and learned positions (GPT-3), GeLU MLPs, linear biases (Qwen2's QKV bias) and
DeepSeek's multi-head latent attention (MLA). It answers three questions for the planner:

- parameters, per part (`embed_params`, `layer_params(i)`, `head_params`), each tied weight once;
- the shapes activations and messages are made of (hidden, q/k/v widths, ffn, expert widths);
- FLOPs per token (`flops_per_token`), from the matmul parameters and causal attention.

Parameter counts equal the published totals (tests/unit/test_plan_models.py): Llama-3 8B/70B/405B
(Dubey et al. 2024, Table 3 shapes; exact totals of the released checkpoints), GPT-3 175B
(Brown et al. 2020, Table 2.1), Mixtral 8x7B (Jiang et al. 2024, 46.7B total / 12.9B active),
DeepSeek-V3 (DeepSeek-AI 2024, 671B total / 37B active, without the 14B multi-token-prediction module,
which `mtp_depth` = 1 describes apart: `mtp_params`, and its FLOPs in `flops_per_token`).

Hugging Face `config.json` files are read by family (`model_type`): the gated-MLP decoders (Llama,
Mistral, Qwen2, Mixtral, Qwen2-MoE, DeepSeek-V2/V3) and the GELU ones, GPT-NeoX (Pythia: MLP of width
intermediate_size, biases, LayerNorm, untied head, parallel attention and MLP) and GPT-2; their totals
equal those of `transformers` models built from the same config (tests/unit/test_plan_models.py; DeepSeek-V3's
per-expert score-correction bias is counted, as the checkpoint stores it, though `transformers` and our
runtime keep it as a buffer). Any other family, activation or variant the shapes here cannot express is
refused, naming the supported ones.

Approximations (stated where they are used): MLA's activations are the up-projected per-head Q, K, V
plus the latents (plan/activations.py `layer_acts`); MoE expert activations assume balanced routing. MLA's
parameters per tp rank, ZeRO units and tp messages are the runtime's (model/latent_attention.py,
parallel/tensor.py): down-projections and latent norms whole on every tp rank, the latents entering the
tensor-parallel region.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any, Callable
from functools import lru_cache
from pathlib import Path

from ..config import MODEL_LIMITS, ConfigError, HeadShapes, ModelConfig, ParameterCounts
from .. import rules
from ..rules import check_count, divisors


def cached_hash(obj) -> int:
    """Hash of a frozen dataclass's fields, computed once and kept on the object (planner cache keys)."""
    h = obj.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(obj.__dict__[f] for f in obj.__dataclass_fields__))
        object.__setattr__(obj, "_hash", h)
    return h


# the runtime's defaults: PlanModel takes the one it shares (top_k), the field table the ones it restores
_RUNTIME_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}


@dataclass(frozen=True)
class PlanModel(HeadShapes, ParameterCounts):
    """Shape of a decoder-only transformer, as far as memory, bytes and FLOPs depend on it."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tie_embeddings: bool           # no default: a planned model says whether its head is its embedding
    max_seq: int                   # ... and its context (the runtime's defaults describe its tiny demo model)
    # MoE: `experts` routed experts of width `moe_ffn`, `top_k` per token, `shared_experts` always on;
    # the first `dense_layers` layers use the dense MLP of width `ffn`.
    experts: int = 0
    top_k: int = _RUNTIME_DEFAULTS["top_k"]        # the runtime's default (ModelConfig): a dense model never reads it
    moe_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    router_bias: bool = False          # DeepSeek-V3's per-expert score-correction bias
    shared_expert_gate: bool = False   # Qwen2-MoE: a sigmoid gate (h -> 1) on the shared expert's output
    # variants
    mlp: str = "swiglu"                # "swiglu": gated, 3 matrices (gate, up, down); "gelu": 2 (up, down)
    norm: str = "rms"                  # "rms" (weight) or "layer" (weight and bias)
    linear_bias: bool = False          # biases on every linear (GPT-3)
    qkv_bias: bool = False             # biases on q, k, v only (Qwen2)
    attn_head_dim: int = 0             # per-head width of q, k, v when not hidden / heads (Qwen3)
    qk_norm: bool = False              # an RMSNorm over each head's q and k (Qwen3)
    learned_pos: bool = False          # learned absolute position embedding (GPT-3)
    parallel_residual: bool = False    # attention and MLP both read the block input (GPT-NeoX)
    dropout: bool = False              # dropout masks stored (Korthikanti's GPT counts them)
    # multi-head latent attention (DeepSeek-V2/V3); 0 = standard (grouped-query) attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # multi-token prediction (DeepSeek-V3 §2.2): `mtp_depth` modules after the last layer, each an MoE (or
    # dense) block of the model's own shape, a projection of [norm(h); norm(embedding)] (2h -> h) and the
    # shared LM head once more; embedding and head are the main model's (not counted again)
    mtp_depth: int = 0
    # LoRA (model/lora.py, train.lora_rank): rank-r adapters on these linear layers of each block (our names,
    # rules.LORA_TARGETS) are what trains; every base weight is frozen (held whole, no gradient, no optimizer
    # state, no traffic: plan/units.py counts the adapters as the trained tensors and `frozen_params` apart)
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    # train.freeze: parameters whose names match these patterns are frozen (plan/units.py `layer_names`)
    frozen: tuple[str, ...] = ()

    def __hash__(self) -> int:     # a cache key everywhere: hash the fields once
        return cached_hash(self)

    # -- shapes -------------------------------------------------------------------------------
    @property
    def q_width(self) -> int:
        """Width of the query projection output (heads · qk head dim)."""
        return self.heads * self.qk_head_dim

    @property
    def kv_width(self) -> int:
        """Width of one of K or V as attention sees it (MLA: up-projected, per-head K and V)."""
        return (self.heads if self.mla else self.kv_heads) * self.qk_head_dim

    @property
    def v_width(self) -> int:
        return (self.heads if self.mla else self.kv_heads) * self.v_dim

    @property
    def attn_out_width(self) -> int:
        return self.heads * self.v_dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_ffn(self) -> int:
        """Hidden width of one routed (or shared) expert (`moe_ffn`: explicit here, 0 in a dense model)."""
        return self.moe_ffn

    # -- parameters (the formula: config.ParameterCounts) ----------------------------------------
    def mla_replicated_params(self) -> int:
        """Latent attention's parameters whole on every tensor-parallel rank: the down-projections q_a
        and kv_a and the latent norms (model/latent_attention.py, parallel/tensor.py); 0 without MLA."""
        if not self.mla:
            return 0
        q = self._linear(self.hidden, self.q_lora_rank) + self.q_lora_rank if self.q_lora_rank else 0
        return q + self._linear(self.hidden, self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank

    def mla_tensors(self, tp: int) -> list[tuple[int, str]]:
        """(elements on one tp rank, tag) of latent attention's tensors in the runtime's registration order
        (q_a, q_norm, q_b, or q_proj; kv_a, kv_norm, kv_b, wo): "norm" for the tp-replicated ones."""
        h, n, r = self.hidden, self.heads, self.q_lora_rank
        q = [(h * r, "norm"), (r, "norm"), (r * n * self.qk_head_dim // tp, "")] if r else \
            [(h * n * self.qk_head_dim // tp, "")]
        return q + [(h * (self.kv_lora_rank + self.qk_rope_dim), "norm"), (self.kv_lora_rank, "norm"),
                    (self.kv_lora_rank * n * (self.qk_nope_dim + self.v_head_dim) // tp, ""),
                    (n * self.v_head_dim * h // tp, "")]

    def mla_latent_width(self) -> int:
        """Width of the latents latent attention enters the tensor-parallel region with: c_q (when there is
        a q latent), c_kv and k_pe."""
        return self.q_lora_rank + self.kv_lora_rank + self.qk_rope_dim

    def mtp_params(self) -> int:
        """Parameters of the multi-token-prediction modules beyond the shared embedding and head (DeepSeek-V3
        §2.2): per depth one block (layer index `layers`: an MoE layer where the model has them), the
        projection M (2h x h) and three norms (the previous depth's hidden, the embedding, the shared
        head's input)."""
        return self.mtp_depth * (self.layer_params(self.layers) + self.mtp_projection_params())

    def mtp_projection_params(self) -> int:
        """One MTP module's own parameters beside its block: the projection M (2h -> h) and the three norms
        (the planner keeps them whole on every tensor-parallel rank, as the layers' norms and routers:
        `units.block_rank_params`)."""
        h = self.hidden
        return self._linear(2 * h, h) + 3 * self._norm(h)

    def mtp_active_weights(self) -> int:
        """Weights one token multiplies in the MTP modules' block and projection (routed: top_k experts),
        the shared head's pass aside (`mtp_head_weights`)."""
        if not self.mtp_depth:
            return 0
        i = self.layers
        block = self.layer_params(i, self.top_k if self.is_moe_layer(i) else None)
        return self.mtp_depth * (block + self._linear(2 * self.hidden, self.hidden))

    @property
    def mtp_head_weights(self) -> int:
        """Weights of the shared LM head's extra passes, one per MTP depth."""
        return self.mtp_depth * self.vocab * self.hidden

    def active_params(self) -> int:
        """Parameters one token uses (routed experts: top_k of them)."""
        return (self.embed_params + self.head_params
                + sum(self.layer_params(i, self.top_k if self.is_moe_layer(i) else None) for i in range(self.layers)))

    # -- FLOPs ----------------------------------------------------------------------------------
    def matmul_params_per_token(self) -> int:
        """Weights a token multiplies by (routed: top_k experts; embedding lookup is free, the head is not)."""
        return _matmul_params_per_token(self)

    def attention_flops_per_token(self, seq: int, causal: bool = True) -> float:
        """Forward FLOPs of QK^T and AV for one token, summed over layers (PaLM, Chowdhery et al. 2022,
        App. B: 2·s·(d_qk + d_v) per head per layer, halved for a causal mask)."""
        per_layer = 2.0 * seq * self.heads * (self.qk_head_dim + self.v_dim)
        return self.layers * per_layer * (0.5 if causal else 1.0)

    def blocks_attention_flops_per_token(self, seq: int, causal: bool = True) -> float:
        """`attention_flops_per_token` over every block a token passes: the layers and the MTP modules'."""
        attn = self.attention_flops_per_token(seq, causal)
        return attn + attn * self.mtp_depth / self.layers if self.mtp_depth else attn

    def elementwise_per_token(self, i: int) -> tuple[float, float]:
        """Elements read and written per token by layer i's element-wise work, forward + backward (norms,
        RoPE, the activation function and gating, residual adds, softmax statistics, the repeat of K/V
        for grouped-query attention, and their gradients), as (whole on every tp rank without sequence
        parallelism, split over tp). Counted from the tensors the runtime's Block touches, op by op (a
        profile of `model/transformer.py` on CPU): about 130·h + 16·f + 10.5·kv_width, with f the MLP
        width a token passes through (top_k routed experts plus shared ones in an MoE layer). Paid at
        memory bandwidth when `Accelerator.elementwise` says these ops are not fused."""
        if self.is_moe_layer(i):
            f = (self.top_k + self.shared_experts) * self.moe_ffn
        else:
            f = self.ffn
        return 130.0 * self.hidden, 16.0 * f + 10.5 * self.kv_width

    def flops_per_token(self, seq: int, causal: bool = True) -> float:
        """Model FLOPs per token for forward + backward: 6·N_matmul + 3·attention (Kaplan et al. 2020;
        Narayanan et al. 2021, eq. 1 without recomputation), the MTP modules' included (their block, their
        projection and the head's extra pass: 6 per weight; their attention as one more layer's)."""
        mtp = 6.0 * (self.mtp_active_weights() + self.mtp_head_weights)
        return 6.0 * self.matmul_params_per_token() + 3.0 * self.blocks_attention_flops_per_token(seq, causal) + mtp

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@lru_cache(maxsize=1024)
@lru_cache(maxsize=256)
def _matmul_params_per_token(model: PlanModel) -> int:
    head = model.vocab * model.hidden
    return sum(model.layer_params(i, model.top_k if model.is_moe_layer(i) else None)
               for i in range(model.layers)) + head


# -- presets ------------------------------------------------------------------------------------
def _llama3(name, hidden, layers, heads, ffn, vocab=128256):
    return PlanModel(name=name, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=8, ffn=ffn,
                     tie_embeddings=False, max_seq=8192)


PRESETS: dict[str, PlanModel] = {
    # Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3.
    "llama3-8b": _llama3("llama3-8b", 4096, 32, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 8192, 80, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 16384, 126, 128, 53248),
    # Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, d_ff = 4·d_model, n_ctx 2048,
    # GPT-2's BPE vocabulary (50257), learned positions, LayerNorm, biases, tied embeddings.
    "gpt3-175b": PlanModel(name="gpt3-175b", vocab=50257, hidden=12288, layers=96, heads=96, kv_heads=96,
                           ffn=4 * 12288, tie_embeddings=True, max_seq=2048, mlp="gelu", norm="layer",
                           linear_bias=True, learned_pos=True, dropout=True),
    # Jiang et al. 2024, "Mixtral of Experts": Mistral-7B shapes, 8 experts, top-2.
    "mixtral-8x7b": PlanModel(name="mixtral-8x7b", vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8,
                              ffn=14336, tie_embeddings=False, max_seq=32768, experts=8, top_k=2, moe_ffn=14336),
    # NVIDIA 2024, "Nemotron-4 340B Technical Report", Table 1 (and Parmar et al. 2024, "Nemotron-4 15B"):
    # 96 layers, hidden 18432, 96 heads with 8 KV heads, seq 4096, a 256k vocabulary, untied embeddings,
    # squared-ReLU MLP of 4·hidden (two matrices, no gate), LayerNorm, no biases, no dropout.
    "nemotron4-340b": PlanModel(name="nemotron4-340b", vocab=256000, hidden=18432, layers=96, heads=96, kv_heads=8,
                                ffn=4 * 18432, tie_embeddings=False, max_seq=4096, mlp="gelu", norm="layer"),
    # DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §4.2: 61 layers, hidden 7168, MLA (128 heads,
    # q rank 1536, kv rank 512, 128+64 qk dims, 128 v dims), first 3 layers dense (ffn 18432), then
    # 1 shared + 256 routed experts of width 2048, top-8, a score-correction bias per expert; §2.2 and
    # §4.2: one multi-token-prediction module (D = 1), its block an MoE layer (the released checkpoint's
    # layer 61).
    "deepseek-v3": PlanModel(name="deepseek-v3", vocab=129280, hidden=7168, layers=61, heads=128, kv_heads=128,
                             ffn=18432, tie_embeddings=False, max_seq=4096, experts=256, top_k=8, moe_ffn=2048, shared_experts=1,
                             dense_layers=3, router_bias=True, q_lora_rank=1536, kv_lora_rank=512,
                             qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, mtp_depth=1),
    # Qwen Team 2025, "Qwen3 Technical Report", Table 2, and the released Qwen3-235B-A22B config.json: 94
    # layers, hidden 4096, 64 query / 4 K/V heads of 128 dims (not hidden / heads) with q/k norms, 128
    # experts of width 1536, top-8, no shared expert, vocabulary 151936, untied: 235.1 B parameters, 22.1 B active.
    "qwen3-235b-a22b": PlanModel(name="qwen3-235b-a22b", vocab=151936, hidden=4096, layers=94, heads=64, kv_heads=4,
                                 ffn=12288, tie_embeddings=False, max_seq=40960, experts=128, top_k=8, moe_ffn=1536,
                                 attn_head_dim=128, qk_norm=True),
}


# -- one model, two descriptions ----------------------------------------------------------------------
@dataclass(frozen=True)
class ModelField:
    """What the planner makes of one `ModelConfig` field: the `PlanModel` field it becomes (`plan`; None:
    it changes no shape, FLOP or byte the planner counts, `why`), how its value is read from the whole
    config (`to_plan`; default: the field's own value) and back (`to_runtime`; default: the PlanModel
    field's value, or ModelConfig's default where `plan` is None and no `to_runtime` is given)."""

    plan: str | None
    to_plan: Callable[[ModelConfig], Any] | None = None
    to_runtime: Callable[["PlanModel"], Any] | None = None
    why: str = ""


def _same(name: str) -> ModelField:
    return ModelField(name)


def _runtime_only(why: str) -> ModelField:
    return ModelField(None, why=why)



# Every ModelConfig field and what the planner reads of it; tests/unit/test_plan_model_fields.py fails when
# ModelConfig gains a field without a row here, or PlanModel one that is neither made here nor in PLAN_ONLY.
MODEL_FIELDS: dict[str, ModelField] = {
    **{name: _same(name) for name in (
        "vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "tie_embeddings", "max_seq", "experts", "top_k",
        "shared_experts", "dense_layers", "shared_expert_gate", "qkv_bias", "q_lora_rank", "kv_lora_rank",
        "qk_nope_dim", "qk_rope_dim", "v_head_dim", "attn_head_dim", "qk_norm")},
    # the runtime's 0 means "ffn"; the planner's width is explicit
    "moe_ffn": ModelField("moe_ffn", lambda c: (c.moe_ffn or c.ffn) if c.experts else 0,
                          lambda m: m.moe_ffn if m.experts else 0),
    # DeepSeek-V3's score-correction bias: in the runtime a buffer per expert (the sigmoid_bias router's:
    # no gradient, no optimizer state, no reduction); a planned model's router_bias counts it with the
    # weights, as Hugging Face's checkpoints hold it, so a runtime model plans without it
    "router": ModelField(None, to_runtime=lambda m: "sigmoid_bias" if m.router_bias else _RUNTIME_DEFAULTS["router"],
                         why="the sigmoid router's bias is a buffer: nothing the planner counts as trained state"),
    # residual dropout keeps a boolean mask per branch (model/layers.py); a planned model's dropout
    # becomes no rate the runtime could use, so it trains without
    "dropout": ModelField("dropout", lambda c: c.dropout > 0, lambda m: _RUNTIME_DEFAULTS["dropout"]),
    "rope_theta": _runtime_only("the rotary base: the same FLOPs and bytes for any value"),
    "norm_eps": _runtime_only("numerics only"),
    "init_std": _runtime_only("initialisation only"),
    "rope_interleave": _runtime_only("the order of RoPE's pairs: the same work"),
    "router_groups": _runtime_only("group-limited routing picks experts, it moves no more tokens (planned "
                                   "balanced); node-limited dispatch is the planner's Workload option"),
    "router_group_limit": _runtime_only("as router_groups"),
    "capacity_factor": _runtime_only("read as Workload.capacity_factor (plan/layout.py from_config): how "
                                     "many rows an expert takes is the batch's, not the model's"),
    "random_routing": _runtime_only("GShard's draw of the second expert: planned as top_k rows a token (what moves "
                                    "in capacity mode; an upper bound of the dropless dispatch)"),
    "aux_loss_coef": _runtime_only("a loss weight"),
    "z_loss_coef": _runtime_only("a loss weight"),
    "bias_update_rate": _runtime_only("the expert bias's step size"),
    "routed_scaling_factor": _runtime_only("a scale on the routed experts' weights"),
}

# PlanModel fields no ModelConfig field makes, and the value the runtime's architecture has (a model
# the runtime builds must have it: `to_model_config`), or None where the run's train config gives it.
PLAN_ONLY: dict[str, Any] = {
    "name": None,                 # a label
    # the architecture the runtime builds: ModelConfig's class constants, which the parameter formula reads
    **{name: getattr(ModelConfig, name) for name in ("mlp", "norm", "linear_bias", "learned_pos", "parallel_residual")},
    "mtp_depth": None,            # DeepSeek-V3's multi-token prediction: planned, not built (left out)
    "router_bias": None,          # the runtime's model.router (sigmoid_bias) holds it as a buffer
    "lora_rank": None, "lora_targets": None, "frozen": None,   # train.lora_rank, lora_targets, freeze
}


def from_model_config(cfg: ModelConfig, name: str = "custom", train=None) -> PlanModel:
    """The planner's view of our own runtime model, field by field from MODEL_FIELDS; with the run's
    `train` config, its LoRA adapters (train.lora_rank, lora_targets) or frozen weights (train.freeze)."""
    lora = dict(lora_rank=train.lora_rank, lora_targets=rules.check_lora_targets(train.lora_targets)) \
        if train is not None and train.lora_rank else {}
    if train is not None and train.freeze and not train.lora_rank:
        lora["frozen"] = tuple(train.freeze)
    made = {f.plan: (f.to_plan(cfg) if f.to_plan else getattr(cfg, key))
            for key, f in MODEL_FIELDS.items() if f.plan is not None}
    return PlanModel(**lora, **made, name=name)


def to_model_config(m: PlanModel, where: str = "") -> ModelConfig:
    """Our ModelConfig for a planned model, field by field from MODEL_FIELDS (the runtime's defaults for
    what the planner does not describe), when the runtime builds its architecture (PLAN_ONLY's values:
    a Llama-style decoder, gated MLP, RMSNorm, rotary, no biases but q/k/v's). Multi-token prediction
    modules are left out: the runtime builds none."""
    other = [k for k, v in PLAN_ONLY.items() if v is not None and getattr(m, k) != v]
    if other:
        raise ConfigError(f"{where or m.name}: the runtime builds Llama-style decoders (gated MLP, RMSNorm, rotary, "
                          f"q/k/v biases only); this one differs in {', '.join(other)} (plan it with fivefold plan)")
    return ModelConfig(**{key: (f.to_runtime(m) if f.to_runtime else getattr(m, f.plan))
                          for key, f in MODEL_FIELDS.items() if f.plan is not None or f.to_runtime})


# -- Hugging Face config.json ---------------------------------------------------------------------
# model_type -> how its config.json reads. Gated ("swiglu": gate, up, down) MLP families differ only in
# biases, MoE and attention fields; GPT-NeoX and GPT-2 have a two-matrix GELU MLP, LayerNorm with bias
# and biases on every linear. Anything else is refused: its MLP or attention would be miscounted.
GATED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
GELU_FAMILIES = ("gpt_neox", "gpt2")
HF_FAMILIES = GATED_FAMILIES + GELU_FAMILIES
# activations that leave the shapes and FLOPs alone (elementwise; the MLP kind comes from the family)
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python",
               "quick_gelu", "relu")


def read_hf_config(path: Path) -> PlanModel:
    """A Hugging Face config.json from disk, trusted for nothing: it must be a JSON object whose sizes are
    integers (heads, vocab, ... >= 1), and the model it describes must be whole (`check_plan_model`)."""
    d = read_json(path)
    for key in HF_COUNTS:
        if d.get(key) is not None:
            check_count(f"--model {path}: {key}", d[key], 1 if key in HF_SIZES else 0)
    try:
        model = from_hf_config(d, name=path.parent.name or path.stem)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError, KeyError, OverflowError) as e:
        raise ConfigError(f"--model {path}: cannot read it as a Hugging Face config ({type(e).__name__}: {e})") from None
    check_shape(model, f"--model {path}")   # GQA grouping, with the valid kv_heads
    check_plan_model(model, f"--model {path}")
    return model


# config.json keys that are counts: the sizes must be >= 1, the others >= 0
HF_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_key_value_heads",
            "intermediate_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions",
            "num_experts_per_tok", "moe_intermediate_size", "n_inner")
HF_COUNTS = HF_SIZES + ("num_local_experts", "n_routed_experts", "num_experts", "n_shared_experts",
                        "first_k_dense_replace", "shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank",
                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim")
# PlanModel fields that are sizes (>= 1); its other integer fields are counts (>= 0)
PLAN_SIZES = ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq", "top_k")


def check_plan_model(m: PlanModel, where: str) -> None:
    """A model the planner can count: every integer field an integer (sizes >= 1, the rest >= 0), every
    flag a boolean, heads splitting hidden (standard attention) and kv_heads splitting heads."""
    for f in fields(m):
        value = getattr(m, f.name)
        if f.type in ("bool", bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: {f.name} must be true or false, got {value!r}")
        elif f.type in ("int", int):
            check_count(f"{where}: {f.name}", value, 1 if f.name in PLAN_SIZES else 0,
                        MODEL_LIMITS.get(f.name, 2**31))   # past these, per-layer loops would run for hours
    if not m.mla and not m.attn_head_dim and m.hidden % m.heads:
        raise ConfigError(f"{where}: hidden ({m.hidden}) must divide by heads ({m.heads})")
    if m.heads % m.kv_heads:
        raise ConfigError(f"{where}: heads ({m.heads}) must divide by kv_heads ({m.kv_heads})")


def from_hf_config(d: dict, name: str = "hf") -> PlanModel:
    """A Hugging Face `config.json`: Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, DeepSeek-V2/V3 (gated
    SwiGLU MLP), GPT-NeoX (Pythia) and GPT-2 (GELU MLP of width 4h, biases, LayerNorm). A config without
    `model_type` is read as Llama. Other families, activations or variants the planner cannot count
    exactly raise ConfigError naming them and the supported ones."""
    kind = d.get("model_type", "llama")
    if kind not in HF_FAMILIES:
        raise ConfigError(f"Hugging Face model_type {kind!r} is not supported (its MLP or attention would be "
                          f"miscounted); supported: {', '.join(HF_FAMILIES)}")
    act = d.get("activation_function" if kind == "gpt2" else "hidden_act", "gelu_new" if kind == "gpt2" else "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"Hugging Face model_type {kind!r}: activation {act!r} is not supported; "
                          f"supported: {', '.join(ACTIVATIONS)}")
    if kind == "gpt2":
        return _gpt2(d, name)
    if kind == "gpt_neox":
        return _gpt_neox(d, name)
    return _gated(d, kind, name)


def _need(d: dict, kind: str, *keys: str) -> list:
    """The sizes `keys`, each present and a whole number >= 1 (not 0, negative, NaN or a fraction)."""
    missing = [k for k in keys if d.get(k) is None]
    if missing:
        raise ConfigError(f"Hugging Face config ({kind}) lacks {', '.join(map(repr, missing))}; "
                          f"need {', '.join(keys)}")
    for k in keys:
        check_count(f"Hugging Face config ({kind}) {k}", d[k], 1)
    return [d[k] for k in keys]


# PlanModel's sizes: each a whole number >= 1, or >= 0 where 0 means "none" (no experts, standard attention)
SIZES = ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq", "top_k")
OPTIONAL_SIZES = ("experts", "moe_ffn", "shared_experts", "dense_layers", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_dim", "qk_rope_dim", "v_head_dim", "attn_head_dim")


def check_shape(m: PlanModel, source: str) -> PlanModel:
    """Every size of `m` (read from `source`) a whole number in its range, and the heads grouped evenly
    for GQA: what the planner divides by and counts with. Returns `m`."""
    for name in SIZES + OPTIONAL_SIZES:
        check_count(f"model {m.name} ({source}): {name}", getattr(m, name), 1 if name in SIZES else 0)
    if m.heads % m.kv_heads:
        raise ConfigError(f"model {m.name} ({source}): heads ({m.heads}) must divide by kv_heads ({m.kv_heads}) "
                          f"for grouped-query attention; valid kv_heads: {divisors(m.heads)}")
    return m


def _refuse(kind: str, what: str) -> None:
    raise ConfigError(f"Hugging Face model_type {kind!r} with {what} is not supported (would be miscounted); "
                      f"supported: {', '.join(HF_FAMILIES)} in their standard form")


def _head_dim(d: dict, kind: str, hidden: int, heads: int) -> int:
    """A config's head_dim when it is not hidden / heads (Qwen3's 128, Mistral's and Llama's own), else 0;
    latent attention's head dims are its own (0)."""
    head_dim = d.get("head_dim")
    if not head_dim or d.get("kv_lora_rank") or (hidden % heads == 0 and head_dim == hidden // heads):
        return 0
    check_count(f"Hugging Face config ({kind}) head_dim", head_dim, 1)
    return head_dim


def _dropout(d: dict, *keys: str) -> bool:
    return any((d.get(k) or 0) > 0 for k in keys)


def _gated(d: dict, kind: str, name: str) -> PlanModel:
    """Llama-style decoders: RMSNorm, rotary, gated MLP (gate, up, down); Qwen2 adds q/k/v biases."""
    h, layers, heads, vocab = _need(d, kind, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "vocab_size")
    head_dim = _head_dim(d, kind, h, heads)
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            _refuse(kind, f"{key} = true")
    m = PlanModel(name=name, vocab=vocab, hidden=h, layers=layers, heads=heads,
                  kv_heads=d.get("num_key_value_heads") or heads, ffn=d.get("intermediate_size") or 4 * h,
                  tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                  max_seq=d.get("max_position_embeddings", 4096), qkv_bias=kind.startswith("qwen2"),
                  dropout=_dropout(d, "attention_dropout"), attn_head_dim=head_dim, qk_norm=kind.startswith("qwen3"))
    experts = d.get("num_local_experts") or d.get("n_routed_experts") or d.get("num_experts") or 0
    if experts:
        m = _with_experts(m, d, kind, experts)
    if d.get("kv_lora_rank"):
        nope, rope, v = _need(d, kind, "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        m = replace(m, q_lora_rank=d.get("q_lora_rank") or 0, kv_lora_rank=d["kv_lora_rank"], qk_nope_dim=nope,
                    qk_rope_dim=rope, v_head_dim=v)
    return m


def _with_experts(m: PlanModel, d: dict, kind: str, experts: int) -> PlanModel:
    """Routed experts of width moe_intermediate_size (Mixtral: intermediate_size), shared experts
    (DeepSeek: n_shared_experts of that width; Qwen2-MoE: one of shared_expert_intermediate_size, with a
    sigmoid gate), the first `first_k_dense_replace` layers dense."""
    if (d.get("decoder_sparse_step") or 1) != 1 or d.get("mlp_only_layers") or (d.get("moe_layer_freq") or 1) != 1:
        _refuse(kind, "MoE layers that are not every layer after the first dense ones")
    width = d.get("moe_intermediate_size") or _need(d, kind, "intermediate_size")[0]
    shared = d.get("n_shared_experts") or 0
    if d.get("shared_expert_intermediate_size"):       # Qwen2-MoE: one shared expert of its own width
        if d["shared_expert_intermediate_size"] % width:
            _refuse(kind, "a shared expert width that is not a multiple of moe_intermediate_size")
        shared = d["shared_expert_intermediate_size"] // width
    return replace(m, experts=experts, top_k=d.get("num_experts_per_tok", 2), moe_ffn=width, shared_experts=shared,
                   shared_expert_gate=kind == "qwen2_moe" and shared > 0,
                   dense_layers=d.get("first_k_dense_replace", 0), router_bias=d.get("topk_method") == "noaux_tc")


def _gpt_neox(d: dict, name: str) -> PlanModel:
    """GPT-NeoX / Pythia (Black et al. 2022; Biderman et al. 2023): LayerNorm with bias, fused QKV and
    every linear with bias, GELU MLP of width intermediate_size, rotary positions (no parameters),
    untied embed_out, attention and MLP in parallel off the block input (use_parallel_residual)."""
    kind = "gpt_neox"
    h, layers, heads, vocab, ffn = _need(d, kind, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "vocab_size", "intermediate_size")
    head_dim = _head_dim(d, kind, h, heads)
    if not d.get("attention_bias", True):
        _refuse(kind, "attention_bias = false")
    return PlanModel(name=name, vocab=vocab, hidden=h, layers=layers, heads=heads, kv_heads=heads, ffn=ffn,
                     tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                     max_seq=d.get("max_position_embeddings", 2048), mlp="gelu", norm="layer", linear_bias=True,
                     parallel_residual=bool(d.get("use_parallel_residual", True)),
                     dropout=_dropout(d, "hidden_dropout", "attention_dropout"))


def _gpt2(d: dict, name: str) -> PlanModel:
    """GPT-2 (Radford et al. 2019): learned positions (n_positions), LayerNorm with bias, biases on every
    linear, GELU MLP of width n_inner (default 4h), head tied to the token embedding, dropout."""
    kind = "gpt2"
    h, layers, heads, vocab = _need(d, kind, "n_embd", "n_layer", "n_head", "vocab_size")
    return PlanModel(name=name, vocab=vocab, hidden=h, layers=layers, heads=heads, kv_heads=heads,
                     ffn=d.get("n_inner") or 4 * h, tie_embeddings=bool(d.get("tie_word_embeddings", True)),
                     max_seq=d.get("n_positions", 1024), mlp="gelu", norm="layer", linear_bias=True,
                     learned_pos=True, dropout=_dropout(d, "resid_pdrop", "attn_pdrop", "embd_pdrop"))


def load_model(spec: str | ModelConfig | PlanModel) -> PlanModel:
    """A preset name, a path to a Hugging Face config.json, a fivefold TOML ([model] table), or a config."""
    if isinstance(spec, PlanModel):
        return spec
    if isinstance(spec, ModelConfig):
        return from_model_config(spec)
    key = spec.lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():   # a Hugging Face checkpoint folder, as --init-hf takes
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return read_hf_config(path)
    if path.suffix == ".toml" and path.is_file():
        from ..config import Config, read_toml
        tables = read_toml(path)
        cfg = Config.from_dict(tables).model   # unknown tables and keys first
        if "model" not in tables:   # the defaults are a tiny test model: planned silently, it answered 0.02 GiB
            raise ConfigError(f"model {spec}: the TOML has no [model] table (hidden, layers, heads, ...); give one, "
                              f"or a preset ({', '.join(PRESETS)})")
        cfg.validate()
        return from_model_config(cfg, name=path.stem)
    if path.is_dir():
        raise ConfigError(f"model {spec}: a folder without config.json; give a preset ({', '.join(PRESETS)}), a "
                          f"Hugging Face config.json (or its folder) or a fivefold .toml")
    if path.suffix in (".json", ".toml") or len(path.parts) > 1:
        raise ConfigError(f"model {spec}: no such file; give a preset ({', '.join(PRESETS)}), a Hugging Face "
                          f"config.json (or its folder) or a fivefold .toml")
    raise ConfigError(f"unknown model {spec!r}; known models: {', '.join(PRESETS)} "
                      f"(or a path to a Hugging Face config.json, its folder, or a fivefold .toml)")


def read_json(path: Path) -> dict:
    """A Hugging Face config.json's object; a file that is not a JSON object is a ConfigError (one line)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"model {path}: cannot read it as JSON ({type(e).__name__}: {e}); give a Hugging Face "
                          f"config.json") from None
    if not isinstance(d, dict):
        raise ConfigError(f"model {path}: a Hugging Face config.json is a JSON object, got {type(d).__name__}")
    return d
