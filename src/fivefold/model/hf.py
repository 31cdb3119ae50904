"""Move weights between our `Transformer` and a Hugging Face Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE or
DeepSeek-V3 model: `from_hf(m)` takes a `transformers` ForCausalLM (an object, or a folder saved with
`save_pretrained`, read tensor by tensor by model/hf_weights.py) and returns our model with the same
weights; `to_hf(model)` goes back, to the family `hf_family(cfg)` picks (or the one named). What maps to
what, and what is refused: model/hf_map.py.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from .hf_map import CLASSES, buffer_map, config_from_hf, config_to_hf, hf_family, name_map, packed_map
from .hf_weights import load_hf_model
from .transformer import Transformer


def _check_covered(theirs: dict, cfg: ModelConfig) -> None:
    """Every Hugging Face tensor is one we map (a new layout or an unsupported feature fails loudly)."""
    mapped = set(name_map(cfg).values()) | set(packed_map(cfg)) | set(buffer_map(cfg).values())
    missing = sorted(mapped - set(theirs))
    extra = sorted(n for n in set(theirs) - mapped if not (n == "lm_head.weight" and cfg.tie_embeddings))
    if missing or extra:
        raise ValueError(f"Hugging Face weights do not match the expected layout (transformers 5.x, packed "
                         f"experts): missing {missing[:4]}, unexpected {extra[:4]}")


def from_hf(hf_model) -> Transformer:
    """Our Transformer with the weights of a transformers Llama/Mistral/Qwen2/Mixtral/Qwen2-MoE
    ForCausalLM (an object), or of a saved folder (read tensor by tensor from its safetensors files:
    model/hf_weights.py's `load_hf_model`; fp32)."""
    if isinstance(hf_model, (str, Path)):
        return load_hf_model(hf_model)
    cfg = config_from_hf(hf_model.config)
    model = Transformer(cfg)
    theirs = hf_model.state_dict()
    _check_covered(theirs, cfg)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for ours, name in name_map(cfg).items():
            params[ours].copy_(theirs[name])
        for name, ours in packed_map(cfg).items():
            for mine, part in zip(ours, theirs[name].chunk(len(ours), dim=1)):
                params[mine].copy_(part)
        buffers = dict(model.named_buffers())
        for ours, name in buffer_map(cfg).items():
            buffers[ours].copy_(theirs[name])
    return model.to(next(hf_model.parameters()).dtype)


def to_hf(model: Transformer, family: str | None = None):
    """A transformers ForCausalLM of `family` (default `hf_family(model.cfg)`) holding our model's weights."""
    import transformers

    family = family or hf_family(model.cfg)
    hf = getattr(transformers, CLASSES[family])(config_to_hf(model.cfg, family))
    params = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())
    with torch.no_grad():
        for ours, name in name_map(model.cfg).items():
            theirs[name].copy_(params[ours])
        for name, ours in packed_map(model.cfg).items():
            theirs[name].copy_(torch.cat([params[o] for o in ours], dim=1))
        mine, their_buffers = dict(model.named_buffers()), dict(hf.named_buffers())
        for ours, name in buffer_map(model.cfg).items():
            their_buffers[name].copy_(mine[ours])
    return hf.to(next(model.parameters()).dtype)
