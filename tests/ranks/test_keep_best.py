"""train.keep_best and train.stop_after: the checkpoint of the lowest eval loss is kept beside the newest
ones and named in OUT/best.json (`generate RUN --checkpoint best` reads it); a run stops after
stop_after evaluations without a lower eval loss, and a resumed run judges as an uninterrupted one."""
import json

import pytest

from fivefold.config import ConfigError
from fivefold.tools.generate import find_checkpoint
from fivefold.train import rundir
from fivefold.train.trainer import Trainer

from tests.support.tiny import tiny_config

pytestmark = pytest.mark.ranks     # trains in this process (seconds)


def config(**train):
    cfg = tiny_config()
    t = cfg.train
    t.steps, t.eval_every, t.eval_fraction, t.eval_tokens = 12, 1, 0.1, 256
    t.checkpoint, t.checkpoint_every, t.keep_checkpoints = True, 0, 1
    t.lr, t.min_lr, t.warmup, t.lr_schedule = 0.05, 0.05, 1, "constant"   # high enough that eval loss turns up
    for k, v in train.items():
        setattr(t, k, v)
    return cfg


def eval_losses(out):
    return [json.loads(line)["eval_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_best_checkpoint_is_kept_and_named_and_stop_after_ends_the_run(tmp_path):
    out = tmp_path / "run"
    Trainer(config(keep_best=True), quiet=True).run(out)
    losses = eval_losses(out)
    best = min(range(len(losses)), key=losses.__getitem__) + 1
    assert best < len(losses), losses              # the loss turned up: the best is not simply the last
    assert rundir.read_best(out) == {"step": best, "eval_loss": losses[best - 1]}
    kept = [c.name for c in rundir.checkpoints(out)]
    assert kept == [rundir.step_dir(out, best).name, rundir.step_dir(out, 12).name]   # keep_checkpoints 1 + best
    assert find_checkpoint(out, "best") == rundir.step_dir(out, best)

    stopped = tmp_path / "stopped"
    Trainer(config(keep_best=True, stop_after=2), quiet=True).run(stopped)
    early = eval_losses(stopped)
    low, since, end = float("inf"), 0, len(losses)
    for i, loss in enumerate(losses):                 # patience 2, by hand
        low, since = (loss, 0) if loss < low else (low, since + 1)
        if since >= 2:
            end = i + 1
            break
    assert end < len(losses) and early == losses[:end]    # it stopped, where two evaluations did not improve
    assert rundir.read_best(stopped)["step"] == min(range(end), key=losses.__getitem__) + 1


def test_a_resumed_run_judges_as_an_uninterrupted_one(tmp_path):
    full = tmp_path / "full"
    Trainer(config(keep_best=True, stop_after=3), quiet=True).run(full)
    part = tmp_path / "part"
    cfg = config(keep_best=True, stop_after=3, checkpoint_every=2)
    cfg.train.steps = 4
    Trainer(cfg, quiet=True).run(part)
    cfg.train.steps = 12
    Trainer(cfg, quiet=True).run(part, resume="auto")
    assert eval_losses(part) == pytest.approx(eval_losses(full), rel=1e-6)
    assert rundir.read_best(part)["step"] == rundir.read_best(full)["step"]


def test_rules_and_a_bad_best_file_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="train.keep_best and train.stop_after judge evaluations"):
        config(keep_best=True, eval_every=0).train.validate()
    with pytest.raises(ConfigError, match="keeps a checkpoint"):
        config(keep_best=True, checkpoint=False).train.validate()
    (tmp_path / rundir.BEST).write_text('{"step": "3"}')
    with pytest.raises(ConfigError, match="best.json is not"):
        rundir.read_best(tmp_path)
    (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError, match="has no best.json"):
        find_checkpoint(tmp_path / "other", "best")
