"""Model presets: parameter counts equal the published totals; HF configs and our ModelConfig load."""
import json
from dataclasses import replace

import pytest

from fivefold.config import ConfigError, ModelConfig
from fivefold.plan.models import PRESETS, from_hf_config, from_model_config, load_model

from tests.support.tiny import tiny_config

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


def test_document_mask_counts_attention_per_document():
    """Packed documents masked (Workload.document_length, train.document_mask): a document of L tokens
    costs L²/2 causal pairs instead of its share of seq²/2, so attention FLOPs follow sum(len²)/sum(len);
    the step is faster, memory and traffic are those of the unmasked plan."""
    from fivefold.plan.estimate import estimate
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.topology import TOPOLOGIES

    m = PRESETS["llama3-8b"]
    lens = [1024, 2048, 5120]                               # one sequence of 8192 tokens, three documents
    pairs = sum(n * n / 2 for n in lens)                    # causal (query, key) pairs per head and layer
    whole = Workload(seq=8192, global_batch=64)
    docs = replace(whole, document_length=sum(n * n for n in lens) / sum(lens))
    per_pair = m.layers * m.heads * 2 * 2 * m.head_dim      # QK^T and AV, 2 FLOPs per multiply-add
    assert m.attention_flops_per_token(docs.attention_span) == pytest.approx(per_pair * pairs / 8192)
    assert m.attention_flops_per_token(whole.attention_span) == pytest.approx(per_pair * 8192 / 2)
    assert replace(whole, document_length=10**6).attention_span == 8192   # a document past the sequence: seq
    lay = Layout(tp=8, dp=8, micro_batch=1)
    a, b = (estimate(m, lay, w, TOPOLOGIES["dgx-h100"], 64) for w in (whole, docs))
    assert b.time.step_time_s < a.time.step_time_s
    assert b.memory.most_loaded == a.memory.most_loaded
    assert [(f.dim, f.op, f.calls, f.bytes_sent) for f in b.flows] == [(f.dim, f.op, f.calls, f.bytes_sent) for f in a.flows]


# -- Hugging Face families: counts equal transformers' models built from the same config ------------------
_SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=1000, intermediate_size=160,
              max_position_embeddings=128)
PYTHIA_6_9B = dict(model_type="gpt_neox", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                   intermediate_size=16384, vocab_size=50432, max_position_embeddings=2048, rotary_pct=0.25,
                   use_parallel_residual=True, tie_word_embeddings=False, hidden_act="gelu")
HF_CONFIGS = {
    "llama": dict(model_type="llama", num_key_value_heads=2, **_SMALL),
    "llama-tied": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True, **_SMALL),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, **_SMALL),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True, **_SMALL),
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    **_SMALL),
    "qwen2_moe": dict(model_type="qwen2_moe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64, **_SMALL),
    "deepseek_v2": dict(model_type="deepseek_v2", num_key_value_heads=4, n_routed_experts=4, n_shared_experts=2,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=None,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
                        topk_group=1, **_SMALL),
    "deepseek_v3": dict(model_type="deepseek_v3", num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        topk_method="noaux_tc", n_group=1, topk_group=1, **_SMALL),
    "gpt_neox": dict(model_type="gpt_neox", use_parallel_residual=True, hidden_act="gelu", **_SMALL),
    "gpt_neox-sequential-tied": dict(model_type="gpt_neox", use_parallel_residual=False, tie_word_embeddings=True,
                                     **_SMALL),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, vocab_size=1000, n_positions=128,
                 bos_token_id=0, eos_token_id=0),
    "gpt2-n_inner-untied": dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, vocab_size=1000, n_positions=128,
                                n_inner=100, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    "pythia-6.9b": PYTHIA_6_9B,
    # a head dim of its own (not hidden / heads), Qwen3's q/k norms, Qwen3-MoE's experts without a shared one
    "mistral-head-dim": dict(model_type="mistral", head_dim=32, num_key_value_heads=2, **_SMALL),
    "qwen3": dict(model_type="qwen3", head_dim=24, num_key_value_heads=2, tie_word_embeddings=True, **_SMALL),
    "qwen3-moe": dict(model_type="qwen3_moe", head_dim=24, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True, **_SMALL),
}


def transformers_count(config: dict) -> int:
    """Parameters of the transformers model built from `config` on the meta device (no weights, no
    download); tied weights once."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = dict(config)
    cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hugging_face_families_count_like_transformers(name):
    ours = from_hf_config(HF_CONFIGS[name])
    # DeepSeek-V3's score-correction bias: a tensor of the checkpoint, a buffer in transformers
    buffers = ours.experts * (ours.layers - ours.dense_layers) if ours.router_bias else 0
    assert ours.num_params() == transformers_count(HF_CONFIGS[name]) + buffers


def test_pythia_is_a_gelu_model_of_6_9_billion():
    """GPT-NeoX 6.9B (Pythia): 6,857,302,016 parameters, not the 9.0 B a SwiGLU reading gives; FLOPs per
    token follow the two-matrix GELU MLP."""
    m = from_hf_config(PYTHIA_6_9B)
    assert m.num_params() == 6_857_302_016
    assert (m.mlp, m.norm, m.linear_bias, m.parallel_residual, m.tie_embeddings) == ("gelu", "layer", True, True, False)
    h, f, L = 4096, 16384, 32
    assert m.layer_params(0) == 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    six_n = 6 * (m.num_params() - m.vocab * h - 2 * h)  # no FLOPs: the embedding lookup, the final norm
    assert m.flops_per_token(2048) == pytest.approx(six_n + 3 * L * 2 * 2048 * h * 2 / 2)
    gated = replace(m, mlp="swiglu")
    assert gated.flops_per_token(2048) - m.flops_per_token(2048) == 6 * L * (h * f + f)   # a third matrix (and bias)


@pytest.mark.parametrize("config, words", [
    (dict(model_type="gemma", **_SMALL), ["'gemma'", "gpt_neox", "llama"]),
    (dict(model_type="gptj", n_embd=64, n_layer=2, n_head=4, vocab_size=100), ["'gptj'", "supported"]),
    (dict(model_type="gpt_neox", hidden_act="softplus", **_SMALL), ["'softplus'", "gelu"]),
    (dict(model_type="llama", attention_bias=True, **_SMALL), ["attention_bias"]),
])
def test_hugging_face_configs_it_cannot_model_are_refused_in_one_line(config, words):
    with pytest.raises(ConfigError) as e:
        from_hf_config(config)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


# -- MFU under both attention conventions -------------------------------------------------------------------
def test_mfu_is_given_under_both_attention_conventions():
    """`mfu` halves causal attention FLOPs; `mfu_attention_full` is the same step counted as 6N + 12·L·H·Q·T
    (PaLM App. B, Narayanan et al. 2021). Llama-3 8B at s = 8192: attention is (4·s·d_attn per layer)."""
    from fivefold.plan.estimate import estimate
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.report import estimate_text
    from fivefold.plan.topology import TOPOLOGIES

    m, s = PRESETS["llama3-8b"], 8192
    six_n = 6 * m.matmul_params_per_token()
    L, H, Q = m.layers, m.heads, m.head_dim
    e = estimate(m, Layout(tp=8, dp=1), Workload(seq=s, global_batch=8), TOPOLOGIES["dgx-h100"])
    assert e.mfu_attention_full == pytest.approx(e.time.mfu * (six_n + 12 * L * H * Q * s) / (six_n + 6 * L * H * Q * s))
    d = e.to_dict()
    assert (d["mfu"], d["mfu_attention_full"]) == (e.time.mfu, e.mfu_attention_full)
    assert "halved" in d["mfu_convention"]["mfu"] and "12LHQT" in d["mfu_convention"]["mfu_attention_full"]
    text = estimate_text(e)
    assert (f"MFU {e.time.mfu:.1%} (assumed: GEMMs by shape, at most 60% of peak), causal attention FLOPs halved; "
            f"{e.mfu_attention_full:.1%} not halved (6N + 12LHQT)") in text
    # bidirectional attention: one convention, one number
    bi = estimate(m, Layout(tp=8, dp=1), Workload(seq=s, global_batch=8, causal=False), TOPOLOGIES["dgx-h100"])
    assert bi.mfu_attention_full == bi.time.mfu and "not halved" not in estimate_text(bi)
