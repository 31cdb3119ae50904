import pytest

from fivefold.config import Config, ConfigError, load_config


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
    ({"parallel.zero": 5}, 1, ["zero must be one of 0, 1, 2, 3"]),
    ({"parallel.tp": 3, "parallel.dp": 1}, 3, ["heads (4) must divide by tp (3)", "valid tp"]),
    ({"parallel.order": "tp-dp-pp"}, 1, ["must name each of"]),
    ({"parallel.ep": 3, "parallel.dp": 2}, 2, ["ep (3) must divide dp*cp"]),
    ({"parallel.pp": 8, "parallel.dp": 1}, 8, ["layers (4) must be >= pp*vpp"]),
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
