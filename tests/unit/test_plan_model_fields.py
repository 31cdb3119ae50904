"""One model, two descriptions: the runtime's `ModelConfig` and the planner's `PlanModel` are joined by one
table (plan/models.py `MODEL_FIELDS`, with `PLAN_ONLY` for what only the planner describes), read both
ways (`from_model_config`, `to_model_config`), as `LAYOUT_SOURCES` joins `ParallelConfig` and `Layout`."""
import dataclasses

import pytest

from fivefold.config import ConfigError, ModelConfig
from fivefold.plan.models import MODEL_FIELDS, PLAN_ONLY, PRESETS, PlanModel, from_model_config, to_model_config

from tests.support.tiny import TINY_MLA


def test_every_field_of_either_description_has_a_row():
    runtime = {f.name for f in dataclasses.fields(ModelConfig)}
    planned = {f.name for f in dataclasses.fields(PlanModel)}
    assert set(MODEL_FIELDS) == runtime, "a ModelConfig field without a row in MODEL_FIELDS (or a stale row)"
    made = {f.plan for f in MODEL_FIELDS.values() if f.plan is not None}
    assert made <= planned, "a row makes a PlanModel field that does not exist"
    assert made | set(PLAN_ONLY) == planned and not made & set(PLAN_ONLY), \
        "a PlanModel field neither made from ModelConfig nor in PLAN_ONLY (or both)"
    for key, f in MODEL_FIELDS.items():
        assert f.plan is not None or f.why, f"{key}: a field the planner ignores says why"
        assert f.to_plan is None or f.plan is not None, key


CONFIGS = [ModelConfig(), ModelConfig(experts=4, top_k=2, moe_ffn=64, shared_experts=1, dense_layers=1),
           ModelConfig(experts=8, top_k=3, router="sigmoid_bias", shared_expert_gate=True, qkv_bias=True),
           ModelConfig(**{**dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=4, ffn=128), **TINY_MLA}),
           ModelConfig(dropout=0.1, tie_embeddings=False, max_seq=512)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_a_runtime_model_planned_and_back_is_itself(cfg):
    """Every field the planner reads comes back (moe_ffn as the width it means: 0 is ffn); what it ignores
    comes back as the runtime's default, dropout too (a planned model has no rate).
    The parameter count is the same in both descriptions."""
    back = to_model_config(from_model_config(cfg))
    for key, f in MODEL_FIELDS.items():
        if f.plan is not None and key not in ("dropout", "moe_ffn"):
            assert getattr(back, key) == getattr(cfg, key), key
    assert back.expert_ffn == cfg.expert_ffn and back.dropout == 0.0
    assert from_model_config(cfg).num_params() == cfg.num_params()
    assert from_model_config(back) == dataclasses.replace(from_model_config(cfg), dropout=False)


def test_one_parameter_formula_for_both_descriptions():
    """ModelConfig and PlanModel count parameters with the same methods (config.ParameterCounts), the
    runtime's variants (SwiGLU, RMSNorm, no biases, no learned positions) being its class constants, which
    are also what the planner's PLAN_ONLY table says a runtime model has; and the runtime's count is what
    it builds (model/transformer.py: a dense, an MoE and an MLA model)."""
    from fivefold.config import ParameterCounts
    from fivefold.model import Transformer

    for name, member in vars(ParameterCounts).items():
        if not name.startswith("__"):
            assert getattr(ModelConfig, name) is member and getattr(PlanModel, name) is member, name
    for name in ("mlp", "norm", "linear_bias", "learned_pos", "parallel_residual"):
        assert PLAN_ONLY[name] == getattr(ModelConfig, name) == getattr(from_model_config(ModelConfig()), name)
    for cfg in (ModelConfig(), CONFIGS[-1], ModelConfig(experts=4, shared_experts=1, dense_layers=1, moe_ffn=64),
                ModelConfig(**TINY_MLA, heads=4, hidden=64, ffn=128, router="sigmoid_bias", experts=4)):
        assert cfg.num_params() == sum(p.numel() for p in Transformer(cfg).parameters())


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b", "deepseek-v3"])
def test_a_preset_the_runtime_builds_is_one_model_both_ways(name):
    """A preset as the runtime builds it (the dry run's `--model`) is the planned model, less what only the
    planner describes (DeepSeek-V3's MTP module; its score-correction bias, which the runtime holds as the
    sigmoid_bias router's buffer)."""
    m = PRESETS[name]
    cfg = to_model_config(m)
    assert (cfg.router == "sigmoid_bias") == m.router_bias
    assert from_model_config(cfg, name=m.name) == dataclasses.replace(m, mtp_depth=0, router_bias=False)


def test_a_preset_the_runtime_cannot_build_is_one_line():
    with pytest.raises(ConfigError, match="differs in mlp, norm, linear_bias, learned_pos"):
        to_model_config(PRESETS["gpt3-175b"])
