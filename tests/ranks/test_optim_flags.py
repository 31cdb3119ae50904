"""Optimizer and schedule flags: the learning-rate schedules (cosine, linear, constant, warmup-stable-decay),
which parameters decay (never norms or biases; the embedding and LM head unless train.decay_embeddings is
false), both engines taking that rule, the flags with help text, and --init-hf's fine-tuning learning rate
when none is given."""
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from fivefold.tools.training import FINE_TUNE_LR, fine_tuning_lr, fine_tuning_note
from fivefold.comm import CommLedger, Group
from fivefold.config import ConfigError, TrainConfig
from fivefold.model import Transformer
from fivefold.parallel.data import DataParallelOptimizer
from fivefold.parallel.engine import decays
from fivefold.parallel.zero.engine import ZeroEngine
from fivefold.parallel.zero.spec import ZeroSpec
from fivefold.train.optim import lr_at

from tests.support.spawn import ranks
from tests.support.tiny import tiny_config


def test_each_schedule_warms_up_then_runs_its_course():
    lr, lo, warm, total = 1.0, 0.1, 4, 24
    for kind in ("cosine", "linear", "constant", "wsd"):
        assert [lr_at(s, lr, lo, warm, total, kind) for s in range(warm)] == [0.25, 0.5, 0.75, 1.0]
        assert lr_at(warm, lr, lo, warm, total, kind) == lr
    assert lr_at(total - 1, lr, lo, warm, total, "cosine") == pytest.approx(lo)
    assert lr_at(14 - 0, lr, lo, warm, total, "cosine") == pytest.approx(lo + 0.5 * (lr - lo) * (1 + math.cos(math.pi * 10 / 19)))
    assert lr_at(total - 1, lr, lo, warm, total, "linear") == pytest.approx(lo)
    assert lr_at(warm + 19 // 2, lr, lo, warm, total, "linear") == pytest.approx(lr - (lr - lo) * 9 / 19)
    assert {lr_at(s, lr, lo, warm, total, "constant") for s in range(warm, total)} == {lr}
    wsd = [lr_at(s, lr, lo, warm, total, "wsd", decay_fraction=0.2) for s in range(warm, total)]
    stable = [x for x in wsd if x == lr]
    assert len(stable) == 16 and wsd[-1] == pytest.approx(lo) and all(a >= b for a, b in zip(wsd, wsd[1:]))
    with pytest.raises(ConfigError, match="train.lr_schedule"):
        TrainConfig(lr_schedule="step").validate()
    with pytest.raises(ConfigError, match="train.decay_fraction"):
        TrainConfig(decay_fraction=1.5).validate()


def test_norms_and_biases_never_decay_and_embeddings_only_when_asked():
    cfg = tiny_config().model
    cfg.tie_embeddings = False
    names = dict(Transformer(cfg).named_parameters())
    on = {n for n, p in names.items() if decays(n, p.shape)}
    off = {n for n, p in names.items() if decays(n, p.shape, embeddings=False)}
    assert {"embed.weight", "head.weight"} <= on and not {"embed.weight", "head.weight"} & off
    assert on - off == {"embed.weight", "head.weight"}
    assert not {n for n in on if n.endswith("norm.weight") or n.endswith("bias")}
    assert "layers.0.attn.wq.weight" in off and "layers.1.mlp.down.weight" in off


def engine_decay(rank, world, kind, embeddings):
    torch.set_num_threads(1)
    cfg = tiny_config().model
    cfg.tie_embeddings = False
    model = Transformer(cfg)
    ledger = CommLedger(rank, world)
    g = Group("dp", list(range(world)), rank, dist.group.WORLD, ledger)
    groups = {k: g for k in ("dp", "world", "all", "dp_cp", "edp", "mp", "tp", "pp", "cp", "ep")}
    from fivefold.train.optim import AdamW

    shapes = {n: p.shape for n, p in model.named_parameters()}   # (ZeRO-3 frees the parameters' storage)
    if kind == "ddp":
        optimizer = DataParallelOptimizer(model, groups, AdamW, decay_embeddings=embeddings).optimizer
    else:
        optimizer = ZeroEngine(model, groups, ZeroSpec(int(kind[-1])), AdamW, decay_embeddings=embeddings).state.optimizer
    return {"decayed": sum(optimizer.decay), "pieces": len(optimizer.decay),
            "expected": sum(decays(n, shape, embeddings) for n, shape in shapes.items()),
            "params": len(shapes)}     # one rank: each parameter is one piece of the optimizer's


@pytest.mark.ranks
@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero3"])
def test_both_engines_decay_by_the_one_rule(kind):
    for embeddings in (True, False):
        r = ranks(engine_decay, 1, kind, embeddings)[0]
        assert r["decayed"] == r["expected"] > 0 and r["pieces"] == r["params"], r


def test_the_optimizer_flags_have_help_and_reach_the_config(tmp_path):
    import argparse

    from fivefold.tools.training import add_train_args, resolve_train_config

    out = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", "--help"], capture_output=True, text=True).stdout
    text = " ".join(out.split())
    for flag, words in (("--min-lr", "last step"), ("--warmup", "linear warmup"), ("--lr-schedule", "wsd"),
                        ("--weight-decay", "norms and biases never decay"), ("--clip", "gradient norm")):
        assert flag in text and words in text, flag
    ap = argparse.ArgumentParser()
    add_train_args(ap)
    args = ap.parse_args(["--lr", "1e-4", "--min-lr", "1e-5", "--warmup", "3", "--lr-schedule", "wsd",
                          "--weight-decay", "0.05", "--clip", "0.5", "--out", str(tmp_path)])
    t = resolve_train_config(args, 1).train
    assert (t.lr, t.min_lr, t.warmup, t.lr_schedule, t.weight_decay, t.grad_clip) == (1e-4, 1e-5, 3, "wsd", 0.05, 0.5)


def test_init_hf_without_lr_fine_tunes_at_a_fine_tuning_rate_and_says_so():
    t = TrainConfig()
    fine_tuning_lr(t, set())
    assert (t.lr, t.min_lr) == (FINE_TUNE_LR, FINE_TUNE_LR / 10)
    assert "fine-tunes at train.lr = 5e-05" in fine_tuning_note(t) and "min_lr 5e-06" in fine_tuning_note(t)
    t = TrainConfig(lr=1e-3)
    fine_tuning_lr(t, {"lr"})
    assert t.lr == 1e-3
    with pytest.raises(ConfigError, match="min_lr = 0.001 is above"):
        fine_tuning_lr(TrainConfig(min_lr=1e-3), {"min_lr"})


def test_init_hf_with_a_low_lr_takes_min_lr_a_tenth_of_it_and_the_error_names_min_lr():
    """The docs/data.md walk gave --init-hf --lr 2e-4: min_lr stayed at the pretraining 3e-4 and the run was
    refused by a rule naming neither --min-lr nor where 3e-4 came from."""
    t = TrainConfig(lr=2e-4)
    fine_tuning_lr(t, {"lr"})
    assert (t.lr, t.min_lr) == (2e-4, 2e-5)
    t = TrainConfig(lr=2e-4, min_lr=1e-4)
    fine_tuning_lr(t, {"lr", "min_lr"})
    assert t.min_lr == 1e-4                          # a min_lr the user gave is theirs
    with pytest.raises(ConfigError, match=r"default min_lr is 0.0003\); valid: --min-lr from 0 to the lr, e.g. --min-lr 1e-05"):
        TrainConfig(lr=1e-4).validate()              # without --init-hf the default min_lr is kept, and named


def test_a_lora_option_without_a_rank_is_refused_in_one_line(tmp_path):
    """--lora-alpha (or dropout, targets) without --lora-rank trained every weight, silently."""
    from fivefold.tools.training import check_lora_flags

    for key, flag in (("train.lora_alpha", "--lora-alpha"), ("train.lora_targets", "--lora-targets")):
        with pytest.raises(ConfigError, match=f"{flag}: LoRA options, but train.lora_rank is 0.*--lora-rank R"):
            check_lora_flags(TrainConfig(), {key})
    check_lora_flags(TrainConfig(lora_rank=8), {"train.lora_alpha"})
    check_lora_flags(TrainConfig(), set())
    import argparse

    from fivefold.tools.training import add_train_args, resolve_train_config

    ap = argparse.ArgumentParser()
    add_train_args(ap)
    with pytest.raises(ConfigError, match="--lora-alpha: LoRA options"):
        resolve_train_config(ap.parse_args(["--lora-alpha", "32", "--out", str(tmp_path)]), 1)
    # a run's config.toml lists every key with its value: its defaults are no choice the user made
    (tmp_path / "run.toml").write_text("[train]\nlora_rank = 0\nlora_alpha = 16.0\nlora_dropout = 0.0\n")
    resolve_train_config(ap.parse_args(["--config", str(tmp_path / "run.toml"), "--out", str(tmp_path)]), 1)
    (tmp_path / "run.toml").write_text("[train]\nlora_alpha = 64.0\n")
    with pytest.raises(ConfigError, match="--lora-alpha: LoRA options"):
        resolve_train_config(ap.parse_args(["--config", str(tmp_path / "run.toml"), "--out", str(tmp_path)]), 1)
