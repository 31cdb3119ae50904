"""A run's checkpoints, as torchtitan's checkpointer is: when to write one (every train.checkpoint_every
steps, when the ranks stop on a signal or for patience, after an evaluation that lowered the eval loss with
train.keep_best, and at the end unless the last step was just written), how many stay (the newest
train.keep_checkpoints complete ones, plus the best one under keep_best, named by OUT/best.json), what each
holds (every rank's pieces of the state as they are, train/checkpoint.py, with the run's training state
beside them: the optimizer's step count, the skipped-step streak, the data read and the evaluator's
judgement) and how a run resumes from one (any layout's; the random streams only from its own).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..config import Config
from . import checkpoint, rundir
from .rank_state import RankState


class Checkpointer:
    """One rank's checkpointing of run `cfg` (train.checkpoint, checkpoint_every, keep_checkpoints,
    keep_best). `saved`: the step last written or resumed from (None: none yet)."""

    def __init__(self, cfg: Config, rank: int, world_size: int, quiet: bool):
        self.cfg, self.rank, self.world_size, self.quiet = cfg, rank, world_size, quiet
        self.saved: int | None = None

    def due(self, step: int, stopped: bool, improved: bool) -> bool:
        """Whether step `step` (1-based: steps done) is written."""
        t = self.cfg.train
        every = t.checkpoint_every
        return t.checkpoint and bool(stopped or (every and step % every == 0) or (improved and t.keep_best))

    def due_at_end(self, step: int, trained: bool) -> bool:
        """The end of a run that trained: its last step, unless it was just written."""
        return self.cfg.train.checkpoint and trained and self.saved != step

    def save(self, out: Path, step: int, state: RankState, device: torch.device, meta: dict,
             protect: int | None) -> Path:
        """Checkpoint `step` into OUT/checkpoints: every rank writes the pieces of state it holds (its ZeRO
        shards as they are), nothing gathered; `meta`: the run's training state; `protect`: a step retention
        keeps (keep-best's)."""
        entries, opt_t = state.entries()
        path = checkpoint.save(out, step, self.cfg, entries, state.rng_state(device), {"opt_t": opt_t, **meta},
                               self.cfg.train.keep_checkpoints, self.rank, protect)
        self.saved = step
        return path

    def mark_best(self, out: Path, step: int, eval_loss: float) -> None:
        """OUT/best.json names the best checkpoint, once it is complete (rank 0)."""
        if self.rank == 0:
            rundir.write_best(out, step, eval_loss)

    def restore(self, ckpt: str | Path, state: RankState, device: torch.device) -> dict:
        """Fill `state` from a checkpoint written by any layout (each rank reads only the boxes it holds) and
        return its index (step, training state). Random streams are restored when the layout is the same
        (then a resumed run is bit-exact, dropout included)."""
        reader = checkpoint.open_matching(ckpt, state.keys())
        state.fill(reader, reader.index["opt_t"])
        where = ("offload", "offload_dir")   # where optimizer state lives changes no random stream
        layout = lambda par: {k: v for k, v in par.items() if k not in where}   # noqa: E731
        same_layout = (reader.index["world_size"] == self.world_size
                       and layout(reader.index["config"]["parallel"]) == layout(self.cfg.to_dict()["parallel"]))
        if same_layout:
            state.set_rng_state(reader.rng(self.rank), device)
        elif self.cfg.model.dropout and not self.quiet:
            print("note: the checkpoint was written by another layout: dropout's random streams start afresh",
                  file=sys.stderr)
        self.saved = reader.index["step"]
        return reader.index
