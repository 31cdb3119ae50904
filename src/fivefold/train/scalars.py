"""Per-step scalars for TensorBoard (`train.tensorboard = true`): what rank 0 writes beside metrics.jsonl.

    OUT/tensorboard/events.out.tfevents.*   loss, grad_norm, lr, tokens_per_s, one point per step, at
                                            its step number (1-based, as metrics.jsonl);
                                            tflops, mfu where known (speed.py), peak_memory_gib;
                                            expert_imbalance, dropped_fraction with experts;
                                            eval_loss, eval_ppl at the steps that evaluate

The values are those of the step's metrics.jsonl line (tokens/s = tokens / seconds), the console line's
(progress.py); W&B logs the same (wandb_log.py). A resumed run hides the events of the steps it rewrites
(SummaryWriter's `purge_step`). Needs the `tensorboard` package (`pip install -e '.[tensorboard]'` from the
checkout): the CLI checks for it before any rank starts (`require_tensorboard`).
Torch (torch.utils.tensorboard) is imported only when a writer is opened.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..config import ConfigError

FOLDER = "tensorboard"
OPTIONAL_SCALARS = ("tflops", "mfu", "expert_imbalance", "dropped_fraction")   # where the record has them
EVAL_SCALARS = ("eval_loss", "eval_ppl")   # only at the steps that evaluate


def require_tensorboard(enabled: bool) -> None:
    """train.tensorboard = true without the package fails at start, in one line."""
    if enabled and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.tensorboard = true needs the tensorboard package: pip install -e '.[tensorboard]' "
                          "from the fivefold checkout (or set train.tensorboard=false)")


def step_scalars(m: dict) -> dict[str, float]:
    """A metrics record's scalars: loss, grad_norm, lr and tokens/s, and those of OPTIONAL_SCALARS,
    peak_memory_gib and EVAL_SCALARS the record has."""
    seconds = m.get("seconds") or 0.0
    extra = {k: m[k] for k in (*OPTIONAL_SCALARS, *EVAL_SCALARS) if m.get(k) is not None}
    memory = {"peak_memory_gib": m["peak_memory_bytes"] / 2**30} if m.get("peak_memory_bytes") else {}
    return {"loss": m["loss"], "grad_norm": m["grad_norm"], "lr": m["lr"],
            "tokens_per_s": m["tokens"] / seconds if seconds > 0 else float("nan"), **memory, **extra}


class ScalarLog:
    """Rank 0's TensorBoard writer under OUT/tensorboard/, or nothing when disabled (other ranks, or
    train.tensorboard = false). `add(metrics)` once per step, `close()` at the end."""

    def __init__(self, out: str | Path, enabled: bool, start: int = 0):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(out) / FOLDER), purge_step=start or None)

    def add(self, m: dict) -> None:
        if self.writer is None:
            return
        for name, value in step_scalars(m).items():
            self.writer.add_scalar(name, value, m["step"])
        self.writer.flush()   # a killed run keeps the steps it finished

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
