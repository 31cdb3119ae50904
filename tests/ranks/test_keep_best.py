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


# The eval losses after steps 1..12 that the tests judge: they fall to a low after step 5, rise for two
# evaluations, dip (not below the low) and rise again. Constructed, not hoped for from a training run.
TRAJECTORY = [5.0, 4.2, 3.9, 3.7, 3.5, 3.6, 3.8, 3.55, 3.9, 4.0, 4.1, 4.2]
BEST = 5                           # the step of the lowest
PATIENCE_2_END = 7                 # stop_after 2: steps 6 and 7 did not improve
PATIENCE_3_END = 8                 # stop_after 3: steps 6, 7 and 8 (its dip, 3.55, is above the low 3.5)


class Scripted(Trainer):
    """A Trainer whose evaluations run as always and then report TRAJECTORY's loss for the step just
    trained (a resumed run reads the same loss at the same step)."""

    def evaluate(self) -> dict:
        m = super().evaluate()
        return {**m, "eval_loss": TRAJECTORY[self.step_count - 1]}


def config(**train):
    cfg = tiny_config()
    t = cfg.train
    t.steps, t.eval_every, t.eval_fraction, t.eval_tokens = 12, 1, 0.1, 256
    t.checkpoint, t.checkpoint_every, t.keep_checkpoints = True, 0, 1
    for k, v in train.items():
        setattr(t, k, v)
    return cfg


def eval_losses(out):
    return [json.loads(line)["eval_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_best_checkpoint_is_kept_and_named_and_stop_after_ends_the_run(tmp_path):
    out = tmp_path / "run"
    Scripted(config(keep_best=True), quiet=True).run(out)
    assert eval_losses(out) == TRAJECTORY              # every step evaluated, no early stop without stop_after
    assert rundir.read_best(out) == {"step": BEST, "eval_loss": TRAJECTORY[BEST - 1]}
    kept = [c.name for c in rundir.checkpoints(out)]
    assert kept == [rundir.step_dir(out, BEST).name, rundir.step_dir(out, 12).name]   # keep_checkpoints 1 + best
    assert find_checkpoint(out, "best") == rundir.step_dir(out, BEST)

    stopped = tmp_path / "stopped"
    Scripted(config(keep_best=True, stop_after=2), quiet=True).run(stopped)
    assert eval_losses(stopped) == TRAJECTORY[:PATIENCE_2_END]   # it stopped where two evaluations did not improve
    assert rundir.read_best(stopped) == {"step": BEST, "eval_loss": TRAJECTORY[BEST - 1]}
    assert rundir.checkpoints(stopped)[-1].name == rundir.step_dir(stopped, PATIENCE_2_END).name   # saved at the stop


def test_a_resumed_run_judges_as_an_uninterrupted_one(tmp_path):
    full = tmp_path / "full"
    Scripted(config(keep_best=True, stop_after=3), quiet=True).run(full)
    assert eval_losses(full) == TRAJECTORY[:PATIENCE_3_END]    # a dip above the best does not reset patience
    part = tmp_path / "part"
    cfg = config(keep_best=True, stop_after=3, checkpoint_every=2)
    cfg.train.steps = 6                                         # interrupted after the best, one bad evaluation in
    Scripted(cfg, quiet=True).run(part)
    cfg.train.steps = 12
    Scripted(cfg, quiet=True).run(part, resume="auto")          # patience carried over: stops at step 8 too
    assert eval_losses(part) == eval_losses(full)
    assert rundir.read_best(part) == rundir.read_best(full) == {"step": BEST, "eval_loss": TRAJECTORY[BEST - 1]}


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
