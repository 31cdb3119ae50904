"""Each option is written once: the config fields' comments in config.py are their documentation
(`config.field_doc`), and the help of `fivefold train`, `eval` and `plan` is made from them, so the help
cannot disagree with the config. `fivefold --help` lists one command a line."""
import argparse
import contextlib
import dataclasses
import io

import pytest

from fivefold.cli import main
from fivefold.config import ModelConfig, ParallelConfig, TrainConfig, field_doc
from fivefold.tools.evaluate import EVAL_FLAGS, add_eval_args
from fivefold.tools.plan import add_plan_args
from fivefold.tools.training import TRAIN_FLAGS, add_train_args

PARTS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}


def flat(text: str) -> str:
    """Without whitespace: argparse wraps lines at spaces and after hyphens."""
    return "".join(text.split())


def help_of(add_args) -> str:
    ap = argparse.ArgumentParser(prog="x")
    add_args(ap)
    return flat(ap.format_help())


def test_every_config_field_is_documented_where_it_is_declared():
    for part, cls in PARTS.items():
        for f in dataclasses.fields(cls):
            doc = field_doc(f"{part}.{f.name}")
            assert doc and not doc.startswith("..."), f"{part}.{f.name} has no comment of its own in config.py"


def test_a_fields_doc_is_its_comment_with_the_lines_under_it():
    assert field_doc("parallel.tp") == "tensor-parallel degree (Megatron: heads and MLP columns split)"
    assert field_doc("train.lora_targets").startswith("LoRA: which linear layers")   # comment on the next line
    # the continuation stops at the next field, and a section comment at the field's indentation is no part of it
    assert "Multi-head latent attention" not in field_doc("model.routed_scaling_factor")
    assert "Mixture of experts" not in field_doc("model.dropout")


def test_train_eval_and_plan_help_say_what_the_config_says():
    train, evaluate, plan = help_of(add_train_args), help_of(add_eval_args), help_of(add_plan_args)
    for flag, key in TRAIN_FLAGS.items():
        assert flat(field_doc(key)) in train, flag
    for flag, key in EVAL_FLAGS.items():
        assert flat(field_doc(key)) in evaluate, flag
    for key in ("parallel.tp", "parallel.pp", "parallel.dp", "parallel.cp", "parallel.ep", "parallel.etp",
                "parallel.zero", "parallel.vpp", "parallel.sp_mode", "parallel.cp_mode", "train.recompute",
                "parallel.schedule", "parallel.order", "parallel.partition", "model.capacity_factor",
                "train.lora_rank", "train.freeze", "parallel.bucket_mb", "parallel.tp_overlap", "parallel.offload"):
        assert flat(field_doc(key)) in plan, key


def test_the_recompute_help_says_chunks_are_recomputed_only_under_zero_bubble():
    """The help said 'each chunk under pp' in three places; rules.block_recompute re-runs whole chunks only
    under the zb schedule with pp > 1 (docs/training.md says so)."""
    doc = field_doc("train.recompute")
    assert "zb schedule with pp > 1" in doc and "chunk under pp" not in doc


def test_fivefold_help_lists_one_command_a_line():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    lines = out.getvalue().splitlines()
    for cmd in ("train", "eval", "export", "generate", "report", "tokenize", "calibrate", "plan", "schedule", "cluster"):
        said = [line.split() for line in lines if line.split()[:1] == [cmd]]
        assert len(said) == 1 and len(said[0]) > 3, cmd                                # what it does, one line
        assert sum(line.strip().startswith(f"fivefold {cmd} ") for line in lines) == 1, cmd   # its usage, one line


def test_the_docs_key_lists_are_the_config_fields():
    """docs/training.md "Config keys" lists every key of each part, and no other."""
    from tests.support.paths import ROOT

    text = (ROOT / "docs" / "training.md").read_text()
    for part, cls in PARTS.items():
        block = text.split(f"- `[{part}]`:", 1)[1].split("\n- ", 1)[0].split("\n\n", 1)[0]
        assert block.split() == [f.name for f in dataclasses.fields(cls)], part
