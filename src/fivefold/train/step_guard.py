"""What keeps a run standing from step to step, besides the step itself: non-finite steps skipped (no
update; train.skip_nonfinite) until train.max_skips in a row stop the run, naming the step; and, once
per step, the ranks' agreement on whether a stop signal arrived (SIGINT / SIGTERM), on the largest peak
memory of any rank and on the slowest rank (the straggler): one 24-byte all-reduce (max) over the world,
ledger dim "control" (the planner counts it: plan/traffic.py).

Stragglers: each rank's busy seconds in a step are its step time less the seconds it spent in collectives
(the ledger's); the max of busy · 2^20 + rank names the slowest rank and, from parallel.ranks_per_node, its
node: metrics.jsonl's `slowest_rank`, `slowest_busy_s` and, when the ranks span nodes, `slowest_node`.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from .. import comm
from ..comm import Group
from ..config import TrainConfig
from .launch import stop_requested

STOP_SIGNALS = ("SIGINT", "SIGTERM")   # agreed over the ranks as an index + 1 (0: keep going)
STRAGGLER_RANK_BITS = 20      # ranks below 2^20 in the low bits; microseconds of busy time above them


class NonFiniteError(RuntimeError):
    """The run stopped on NaN/inf loss or gradient norm (train.skip_nonfinite, train.max_skips)."""

    brief = True   # the message says it all: the launcher reports it without a traceback


def straggler_key(busy_s: float, rank: int) -> int:
    """One int64 whose max over ranks is the slowest rank: busy microseconds, then the rank."""
    return (max(0, int(busy_s * 1e6)) << STRAGGLER_RANK_BITS) | rank


def straggler(key: int, ranks_per_node: int, world: int) -> dict:
    """The metrics of the slowest rank from the agreed key ({} with one rank: no one to compare)."""
    if world <= 1:
        return {}
    rank = key & ((1 << STRAGGLER_RANK_BITS) - 1)
    node = {"slowest_node": rank // ranks_per_node} if 0 < ranks_per_node < world else {}
    return {"slowest_rank": rank, **node, "slowest_busy_s": (key >> STRAGGLER_RANK_BITS) / 1e6}


class StepGuard:
    """One rank's guard. `skips`: the non-finite steps in a row (checkpoints keep it). `value` reads a
    0-dim tensor as a number (a dry run's: 0)."""

    def __init__(self, train: TrainConfig, rank: int, world: Group, ranks_per_node: int, device: torch.device,
                 value: Callable, quiet: bool):
        self.cfg, self.rank, self.world, self.ranks_per_node = train, rank, world, ranks_per_node
        self.device, self.value, self.quiet = device, value, quiet
        self.skips = 0

    def passed(self) -> None:
        """A finite step: the streak ends."""
        self.skips = 0

    def skip(self, step: int, loss: float, norm: float) -> None:
        """A non-finite step: no update (its gradients are dropped), or the end of the run."""
        cfg = self.cfg
        self.skips += 1
        what = f"step {step + 1}: loss {loss}, gradient norm {norm}"   # 1-based, as the console and metrics.jsonl
        if not cfg.skip_nonfinite:
            raise NonFiniteError(f"{what} (train.skip_nonfinite is off); lower train.lr or raise train.warmup")
        if self.skips >= cfg.max_skips:
            raise NonFiniteError(f"{what}: {self.skips} non-finite steps in a row (train.max_skips = "
                                 f"{cfg.max_skips}); stopped without saving: lower train.lr or raise train.warmup")
        if not self.quiet:
            print(f"\nwarning: {what}: step skipped ({self.skips} in a row, stop at {cfg.max_skips})", file=sys.stderr)

    def agree(self, peak_bytes: int | None, busy_s: float = 0.0) -> tuple[str | None, int | None, dict]:
        """The stop signal any rank received, the largest of the ranks' peak memory (`peak_bytes`: this
        rank's) and the slowest rank by busy seconds (`busy_s`: this rank's step time outside collectives),
        agreed by all: one all-reduce (max) of three int64."""
        name = stop_requested()
        busy = straggler_key(busy_s, self.rank)
        flags = torch.tensor([STOP_SIGNALS.index(name) + 1 if name in STOP_SIGNALS else 0, peak_bytes or 0, busy],
                             dtype=torch.int64, device=self.device)
        comm.all_reduce(flags, self.world, reduce_op="max", dim="control")
        agreed, peak = int(self.value(flags[0])), int(self.value(flags[1]))
        return (STOP_SIGNALS[agreed - 1] if agreed else None), (peak or None), \
            straggler(int(self.value(flags[2])), self.ranks_per_node, self.world.size)
