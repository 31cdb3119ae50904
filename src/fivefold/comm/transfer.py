"""Recorded copies: the bytes offloaded state moves between device and host memory and between host
memory and disk (parallel/zero/offload.py), in the same ledger as the collectives.

    copy(dst, src, ledger, "d2h")                  # device -> host (or "h2d"); non_blocking on CUDA
    read_file(fd, dst, offset, ledger)             # disk -> host memory ("nvme_read"), os.preadv
    write_file(fd, src, offset, ledger)            # host memory -> disk ("nvme_write"), os.pwritev

Each call records one row under (dim, op): message_bytes = bytes_sent = the bytes moved
(`volume.copy`), and the seconds spent issuing (an asynchronous CUDA copy: issuing only); the ledger
files d2h / h2d under tier "pcie" and nvme_read / nvme_write under "nvme". File reads and
writes go straight between the file and the tensor's memory (no mapping, so the pages never count in
the process's resident memory) and may run on a worker thread; recording takes a lock.
"""
from __future__ import annotations

import os
import threading
import time

import torch

from . import volume
from .ledger import CommLedger

OFFLOAD = "offload"   # the ledger dim of offload traffic during a step
_LOCK = threading.Lock()


def _record(ledger: CommLedger | None, dim: str, op: str, nbytes: int, seconds: float) -> None:
    if ledger is not None:
        with _LOCK:
            ledger.record(dim, op, nbytes, volume.copy(nbytes), seconds)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def copy(dst: torch.Tensor, src: torch.Tensor, ledger: CommLedger | None, op: str, dim: str = OFFLOAD,
         non_blocking: bool = False) -> None:
    """dst.copy_(src) between device and host memory (op "d2h" or "h2d"), recorded as nbytes(src). The
    dtypes must agree: a conversion happens on one side, before or after, so the bytes moved are plain."""
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(f"a recorded copy moves equal tensors, got {src.dtype}[{src.numel()}] -> "
                         f"{dst.dtype}[{dst.numel()}]")
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=non_blocking)
    _record(ledger, dim, op, nbytes(src), time.perf_counter() - t0)


def _buffer(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("file reads and writes go through contiguous host tensors")
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def read_file(fd: int, dst: torch.Tensor, offset: int, ledger: CommLedger | None, op: str = "nvme_read",
              dim: str = OFFLOAD) -> None:
    """Fill the contiguous host tensor dst from the file at byte `offset` (all of it, or OSError)."""
    buf, done, t0 = _buffer(dst), 0, time.perf_counter()
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"offload file ended after {offset + done} bytes, wanted {offset + len(buf)}")
        done += n
    _record(ledger, dim, op, len(buf), time.perf_counter() - t0)


def write_file(fd: int, src: torch.Tensor, offset: int, ledger: CommLedger | None, op: str = "nvme_write",
               dim: str = OFFLOAD) -> None:
    """Write the contiguous host tensor src into the file at byte `offset`."""
    buf, done, t0 = _buffer(src), 0, time.perf_counter()
    while done < len(buf):
        done += os.pwritev(fd, [buf[done:]], offset + done)
    _record(ledger, dim, op, len(buf), time.perf_counter() - t0)
