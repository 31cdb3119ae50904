"""Evaluation in a run, as torchtitan's validator is: when (every train.eval_every steps and after the last),
on what (the held-out batches, data.py's EvalBatches: train.eval_data or train.eval_fraction), how (forward
only, no gradient, dropout off, the mean token loss over every evaluated token, summed as the training
loss is so it is the same under every layout), and the keep-best judgement: the lowest eval loss so far
(train.keep_best checkpoints it) and how many evaluations went by without a lower one (train.stop_after
stops the run). The judgement is training state: checkpoints carry it (`state`, `load`), so a resumed run
judges as an uninterrupted one.
"""
from __future__ import annotations

import math
import sys
from typing import Callable

import torch

from ..config import TrainConfig
from ..model.moe import MoE
from .launch import heartbeat


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows (and NaN for a NaN loss)."""
    return math.exp(loss) if loss < 709 or not math.isfinite(loss) else math.inf


class Evaluator:
    """`batches`: the evaluation batches (None: no evaluation). `quiet`: no console line (the other ranks)."""

    def __init__(self, train: TrainConfig, batches, quiet: bool):
        self.cfg, self.batches, self.quiet = train, batches, quiet
        self.count = 0                  # evaluations this process ran
        self.best: dict | None = None   # {"step", "eval_loss"} of the lowest eval loss
        self.since_best = 0             # evaluations since it

    def due(self, step: int) -> bool:
        """Whether step `step` (0-based) is followed by an evaluation: every train.eval_every steps and
        after the run's last step (eval_every 0: never)."""
        every = self.cfg.eval_every
        return bool(every and self.batches is not None and ((step + 1) % every == 0 or step + 1 == self.cfg.steps))

    def evaluate(self, model: torch.nn.Module, forward: Callable[[int, int], torch.Tensor],
                 finish: Callable[[torch.Tensor], None], device: torch.device, step: int | None) -> dict:
        """The model's loss on the evaluation batches: `forward(b, n_tokens)` is batch b's local summed token
        loss over the evaluation's n_tokens, `finish(loss)` sums it over the ranks (and frees what the
        forwards gathered). Call on every rank; `step`: the run's, for the watchdog's heartbeat."""
        n_tokens = self.batches.loss_tokens_total()
        was_training = model.training
        model.eval()
        with torch.no_grad():
            loss_local = torch.zeros(1, dtype=torch.float64, device=device)
            for b in range(self.batches.count):
                loss_local += forward(b, n_tokens)
                heartbeat(step)   # progress, not a hang (watchdog)
            finish(loss_local)
        model.train(was_training)
        model.aux.take()   # an evaluation trains nothing: no auxiliary loss, no routing statistics
        for m in model.modules():
            if isinstance(m, MoE):
                m.take_step_stats()
        self.count += 1
        loss = float(loss_local)
        return {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_loss_tokens": n_tokens}

    def judge(self, step: int, eval_loss: float) -> bool:
        """Whether the evaluation after step `step` (1-based) lowered the best eval loss; every rank decides
        alike (the loss is the same on all)."""
        if not math.isfinite(eval_loss) or (self.best is not None and eval_loss >= self.best["eval_loss"]):
            self.since_best += 1
            return False
        self.best, self.since_best = {"step": step, "eval_loss": float(eval_loss)}, 0
        return True

    def patience_out(self, step: int) -> bool:
        """train.stop_after evaluations in a row without a lower eval loss: stop (with one line)."""
        n = self.cfg.stop_after
        if not n or self.since_best < n:
            return False
        if not self.quiet:
            print(f"stopping after step {step}: the eval loss has not improved for {n} evaluations (best "
                  f"{self.best['eval_loss']:.6f} after step {self.best['step']})", file=sys.stderr)
        return True

    def best_step(self) -> int | None:
        """The step whose checkpoint keep-best protects from retention, or None."""
        return self.best["step"] if self.best and self.cfg.keep_best else None

    def state(self) -> dict:
        """What a checkpoint keeps of the judgement (its index's keys, as before this class)."""
        return {"best": self.best, "evals_since_best": self.since_best}

    def load(self, index: dict) -> None:
        self.best = index.get("best")
        self.since_best = index.get("evals_since_best", 0)
