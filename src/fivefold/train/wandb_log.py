"""Weights & Biases logging (`train.wandb = true`): rank 0 logs the scalars it writes to TensorBoard.

The scalars are `scalars.step_scalars` of each metrics.jsonl line, logged at the line's step (1-based);
the run's resolved config is the W&B run's config, its folder `OUT/wandb/`, its name the run folder's
name, its project `train.wandb_project`. `WANDB_MODE=offline` keeps everything in OUT/wandb/ with no
network (`wandb sync` uploads it later); other WANDB_* variables work as wandb documents them. Needs the
`wandb` package, an extra: `pip install -e '.[wandb]'` from the checkout. The CLI checks for it before
any rank starts (`require_wandb`); wandb is imported only when a run is opened.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..config import Config, ConfigError
from .scalars import step_scalars

FOLDER = "wandb"


def require_wandb(enabled: bool) -> None:
    """train.wandb = true without the package fails at start, in one line."""
    if enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError("train.wandb = true needs the wandb package: pip install -e '.[wandb]' from the fivefold "
                          "checkout (or set train.wandb=false)")


class WandbLog:
    """Rank 0's W&B run, or nothing when disabled. `add(metrics)` once per step, `close()` at the end."""

    def __init__(self, out: str | Path, enabled: bool, cfg: Config, start: int = 0):
        self.run = None
        if enabled:
            import wandb

            folder = Path(out) / FOLDER
            folder.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(project=cfg.train.wandb_project, name=Path(out).resolve().name, dir=str(out),
                                  config=cfg.to_dict(), resume="allow" if start else None)

    def add(self, m: dict) -> None:
        if self.run is not None:
            self.run.log(step_scalars(m), step=m["step"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
