"""What a run writes into its folder as it goes, behind one object: `RunOutputs(out, cfg, rank, start)`.

Every step's metrics go to `log(m)`, which hands them, on rank 0, to each sink: OUT/metrics.jsonl (one
JSON line a step, NaN/inf as null), TensorBoard (train.tensorboard: scalars.py) and W&B (train.wandb:
wandb_log.py). At the end `finish(comm, run)` writes OUT/comm.json (the ledger summed over ranks, with
the evaluations' traffic under "eval") and OUT/run.json once each; `close()` ends the sinks. Other ranks
write nothing, so the trainer calls every method on every rank.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..config import Config
from .scalars import ScalarLog
from .wandb_log import WandbLog

METRICS = "metrics.jsonl"


def finite_or_null(m: dict) -> dict:
    """A metrics record with NaN/inf written as null (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}


class MetricsFile:
    """OUT/metrics.jsonl: a line per step, appended (a resumed run keeps the lines before its start)."""

    def __init__(self, out: Path):
        self.path = out / METRICS

    def add(self, m: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(finite_or_null(m), allow_nan=False) + "\n")

    def close(self) -> None:
        pass


class RunOutputs:
    def __init__(self, out: str | Path, cfg: Config, rank: int, start: int = 0):
        self.out, self.writes = Path(out), rank == 0
        self.sinks = [MetricsFile(self.out), ScalarLog(self.out, cfg.train.tensorboard, start),
                      WandbLog(self.out, cfg.train.wandb, cfg, start)] if self.writes else []

    def log(self, m: dict) -> None:
        """One step's metrics into every sink."""
        for sink in self.sinks:
            sink.add(m)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def finish(self, comm: dict, run: dict) -> None:
        """comm.json and run.json, each written once."""
        if self.writes:
            (self.out / "comm.json").write_text(json.dumps(comm, indent=1))
            (self.out / "run.json").write_text(json.dumps(run, indent=1))
