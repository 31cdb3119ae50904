"""Layers to pipeline stages.

A model of L transformer layers is cut into `pp * vpp` contiguous *chunks* (virtual stages). Chunk c holds
the layers `partition.layers_of(c)` and lives on pipeline rank `c % pp`, so with vpp > 1 every rank holds
vpp chunks spread along the model (Megatron's interleaved layout). Chunk 0 also holds the embedding and
the last chunk the output head and loss. Worked example, 16 layers, pp=2, vpp=2::

    chunk   0         1         2          3
    layers  0-3       4-7       8-11       12-15
    rank    0         1         0          1
            +embed                         +head, loss

Four ways to split (`partition_layers(..., method=...)`):

* ``"even"``    — L // n per chunk; the remainder goes to the *last* chunks, because under 1F1B the early
                  stages keep the most micro-batches in flight (stage s keeps pp - s) and so have the
                  least memory to spare.
* ``"llama3"``  — Llama-3 style: the first and last chunk hold one layer fewer, since they also carry the
                  embedding and the head + loss (Llama 3 paper, section 3.3.2). Equivalently: count the
                  embedding and the head as one layer each and split L + 2 evenly; the remainder goes to
                  the middle chunks, latest first (same memory reason as above).
* ``"cost"``    — given a cost per layer (measured or estimated; optional embedding and head costs added
                  to the first and last chunk), the contiguous split that minimises the most expensive
                  chunk; among those, the one with the smallest sum of squared chunk costs (most even).
* a list        — the user's layer counts per chunk (also accepted as a string "7,9,9,7").

Bad input raises `ConfigError` naming the rule and suggesting valid values; the rules (layers >= pp·vpp,
a user list's counts) are `fivefold.rules`', which `Config.validate` applies too. Pure Python: the
planner imports this module for its stage split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from fivefold import rules
from fivefold.rules import ConfigError

METHODS = ("even", "llama3", "cost")


@dataclass(frozen=True)
class Partition:
    """Layer counts per chunk, in model order. Chunk c lives on rank c % pp."""
    counts: tuple[int, ...]
    pp: int
    vpp: int = 1

    @property
    def layers(self) -> int:
        return sum(self.counts)

    @property
    def chunks(self) -> int:
        return len(self.counts)

    def bounds(self, chunk: int) -> tuple[int, int]:
        """[start, end) layer indices of a chunk."""
        start = sum(self.counts[:chunk])
        return start, start + self.counts[chunk]

    def layers_of(self, chunk: int) -> range:
        return range(*self.bounds(chunk))

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    def chunks_of(self, rank: int) -> list[int]:
        """Global chunk ids held by a rank, in model order (local chunk j is chunk j*pp + rank)."""
        return [j * self.pp + rank for j in range(self.vpp)]

    def layers_of_rank(self, rank: int) -> list[int]:
        return [layer for c in self.chunks_of(rank) for layer in self.layers_of(c)]

    def holds_embedding(self, rank: int) -> bool:
        return rank == 0

    def holds_head(self, rank: int) -> bool:
        return rank == self.rank_of(self.chunks - 1)


def check_sizes(layers: int, pp: int, vpp: int = 1) -> None:
    """Every (virtual) stage needs at least one layer: layers >= pp * vpp."""
    rules.check_pipeline_layers(layers, pp, vpp)


def even_counts(layers: int, chunks: int) -> list[int]:
    base, rem = divmod(layers, chunks)
    return [base + (1 if c >= chunks - rem else 0) for c in range(chunks)]


def llama3_counts(layers: int, chunks: int) -> list[int]:
    """First and last chunk one layer fewer; remainder to the middle chunks, latest first."""
    if chunks == 1:
        return [layers]
    base, rem = divmod(layers + 2, chunks)
    counts = [base] * chunks
    counts[0] -= 1
    counts[-1] -= 1
    order = list(range(chunks - 2, 0, -1)) + [0, chunks - 1]
    for c in order[:rem]:
        counts[c] += 1
    while min(counts) < 1:  # too few layers for the rule: take from the largest middle chunk
        short = counts.index(min(counts))
        donor = max(range(chunks), key=lambda c: (counts[c], c))
        counts[donor] -= 1
        counts[short] += 1
    return counts


def cost_counts(costs: Sequence[float], chunks: int, embed_cost: float = 0.0, head_cost: float = 0.0) -> list[int]:
    """Contiguous split of `costs` into `chunks` non-empty parts minimising the largest part cost
    (embedding cost added to the first part, head cost to the last); ties broken by the smallest sum of
    squared part costs."""
    n_layers = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def part_cost(chunk: int, start: int, end: int) -> float:
        extra = (embed_cost if chunk == 0 else 0.0) + (head_cost if chunk == chunks - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    def solve(score, cap: float) -> list[list[tuple[float, int]]]:
        # best[c][e]: (score of parts 0..c with part c ending at layer e, start of part c)
        inf = (float("inf"), -1)
        best = [[inf] * (n_layers + 1) for _ in range(chunks)]
        for e in range(1, n_layers - chunks + 2):
            cost = part_cost(0, 0, e)
            if cost <= cap:
                best[0][e] = (score(0.0, cost), 0)
        for c in range(1, chunks):
            for e in range(c + 1, n_layers - (chunks - 1 - c) + 1):
                for s in range(c, e):
                    prev = best[c - 1][s][0]
                    cost = part_cost(c, s, e)
                    if prev == float("inf") or cost > cap:
                        continue
                    value = score(prev, cost)
                    if value < best[c][e][0]:
                        best[c][e] = (value, s)
        return best

    best = solve(lambda acc, cost: max(acc, cost), float("inf"))
    cap = best[-1][n_layers][0]
    best = solve(lambda acc, cost: acc + cost * cost, cap * (1 + 1e-12) + 1e-12)
    counts, end = [], n_layers
    for c in range(chunks - 1, -1, -1):
        start = best[c][end][1]
        counts.append(end - start)
        end = start
    return counts[::-1]


def parse_counts(value: Union[str, Sequence[int]]) -> list[int]:
    return rules.parse_counts(value)


def check_counts(counts: Sequence[int], layers: int, pp: int, vpp: int) -> None:
    chunks = pp * vpp
    hint = f"e.g. even {even_counts(layers, chunks)} or llama3 {llama3_counts(layers, chunks)}"
    rules.check_counts(list(counts), layers, pp, vpp, hint)


def partition_layers(layers: int, pp: int, vpp: int = 1, method: Union[str, Sequence[int]] = "even",
                     costs: Sequence[float] | None = None, embed_cost: float = 0.0,
                     head_cost: float = 0.0) -> Partition:
    """Split `layers` layers into pp*vpp chunks; see the module docstring for the methods."""
    check_sizes(layers, pp, vpp)
    chunks = pp * vpp
    if isinstance(method, str) and method not in METHODS and any(ch.isdigit() for ch in method):
        method = parse_counts(method)
    if not isinstance(method, str):
        counts = parse_counts(method)
    elif method == "even":
        counts = even_counts(layers, chunks)
    elif method == "llama3":
        counts = llama3_counts(layers, chunks)
    elif method == "cost":
        if costs is None or len(costs) != layers:
            got = "none" if costs is None else len(costs)
            raise ConfigError(f"method 'cost' needs one cost per layer: {layers} costs, got {got}")
        if min(costs) < 0 or embed_cost < 0 or head_cost < 0:
            raise ConfigError("layer, embedding and head costs must be >= 0")
        counts = cost_counts(costs, chunks, embed_cost, head_cost)
    else:
        raise ConfigError(f"partition method must be one of {', '.join(METHODS)} or a list of layer counts, "
                          f"got {method!r}")
    check_counts(counts, layers, pp, vpp)
    return Partition(tuple(counts), pp, vpp)
