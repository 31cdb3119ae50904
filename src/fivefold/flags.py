"""Command-line flags shared by `fivefold train` and `fivefold plan`: the micro-batch names, and flags
that were renamed.

One name, one meaning, in every command:

    --microbatches M       how many micro-batches a step's batch is cut into per data-parallel rank
                           (parallel.microbatches; train, eval, schedule)
    --micro-batch-size B   sequences per micro-batch (plan; train derives microbatches from it:
                           global_batch / (dp x B))

The old `--micro-batch` (plan: a size, easily read as train's count) is a one-line error naming the new
flag, exit 2, as is every renamed flag in RENAMED, and every error argparse itself finds (`OneLineParser`).
"""
from __future__ import annotations

import argparse

MICROBATCHES_HELP = "micro-batches per step on each data-parallel rank: a count"
MICRO_BATCH_SIZE_HELP = "sequences per micro-batch: a size (train: sets microbatches = global_batch / (dp x B))"
RENAMED = {"--micro-batch": "--micro-batch-size B (sequences per micro-batch); the count is --microbatches M (train, eval)"}


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (a value of the wrong type, an unknown choice, a missing argument) in one line
    naming the flag and the valid values, exit 2, as every other bad input; argparse printed its whole usage
    first (for `fivefold plan`, 25 lines)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class Renamed(argparse.Action):
    """A flag that was renamed: using it prints one line naming the new one and exits 2."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(nargs="?", help=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: {option_string} was renamed: use {RENAMED[option_string]}\n")


def add_renamed(ap: argparse.ArgumentParser) -> None:
    """Every RENAMED flag, hidden from --help."""
    for old in RENAMED:
        ap.add_argument(old, dest=f"renamed_{old.strip('-').replace('-', '_')}", action=Renamed)
