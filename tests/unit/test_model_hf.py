"""Our Llama equals transformers' LlamaForCausalLM: logits, loss and gradients, several configs."""
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from fivefold.model import Transformer, loss_sum  # noqa: E402
from fivefold.model.hf import from_hf, to_hf  # noqa: E402
from fivefold.model.hf_map import config_from_hf, hf_family, name_map  # noqa: E402

from tests.support.tiny import perturb_qk_norms  # noqa: E402

CONFIGS = [
    dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0),
    dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0),
    dict(num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0),
    dict(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1000.0),
]


def hf_model(**kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager",
                                   **kw)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_loss_grads_match(kw):
    hf = hf_model(**kw)
    ours = from_hf(hf)
    assert ours.cfg.tie_embeddings == kw["tie_word_embeddings"] and ours.cfg.rope_theta == kw["rope_theta"]
    tokens = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, 1)
    logits_hf = hf(tokens).logits
    logits = ours(tokens)
    torch.testing.assert_close(logits, logits_hf, rtol=1e-5, atol=1e-5)
    loss_hf = F.cross_entropy(logits_hf.flatten(0, 1), targets.flatten())
    loss = loss_sum(logits, targets) / targets.numel()
    torch.testing.assert_close(loss, loss_hf, rtol=1e-6, atol=1e-6)
    loss_hf.backward()
    loss.backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name_map(ours.cfg)[name]].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def match_transformers(ours, hf) -> None:
    """Our model against a transformers one holding the same weights: logits (1e-5), the language-model
    loss's gradient of every parameter (1e-4; an expert's w_gate / w_up against its half of gate_up_proj),
    and exported back, the same state dict and logits."""
    tokens = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, 1)
    logits_hf = hf(tokens).logits
    logits = ours(tokens)
    torch.testing.assert_close(logits, logits_hf, rtol=1e-5, atol=1e-5)
    F.cross_entropy(logits_hf.flatten(0, 1), targets.flatten()).backward()
    (loss_sum(logits, targets) / targets.numel()).backward()
    theirs = dict(hf.named_parameters())
    names = name_map(ours.cfg)
    for name, p in ours.named_parameters():
        if name in names:
            want = theirs[names[name]].grad
        else:
            packed = "model." + name.rsplit(".", 1)[0] + ".gate_up_proj"
            want = theirs[packed].grad.chunk(2, dim=1)[0 if name.endswith("w_gate") else 1]
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    back = to_hf(ours)
    assert type(back) is type(hf)
    want, got = hf.state_dict(), back.state_dict()
    assert set(got) == set(want)
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    torch.testing.assert_close(back.eval()(tokens).logits, logits_hf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim, tied", [(12, False), (16, True)])
def test_qwen3_logits_grads_and_round_trip(head_dim, tied):
    """Qwen3: q and k normalised per head before RoPE, a head dim of its own (12 or 16 x 4 heads, not hidden
    64 / 4): logits and gradients equal transformers', and the model goes back to the same tensors."""
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=64, rms_norm_eps=1e-6,
        attn_implementation="eager", tie_word_embeddings=tied)).eval()
    perturb_qk_norms(hf)   # the q/k norms start at one: make them matter
    ours = from_hf(hf)
    assert ours.cfg.qk_norm and ours.cfg.head_dim == head_dim and hf_family(ours.cfg) == "qwen3"
    assert sum(p.numel() for p in ours.parameters()) == ours.cfg.num_params() == \
        sum(p.numel() for p in hf.parameters())
    match_transformers(ours, hf)


def test_round_trip_and_saved_folder(tmp_path):
    hf = hf_model(**CONFIGS[0])
    hf.save_pretrained(tmp_path)
    ours = from_hf(str(tmp_path))
    back = to_hf(ours)
    theirs = hf.state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    tokens = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(back(tokens).logits, hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_seeded_init_is_deterministic():
    cfg = from_hf(hf_model(**CONFIGS[1])).cfg
    a, b, c = Transformer(cfg, seed=3), Transformer(cfg, seed=3), Transformer(cfg, seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q)
        if p.dim() > 1:
            assert not torch.equal(p, r)
    assert a.head.weight is a.embed.weight


# -- mixture of experts: Mixtral, Qwen2-MoE and Qwen3-MoE ---------------------------------------------------------

MOE_COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager",
                  num_experts_per_tok=2)
MOE_CASES = {
    "mixtral": dict(intermediate_size=48, num_local_experts=4, tie_word_embeddings=False),
    "mixtral_tied": dict(intermediate_size=32, num_local_experts=4, tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2_moe_norm": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                           num_experts=4, norm_topk_prob=True, qkv_bias=False),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      num_experts=4, norm_topk_prob=False, qkv_bias=False),
    "qwen2_moe_dense0": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                             num_experts=4, norm_topk_prob=False, qkv_bias=False, mlp_only_layers=[0]),
    # Qwen3-MoE: q/k norms, a head dim of its own (12 x 4 heads = 48 != hidden 64), no shared expert
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, norm_topk_prob=True, head_dim=12),
    "qwen3_moe_dense0": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, norm_topk_prob=False,
                             head_dim=16, mlp_only_layers=[0]),
}


def hf_moe(case, **over):
    torch.manual_seed(0)
    kw = {**MOE_COMMON, **MOE_CASES[case], **over}
    if case.startswith("mixtral"):
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw)).eval()
    if case.startswith("qwen3"):
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw)).eval()
        perturb_qk_norms(model)   # the q/k norms start at one: make them matter
        return model
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**kw)).eval()


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_logits_grads_and_round_trip(case):
    hf = hf_moe(case)
    ours = from_hf(hf)
    c = ours.cfg
    assert (c.experts, c.top_k) == (4, 2)
    if case.startswith("mixtral"):
        assert (c.router, c.shared_experts, c.moe_ffn, c.dense_layers) == ("softmax_topk_norm", 0, c.ffn, 0)
    elif case.startswith("qwen3"):
        kw = MOE_CASES[case]
        assert c.qk_norm and c.head_dim == kw["head_dim"]   # (attn_head_dim 0 where it is hidden / heads)
        assert c.router == ("softmax_topk_norm" if kw["norm_topk_prob"] else "softmax_topk") and not c.shared_experts
        assert c.dense_layers == len(kw.get("mlp_only_layers", []))
    else:
        kw = MOE_CASES[case]
        assert c.router == ("softmax_topk_norm" if kw["norm_topk_prob"] else "softmax_topk")
        assert c.shared_expert_gate and c.shared_experts * c.moe_ffn == kw["shared_expert_intermediate_size"]
        assert c.dense_layers == len(kw.get("mlp_only_layers", []))
    tokens = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, 1)
    logits_hf = hf(tokens).logits
    ours.eval()
    logits = ours(tokens)
    torch.testing.assert_close(logits, logits_hf, rtol=1e-5, atol=1e-5)
    # gradients of the language-model loss (our aux losses off: Hugging Face adds its own only on request)
    for layer in ours.layers:
        if hasattr(layer.mlp, "aux_loss_coef"):
            layer.mlp.aux_loss_coef = 0.0
    F.cross_entropy(logits_hf.flatten(0, 1), targets.flatten()).backward()
    (loss_sum(ours(tokens), targets) / targets.numel()).backward()
    theirs = dict(hf.named_parameters())
    names = name_map(c)
    for name, p in ours.named_parameters():
        if name in names:
            want = theirs[names[name]].grad
        else:   # w_gate / w_up: halves of gate_up_proj
            packed = "model." + name.rsplit(".", 1)[0] + ".gate_up_proj"
            want = theirs[packed].grad.chunk(2, dim=1)[0 if name.endswith("w_gate") else 1]
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    back = to_hf(ours)
    assert type(back) is type(hf)
    want = hf.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    back.eval()
    torch.testing.assert_close(back(tokens).logits, logits_hf, rtol=1e-5, atol=1e-5)


def test_moe_saved_folder_and_export_from_scratch(tmp_path):
    hf = hf_moe("qwen2_moe_norm")
    hf.save_pretrained(tmp_path)
    ours = from_hf(str(tmp_path)).eval()
    tokens = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    # a model of ours (seeded init), exported and imported back: the same weights and logits
    mine = Transformer(from_hf(hf_moe("mixtral")).cfg, seed=5).eval()
    again = from_hf(to_hf(mine).eval()).eval()
    for (n, p), q in zip(mine.named_parameters(), again.parameters()):
        assert torch.equal(p, q), n
    torch.testing.assert_close(again(tokens), mine(tokens), rtol=0, atol=0)


def test_moe_load_balance_loss_matches_hf_convention():
    """One layer, one sequence: Hugging Face's loss is k times ours (its f_e counts per token, not per
    assignment), before coefficients."""
    hf = hf_moe("mixtral", num_hidden_layers=1)
    ours = from_hf(hf)
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    theirs = hf(tokens, output_router_logits=True).aux_loss
    ours(tokens)
    (value,) = ours.aux.values
    torch.testing.assert_close(value / ours.cfg.aux_loss_coef * 2, theirs.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("over, words", [
    (dict(decoder_sparse_step=2, num_hidden_layers=4), "layers [0, 2] are dense"),
    (dict(mlp_only_layers=[1]), "layers [1] are dense"),
    (dict(shared_expert_intermediate_size=48), "multiple of moe_intermediate_size"),
])
def test_qwen2_moe_unsupported_configs_refused(over, words):
    cfg = transformers.Qwen2MoeConfig(**{**MOE_COMMON, **MOE_CASES["qwen2_moe"], **over})
    with pytest.raises(ValueError, match=re.escape(words)):
        config_from_hf(cfg)


def test_qwen2_moe_with_qkv_biases_matches_and_round_trips():
    """Every released Qwen2-MoE has q/k/v biases (qkv_bias, transformers' default): they load, match and go back."""
    hf = hf_moe("qwen2_moe", qkv_bias=True)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    ours = from_hf(hf)
    assert ours.cfg.qkv_bias and ours.layers[0].attn.wq.bias is not None
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    back = to_hf(ours)
    for name, t in back.state_dict().items():
        assert torch.equal(t, hf.state_dict()[name]), name


def test_a_sliding_window_shorter_than_the_positions_limits_max_seq():
    """Up to its window, sliding-window attention is full causal attention: max_seq becomes the window."""
    cfg = transformers.Qwen2MoeConfig(**{**MOE_COMMON, **MOE_CASES["qwen2_moe"], "use_sliding_window": True,
                                         "sliding_window": 16})
    assert config_from_hf(cfg).max_seq == 16
    mistral = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=64, sliding_window=32)
    assert config_from_hf(mistral).max_seq == 32 and config_from_hf(mistral).heads == 4


def test_qwen2_moe_sparse_step_with_a_dense_prefix_is_supported():
    """decoder_sparse_step=2 on 2 layers: layer 0 dense, layer 1 sparse = dense_layers 1."""
    cfg = transformers.Qwen2MoeConfig(**{**MOE_COMMON, **MOE_CASES["qwen2_moe"], "decoder_sparse_step": 2})
    assert config_from_hf(cfg).dense_layers == 1


def test_export_refuses_models_without_a_family():
    from fivefold.config import ModelConfig
    from fivefold.model.hf_map import hf_family

    base = dict(vocab=97, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, experts=4, moe_ffn=32)
    assert hf_family(ModelConfig(**base)) == "mixtral"
    assert hf_family(ModelConfig(**base, shared_experts=1, shared_expert_gate=True, dense_layers=1)) == "qwen2_moe"
    for bad in (dict(router="sigmoid_bias"), dict(router_groups=2, router_group_limit=1), dict(shared_experts=1),
                dict(router="softmax_topk")):
        with pytest.raises(ValueError):
            hf_family(ModelConfig(**base, **bad))


def test_older_per_expert_folders_load_like_packed_ones(tmp_path):
    """A Mixtral folder in the per-expert layout of earlier transformers and of the released checkpoints
    (block_sparse_moe.experts.<e>.w1 / w3 / w2, block_sparse_moe.gate) reads into the same model."""
    from safetensors.torch import load_file, save_file

    from fivefold.model.hf_weights import load_hf_model

    hf = hf_moe("mixtral")
    hf.save_pretrained(tmp_path / "packed")
    packed = load_hf_model(tmp_path / "packed")
    theirs = load_file(str(tmp_path / "packed" / "model.safetensors"))
    legacy = {}
    for name, t in theirs.items():
        if ".mlp.experts.gate_up_proj" in name:
            base = name.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts")
            for e, (w1, w3) in enumerate(zip(*t.chunk(2, dim=1))):
                legacy[f"{base}.{e}.w1.weight"], legacy[f"{base}.{e}.w3.weight"] = w1.clone(), w3.clone()
        elif ".mlp.experts.down_proj" in name:
            base = name.replace("mlp.experts.down_proj", "block_sparse_moe.experts")
            for e, w2 in enumerate(t):
                legacy[f"{base}.{e}.w2.weight"] = w2.clone()
        else:
            legacy[name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = t
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text((tmp_path / "packed" / "config.json").read_text())
    save_file(legacy, str(tmp_path / "legacy" / "model.safetensors"))
    old = load_hf_model(tmp_path / "legacy")
    for (name, a), b in zip(packed.named_parameters(), old.parameters()):
        assert torch.equal(a, b), name


def test_qwen2_with_biases_round_trips_through_a_saved_folder(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    ours = from_hf(str(tmp_path))
    assert ours.cfg.qkv_bias and hf_family(ours.cfg) == "qwen2"
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    back = to_hf(ours)
    assert type(back).__name__ == "Qwen2ForCausalLM"
    for name, t in back.state_dict().items():
        assert torch.equal(t, hf.state_dict()[name]), name


# -- DeepSeek-V3: latent attention, sigmoid router with bias, groups, scaling, shared experts ------------

DEEPSEEK_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                       num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                       n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                       routed_scaling_factor=2.5, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                       v_head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager",
                       tie_word_embeddings=False)
DEEPSEEK_CASES = {
    "q_lora": dict(q_lora_rank=20),
    "no_q_lora": dict(q_lora_rank=None),                      # DeepSeek-V2-Lite's plain q projection
    "rotate_half": dict(q_lora_rank=20, rope_interleave=False),
}


def hf_deepseek(case):
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_COMMON,
                                                                         **DEEPSEEK_CASES[case])).eval()
    with torch.no_grad():   # a nonzero score-correction bias, so that its mapping is tested
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    return hf


@pytest.mark.parametrize("case", list(DEEPSEEK_CASES))
def test_deepseek_v3_logits_grads_and_round_trip(case):
    """A tiny DeepseekV3ForCausalLM (transformers) and ours from its weights: the same logits and
    gradients (fp32); exported back, the same state dict, buffers included."""
    hf = hf_deepseek(case)
    ours = from_hf(hf).eval()
    c = ours.cfg
    assert c.mla and c.q_lora_rank == (DEEPSEEK_CASES[case]["q_lora_rank"] or 0)
    assert (c.router, c.router_groups, c.router_group_limit, c.routed_scaling_factor) == ("sigmoid_bias", 4, 2, 2.5)
    assert (c.dense_layers, c.shared_experts, c.experts) == (1, 1, 8)
    assert c.num_params() == sum(p.numel() for p in hf.parameters())
    match_transformers(ours, hf)


def test_deepseek_v3_generate_with_cache_matches_full_forward():
    """The KV cache (per-head k, v) gives the logits of the full forward."""
    from fivefold.model.attention import KVCache

    ours = from_hf(hf_deepseek("q_lora")).eval()
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = ours(tokens)
        cache = KVCache(ours.cfg.layers)
        step = torch.cat([ours(tokens[:, :7], cache=cache), ours(tokens[:, 7:9], cache=cache),
                          ours(tokens[:, 9:], cache=cache)], dim=1)
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("over, words", [(dict(norm_topk_prob=False), "norm_topk_prob"),
                                         (dict(attention_bias=True), "attention_bias"),
                                         (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                "rope_theta": 10000.0,
                                                                "original_max_position_embeddings": 16}),
                                          "default RoPE")])
def test_deepseek_v3_unsupported_configs_refused(over, words):
    hf_cfg = transformers.DeepseekV3Config(**{**DEEPSEEK_COMMON, "q_lora_rank": 20, **over})
    with pytest.raises(ValueError, match=words):
        config_from_hf(hf_cfg)


def test_a_hub_cache_snapshot_reads_through_its_links_and_nothing_else(tmp_path):
    """The Hugging Face hub's cache keeps a revision as <repo>/snapshots/<rev>/<file>, each a link to
    ../../blobs/<hash>: --init-hf reads such a folder; a weight file linked anywhere else is refused."""
    import hashlib
    import os
    import shutil

    from fivefold.config import ConfigError
    from fivefold.model.hf_weights import HFWeights, hf_config

    hf = hf_model(**CONFIGS[0])
    hf.save_pretrained(tmp_path / "saved")
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in (tmp_path / "saved").iterdir():
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blobs / blob)
        os.symlink(f"../../blobs/{blob}", snapshot / f.name)
    weights = HFWeights(snapshot, hf_config(snapshot))
    name = "model.embed_tokens.weight"
    assert weights.header(name)[0] == tuple(hf.state_dict()[name].shape)
    weight_file = weights.files[name]
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(snapshot / weight_file, tmp_path / "elsewhere" / "w.safetensors")
    os.remove(snapshot / weight_file)
    os.symlink(tmp_path / "elsewhere" / "w.safetensors", snapshot / weight_file)
    with pytest.raises(ConfigError, match="outside the folder"):
        HFWeights(snapshot, hf_config(snapshot)).header(name)
