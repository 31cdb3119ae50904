"""How our model maps onto Hugging Face's: config fields (`config_from_hf`, `config_to_hf`, `hf_family`)
and tensor names (`name_map`, `packed_map`, `buffer_map`). Torch-free tables and functions; model/hf.py
moves weights between the two models with them, model/hf_weights.py reads a saved folder with them.

Import and export Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3
weights.

`from_hf(m)` takes a `transformers` LlamaForCausalLM, MixtralForCausalLM or Qwen2MoeForCausalLM (an
object, or a folder saved with `save_pretrained`) and returns our `Transformer` with the same weights;
`to_hf(model)` goes back, to the family `hf_family(cfg)` picks (or the one named). No tensor is permuted
(both use the "rotate half" RoPE layout); names map one to one, except that transformers (5.x) packs each
layer's expert gate and up projections into one 3-D tensor, `mlp.experts.gate_up_proj` (E, 2f, h) =
[w_gate; w_up] along dim 1, which we split. `mlp.experts.down_proj` (E, h, f) is our `w_down` as is.

What maps (ours <- theirs):
- Mixtral: router softmax_topk_norm; experts num_local_experts, top_k num_experts_per_tok,
  moe_ffn = ffn = intermediate_size; aux_loss_coef router_aux_loss_coef. Refused: a sliding window,
  router jitter noise.
- Mistral: a Llama (head_dim given). A sliding window shorter than max_position_embeddings sets
  model.max_seq to the window: up to it, sliding-window attention is full causal attention (exact).
- Qwen2: a Llama with q/k/v biases (model.qkv_bias); a sliding window (use_sliding_window) as Mistral's.
- Qwen2-MoE: q/k/v biases when qkv_bias (the default, and every released checkpoint); router softmax_topk_norm if norm_topk_prob else softmax_topk; moe_ffn moe_intermediate_size;
  the shared expert (width shared_expert_intermediate_size, which must be a multiple of
  moe_intermediate_size: shared_experts = the ratio) behind its sigmoid gate (shared_expert_gate);
  ffn = intermediate_size (the dense layers). Dense layers (mlp_only_layers, decoder_sparse_step) must be
  the first N layers (dense_layers = N; the default, all sparse, is N = 0).
- Qwen3: a Llama with q and k norms (model.qk_norm: an RMSNorm over each head's q and k, self_attn.q_norm /
  k_norm) and its own head dim (head_dim, 128 whatever hidden: model.attn_head_dim); no biases.
- Qwen3-MoE: Qwen3's attention; experts num_experts of moe_intermediate_size, top_k num_experts_per_tok,
  router softmax_topk_norm if norm_topk_prob else softmax_topk, no shared expert; dense layers
  (mlp_only_layers, decoder_sparse_step) as Qwen2-MoE's: the first N only.
- DeepSeek-V3: latent attention (model/latent_attention.py: q_a_proj, q_a_layernorm, q_b_proj or q_proj,
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; rope_interleave as given); dense_layers
  first_k_dense_replace; router sigmoid_bias (its e_score_correction_bias buffer is our expert_bias),
  group-limited by n_group / topk_group, weights renormalised (norm_topk_prob must be true) and times
  routed_scaling_factor; n_shared_experts ungated shared experts ("mlp.shared_experts.*").
Refused everywhere: biases on the output projection or the MLP (attention_bias, mlp_bias), other RoPE
scalings, activations other than SiLU.
Hugging Face computes its load-balance loss over the whole batch and with f_e = count/tokens (k times
ours); ours is per sequence (model/moe.py). Capacity has no Hugging Face counterpart (it runs dropless).
"""
from __future__ import annotations

from ..config import ModelConfig

# ours -> Hugging Face, per layer: attention and norms (every family), then each MLP kind
QKV_BIAS_NAMES = {
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
}
ATTN_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
}
DENSE_NAMES = {
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
MOE_NAMES = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.w_down": "mlp.experts.down_proj",
}
SHARED_NAMES = {
    "mlp.shared.gate.weight": "mlp.shared_expert.gate_proj.weight",
    "mlp.shared.up.weight": "mlp.shared_expert.up_proj.weight",
    "mlp.shared.down.weight": "mlp.shared_expert.down_proj.weight",
}
SHARED_GATE_NAMES = {"mlp.shared_gate.weight": "mlp.shared_expert_gate.weight"}
# Hugging Face's packed tensor -> our tensors, concatenated along dim 1
PACKED_NAMES = {"mlp.experts.gate_up_proj": ("mlp.experts.w_gate", "mlp.experts.w_up")}
# DeepSeek-V3: latent attention (model/latent_attention.py), shared experts named "shared_experts"
MLA_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
}
MLA_Q_LORA_NAMES = {
    "attn.q_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b.weight": "self_attn.q_b_proj.weight",
}
MLA_Q_NAMES = {"attn.q_proj.weight": "self_attn.q_proj.weight"}
QK_NORM_NAMES = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}
DEEPSEEK_SHARED_NAMES = {k: v.replace("shared_expert.", "shared_experts.") for k, v in SHARED_NAMES.items()}
# buffers that map one to one (training state, not parameters): the sigmoid router's expert bias
BUFFER_NAMES = {"mlp.expert_bias": "mlp.gate.e_score_correction_bias"}

CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def rope_theta_of(hf_cfg) -> float:
    params = getattr(hf_cfg, "rope_parameters", None) or getattr(hf_cfg, "rope_scaling", None) or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"only default RoPE is supported, got {params.get('rope_type')}")
    theta = params.get("rope_theta", getattr(hf_cfg, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _common(hf_cfg) -> dict:
    """Fields every family shares (attention, norms, embeddings)."""
    if getattr(hf_cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"only SwiGLU (hidden_act silu) MLPs are supported, got {hf_cfg.hidden_act}")
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    own = head_dim * hf_cfg.num_attention_heads != hf_cfg.hidden_size   # Qwen3's 128 whatever hidden
    return dict(attn_head_dim=head_dim if own else 0,
        vocab=hf_cfg.vocab_size, hidden=hf_cfg.hidden_size, layers=hf_cfg.num_hidden_layers,
        heads=hf_cfg.num_attention_heads, kv_heads=hf_cfg.num_key_value_heads or hf_cfg.num_attention_heads,
        ffn=hf_cfg.intermediate_size, rope_theta=rope_theta_of(hf_cfg), norm_eps=hf_cfg.rms_norm_eps,
        tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        max_seq=hf_cfg.max_position_embeddings, init_std=getattr(hf_cfg, "initializer_range", 0.02))


def qwen2_moe_dense_layers(hf_cfg) -> int:
    """How many leading layers a Qwen2-MoE config keeps dense; ValueError unless the dense ones are a prefix."""
    n = hf_cfg.num_hidden_layers
    step, only = hf_cfg.decoder_sparse_step, set(hf_cfg.mlp_only_layers or [])
    sparse = [i not in only and hf_cfg.num_experts > 0 and (i + 1) % step == 0 for i in range(n)]
    dense = sparse.index(True) if True in sparse else n
    if not all(sparse[dense:]) or dense == n:
        raise ValueError(f"Qwen2-MoE layers {[i for i in range(n) if not sparse[i]]} are dense (mlp_only_layers="
                         f"{sorted(only)}, decoder_sparse_step={step}); fivefold supports dense layers only as the "
                         f"first N < {n} (model.dense_layers): use decoder_sparse_step=1 and mlp_only_layers=[0..N-1]")
    return dense


def config_from_hf(hf_cfg) -> ModelConfig:
    kind = getattr(hf_cfg, "model_type", "llama")
    if kind not in CLASSES:
        raise ValueError(f"unsupported Hugging Face model_type {kind!r}; supported: {', '.join(CLASSES)}")
    if any(getattr(hf_cfg, name, False) for name in ("attention_bias", "mlp_bias")):
        raise ValueError(f"{kind} models with output-projection or MLP biases (attention_bias/mlp_bias) are not "
                         f"supported: fivefold's biases are Qwen2's, on q, k and v only")
    if kind == "deepseek_v3":
        return _deepseek_v3_config(hf_cfg)
    cfg = _common(hf_cfg)
    cfg["max_seq"] = _window_limit(hf_cfg, kind, cfg["max_seq"])
    if kind == "qwen2":
        cfg["qkv_bias"] = True   # Qwen2's attention always has them
    if kind in ("qwen3", "qwen3_moe"):
        cfg["qk_norm"] = True
    if kind == "qwen3_moe":
        cfg.update(experts=hf_cfg.num_experts, top_k=hf_cfg.num_experts_per_tok, moe_ffn=hf_cfg.moe_intermediate_size,
                   dense_layers=qwen2_moe_dense_layers(hf_cfg), aux_loss_coef=hf_cfg.router_aux_loss_coef,
                   router="softmax_topk_norm" if hf_cfg.norm_topk_prob else "softmax_topk")
    if kind == "mixtral":
        if hf_cfg.sliding_window is not None:
            raise ValueError(f"Mixtral with sliding_window={hf_cfg.sliding_window} is not supported (full causal "
                             f"attention only); use sliding_window=None")
        if hf_cfg.router_jitter_noise:
            raise ValueError(f"Mixtral router_jitter_noise={hf_cfg.router_jitter_noise} is not supported; use 0")
        cfg.update(experts=hf_cfg.num_local_experts, top_k=hf_cfg.num_experts_per_tok,
                   moe_ffn=hf_cfg.intermediate_size, router="softmax_topk_norm",
                   aux_loss_coef=hf_cfg.router_aux_loss_coef)
    elif kind == "qwen2_moe":
        m, shared = hf_cfg.moe_intermediate_size, hf_cfg.shared_expert_intermediate_size
        if shared <= 0 or shared % m:
            raise ValueError(f"Qwen2-MoE shared_expert_intermediate_size ({shared}) must be a positive multiple of "
                             f"moe_intermediate_size ({m}): fivefold's shared expert is shared_experts x moe_ffn wide")
        cfg.update(experts=hf_cfg.num_experts, top_k=hf_cfg.num_experts_per_tok, moe_ffn=m,
                   shared_experts=shared // m, shared_expert_gate=True, dense_layers=qwen2_moe_dense_layers(hf_cfg),
                   router="softmax_topk_norm" if hf_cfg.norm_topk_prob else "softmax_topk",
                   aux_loss_coef=hf_cfg.router_aux_loss_coef, qkv_bias=bool(getattr(hf_cfg, "qkv_bias", True)))
    out = ModelConfig(**cfg)
    out.validate()
    return out


def _deepseek_v3_config(hf_cfg) -> ModelConfig:
    """DeepSeek-V3: latent attention, first_k_dense_replace dense layers, then MoE layers of n_routed_experts
    behind the sigmoid router with its score-correction bias, group-limited (n_group, topk_group), weights
    renormalised and times routed_scaling_factor, plus n_shared_experts ungated shared experts. Refused:
    yarn (or any) RoPE scaling, norm_topk_prob false, attention biases, multi-token prediction is ignored
    (transformers builds no MTP layer)."""
    if getattr(hf_cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"only SwiGLU (hidden_act silu) MLPs are supported, got {hf_cfg.hidden_act}")
    if getattr(hf_cfg, "attention_bias", False):
        raise ValueError("DeepSeek-V3 with attention_bias is not supported (fivefold's latent attention has no biases)")
    if not hf_cfg.norm_topk_prob:
        raise ValueError("DeepSeek-V3 with norm_topk_prob false is not supported: the sigmoid_bias router "
                         "renormalises its top-k weights")
    layers, dense = hf_cfg.num_hidden_layers, hf_cfg.first_k_dense_replace or 0
    moe = dense < layers and hf_cfg.n_routed_experts
    groups = hf_cfg.n_group or 0
    cfg = dict(vocab=hf_cfg.vocab_size, hidden=hf_cfg.hidden_size, layers=layers, heads=hf_cfg.num_attention_heads,
               kv_heads=hf_cfg.num_attention_heads, ffn=hf_cfg.intermediate_size, rope_theta=rope_theta_of(hf_cfg),
               norm_eps=hf_cfg.rms_norm_eps, tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
               max_seq=hf_cfg.max_position_embeddings, init_std=getattr(hf_cfg, "initializer_range", 0.02),
               q_lora_rank=hf_cfg.q_lora_rank or 0, kv_lora_rank=hf_cfg.kv_lora_rank,
               qk_nope_dim=hf_cfg.qk_nope_head_dim, qk_rope_dim=hf_cfg.qk_rope_head_dim, v_head_dim=hf_cfg.v_head_dim,
               rope_interleave=bool(hf_cfg.rope_interleave))
    if moe:
        cfg.update(experts=hf_cfg.n_routed_experts, top_k=hf_cfg.num_experts_per_tok,
                   moe_ffn=hf_cfg.moe_intermediate_size, shared_experts=hf_cfg.n_shared_experts or 0,
                   dense_layers=dense, router="sigmoid_bias", router_groups=groups if groups > 1 else 0,
                   router_group_limit=hf_cfg.topk_group if groups > 1 else 0,
                   routed_scaling_factor=float(hf_cfg.routed_scaling_factor))
    out = ModelConfig(**cfg)
    out.validate()
    return out


def _deepseek_v3_hf(cfg: ModelConfig, common: dict):
    import transformers

    if not cfg.mla:
        raise ValueError("DeepSeek-V3 has latent attention: this model has none (model.kv_lora_rank 0)")
    if cfg.experts and (cfg.router != "sigmoid_bias" or cfg.shared_expert_gate):
        raise ValueError("DeepSeek-V3 routes by sigmoid_bias and does not gate its shared experts")
    if cfg.experts and cfg.router_groups and cfg.router_groups <= 1:
        raise ValueError("DeepSeek-V3's group-limited routing needs router_groups > 1")
    common = {k: v for k, v in common.items() if k != "num_key_value_heads"}
    moe = dict(n_routed_experts=cfg.experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.expert_ffn,
               n_shared_experts=cfg.shared_experts, first_k_dense_replace=cfg.dense_layers,
               n_group=cfg.router_groups or 1, topk_group=cfg.router_group_limit or 1,
               routed_scaling_factor=cfg.routed_scaling_factor) if cfg.experts else \
        dict(n_routed_experts=1, first_k_dense_replace=cfg.layers, n_group=1, topk_group=1)
    return transformers.DeepseekV3Config(
        intermediate_size=cfg.ffn, num_key_value_heads=cfg.heads, q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_dim, qk_rope_head_dim=cfg.qk_rope_dim,
        v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave, norm_topk_prob=True, attention_bias=False,
        **moe, **common)


def _window_limit(hf_cfg, kind: str, max_seq: int) -> int:
    """max_seq under a sliding window: the window when it is shorter (up to it, attention is full causal).
    Mistral and Mixtral name a window by `sliding_window`; Qwen2 and Qwen2-MoE only with use_sliding_window."""
    window = getattr(hf_cfg, "sliding_window", None)
    if kind in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and not getattr(hf_cfg, "use_sliding_window", False):
        window = None
    return min(max_seq, window) if window else max_seq


def hf_family(cfg: ModelConfig) -> str:
    """The transformers family that holds this model exactly: llama (dense); mixtral (softmax_topk_norm,
    no shared expert, no dense layers); qwen2_moe (softmax routers, shared experts behind a gate)."""
    if cfg.mla:
        return "deepseek_v3"
    if cfg.qk_norm:
        return "qwen3_moe" if cfg.experts else "qwen3"
    if not cfg.experts:
        return "qwen2" if cfg.qkv_bias else "llama"
    if cfg.router == "sigmoid_bias" or cfg.router_groups:
        raise ValueError(f"no supported Hugging Face family routes like this model (router {cfg.router}, "
                         f"router_groups {cfg.router_groups}); export supports Mixtral and Qwen2-MoE routers")
    if not cfg.shared_experts and not cfg.dense_layers and cfg.router == "softmax_topk_norm" and not cfg.qkv_bias:
        return "mixtral"
    if cfg.shared_expert_gate:
        return "qwen2_moe"
    raise ValueError("this MoE model has no Hugging Face family: Mixtral has no shared experts or dense layers and "
                     "renormalises its top-k; Qwen2-MoE gates its shared experts (shared_expert_gate true)")


def config_to_hf(cfg: ModelConfig, family: str | None = None):
    import transformers

    family = family or hf_family(cfg)
    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, rope_theta=cfg.rope_theta,
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                  max_position_embeddings=cfg.max_seq, initializer_range=cfg.init_std, attention_dropout=0.0)
    if family == "deepseek_v3":
        return _deepseek_v3_hf(cfg, common)
    if cfg.qk_norm != family.startswith("qwen3"):
        raise ValueError(f"{family} {'has no' if cfg.qk_norm else 'always has'} q/k norms (model.qk_norm "
                         f"{str(cfg.qk_norm).lower()}): export as {'qwen3 / qwen3_moe' if cfg.qk_norm else hf_family(cfg)}")
    if family != "mistral" and family != "mixtral":
        common["head_dim"] = cfg.head_dim
    if cfg.mla:
        raise ValueError(f"{family} has no latent attention (model.kv_lora_rank > 0): export as deepseek_v3")
    if cfg.routed_scaling_factor != 1.0:
        raise ValueError(f"{family} does not scale its routed weights (model.routed_scaling_factor "
                         f"{cfg.routed_scaling_factor}): export as deepseek_v3")
    dense = family in ("llama", "mistral", "qwen2")
    if dense and cfg.experts:
        raise ValueError(f"{family} is a dense family; this model has {cfg.experts} experts")
    if family in ("llama", "mistral", "mixtral") and cfg.qkv_bias:
        raise ValueError(f"{family} has no q/k/v biases (model.qkv_bias): export as qwen2 / qwen2_moe")
    if family == "qwen2" and not cfg.qkv_bias:
        raise ValueError("Qwen2 always has q/k/v biases: this model has none (model.qkv_bias false); use llama")
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=cfg.ffn, attention_bias=False, mlp_bias=False, **common)
    if family == "mistral":
        return transformers.MistralConfig(intermediate_size=cfg.ffn, sliding_window=None, head_dim=cfg.head_dim,
                                          **common)
    if family == "qwen2":
        return transformers.Qwen2Config(intermediate_size=cfg.ffn, use_sliding_window=False, **common)
    if family in ("qwen3", "qwen3_moe") and cfg.qkv_bias:
        raise ValueError("Qwen3 has no q/k/v biases (model.qkv_bias): export as qwen2 / qwen2_moe")
    if family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=cfg.ffn, attention_bias=False, use_sliding_window=False,
                                        **common)
    if family == "qwen3_moe":
        if cfg.shared_experts or cfg.router not in ("softmax_topk_norm", "softmax_topk"):
            raise ValueError("Qwen3-MoE has no shared experts and routes by softmax top-k")
        return transformers.Qwen3MoeConfig(
            intermediate_size=cfg.ffn, moe_intermediate_size=cfg.expert_ffn, num_experts=cfg.experts,
            num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.router == "softmax_topk_norm", decoder_sparse_step=1,
            mlp_only_layers=list(range(cfg.dense_layers)), attention_bias=False, use_sliding_window=False,
            router_aux_loss_coef=cfg.aux_loss_coef, **common)
    if family == "mixtral":
        if cfg.shared_experts or cfg.dense_layers or cfg.router != "softmax_topk_norm":
            raise ValueError("Mixtral has no shared experts or dense layers and renormalises its top-k")
        return transformers.MixtralConfig(intermediate_size=cfg.expert_ffn, num_local_experts=cfg.experts,
                                          num_experts_per_tok=cfg.top_k, router_aux_loss_coef=cfg.aux_loss_coef,
                                          sliding_window=None, router_jitter_noise=0.0, head_dim=cfg.head_dim,
                                          **common)
    if family == "qwen2_moe":
        if not cfg.shared_expert_gate or cfg.router not in ("softmax_topk_norm", "softmax_topk"):
            raise ValueError("Qwen2-MoE gates its shared experts (shared_expert_gate) and routes by softmax top-k")
        return transformers.Qwen2MoeConfig(
            intermediate_size=cfg.ffn, moe_intermediate_size=cfg.expert_ffn,
            shared_expert_intermediate_size=cfg.shared_experts * cfg.expert_ffn, num_experts=cfg.experts,
            num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.router == "softmax_topk_norm",
            decoder_sparse_step=1, mlp_only_layers=list(range(cfg.dense_layers)), qkv_bias=cfg.qkv_bias,
            use_sliding_window=False, router_aux_loss_coef=cfg.aux_loss_coef, **common)
    raise ValueError(f"unknown family {family!r}; supported: {', '.join(CLASSES)}")


def name_map(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the Hugging Face name, for the tensors that map one to one (all but the
    experts' w_gate and w_up: see `packed_map`)."""
    out = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        out["head.weight"] = "lm_head.weight"
    for i in range(cfg.layers):
        if cfg.mla:
            names = {**MLA_NAMES, **(MLA_Q_LORA_NAMES if cfg.q_lora_rank else MLA_Q_NAMES)}
        else:
            names = {**ATTN_NAMES, **(QKV_BIAS_NAMES if cfg.qkv_bias else {}), **(QK_NORM_NAMES if cfg.qk_norm else {})}
        if cfg.is_moe_layer(i):
            names.update(MOE_NAMES)
            names.update((DEEPSEEK_SHARED_NAMES if cfg.mla else SHARED_NAMES) if cfg.shared_experts else {})
            names.update(SHARED_GATE_NAMES if cfg.shared_expert_gate else {})
        else:
            names.update(DENSE_NAMES)
        for ours, theirs in names.items():
            out[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return out


def buffer_map(cfg: ModelConfig) -> dict[str, str]:
    """Our buffer name -> the Hugging Face name (the sigmoid router's expert bias, DeepSeek-V3's
    e_score_correction_bias)."""
    if cfg.router != "sigmoid_bias":
        return {}
    return {f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for i in range(cfg.layers) if cfg.is_moe_layer(i)
            for ours, theirs in BUFFER_NAMES.items()}


def packed_map(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Hugging Face name -> our names whose concatenation along dim 1 it is (each MoE layer's gate_up_proj)."""
    return {f"model.layers.{i}.{theirs}": tuple(f"layers.{i}.{o}" for o in ours)
            for i in range(cfg.layers) if cfg.is_moe_layer(i) for theirs, ours in PACKED_NAMES.items()}
