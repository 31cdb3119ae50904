"""ZeRO's order of events, torch-free: what the runtime (engine.py) does and the planner (plan/buffers.py,
plan/time.py `prefetch_exposed`) replays, stated once.

Slots: slot 0 is the root unit (every parameter outside the blocks: embedding, final norm, head; its
hooks wrap the whole model), slots 1..last the blocks in model order.

* Forward: a slot is gathered by its pre-forward hook, and outside a pipeline the `depth` slots after it
  are gathered behind it (`forward_prefetch`; parallel.zero_prefetch, 1 by default as FSDP's implicit
  prefetch; 0: each slot gathered only when it runs); after its forward a block is freed under
  reshard_after_forward, the root once the whole forward is done, and under a pipeline the root stays
  for the step (`frees_after_forward`).
* Backward: the root's hook fires first (the head's gradients come first), then the blocks from last to
  first (`backward_slots`); each gathers itself and, outside a pipeline, the `depth` slots whose
  backwards run next (`backward_prefetch`).
* Reductions: at most `MAX_INFLIGHT` reduce-scatters are in flight before the oldest is waited for and
  folded into its shard: enough to overlap one with the next unit's backward, few enough to bound the
  temporary buffers.

A deeper prefetch starts each gather earlier, so a gather slower than one slot's compute can still hide
behind several; it holds up to depth + 1 gathered slots at a time instead of 2 (the planner's buffers
replay it).
"""
from __future__ import annotations

MAX_INFLIGHT = 2


def forward_prefetch(slot: int, last: int, pipeline: bool, depth: int = 1) -> list[int]:
    """The slots gathered behind `slot`'s forward: the next `depth`, outside a pipeline (under one the next
    module to run depends on the schedule); none past the last."""
    if pipeline:
        return []
    return list(range(slot + 1, min(last, slot + depth) + 1))


def frees_after_forward(slot: int, reshard_after_forward: bool, pipeline: bool) -> bool:
    """Whether `slot` is freed when its forward ends (the root's forward ends with the model's)."""
    return reshard_after_forward and not (pipeline and slot == 0)


def backward_prefetch(slot: int, slots: int, pipeline: bool, depth: int = 1) -> list[int]:
    """The slots gathered behind `slot`'s backward outside a pipeline: the `depth` whose backwards run next
    (`backward_slots`: after the root's, which runs first, the last block, then the blocks before it)."""
    if pipeline:
        return []
    order = backward_slots(slots)
    at = order.index(slot)
    return order[at + 1:at + 1 + depth]


def backward_slots(slots: int) -> list[int]:
    """The order the slots' backwards start: the root (its head and final norm first), then the blocks
    from last to first."""
    return [0] + list(range(slots - 1, 0, -1))
