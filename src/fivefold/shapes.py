"""Sizes the runtime lays out and the planner predicts, torch-free: one definition for both.

- `padded_vocab(vocab, n)`: the vocabulary rounded up to a multiple of the tensor-parallel size.
- `bucket_ranges(numels, bucket_bytes, itemsize)`: DDP / ZeRO-1/2 buckets (consecutive, greedy).
- `padded(numel, n)`, `shard_size(numel, n)`, `segments(...)`: a ZeRO unit's flat buffer padded to a
  multiple of n, the k = padded/n elements each rank owns (rank r: [r·k, (r+1)·k)), and which
  parameters overlap a rank's shard [lo, hi).
- `Box`: the part of a single-process tensor that a piece holds (offsets and sizes along every dim): what
  checkpoints store and every weight source (init, checkpoint, Hugging Face files) is asked for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def padded_vocab(vocab: int, n: int) -> int:
    """The vocabulary rounded up to a multiple of the tensor-parallel size (padded rows get -inf logits)."""
    return padded(vocab, n)


def padded(numel: int, n: int) -> int:
    """A flat buffer of numel elements padded to a multiple of n (shard size padded // n)."""
    return -(-numel // n) * n


def shard_size(numel: int, n: int) -> int:
    """Elements each of n ranks owns of a buffer of numel elements padded to a multiple of n."""
    return padded(numel, n) // n


def bucket_ranges(numels: list[int], bucket_bytes: int | float, itemsize: int) -> list[list[int]]:
    """Indices of consecutive items grouped into buckets of at most bucket_bytes (a single larger
    item gets a bucket of its own)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        if cur and size + n * itemsize > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n * itemsize
    if cur:
        out.append(cur)
    return out


def segments(numels: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(item index, start in the shard, length) for each item of a flat buffer (items laid out
    consecutively from offset 0) that overlaps the shard [lo, hi)."""
    out, o = [], 0
    for i, n in enumerate(numels):
        a, b = max(o, lo), min(o + n, hi)
        if a < b:
            out.append((i, a - lo, b - a))
        o += n
    return out


def windows(total: float, chunk: int) -> list[tuple[float, int]]:
    """A flat sequence of `total` elements cut into consecutive windows of at most `chunk`: [(elements
    per window, windows)], the full windows then the rest (`total` may be a planner's mean, fractional)."""
    full, rest = int(total // chunk), total - chunk * int(total // chunk)
    return [(n, k) for n, k in ((chunk, full), (rest, 1)) if n > 0 and k > 0]


@dataclass(frozen=True)
class Box:
    """The part of a single-process tensor a piece holds: `shape` is the full tensor's."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @staticmethod
    def whole(shape) -> "Box":
        shape = tuple(shape)
        return Box(shape, (0,) * len(shape), shape)
