"""ZeRO's order of events, torch-free: what the runtime (zero.py) does and the planner (plan/buffers.py)
replays, stated once.

Slots: slot 0 is the root unit (every parameter outside the blocks: embedding, final norm, head; its
hooks wrap the whole model), slots 1..last the blocks in model order.

* Forward: a slot is gathered by its pre-forward hook, and outside a pipeline the next slot is gathered
  behind it (`forward_prefetch`); after its forward a block is freed under reshard_after_forward, the
  root once the whole forward is done, and under a pipeline the root stays for the step
  (`frees_after_forward`).
* Backward: the root's hook fires first (the head's gradients come first), then the blocks from last to
  first; each gathers itself and, outside a pipeline, the slot whose backward runs next
  (`backward_prefetch`). `backward_slots` lists that order.
* Reductions: at most `MAX_INFLIGHT` reduce-scatters are in flight before the oldest is waited for and
  folded into its shard: enough to overlap one with the next unit's backward, few enough to bound the
  temporary buffers.
"""
from __future__ import annotations

MAX_INFLIGHT = 2


def forward_prefetch(slot: int, last: int, pipeline: bool) -> int | None:
    """The slot gathered behind `slot`'s forward: the next one, outside a pipeline (under one the next
    module to run depends on the schedule); None after the last."""
    return slot + 1 if not pipeline and slot < last else None


def frees_after_forward(slot: int, reshard_after_forward: bool, pipeline: bool) -> bool:
    """Whether `slot` is freed when its forward ends (the root's forward ends with the model's)."""
    return reshard_after_forward and not (pipeline and slot == 0)


def backward_prefetch(slot: int, slots: int, pipeline: bool) -> int | None:
    """The slot gathered behind `slot`'s backward outside a pipeline: the block before it (none before
    block 1: the root is held), and after the root's (which runs first) the last block."""
    if pipeline:
        return None
    if slot == 0:
        return slots - 1 if slots > 1 else None
    return slot - 1 if slot > 1 else None


def backward_slots(slots: int) -> list[int]:
    """The order the slots' backwards start: the root (its head and final norm first), then the blocks
    from last to first."""
    return [0] + list(range(slots - 1, 0, -1))
