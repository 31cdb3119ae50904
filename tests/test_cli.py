"""The command line: flags and choices come from the config's declared types; bad input exits 2 with
the rule before any rank is spawned."""
import argparse

import pytest

from fivefold.cli import add_train_args, main
from fivefold.plan.cli import add_plan_args
from fivefold.plan.layout import GradDtype
from fivefold.rules import CpMode, Device, Dtype, Recompute, Schedule, SpMode, ZeroStage, choices


def _choices(add) -> dict:
    ap = argparse.ArgumentParser()
    add(ap)
    return {a.dest: tuple(a.choices) for a in ap._actions if a.choices}


def test_choices_are_the_literals():
    train = _choices(add_train_args)
    assert train == {"zero": choices(ZeroStage), "sp_mode": choices(SpMode), "cp_mode": choices(CpMode),
                     "schedule": choices(Schedule), "recompute": choices(Recompute), "dtype": choices(Dtype),
                     "device": choices(Device)}
    plan = _choices(add_plan_args)
    assert {k: plan[k] for k in ("sp_mode", "cp_mode", "schedule", "recompute", "dtype", "grad_dtype")} == {
        "sp_mode": choices(SpMode), "cp_mode": choices(CpMode), "schedule": choices(Schedule),
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
