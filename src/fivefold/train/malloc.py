"""A sharded rank's resident memory follows its live tensors: large host buffers go back to the system when freed.

PyTorch's CPU allocator is the C library's malloc. glibc maps a block of at least M_MMAP_THRESHOLD bytes
on its own and unmaps it on free, but by default it raises that threshold to the size of every mapped
block freed (up to 32 MiB), so after the first step the blocks a step makes and frees (ZeRO-3's gathered
units, gradient buckets, the optimizer's scratch) come from its heap and stay resident once freed, well
beyond the bytes of its live tensors (tests/ranks/test_start_memory.py holds the bound). Fixing the threshold at
`rules.MMAP_THRESHOLD_BYTES` keeps large blocks mapped, so what is resident is what the planner counts; the
cost is the kernel's page faults on each new large block, activations included (2 MiB sits above a small
model's per-layer activations; `rules.MMAP_THRESHOLD_BYTES` says what the planner charges for it).

Only ranks that shard their model state fix it (`rules.pins_mmap_threshold`, called by the Trainer): a
rank holding the whole model gains nothing from it and pays the faults (benchmarks/README.md, "One rank
against the plain transformers loop").

A user's own MALLOC_MMAP_THRESHOLD_ (glibc's environment tuning) is left as it is, and so is a C
library without mallopt."""
from __future__ import annotations

import ctypes
import os

from ..rules import MMAP_THRESHOLD_BYTES

M_MMAP_THRESHOLD = -3   # glibc's malloc.h


def return_freed_memory() -> bool:
    """Set glibc's mmap threshold for this process (see the module docstring); True if it was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):   # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
