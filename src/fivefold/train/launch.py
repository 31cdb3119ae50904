"""Start ranks: N local gloo processes, or one rank of a `torchrun` job.

`run_ranks(fn, nproc, args, timeout_s)` spawns fresh processes (one intra-op thread each), joins them
into a gloo process group on a free local port, runs `fn(rank, world_size, *args)` in each and returns
every rank's result, in rank order. A rank that raises makes the call raise `RankError` carrying that
rank's traceback, after every other rank has been terminated; a run that exceeds `timeout_s` is killed
the same way and raises `TimeoutError`. No process outlives the call. The tests use the same function.
"""
from __future__ import annotations

import io
import os
import sys
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import ConfigError


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_thread() -> None:
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set in this process


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 300) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)   # results are tensors and plain data: no code


def _worker(rank, world_size, port, fn, args, results, timeout_s):
    one_thread()
    try:
        if world_size > 1:
            init_gloo(rank, world_size, port, timeout_s)
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", _dumps(out)))
    except BaseException:  # noqa: BLE001 - any failure is reported with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(fn, nproc: int, args: tuple = (), timeout_s: float = 300) -> list:
    """Run fn(rank, nproc, *args) on nproc fresh gloo ranks; return the results in rank order."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the children before torch loads
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, fn, args, results, timeout_s), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < nproc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{nproc} ranks did not finish within {timeout_s:.0f} s "
                                   f"(finished: {sorted(out)})")
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RankError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result")
                continue
            if status == "error":
                raise RankError(f"rank {rank} failed:\n{payload}")
            out[rank] = _loads(payload)
        for p in procs:
            p.join(timeout=30)
        return [out[r] for r in range(nproc)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world_size) when started by torchrun, else None. Read only by the launcher."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def init_torchrun(timeout_s: float = 1800, device: str = "auto") -> tuple[int, int]:
    """Join a torchrun job: NCCL when the run's device (train.device: auto | cpu | cuda) is CUDA, else gloo.
    On CUDA each rank takes the GPU of its local rank (torchrun's LOCAL_RANK)."""
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"   # the trainer resolves train.device from this backend
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def leave_torchrun(code: int) -> None:
    """Leave the job and end this rank's process now with `code`. The process group is destroyed first;
    then the process exits without the interpreter's teardown, during which a native thread torch leaves
    behind intermittently aborts the rank ("terminate called without an active exception", about one run
    in three with gloo on torch 2.13) after all its work is written."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def resolve_device(name: str, backend: str | None) -> torch.device:
    """train.device for ranks joined over `backend` (None: a single process). auto: CUDA when present and
    the ranks talk over NCCL (torchrun), else CPU — local `--nproc` ranks talk over gloo on the CPU.
    cuda: the current CUDA device, which the launcher set from torchrun's local rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and backend in (None, "nccl") else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but torch finds no CUDA device; use device = 'cpu' or 'auto'")
    if backend == "gloo":
        raise ConfigError("train.device = 'cuda' needs NCCL: run the job under torchrun (one process per GPU); "
                          "local --nproc ranks run on the CPU over gloo (use device = 'cpu' or 'auto')")
    return torch.device("cuda", torch.cuda.current_device())
