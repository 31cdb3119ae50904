"""A rank's resident memory follows its live tensors: large host buffers go back to the system when freed.

PyTorch's CPU allocator is the C library's malloc. glibc maps a block of at least M_MMAP_THRESHOLD bytes
on its own and unmaps it on free, but by default it raises that threshold to the size of every mapped
block freed (up to 32 MiB), so after the first step the blocks a step makes and frees (ZeRO-3's gathered
units, gradient buckets, the optimizer's scratch) come from its heap and stay resident once freed. A
ZeRO-3 rank then held 1.7-2x the bytes of its live tensors (tests/test_start_memory.py: 1.2-1.4 GiB of
resident memory over the floor against 0.62 GiB of tensors at the step's peak). Fixing the threshold at
MMAP_THRESHOLD_BYTES keeps large blocks mapped, so what is resident is what the planner counts; smaller
blocks still come from the heap. The cost is the kernel's page faults on each new large block, so the
threshold sits above a layer's per-micro-batch activations of small models: at 1 MiB a tp2 step of
benchmarks/plan_vs_run.py's model (1 MiB activations) spent 158 ms of "other aten ops" (element-wise
kernels writing fresh pages at 4-5 GB/s) against 49 ms at glibc's own threshold, 656 ms a step against
480. At 2 MiB the step takes 514 ms and tests/test_start_memory.py's ranks use the same share of their
bound as at 1 MiB (tp2 x pp2 up to 0.988 against 0.982); at 4 MiB (491 ms) tp2 x pp2 reaches 1.00 of it.

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
