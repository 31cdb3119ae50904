"""Layers to pipeline stages: even, Llama-3 style, by cost, or a user list; virtual stages; errors."""
import itertools
import random

import pytest

from fivefold.config import ConfigError
from fivefold.parallel.pipeline import Partition, partition_layers
from fivefold.parallel.pipeline.partition import cost_counts


def test_even_split_puts_the_remainder_on_later_stages():
    assert partition_layers(32, 4).counts == (8, 8, 8, 8)
    assert partition_layers(30, 4).counts == (7, 7, 8, 8)
    assert partition_layers(5, 1).counts == (5,)


def test_llama3_first_and_last_stage_one_layer_fewer():
    assert partition_layers(126, 16, method="llama3").counts == (7,) + (8,) * 14 + (7,)  # Llama 3 405B
    assert partition_layers(32, 4, method="llama3").counts == (7, 9, 9, 7)
    assert partition_layers(30, 4, vpp=2, method="llama3").counts == (3, 4, 4, 4, 4, 4, 4, 3)
    assert partition_layers(8, 2, method="llama3").counts == (4, 4)
    for layers, pp in itertools.product(range(4, 40), (2, 3, 4, 6)):
        if layers < pp:
            continue
        counts = partition_layers(layers, pp, method="llama3").counts
        assert sum(counts) == layers and min(counts) >= 1
        load = [n + (i == 0) + (i == pp - 1) for i, n in enumerate(counts)]  # embedding/head as one layer each
        assert max(load) - min(load) <= 1 or min(counts) == 1, (layers, pp, counts)


def test_virtual_stages_map_chunks_to_ranks():
    part = partition_layers(16, 2, vpp=2)
    assert part.counts == (4, 4, 4, 4)
    assert [part.rank_of(c) for c in range(4)] == [0, 1, 0, 1]
    assert part.chunks_of(0) == [0, 2] and part.chunks_of(1) == [1, 3]
    assert part.layers_of_rank(0) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert list(part.layers_of(3)) == [12, 13, 14, 15]
    assert part.holds_embedding(0) and part.holds_head(1) and not part.holds_head(0)


def brute_force(costs, chunks, embed, head):
    best = None
    n = len(costs)
    for cuts in itertools.combinations(range(1, n), chunks - 1):
        bounds = (0,) + cuts + (n,)
        parts = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        parts[0] += embed
        parts[-1] += head
        key = (max(parts), sum(x * x for x in parts))
        if best is None or key < best[0]:
            best = (key, [b - a for a, b in zip(bounds, bounds[1:])])
    return best[0]


def test_cost_split_minimises_the_slowest_stage():
    rng = random.Random(1)
    for _ in range(60):
        n = rng.randint(2, 9)
        chunks = rng.randint(1, n)
        costs = [rng.choice([0.5, 1, 1, 2, 3]) for _ in range(n)]
        embed, head = rng.choice([0, 0.5, 2]), rng.choice([0, 1, 3])
        counts = cost_counts(costs, chunks, embed, head)
        bounds = [0] + list(itertools.accumulate(counts))
        parts = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        parts[0] += embed
        parts[-1] += head
        assert (max(parts), sum(x * x for x in parts)) == pytest.approx(brute_force(costs, chunks, embed, head))
    assert sorted(partition_layers(10, 4, method="cost", costs=[1] * 10).counts) == [2, 2, 3, 3]
    assert partition_layers(8, 4, method="cost", costs=[1] * 8, embed_cost=1, head_cost=2).counts == (1, 3, 3, 1)


def test_user_list():
    assert partition_layers(32, 4, method=[7, 9, 9, 7]).counts == (7, 9, 9, 7)
    assert partition_layers(32, 4, method="7,9,9,7").counts == (7, 9, 9, 7)
    assert isinstance(partition_layers(4, 2, method=(1, 3)), Partition)


@pytest.mark.parametrize("kwargs, words", [
    (dict(layers=3, pp=2, vpp=2), ["model.layers (3) must be >= pp*vpp = 2*2 = 4", "valid: pp <= 1 at vpp=2",
                                   "vpp <= 1 at pp=2"]),
    (dict(layers=3, pp=4), ["must be >= pp*vpp", "pp <= 3 at vpp=1", "more stages than layers"]),
    (dict(layers=8, pp=2, method=[4, 3]), ["sums to 7", "8 layers", "e.g. even [4, 4]"]),
    (dict(layers=8, pp=2, method=[8, 0]), ["at least one layer", "stage(s) [1]"]),
    (dict(layers=8, pp=2, vpp=2, method=[4, 4]), ["pp*vpp = 2*2 = 4 counts, got 2", "even [2, 2, 2, 2]"]),
    (dict(layers=8, pp=2, method="cost"), ["needs one cost per layer: 8 costs, got none"]),
    (dict(layers=8, pp=2, method="balanced"), ["must be one of even, llama3, cost"]),
    (dict(layers=8, pp=2, method="4;4"), ["comma-separated"]),
])
def test_errors_name_the_rule_and_suggest(kwargs, words):
    with pytest.raises(ConfigError) as e:
        partition_layers(**kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
