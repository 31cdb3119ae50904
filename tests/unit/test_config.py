import typing

import pytest

from fivefold.config import (Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig, field_type,
                             load_config)
from fivefold.rules import CpMode, Device, SpMode, ZeroStage, cp_degrees, kv_replicas


def test_defaults_validate():
    Config().validate(1)


def test_toml_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nhidden = 64\nheads = 4\n[parallel]\ndp = 2\n[train]\nsteps = 5\ndata = ["a.txt"]\n')
    cfg = load_config(f, {"train.steps": "7", "parallel.microbatches": 2})
    assert (cfg.model.hidden, cfg.parallel.dp, cfg.train.steps, cfg.parallel.microbatches) == (64, 2, 7, 2)
    assert cfg.train.data == ["a.txt"]
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("overrides, world, words", [
    ({"parallel.dp": 2}, 3, ["world size 3", "tp*cp*dp*pp", "valid world sizes"]),
    ({"model.heads": 4, "model.kv_heads": 3}, 1, ["kv_heads", "valid kv_heads: [1, 2, 4]"]),
    ({"model.hidden": 100, "model.heads": 3}, 1, ["must divide by model.heads"]),
    ({"train.global_batch": 10, "parallel.dp": 4}, 4, ["global_batch (10)", "dp*microbatches", "8, 12]"]),
    ({"train.seq_len": 512}, 1, ["seq_len (512)", "max_seq"]),
    ({"parallel.tp": 3, "parallel.dp": 1}, 3, ["heads (4) must divide by tp (3)", "valid tp"]),
    ({"parallel.order": "tp-dp-pp"}, 1, ["must name each of"]),
    ({"parallel.ep": 3, "parallel.dp": 2}, 2, ["etp x ep (1 x 3) must divide tp*cp*dp (2)"]),
    ({"parallel.pp": 8, "parallel.dp": 1}, 8, ["layers (4) must be >= pp*vpp"]),
    ({"parallel.pp": 2, "parallel.microbatches": 2, "parallel.partition": "1,2"}, 2, ["sums to 3", "4 layers"]),
    ({"parallel.pp": 2, "parallel.microbatches": 2, "parallel.partition": "balanced"}, 2,
     ["partition must be one of even, llama3 or layer counts"]),
    ({"parallel.pp": 2}, 2, ["schedule 1f1b needs microbatches >= pp (2), got 1"]),
    ({"parallel.ep": 2, "parallel.dp": 2}, 2, ["needs a mixture-of-experts model"]),
    ({"parallel.ep": 4, "parallel.dp": 4, "model.experts": 6}, 4, ["experts (6) must divide by ep (4)", "valid ep"]),
    ({"parallel.cp": 2, "parallel.cp_mode": "ulysses", "parallel.tp": 4, "parallel.dp": 1, "model.kv_heads": 4},
     8, ["Ulysses", "heads/tp = 4/4 = 1 must divide by cp (2)", "valid cp: [1]"]),
    ({"parallel.cp": 3, "parallel.dp": 1}, 3, ["ring attention", "2*cp = 6", "valid cp: [1, 2, 4]"]),
    ({"parallel.cp": 2, "parallel.cp_mode": "ulysses", "parallel.dp": 1, "train.seq_len": 33,
      "model.max_seq": 64}, 2, ["seq_len (33) must divide by cp (2)"]),
    ({"parallel.tp": 2, "parallel.sp_mode": "megatron", "parallel.dp": 1, "train.seq_len": 33,
      "model.max_seq": 64}, 2, ["seq_len (33) must divide by tp (2)", "valid seq_len: [30, 32, 34]"]),
])
def test_errors_name_rule_and_suggest(overrides, world, words):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ConfigError, match="valid keys in \\[model\\]"):
        load_config(None, {"model.hiden": 3})
    with pytest.raises(ConfigError, match="must be of type int"):
        load_config(None, {"model.hidden": "lots"})


def test_ulysses_degree_rules_not_ring_rules():
    """Ulysses needs seq % cp (not ring's 2*cp); ring needs 2*cp; hybrid splits cp into Ulysses x ring."""
    ok = load_config(None, {"parallel.cp": 2, "parallel.cp_mode": "ulysses", "parallel.dp": 1, "train.seq_len": 34,
                            "model.max_seq": 64})
    ok.validate(2)
    assert cp_degrees("ulysses", 4, heads=8) == (4, 1) and cp_degrees("ring", 4, heads=8) == (1, 4)
    assert cp_degrees("hybrid", 8, heads=8, tp=2) == (4, 2)     # 4 heads per tp rank: Ulysses 4, ring 2
    assert cp_degrees("hybrid", 6, heads=4) == (2, 3)
    assert [kv_replicas(tp, 2) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]


@pytest.mark.parametrize("key, value, expect", [
    ("train.checkpoint", "ture", "must be a boolean"),
    ("train.checkpoint", "2", "must be a boolean"),
    ("parallel.zero", 5, "parallel.zero must be one of 0, 1, 2, 3, got 5"),
    ("parallel.zero", "two", "must be of type int"),
    ("parallel.sp_mode", "ulysses", "parallel.sp_mode must be one of none, megatron, got 'ulysses'"),
    ("parallel.cp_mode", "zigzag", "must be one of ulysses, ring, hybrid"),
    ("train.device", "tpu", "must be one of auto, cpu, cuda"),
    ("train.steps", 2.5, "must be of type int"),
    ("train.steps", True, "must be of type int"),
    ("parallel.order", 3, "must be of type str"),
])
def test_overrides_are_strict(key, value, expect):
    with pytest.raises(ConfigError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, {key: value})


def test_overrides_convert_by_declared_type():
    cfg = load_config(None, {"train.checkpoint": "Off", "parallel.reshard_after_forward": "YES", "parallel.zero": "2",
                             "train.device": "cpu", "parallel.cp_mode": "hybrid", "parallel.bucket_mb": "0.5",
                             "train.steps": 3.0})
    assert cfg.train.checkpoint is False and cfg.parallel.reshard_after_forward is True
    assert (cfg.parallel.zero, cfg.train.device, cfg.parallel.cp_mode) == (2, "cpu", "hybrid")
    assert cfg.parallel.bucket_mb == 0.5 and cfg.train.steps == 3
    assert field_type("parallel.zero") is ZeroStage and field_type("parallel.sp_mode") is SpMode
    assert field_type("parallel.cp_mode") is CpMode and field_type("train.device") is Device
    assert (ParallelConfig().cp_mode, TrainConfig().device) == ("ring", "auto")


def test_validate_checks_choices_of_configs_built_in_code():
    cfg = Config()
    cfg.parallel.schedule = "zigzag"
    with pytest.raises(ConfigError, match="parallel.schedule must be one of gpipe, 1f1b, interleaved, zb"):
        cfg.validate(1)
    assert typing.get_origin(field_type("train.recompute")) is typing.Literal


def _float_keys() -> list[str]:
    parts = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}
    return [f"{part}.{name}" for part, cls in parts.items()
            for name, kind in typing.get_type_hints(cls).items() if kind is float]


def test_every_float_field_is_covered():
    model = ("rope_theta", "norm_eps", "init_std", "dropout", "capacity_factor", "aux_loss_coef", "z_loss_coef",
             "bias_update_rate", "routed_scaling_factor")
    train = ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "data_limit_mb", "eval_fraction",
             "decay_fraction", "lora_alpha", "lora_dropout", "warmup_ratio")
    assert set(_float_keys()) == ({f"model.{n}" for n in model} | {f"train.{n}" for n in train}
                                  | {"parallel.bucket_mb"})


@pytest.mark.parametrize("key", _float_keys())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("nan")])
def test_non_finite_floats_rejected(key, value):
    cfg = load_config(None, {key: value})
    with pytest.raises(ConfigError, match=rf"^{key} must be a finite number, got -?(nan|inf)$"):
        cfg.validate(1)


def test_non_finite_float_from_toml(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nlr = nan\n")
    with pytest.raises(ConfigError, match="train.lr must be a finite number, got nan"):
        load_config(f).validate(1)


def test_non_number_in_float_field_built_in_code():
    cfg = Config()
    cfg.train.grad_clip = "1.0"
    with pytest.raises(ConfigError, match="train.grad_clip must be a finite number, got '1.0'"):
        cfg.validate(1)


@pytest.mark.parametrize("key, value, expect", [
    ("train.grad_clip", -1.0, "train.grad_clip must be >= 0 (0: no clipping), got -1.0"),
    ("train.weight_decay", -0.1, "train.weight_decay must be >= 0, got -0.1"),
    ("train.beta1", 1.0, "train.beta1 must be in [0, 1) (typical: 0.9), got 1.0"),
    ("train.beta1", -0.1, "train.beta1 must be in [0, 1)"),
    ("train.beta2", 1.5, "train.beta2 must be in [0, 1) (typical: 0.95 or 0.999), got 1.5"),
    ("train.eps", 0.0, "train.eps must be > 0 (typical: 1e-8), got 0.0"),
    ("train.data_limit_mb", -1.0, "train.data_limit_mb must be >= 0 (0: no limit)"),
    ("train.log_every", -1, "train.log_every must be >= 0 (0: about 20 lines a run), got -1"),
    ("train.checkpoint_every", -5, "train.checkpoint_every must be >= 0 (0: only at the end), got -5"),
    ("train.keep_checkpoints", 0, "train.keep_checkpoints must be >= 1, got 0"),
    ("train.max_skips", 0, "train.max_skips must be >= 1, got 0"),
    ("parallel.bucket_mb", 0.0, "parallel.bucket_mb must be > 0 (typical: 25), got 0.0"),
    ("model.norm_eps", -1e-5, "model.norm_eps must be > 0"),
    ("model.rope_theta", 0.0, "model.rope_theta must be > 0"),
    ("model.init_std", 0.0, "model.init_std must be > 0 (typical: 0.02)"),
    ("model.dropout", 1.0, "model.dropout must be in [0, 1) (0: off), got 1.0"),
    ("model.aux_loss_coef", -0.5, "model.aux_loss_coef must be >= 0, got -0.5"),
])
def test_float_ranges(key, value, expect):
    cfg = load_config(None, {key: value})
    with pytest.raises(ConfigError) as e:
        cfg.validate(1)
    assert expect in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key, value", [
    ("train.grad_clip", 0.0), ("train.weight_decay", 0.0), ("train.beta1", 0.0), ("train.beta2", 0.999),
    ("train.data_limit_mb", 0.0), ("train.log_every", 0), ("train.log_every", 7), ("train.checkpoint_every", 0),
    ("train.keep_checkpoints", 1), ("train.max_skips", 1), ("train.skip_nonfinite", "false"),
])
def test_range_edges_accepted(key, value):
    load_config(None, {key: value}).validate(1)


def test_reliability_fields_defaults():
    t = TrainConfig()
    assert (t.checkpoint_every, t.keep_checkpoints, t.skip_nonfinite, t.max_skips, t.log_every) == (100, 2, True, 5, 0)
    assert field_type("train.skip_nonfinite") is bool and field_type("train.max_skips") is int


@pytest.mark.parametrize("over, words", [
    (dict(q_lora_rank=16), "kv_lora_rank is 0"),
    (dict(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=7, v_head_dim=8), "qk_rope_dim .7. must be even"),
    (dict(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8), "v_head_dim must be >= 1"),
    (dict(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8, kv_heads=2), "must equal model.heads"),
    (dict(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8, kv_heads=4, qkv_bias=True), "qkv_bias"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be > 0"),
])
def test_latent_attention_rules(over, words):
    m = ModelConfig(heads=4, kv_heads=4, **{k: v for k, v in over.items() if k != "kv_heads"})
    if "kv_heads" in over:
        m.kv_heads = over["kv_heads"]
    with pytest.raises(ConfigError, match=words):
        m.validate()
    ok = ModelConfig(heads=4, kv_heads=4, hidden=62, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8)
    ok.validate()   # latent attention needs no hidden % heads
