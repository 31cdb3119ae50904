"""Which ranks are blocked in a collective: a slot of shared memory per local rank, 1 while it waits.

`train.launch.run_ranks` hands each rank its slot (`watch_waits`); every blocking wait of comm/ (a
Handle's `wait`, `gather_objects`, `CommLedger.gather`) runs inside `waiting()`. When the hang watchdog
fires, the ranks blocked in a collective are waiting for the ones that are not, and those are named.
Torch-free: the ledger imports it.
"""
from __future__ import annotations

import contextlib

_slots = None   # (shared array, this rank's index) under train.launch.run_ranks; None elsewhere
_depth = 0      # nested waits of this process (a batched handle waits for its parts)


def watch_waits(slots, index: int) -> None:
    """Mark this process's blocking waits in slots[index] (1 while waiting, else 0): the launcher reads it."""
    global _slots
    _slots = (slots, index)


@contextlib.contextmanager
def waiting():
    """Inside: this rank is blocked in a collective (see `watch_waits`)."""
    global _depth
    _depth += 1
    if _slots is not None:
        _slots[0][_slots[1]] = 1
    try:
        yield
    finally:
        _depth -= 1
        if _slots is not None and _depth == 0:
            _slots[0][_slots[1]] = 0


def blocked() -> bool:
    """Whether this process is inside a blocking wait now (read by a torchrun rank's watchdog thread)."""
    return _depth > 0
