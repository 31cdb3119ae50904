"""ZeRO-3's prefetch depth in the planner (plan/time.py `prefetch_exposed`): the gathers and reduce-scatters of
one micro-batch on one stream in the order `ShardedParams` issues them (parallel/zero/order.py), each slot's hook
waiting for its own gather and then issuing the next `depth`."""
from dataclasses import replace

import pytest

from fivefold.plan.estimate import estimate
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.models import PRESETS
from fivefold.plan.time import prefetch_exposed
from fivefold.plan.topology import TOPOLOGIES


def test_by_hand_a_root_and_two_blocks():
    """Gathers of 1 s each, blocks computing 1.75 s forward (t_f 4 less the head's 0.5, which runs at the
    end), the root ~0. Depth 1: the
    root's and the first block's gathers show (nothing computes before them), the second hides: 2 s. Depth 0:
    every gather waits: 3 s. Backward (the head's 1 s, blocks 2 s, reduce-scatters 1 s each, the root's
    last): the root's gather shows; block 2's hides behind the head's backward, block 1's behind block 2's,
    block 2's reduction behind block 1's backward; block 1's and the root's reductions show: 3 s. Depth 0:
    every gather and every reduction but block 2's shows: 6 s."""
    fwd, bwd = prefetch_exposed([1.0, 1.0, 1.0], 3.0, 3.0, 4.0, 5.0, 0.5, depth=1)
    assert fwd == pytest.approx(2.0) and bwd == pytest.approx(3.0)
    fwd0, bwd0 = prefetch_exposed([1.0, 1.0, 1.0], 3.0, 3.0, 4.0, 5.0, 0.5, depth=0)
    assert fwd0 == pytest.approx(3.0) and bwd0 == pytest.approx(6.0)


def test_deeper_hides_more_and_never_less():
    """On one stream a deeper prefetch helps forward only where the stream would idle: uneven slots (a small
    block before a large one). Uniform blocks whose gathers outrun their compute gain nothing forward past
    depth 1 (the stream is the bottleneck); backward a deeper prefetch puts the gathers on the stream
    before the reductions the blocks' backwards queue there, until the reductions it delays hold the
    compute (at most MAX_INFLIGHT in flight)."""
    uneven = [1.0, 0.1, 1.9, 0.1, 1.9]                 # blocks 1 s each forward; gathers 0.5 s in all per 1.0
    runs = [prefetch_exposed(uneven, 5.0, 0.0, 4.0, 8.0, 0.0, depth=d) for d in range(5)]
    assert runs[0][0] == pytest.approx(5.0)           # depth 0: every gather shows
    assert runs[1][0] == pytest.approx(2.9)           # the root, the first block, and 0.9 of each large one
    assert runs[2][0] == pytest.approx(2.0)           # depth 2: issued a block earlier, the large ones hide
    uniform = [4.0] + [1.0] * 8
    flat = [prefetch_exposed(uniform, 6.0, 6.0, 4.0, 8.0, 0.4, depth=d) for d in range(6)]
    for series in (runs, flat):                       # forward a deeper prefetch never shows more
        for a, b in zip(series, series[1:]):
            assert b[0] <= a[0] + 1e-12
    assert flat[5][0] == pytest.approx(flat[1][0])     # forward: nothing to gain
    assert flat[2][1] < flat[1][1]                      # backward: gathers go ahead of the reductions queued
    # too deep and the queued gathers delay the reductions, for the oldest of which the compute waits once
    # more than MAX_INFLIGHT are in flight
    assert flat[5][1] > flat[2][1]


def test_the_step_follows_the_depth():
    model, topo = PRESETS["llama3-8b"], TOPOLOGIES["dgx-h100"]
    work = Workload(seq=4096, global_batch=64)
    lay = Layout(dp=64, zero=3, micro_batch=1)
    steps = [estimate(model, replace(lay, zero_prefetch=d), work, topo, 64).time.step_time_s for d in (0, 1, 4)]
    assert steps[0] > steps[1] >= steps[2]
    mem = [estimate(model, replace(lay, zero_prefetch=d), work, topo, 64).memory.most_loaded["buffers"]
           for d in (0, 1, 4)]
    assert mem[0] < mem[1] < mem[2]
