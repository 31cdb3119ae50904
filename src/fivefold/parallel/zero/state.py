"""Where a ZeRO engine's optimizer state lives, and how the optimizer step reaches it: the `StateStore`.

Per unit j (units.py) this rank owns a shard of k_j padded elements; its optimizer state is the fp32
master shard (the parameter shard itself when the parameters are fp32) and AdamW's two moments
(Loshchilov & Hutter 2019), each a padded shard of k_j elements. Three stores keep it, behind one protocol:

* `DeviceState` (offload "none"): on the device, beside the parameters. The step is one multi-tensor
  AdamW over every segment of every shard (train/optim.py), then the masters are copied into the
  parameter shards when their dtypes differ. No communication.
* `HostState` (offload "cpu", ZeRO-Offload) and `DiskState` (offload "nvme", ZeRO-Infinity; with ZeRO-3
  the parameter shards too: `holds_params`): parallel/zero/offload.py, which documents the device <-> host
  and host <-> disk transfers they record in the ledger under dim "offload".

All three run AdamW's own arithmetic on the same per-parameter segments in the same order, so where the
state lives changes no number (tests/unit/test_zero_parts.py holds the stores equal bit for bit).
"""
from __future__ import annotations

from typing import Protocol

import torch

from ...comm.ledger import CommLedger
from ..engine import nbytes
from .offload import DiskState, HostState


class StateStore(Protocol):
    optimizer: object    # train/optim.py's AdamW: its hyperparameters and step count (and with DeviceState the update itself)
    holds_params: bool   # the store keeps the parameter shards too (ZeRO-3 nvme): read them with read_params
    streams_grads: bool  # the reduced gradient shards go to host memory during the backward (offload, ZeRO-2/3)

    def grad_shards(self) -> list[torch.Tensor]:
        """Stages 2 and 3: the per-unit shards the reduced gradients accumulate in (device, or host when
        `streams_grads`), zero."""
        ...

    def add_grad(self, j: int, reduced: torch.Tensor) -> None:
        """Add a reduced shard of unit j (device) to its gradient shard (streaming: d2h, then on the host)."""
        ...

    def settle(self) -> None:
        """Every `add_grad` done (a streamed copy may still be in flight until then)."""
        ...

    def step(self, grads: list[torch.Tensor], params: list[torch.Tensor], lr: float) -> None:
        """AdamW on every unit: grads[j] (device, reduced and clipped shard) in, params[j] (device parameter
        shard; none when `holds_params`) updated."""
        ...

    def state(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unit j's (master, exp_avg, exp_avg_sq) shards."""
        ...

    def put(self, j: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Replace unit j's state (a checkpoint load); with `holds_params` its parameter shard too."""
        ...

    def load_into(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tensors to read unit j's loaded state into before `put`: the store's own where it keeps them in
        memory (nothing beyond the state is allocated), else a host buffer."""
        ...

    def read_params(self, j: int, dst: torch.Tensor) -> None:
        """Only when `holds_params`: unit j's parameter shard into dst (device)."""
        ...

    def bytes(self) -> dict:
        """{"optimizer": device bytes} and, off the device, {"host": {...}, "disk": {...}}."""
        ...

    def close(self) -> None:
        ...


class DeviceState:
    """offload = "none": masters and moments on the device. `params[j]`: unit j's parameter shard, which
    is also its master when the dtypes agree (else the master starts as its upcast copy)."""

    holds_params = False
    streams_grads = False

    def __init__(self, units: list, decay: list[list[bool]], params: list[torch.Tensor], master_dtype: torch.dtype,
                 grad_dtype: torch.dtype, make_optimizer):
        self.units, self.grad_dtype = units, grad_dtype
        self.device = params[0].device if params else torch.device("cpu")
        self._grads: list[torch.Tensor] = []
        param_dtype = params[0].dtype if params else master_dtype
        self.masters = [p if master_dtype == param_dtype else p.to(master_dtype) for p in params]
        self.exp_avg = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.masters]
        self.separate_masters = master_dtype != param_dtype
        self.optimizer = make_optimizer([], []).hold(
            self._segments(self.masters), [d for ds in decay for d in ds],
            self._segments(self.exp_avg), self._segments(self.exp_avg_sq))

    def grad_shards(self):
        self._grads = [torch.zeros(u.shard_size, dtype=self.grad_dtype, device=self.device) for u in self.units]
        return self._grads

    def add_grad(self, j, reduced):
        self._grads[j].add_(reduced)

    def settle(self) -> None:
        pass

    def _segments(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of every parameter's segment in every unit's shard, in unit order (what AdamW updates)."""
        return [s[a:a + n] for u, s in zip(self.units, shards) for _, a, n in u.segments]

    @torch.no_grad()
    def step(self, grads, params, lr):
        self.optimizer.step(self._segments(grads), lr)
        for master, param in zip(self.masters, params):
            if master is not param:
                param.copy_(master)

    def state(self, j):
        return self.masters[j], self.exp_avg[j], self.exp_avg_sq[j]

    @torch.no_grad()
    def put(self, j, master, exp_avg, exp_avg_sq):
        for dst, src in zip(self.state(j), (master, exp_avg, exp_avg_sq)):
            if dst is not src:
                dst.copy_(src)

    def load_into(self, j):
        return self.state(j)

    def read_params(self, j, dst):
        raise RuntimeError("the device state keeps no parameter shards")

    def bytes(self) -> dict:
        opt = self.optimizer.state_bytes()   # the moments' segments (no padding)
        return {"optimizer": opt + (nbytes(self.masters) if self.separate_masters else 0)}

    def close(self) -> None:
        pass


def state_store(mode: str, units: list, decay: list[list[bool]], params: list[torch.Tensor], master_dtype: torch.dtype,
                grad_dtype: torch.dtype, make_optimizer, ledger: CommLedger | None, folder: str = "", rank: int = 0,
                params_on_disk: bool = False, streams_grads: bool = False) -> StateStore:
    """The state of `units` on the device ("none"), in host memory ("cpu") or in files in `folder` ("nvme";
    with `params_on_disk`, ZeRO-3's parameter shards too; with `streams_grads`, offloaded stores take the
    reduced gradient shards into host memory during the backward). `make_optimizer(params, decay)` gives
    the AdamW."""
    if mode == "none":
        return DeviceState(units, decay, params, master_dtype, grad_dtype, make_optimizer)
    optimizer = make_optimizer([], [])   # its hyperparameters and step count; the state lives in the store
    if mode == "cpu":
        return HostState(units, decay, params, master_dtype, grad_dtype, ledger, optimizer, streams_grads)
    if mode == "nvme":
        return DiskState(units, decay, params, master_dtype, grad_dtype, ledger, optimizer, folder, rank,
                         params_on_disk, streams_grads)
    raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {mode!r}")
