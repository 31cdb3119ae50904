"""ZeRO's order of events is stated once (parallel/zero/order.py): the runtime runs it and the planner
replays it, neither keeps its own copy."""
from fivefold.parallel.zero import order as zero_order
from fivefold.parallel.zero.order import backward_prefetch, backward_slots, forward_prefetch, frees_after_forward
from fivefold.plan import buffers


def test_the_order_outside_and_under_a_pipeline():
    assert [forward_prefetch(k, 3, pipeline=False) for k in range(4)] == [[1], [2], [3], []]
    assert [forward_prefetch(k, 3, pipeline=True) for k in range(4)] == [[]] * 4
    assert backward_slots(4) == [0, 3, 2, 1]                       # the head's gradients come first
    assert [backward_prefetch(k, 4, pipeline=False) for k in backward_slots(4)] == [[3], [2], [1], []]
    assert backward_prefetch(0, 1, pipeline=False) == []            # a root alone
    assert frees_after_forward(0, True, pipeline=False) and not frees_after_forward(0, True, pipeline=True)
    assert frees_after_forward(2, True, pipeline=True) and not frees_after_forward(2, False, pipeline=False)


def test_deeper_prefetch_takes_the_next_slots_in_running_order():
    assert [forward_prefetch(k, 4, False, depth=2) for k in range(5)] == [[1, 2], [2, 3], [3, 4], [4], []]
    assert [backward_prefetch(k, 5, False, depth=3) for k in backward_slots(5)] == [[4, 3, 2], [3, 2, 1], [2, 1],
                                                                                      [1], []]
    assert forward_prefetch(0, 4, False, depth=0) == [] and backward_prefetch(4, 5, False, depth=0) == []
    assert forward_prefetch(0, 4, True, depth=3) == [] and backward_prefetch(0, 5, True, depth=3) == []


def test_planner_and_runtime_share_it():
    import fivefold.parallel.zero.engine as zero
    import fivefold.parallel.zero.stages as zero_stage   # ZeRO-3's gathers and frees

    assert buffers.MAX_INFLIGHT is zero_order.MAX_INFLIGHT is zero.MAX_INFLIGHT
    for name in ("forward_prefetch", "backward_prefetch", "frees_after_forward"):
        assert getattr(zero_stage, name) is getattr(zero_order, name) is getattr(buffers, name)
