"""Offloaded optimizer state: where ZeRO's optimizer shards live when not on the device, and how they move.

Papers: Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC 2021), and
Rajbhandari et al., "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep Learning"
(SC 2021). ZeRO-Offload keeps on the accelerator only what forward and backward touch (parameters and
gradients) and moves the rest of model state, the fp32 master weights and Adam's two moments (12 of
the 16 bytes per parameter of mixed-precision Adam), together with the optimizer step itself, to host
memory; ZeRO-Infinity moves that state on to NVMe. Both keep ZeRO's partitioning: each rank offloads
only its own shard [lo, hi) of every unit (engine.py).

`parallel.offload`:

- "cpu" (`HostState`): the master shard and the moments of every unit live in host memory (pinned
  when the device is CUDA). After the gradient reduction (and clipping) the step runs unit by unit:
  the unit's reduced gradient shard is copied device -> host, AdamW updates the unit on the host, the
  updated parameter shard (converted to the parameters' dtype on the host) goes host -> device. On CUDA
  every gradient copy is issued at once on a side stream and the host waits only for the unit it
  updates next, and each unit's parameter copy runs while the host updates the next unit.
- Gradients streamed to the host (ZeRO-2 and 3, both modes; Ren et al. 2021, §4.1; `streams_grads`):
  the reduced gradient shards never stay on the device. When the engine folds a unit's reduce-scatter
  in (parallel/zero/engine.py `_fold`, at most MAX_INFLIGHT behind the backward) `add_grad` copies the shard
  down (d2h; on CUDA on the side stream, behind the reduce-scatter) into one of LANDING host buffers of
  the largest shard, then adds it to the unit's host gradient shard, where the micro-batches accumulate
  (as DeepSpeed accumulates into the CPU partition), and the unit's device gradient and result are
  freed. On the CPU the add follows the copy at once; on CUDA it waits until the landing buffer is
  needed again or the engine's `finish` (`settle`). The step then starts with the gradients in host
  memory (no d2h at the step); the norm and clipping run on those host shards. ZeRO-1 keeps its whole
  gradient on the device and copies the shard down at the step as above.
- "nvme" (`DiskState`): the master shard and the moments of every unit live in one file per rank in
  OFFLOAD_DIR/rank-RRRRR/ (unit j at a fixed offset, [master | exp_avg | exp_avg_sq], and with ZeRO-3
  its parameter shard after them: [... | param]), read with
  os.preadv into one of two bounded host buffers and written back with os.pwritev (never
  memory-mapped: mapped pages would count in the process's resident memory). A worker thread reads
  unit j + 2 while the host updates unit j + 1 and writes unit j back behind it, so at most two units'
  state is in memory. The file is scratch: it is built at start from the model (or, on resume, from
  the checkpoint, which is what a resume reads) and its name is removed as soon as it is open, so no
  other run can open it and the kernel frees it when the process ends, however it ends (a crash
  leaves nothing behind; `df` shows the space while the run lives, `ls` does not).
- "nvme" with ZeRO-3 (`params_on_disk`: the store `holds_params`, ZeRO-Infinity's parameter offload): the device keeps no
  parameter shard between uses either. Before each all-gather of unit u (every gather the engine makes:
  forward, backward, prefetches, pipeline uses) `read_params` reads the shard from the file into a host
  buffer of the largest shard (nvme_read) and copies it up (h2d) into the shard's own slot of the
  gathered buffer, which the all-gather then fills in place (NCCL and gloo allow an input that is the
  output's own chunk): no device buffer beyond the gathered one, freed with it. After the optimizer step
  the updated parameter shard goes to the file (nvme_write, written behind like the state) instead of up
  to the device. The copy up is blocking (the shard is in the host buffer only until it returns).

Traffic per rank per step, recorded in the ledger under dim "offload" (comm/transfer.py), for every
unit u of this rank with shard size k_u (padded elements; g, w, m bytes per gradient, parameter and
master element):

| op         | calls | message (= bytes sent)           | mode        |
|------------|-------|----------------------------------|-------------|
| d2h        | c_u   | k_u · g   (reduced gradient)     | cpu, nvme: ZeRO-1 once at the step; ZeRO-2/3 after each of the unit's c_u reduce-scatters (m per step outside a pipeline, 1 under one) |
| h2d        | 1     | k_u · w   (updated parameters)   | cpu, nvme (not ZeRO-3 nvme) |
| nvme_read  | 1     | 3 k_u · m (master, m, v)         | nvme        |
| nvme_write | 1     | 3 k_u · m                        | nvme        |

and with ZeRO-3 nvme (parameters on disk), for G_u all-gathers of u in the step (the engine's count,
per micro-batch: 2 without a pipeline, 1 with reshard_after_forward off, under one 2 per block and 3
with full recompute; the root unit under a pipeline once a step), instead of the h2d above:

| op         | calls | message (= bytes sent)           |                                    |
|------------|-------|----------------------------------|------------------------------------|
| nvme_read  | G_u   | k_u · w   (parameter shard)      | before each all-gather             |
| h2d        | G_u   | k_u · w                          | into the gathered buffer's slot    |
| nvme_write | 1     | k_u · w   (updated parameters)   | after the step, written behind     |

Summed over units: (c·g + w)·Φ/n over PCIe and 2·3m·Φ/n to and from disk (Φ/n: this rank's padded
shards; c the copies of each gradient shard); ZeRO-3 nvme: (c·g + G·w)·Φ/n over PCIe and (6m + (G + 1)·w)·Φ/n to and from disk (G gathers a
unit). A skipped (non-finite) step moves nothing in the step; the gathers still read. In nvme mode a
checkpoint's save or load reads or writes the file once per unit, recorded as nvme_read / nvme_write
under dim "checkpoint" (a load with parameters on disk also writes each parameter shard, a second
nvme_write of k_u · w). Not recorded: building the state at start (setup, like the model's own first
copy to the device) and the checkpoint's host <-> device copies (like the rest of checkpoint I/O).

The arithmetic is AdamW's own (`AdamW.advance`, `AdamW.update` on the same per-parameter segments, in
the same order, with the same fp32 numbers), so an offloaded run equals the run without offload bit for
bit.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ...comm import transfer
from ...comm.ledger import CommLedger
from .reduce import LANDING

MODES = ("cpu", "nvme")
SLOTS = 2   # disk mode: units whose state is in host memory at once (the one updated, the one read ahead)


def _host(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, pin_memory=pin)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sizes(params: int = 0, grads: int = 0, optimizer: int = 0) -> dict:
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


class OffloadedState:
    """The optimizer state of a ZeRO engine's units off the device, and the step that updates it (a
    `StateStore`, state.py).

    `units`: the engine's units (shard_size, segments); `decay[j]`: per segment of unit j, whether it
    decays; `params[j]`: the device parameter shard of unit j, which also initialises the master;
    `optimizer`: the AdamW whose arithmetic (`advance`, `update`) and step count the store uses."""

    mode = ""
    holds_params = False

    def __init__(self, units: list, decay: list[list[bool]], params: list[torch.Tensor], master_dtype: torch.dtype,
                 grad_dtype: torch.dtype, ledger: CommLedger | None, optimizer, streams_grads: bool = False):
        self.units, self.decay, self.ledger, self.optimizer = units, decay, ledger, optimizer
        self.master_dtype, self.grad_dtype = master_dtype, grad_dtype
        self.param_dtype = params[0].dtype if params else master_dtype
        self.device = params[0].device if params else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.convert = self.param_dtype != self.master_dtype   # bf16 parameters: converted on the host
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.streams_grads = streams_grads
        pin = self.cuda
        # streaming: every unit's gradient shard accumulates in host memory; a reduced shard lands in one of
        # LANDING host buffers of the largest shard first (the copy may still run when the next one comes)
        self.grads = [_host(u.shard_size, grad_dtype, pin) for u in units] if streams_grads else []
        largest = max((u.shard_size for u in units), default=0)
        self.landing = [_host(largest, grad_dtype, pin) for _ in range(LANDING)] if streams_grads else []
        self._pending: list = []   # (unit, landing buffer, device shard, copy done) not yet added
        self._turn = 0

    def _on_side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    # -- gradients streamed to the host during the backward (ZeRO-Offload) -----------------------------
    def grad_shards(self) -> list[torch.Tensor]:
        """Streaming: the host shards the reduced gradients accumulate in (the engine's `grad_shards`)."""
        return self.grads

    @torch.no_grad()
    def add_grad(self, j: int, reduced: torch.Tensor) -> None:
        """Streaming: unit j's reduced gradient shard (device) to host memory, d2h into a landing buffer
        (on CUDA on the side stream, behind the reduce-scatter), then added to the host shard; the device's
        bucket and result can go. On the CPU the add follows at once; on CUDA when the landing buffer is
        needed again or at `settle`."""
        if len(self._pending) == len(self.landing):
            self._settle_oldest()
        buf = self.landing[self._turn % len(self.landing)][:reduced.numel()]
        self._turn += 1
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_side():
            transfer.copy(buf, reduced, self.ledger, "d2h", non_blocking=self.cuda)
            done = self.stream.record_event() if self.cuda else None
        self._pending.append((j, buf, reduced, done))   # `reduced` lives until its copy has landed
        if not self.cuda:
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        j, buf, _, done = self._pending.pop(0)
        if done is not None:
            done.synchronize()
        self.grads[j].add_(buf)

    def settle(self) -> None:
        """Every streamed gradient added to its host shard (the engine's `finish`)."""
        while self._pending:
            self._settle_oldest()

    # -- the step ----------------------------------------------------------------------------------
    def step(self, grads: list[torch.Tensor], params: list[torch.Tensor], lr: float) -> None:
        """AdamW on every unit: grads[j] (device, reduced and clipped) in, params[j] (device) updated."""
        raise NotImplementedError

    def _update(self, j: int, master, exp_avg, exp_avg_sq, grad, lr: float) -> None:
        """AdamW on unit j's segments: the same tensors, lengths and order as without offload."""
        for (_, a, n), decay in zip(self.units[j].segments, self.decay[j]):
            self.optimizer.update(master[a:a + n], grad[a:a + n], exp_avg[a:a + n], exp_avg_sq[a:a + n], decay, lr)

    def _to_params(self, master: torch.Tensor, staging: torch.Tensor | None) -> torch.Tensor:
        """The host tensor the updated parameter shard is copied from (in the parameters' dtype)."""
        return staging.copy_(master) if self.convert else master

    # -- state for checkpoints -----------------------------------------------------------------------
    def state(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unit j's (master, exp_avg, exp_avg_sq) shards, host tensors (read from disk in nvme mode)."""
        raise NotImplementedError

    def put(self, j: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Replace unit j's state (a checkpoint load)."""
        raise NotImplementedError

    def load_into(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host tensors to read unit j's loaded state into before `put` (`StateStore.load_into`)."""
        return self.state(j)

    def read_params(self, j: int, dst: torch.Tensor) -> None:
        """With `holds_params`: unit j's parameter shard into dst (device)."""
        raise RuntimeError(f"offload {self.mode!r} keeps no parameter shards")

    def bytes(self) -> dict:
        """{"optimizer": 0 (on the device), "host": {params, grads, optimizer, total}, "disk": {...}}: bytes
        this rank keeps off the device."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the state holds outside memory (disk mode: its file)."""


class HostState(OffloadedState):
    """offload = "cpu": ZeRO-Offload. Every unit's master and moments in (pinned) host memory, plus a host
    copy of its reduced gradient shard (streamed in during the backward, or copied at the step for ZeRO-1)
    and, for low-precision parameters, a staging shard."""

    mode = "cpu"

    @torch.no_grad()
    def __init__(self, units, decay, params, master_dtype, grad_dtype, ledger, optimizer, streams_grads=False):
        super().__init__(units, decay, params, master_dtype, grad_dtype, ledger, optimizer, streams_grads)
        pin = self.cuda
        self.master = [_host(u.shard_size, master_dtype, pin) for u in units]
        for m, p in zip(self.master, params):
            m.copy_(p)   # setup: the master starts as the parameters (upcast)
        self.exp_avg = [_host(u.shard_size, master_dtype, False) for u in units]
        self.exp_avg_sq = [_host(u.shard_size, master_dtype, False) for u in units]
        if not streams_grads:   # ZeRO-1: the reduced shards are slices of the device's whole gradient
            self.grads = [_host(u.shard_size, grad_dtype, pin) for u in units]
        self.staging = [_host(u.shard_size, self.param_dtype, pin) for u in units] if self.convert else None

    @torch.no_grad()
    def step(self, grads, params, lr):
        self.optimizer.advance()
        ready = [None] * len(self.units)   # streamed: the (clipped) gradients are in host memory already
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))   # the reduced, clipped shards
        if not self.streams_grads:
            ready = []
            with self._on_side():   # every gradient copy at once: the host waits only for the unit it needs
                for host, dev in zip(self.grads, grads):
                    transfer.copy(host, dev, self.ledger, "d2h", non_blocking=self.cuda)
                    ready.append(self.stream.record_event() if self.cuda else None)
        for j in range(len(self.units)):
            if ready[j] is not None:
                ready[j].synchronize()
            self._update(j, self.master[j], self.exp_avg[j], self.exp_avg_sq[j], self.grads[j], lr)
            src = self._to_params(self.master[j], self.staging[j] if self.convert else None)
            with self._on_side():   # overlaps the next unit's update
                transfer.copy(params[j], src, self.ledger, "h2d", non_blocking=self.cuda)
        if self.cuda:
            self.stream.synchronize()   # parameters in place before the all-gather; host buffers free again

    def state(self, j):
        return self.master[j], self.exp_avg[j], self.exp_avg_sq[j]

    @torch.no_grad()
    def put(self, j, master, exp_avg, exp_avg_sq):
        for dst, src in zip(self.state(j), (master, exp_avg, exp_avg_sq)):
            if dst is not src:
                dst.copy_(src)

    def bytes(self) -> dict:
        return {"optimizer": 0,
                "host": _sizes(_nbytes(self.staging or []), _nbytes(self.grads + self.landing),
                               _nbytes(self.master + self.exp_avg + self.exp_avg_sq)),
                "disk": _sizes()}


def _close_file(fd: int, folder: Path, io: ThreadPoolExecutor) -> None:
    io.shutdown(wait=True)
    with contextlib.suppress(OSError):
        os.close(fd)   # the file has no name: closing it frees its blocks
    with contextlib.suppress(OSError):
        folder.rmdir()   # only when empty


class DiskState(OffloadedState):
    """offload = "nvme": ZeRO-Infinity's optimizer state on disk. One file per rank holds every unit's
    [master | exp_avg | exp_avg_sq]; two host slots of the largest unit's size hold the unit being
    updated and the one read ahead; a worker thread reads ahead and writes behind. `params_on_disk`
    (ZeRO-3): the file also holds each unit's parameter shard ([... | param], the parameters' dtype),
    read before each all-gather (`read_params`) and written after each step instead of copied up."""

    mode = "nvme"

    @torch.no_grad()
    def __init__(self, units, decay, params, master_dtype, grad_dtype, ledger, optimizer, folder: str | Path,
                 rank: int, params_on_disk: bool = False, streams_grads: bool = False):
        super().__init__(units, decay, params, master_dtype, grad_dtype, ledger, optimizer, streams_grads)
        self.holds_params = params_on_disk
        pin = self.cuda
        self.dir = Path(folder).expanduser() / f"rank-{rank:05d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fd, name = tempfile.mkstemp(prefix="optimizer-", suffix=".bin", dir=self.dir)
        os.unlink(name)   # a file without a name: the kernel frees it when the process ends, however it ends
        item = torch.empty((), dtype=master_dtype).element_size()
        pitem = torch.empty((), dtype=self.param_dtype).element_size()
        self.offsets, self.param_offsets, offset = [], [], 0
        for u in units:
            self.offsets.append(offset)
            offset += 3 * u.shard_size * item
            if params_on_disk:
                self.param_offsets.append(offset)
                offset += u.shard_size * pitem
        self.file_bytes = offset
        self.param_file_bytes = sum(u.shard_size for u in units) * pitem if params_on_disk else 0
        largest = max((u.shard_size for u in units), default=0)
        self.slots = [_host(3 * largest, master_dtype, pin) for _ in range(SLOTS)]
        # ZeRO-1: the unit's gradient copied down at the step into one of two slots; streamed: self.grads
        self.grad_slots = [] if streams_grads else [_host(largest, grad_dtype, pin) for _ in range(SLOTS)]
        self.staging = [_host(largest, self.param_dtype, pin) for _ in range(SLOTS)] if self.convert else None
        # params on disk: the host buffer a parameter shard passes through on its way to an all-gather
        self.gather_buf = _host(largest, self.param_dtype, pin) if params_on_disk else None
        self.io = ThreadPoolExecutor(1, thread_name_prefix="fivefold-offload")
        self._finalizer = weakref.finalize(self, _close_file, self.fd, self.dir, self.io)
        for j, (u, p) in enumerate(zip(units, params)):   # setup: master = parameters, moments 0
            slot = self._slot(0, u.shard_size)
            slot.zero_()
            slot[:u.shard_size].copy_(p)
            transfer.write_file(self.fd, slot, self.offsets[j], None)
            if params_on_disk:
                buf = self.gather_buf[:u.shard_size]
                buf.copy_(p)
                transfer.write_file(self.fd, buf, self.param_offsets[j], None)

    def _slot(self, k: int, size: int) -> torch.Tensor:
        return self.slots[k][:3 * size]

    def _read(self, j: int, into: torch.Tensor, dim: str = transfer.OFFLOAD) -> None:
        transfer.read_file(self.fd, into, self.offsets[j], self.ledger, dim=dim)

    def _write(self, j: int, src: torch.Tensor, dim: str = transfer.OFFLOAD) -> None:
        transfer.write_file(self.fd, src, self.offsets[j], self.ledger, dim=dim)

    def _write_params(self, j: int, src: torch.Tensor, dim: str = transfer.OFFLOAD) -> None:
        transfer.write_file(self.fd, src, self.param_offsets[j], self.ledger, dim=dim)

    @torch.no_grad()
    def read_params(self, j: int, dst: torch.Tensor) -> None:
        """Unit j's parameter shard from the file into dst (a device tensor of shard_size elements in the
        parameters' dtype): nvme_read into the host buffer, then h2d (blocking: the buffer is reused)."""
        buf = self.gather_buf[:self.units[j].shard_size]
        transfer.read_file(self.fd, buf, self.param_offsets[j], self.ledger)
        transfer.copy(dst, buf, self.ledger, "h2d")

    @torch.no_grad()
    def step(self, grads, params, lr):
        self.optimizer.advance()
        units, futures = self.units, []
        reads = {}

        def read_ahead(j):   # slot j % 2: queued after the write of unit j - 2, which used it
            reads[j] = self.io.submit(self._read, j, self._slot(j % SLOTS, units[j].shard_size))
            futures.append(reads[j])

        try:
            for j in range(min(SLOTS, len(units))):
                read_ahead(j)
            for j, u in enumerate(units):
                k, s = j % SLOTS, u.shard_size
                if self.streams_grads:
                    grad = self.grads[j]
                else:
                    grad = self.grad_slots[k][:s]
                    transfer.copy(grad, grads[j], self.ledger, "d2h")
                reads.pop(j).result()
                slot = self._slot(k, s)
                master, exp_avg, exp_avg_sq = slot[:s], slot[s:2 * s], slot[2 * s:]
                self._update(j, master, exp_avg, exp_avg_sq, grad, lr)
                src = self._to_params(master, self.staging[k][:s] if self.convert else None)
                if self.holds_params:   # to the file, behind (src's slot is reused only after it)
                    futures.append(self.io.submit(self._write_params, j, src))
                else:
                    transfer.copy(params[j], src, self.ledger, "h2d")
                futures.append(self.io.submit(self._write, j, slot))   # write behind
                if j + SLOTS < len(units):
                    read_ahead(j + SLOTS)
        finally:
            wait(futures)   # nothing in flight after the step, whatever happened
        for f in futures:
            f.result()      # a failed read or write fails the step

    def state(self, j):
        s = self.units[j].shard_size
        buf = torch.empty(3 * s, dtype=self.master_dtype)
        self._read(j, buf, "checkpoint")
        return buf[:s], buf[s:2 * s], buf[2 * s:]

    def load_into(self, j):
        s = self.units[j].shard_size
        buf = torch.zeros(3 * s, dtype=self.master_dtype)   # not read: a load replaces all of it
        return buf[:s], buf[s:2 * s], buf[2 * s:]

    @torch.no_grad()
    def put(self, j, master, exp_avg, exp_avg_sq):
        buf = torch.cat([t.reshape(-1).to("cpu", self.master_dtype) for t in (master, exp_avg, exp_avg_sq)])
        self._write(j, buf, "checkpoint")
        if self.holds_params:   # the parameters are the master in their dtype (as after a step)
            self._write_params(j, buf[:self.units[j].shard_size].to(self.param_dtype), "checkpoint")

    def bytes(self) -> dict:
        host_params = _nbytes(self.staging or []) + (_nbytes([self.gather_buf]) if self.holds_params else 0)
        return {"optimizer": 0, "host": _sizes(host_params, _nbytes(self.grad_slots + self.grads + self.landing),
                                               _nbytes(self.slots)),
                "disk": _sizes(params=self.param_file_bytes, optimizer=self.file_bytes - self.param_file_bytes)}

    def close(self) -> None:
        self._finalizer()

