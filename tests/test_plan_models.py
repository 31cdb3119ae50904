"""Model presets: parameter counts equal the published totals; HF configs and our ModelConfig load."""
import json

import pytest

from fivefold.config import ConfigError, ModelConfig
from fivefold.plan.models import PRESETS, from_hf_config, from_model_config, load_model

from .helpers import tiny_config

# Exact totals of the released checkpoints (sum of tensor sizes), and the rounded figure each paper states.
PUBLISHED = {
    # Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3 (8B, 70B, 405B); HF safetensors totals.
    "llama3-8b": (8_030_261_248, 8.0e9),
    "llama3-70b": (70_553_706_496, 70.6e9),
    "llama3-405b": (405_853_388_800, 405e9),
    # Jiang et al. 2024, "Mixtral of Experts": 46.7B total, 12.9B active (HF total 46,702,792,704).
    "mixtral-8x7b": (46_702_792_704, 46.7e9),
    # DeepSeek-AI 2024, "DeepSeek-V3 Technical Report": 671B total, 37B activated per token (main model,
    # without the 14B multi-token-prediction module).
    "deepseek-v3": (671_026_419_200, 671e9),
    # Brown et al. 2020, Table 2.1: "175.0B".
    "gpt3-175b": (None, 175.0e9),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_equal_published_totals(name):
    exact, stated = PUBLISHED[name]
    n = PRESETS[name].num_params()
    if exact is not None:
        assert n == exact
    assert n == pytest.approx(stated, rel=5e-3)   # the figure the paper states, to its precision


def test_active_parameters_of_moe_presets():
    # Mixtral paper: "13B active parameters" (12.9B); DeepSeek-V3: 37B activated.
    assert PRESETS["mixtral-8x7b"].active_params() == pytest.approx(12.9e9, rel=0.005)
    assert PRESETS["deepseek-v3"].active_params() == pytest.approx(37e9, rel=0.02)
    assert PRESETS["llama3-8b"].active_params() == PRESETS["llama3-8b"].num_params()


def _hf_llama(h=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256, **extra):
    return {"model_type": "llama", "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": ffn, "vocab_size": vocab,
            "tie_word_embeddings": False, "max_position_embeddings": 8192, **extra}


def test_hugging_face_configs_give_the_preset_counts(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf_llama()))
    assert load_model(str(path)).num_params() == PRESETS["llama3-8b"].num_params()
    mixtral = _hf_llama(vocab=32000, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    assert from_hf_config(mixtral).num_params() == PRESETS["mixtral-8x7b"].num_params()
    deepseek = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "vocab_size": 129280, "n_routed_experts": 256,
                "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                "topk_method": "noaux_tc", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False}
    assert from_hf_config(deepseek).num_params() == PRESETS["deepseek-v3"].num_params()


def test_our_model_config_counts_like_the_runtime(tmp_path):
    for cfg in (ModelConfig(), tiny_config().model, ModelConfig(tie_embeddings=False, kv_heads=4)):
        assert from_model_config(cfg).num_params() == cfg.num_params()
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nhidden = 64\nlayers = 3\nheads = 4\nkv_heads = 2\nffn = 128\n")
    assert load_model(str(toml)).num_params() == ModelConfig(hidden=64, layers=3, heads=4, kv_heads=2,
                                                             ffn=128).num_params()


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ConfigError) as e:
        load_model("llama9-1t")
    for name in PRESETS:
        assert name in str(e.value)


def test_flops_per_token_is_six_n_plus_attention():
    m = PRESETS["llama3-8b"]
    six_n = 6 * (m.num_params() - m.vocab * m.hidden)        # the embedding lookup has no FLOPs
    attn = 3 * m.layers * 2 * 4096 * m.heads * 2 * m.head_dim / 2
    assert m.flops_per_token(4096) == pytest.approx(six_n + attn)
