"""Import and export Hugging Face Llama weights.

`from_hf(m)` takes a `transformers` LlamaForCausalLM (an object, or a folder saved with
`save_pretrained`) and returns our `Transformer` with the same weights; `to_hf(model)` goes back.
Names map one to one; no tensor is permuted (both use the "rotate half" RoPE layout).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from .transformer import Transformer

# ours -> Hugging Face, per layer
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}


def rope_theta_of(hf_cfg) -> float:
    params = getattr(hf_cfg, "rope_parameters", None) or getattr(hf_cfg, "rope_scaling", None) or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"only default RoPE is supported, got {params.get('rope_type')}")
    theta = params.get("rope_theta", getattr(hf_cfg, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def config_from_hf(hf_cfg) -> ModelConfig:
    if getattr(hf_cfg, "attention_bias", False) or getattr(hf_cfg, "mlp_bias", False):
        raise ValueError("Llama models with attention or MLP biases are not supported")
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    if head_dim * hf_cfg.num_attention_heads != hf_cfg.hidden_size:
        raise ValueError("head_dim * heads must equal hidden_size")
    return ModelConfig(
        vocab=hf_cfg.vocab_size, hidden=hf_cfg.hidden_size, layers=hf_cfg.num_hidden_layers,
        heads=hf_cfg.num_attention_heads, kv_heads=hf_cfg.num_key_value_heads or hf_cfg.num_attention_heads,
        ffn=hf_cfg.intermediate_size, rope_theta=rope_theta_of(hf_cfg), norm_eps=hf_cfg.rms_norm_eps,
        tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        max_seq=hf_cfg.max_position_embeddings, init_std=getattr(hf_cfg, "initializer_range", 0.02))


def config_to_hf(cfg: ModelConfig):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_seq, initializer_range=cfg.init_std, attention_bias=False,
        mlp_bias=False, attention_dropout=0.0)


def name_map(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the Hugging Face name."""
    out = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        out["head.weight"] = "lm_head.weight"
    for i in range(cfg.layers):
        for ours, theirs in LAYER_NAMES.items():
            out[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return out


def from_hf(hf_model) -> Transformer:
    """Our Transformer with the weights of a transformers LlamaForCausalLM (object or saved folder)."""
    if isinstance(hf_model, (str, Path)):
        from transformers import LlamaForCausalLM

        hf_model = LlamaForCausalLM.from_pretrained(hf_model)
    cfg = config_from_hf(hf_model.config)
    model = Transformer(cfg)
    theirs = hf_model.state_dict()
    with torch.no_grad():
        params = dict(model.named_parameters())
        for ours, name in name_map(cfg).items():
            params[ours].copy_(theirs[name])
    return model.to(next(hf_model.parameters()).dtype)


def to_hf(model: Transformer):
    """A transformers LlamaForCausalLM holding our model's weights."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(config_to_hf(model.cfg))
    params = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())
    with torch.no_grad():
        for ours, name in name_map(model.cfg).items():
            theirs[name].copy_(params[ours])
    return hf.to(next(model.parameters()).dtype)
