"""The command line: flags and choices come from the config's declared types; bad input exits 2 with
the rule before any rank is spawned."""
import argparse

import pytest

from fivefold.cli import main
from fivefold.tools.training import add_train_args
from fivefold.tools.plan import add_plan_args
from fivefold.plan.layout import GradDtype
from fivefold.rules import (LrSchedule, CpMode, Device, Dtype, PlannedScheduleKind, Recompute, ScheduleKind, SpMode,
                            ZeroStage, choices)


def _choices(add) -> dict:
    ap = argparse.ArgumentParser()
    add(ap)
    return {a.dest: tuple(a.choices) for a in ap._actions if a.choices}


def test_choices_are_the_literals():
    train = _choices(add_train_args)
    assert train == {"zero": choices(ZeroStage), "sp_mode": choices(SpMode), "cp_mode": choices(CpMode),
                     "schedule": choices(ScheduleKind), "recompute": choices(Recompute), "dtype": choices(Dtype),
                     "device": choices(Device), "lr_schedule": choices(LrSchedule)}
    plan = _choices(add_plan_args)
    assert {k: plan[k] for k in ("sp_mode", "cp_mode", "schedule", "recompute", "dtype", "grad_dtype")} == {
        "sp_mode": choices(SpMode), "cp_mode": choices(CpMode), "schedule": choices(PlannedScheduleKind),
        "recompute": choices(Recompute), "dtype": choices(Dtype), "grad_dtype": choices(GradDtype)}


@pytest.mark.parametrize("argv, words", [
    (["--set", "train.checkpoint=ture"], "train.checkpoint must be a boolean"),
    (["--set", "parallel.cp_mode=zigzag"], "parallel.cp_mode must be one of ulysses, ring, hybrid"),
    (["--nproc", "2", "--pp", "2"], "schedule 1f1b needs microbatches >= pp (2)"),
    (["--cp", "2", "--cp-mode", "ulysses", "--tp", "4", "--set", "model.kv_heads=4"], "Ulysses gives each cp rank"),
])
def test_train_rejects_bad_input_before_spawning(argv, words, capsys):
    assert main(["train", *argv]) == 2
    assert words in capsys.readouterr().err


def test_plan_takes_the_cp_mode_and_the_partition(capsys):
    rc = main(["plan", "--model", "llama3-8b", "--tp", "8", "--pp", "2", "--cp", "4", "--dp", "1",
               "--cp-mode", "hybrid", "--partition", "llama3", "--seq", "8192", "--global-batch", "16", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    assert '"cp_mode": "hybrid"' in out and '"partition": "llama3"' in out


def test_train_help_gives_every_flag_a_text_and_its_default():
    ap = argparse.ArgumentParser()
    add_train_args(ap)
    shown = [a for a in ap._actions if a.help != argparse.SUPPRESS and a.dest != "help"]
    missing = [a.option_strings[0] for a in shown if not a.help or "default" not in a.help]
    assert not missing, missing
    sets = next(a for a in shown if a.dest == "set").help
    assert "docs/training.md 'Config keys'" in sets and "config.py" in sets


@pytest.mark.parametrize("command", [["train"], ["plan", "--model", "llama3-8b"]])
def test_old_micro_batch_flag_names_the_new_one(command, capsys):
    """--micro-batch (plan: a size, easily taken for train's count) is one line naming --micro-batch-size."""
    with pytest.raises(SystemExit) as e:
        main([*command, "--micro-batch", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--micro-batch-size B" in err and "--microbatches" in err


def test_micro_batch_size_means_sequences_in_train_too():
    from fivefold.tools.training import resolve_train_config
    from fivefold.config import ConfigError

    ap = argparse.ArgumentParser()
    add_train_args(ap)
    cfg = resolve_train_config(ap.parse_args(["--nproc", "2", "--global-batch", "16", "--micro-batch-size", "2"]))
    assert cfg.parallel.dp == 2 and cfg.parallel.microbatches == 4   # 16 / (2 x 2)
    for argv, words in ((["--micro-batch-size", "3"], r"valid sizes: \[1, 2, 4, 8\]"),
                        (["--micro-batch-size", "2", "--microbatches", "2"], "disagree")):
        with pytest.raises(ConfigError, match=words):
            resolve_train_config(ap.parse_args(["--nproc", "2", "--global-batch", "16", *argv]))


def test_config_toml_round_trips_and_json_is_named(tmp_path):
    from fivefold.config import Config, ConfigError, load_config, write_run_config

    cfg = Config()
    cfg.train.data, cfg.model.experts, cfg.parallel.order = ["a b.txt", "x.bin:0.3"], 4, "tp-dp-cp-ep-pp"
    path = write_run_config(cfg, tmp_path)
    assert path.name == "config.toml" and load_config(path) == cfg
    for wrong in (tmp_path / "run.json", tmp_path):
        with pytest.raises(ConfigError, match=f"pass --config {tmp_path / 'config.toml'}"):
            load_config(wrong)
    # cut at a line boundary it is still TOML, and would train with defaults for what is gone: refused
    lines = path.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.toml"
    for keep in (len(lines) - 1, len(lines) // 2, 1):
        cut.write_text("".join(lines[:keep]))
        with pytest.raises(ConfigError, match="was written by a run but ends before its last line"):
            load_config(cut)
    edited = "".join(lines).replace("steps = 200", "steps = 300")   # an edit keeps the last line: the user's to make
    cut.write_text(edited)
    assert load_config(cut).train.steps == 300


