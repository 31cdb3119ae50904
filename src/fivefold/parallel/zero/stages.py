"""What a ZeRO stage shards, and where the parameters live between uses.

Paper: Rajbhandari et al., "ZeRO" (SC 2020). Stage 1 shards the optimizer state, stage 2 also the
gradients, stage 3 also the parameters (per parameter, of the 2 + 2 + K bytes of mixed-precision
model state, a rank keeps 1/n of K, then of 2 + K, then of everything).

* `FullParams` (stages 1 and 2): every parameter whole in its unit's flat buffer (the parameters are views
  of it); this rank's slice [lo, hi) is its parameter shard, updated by the step, then every unit is
  all-gathered over its group (Φ(n-1)/n · w per rank). Stage 1 keeps each unit's whole gradient as well
  (its gradient shard is the slice of it); stage 2 only the shard (the engine reads `ZeroSpec.shards_grads`).
* `ShardedParams`: only the parameter shards stay. A unit is all-gathered before its module runs (forward and
  backward, with the next unit prefetched: order.py, which the planner replays) and freed after;
  the step updates the shards in place and gathers nothing. With parameters in the state store
  (ZeRO-Infinity, offload "nvme": `StateStore.holds_params`) the device keeps no shard either: each
  gather first reads its unit's shard from the store into the shard's own slot of the gathered buffer.

The gradients' reduce-scatter is the engine's (engine.py), its timing the reduce policy's (reduce.py).
"""
from __future__ import annotations

import torch
from torch import nn

from ... import comm
from ..engine import nbytes
from .order import backward_prefetch, forward_prefetch, frees_after_forward
from .units import Unit


class FullParams:
    """Stages 1 and 2: full parameters in flat per-unit buffers, this rank's slice is its shard; after the
    step each unit's shards are all-gathered. The hooks (`after_grad`, `after_reduce`, `finish`,
    `release`) are stage 3's; here they do nothing."""

    loads_full_params = True   # a rank holds every parameter whole: a load fills them too

    @torch.no_grad()
    def __init__(self, units: list[Unit], param_dtype: torch.dtype, device):
        self.units = units
        self.param_dtype, self.device = param_dtype, device
        self.param_flats, self.param_shards = [], []
        for u in units:
            flat = u.flatten([p.data for p in u.params], param_dtype, device)
            self.param_flats.append(flat)
            for p, v in zip(u.params, u.views(flat)):
                p.data = v
            self.param_shards.append(flat[u.lo:u.hi])

    def use(self, state) -> None:
        """The engine's state store (state.py) exists: stage 3 may keep its parameter shards there."""
        self.state = state

    def after_grad(self, u: Unit, p: nn.Parameter) -> None:
        """p's gradient has been added to its unit."""

    def after_reduce(self, u: Unit) -> None:
        """u's gradient reduce-scatter has been launched."""

    def finish(self) -> None:
        """Every reduction of the step has been waited for."""

    def release(self) -> None:
        """After forwards without a backward (an evaluation): give back what they gathered."""

    def after_step(self) -> None:
        for u, flat, shard in zip(self.units, self.param_flats, self.param_shards):
            comm.all_gather(flat, shard.clone(), u.group)

    def param_bytes(self) -> int:
        return nbytes(self.param_flats)

    def load_params(self, j: int, flat: torch.Tensor) -> None:
        """Unit j's full flat parameters from a loaded state."""
        self.param_flats[j].copy_(flat)

    def remove(self) -> None:
        pass


def free_bytes(full: torch.Tensor) -> None:
    """Give back the bytes of a gathered unit while views of it live on. Autograd saves views of the
    weights it needs for the backward (a linear saves `weight.t()`), and those views keep the storage
    they see: swapping `p.data` alone would free nothing until the backward, so every unit gathered in
    the forward would stay gathered (the whole model's weights at the backward's start). Resizing the
    storage to 0 frees it under every view, as FSDP does (Zhao et al. 2023); `regather_buffer`
    gives it back its bytes before the next all-gather refills it."""
    full.untyped_storage().resize_(0)


def regather_buffer(full: torch.Tensor | None, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The unit's gathered buffer with room for `numel` elements: the same storage (and so every view
    of it autograd saved) when the unit was gathered before, a new one the first time."""
    if full is None:
        return torch.empty(numel, dtype=dtype, device=device)
    full.untyped_storage().resize_(numel * full.element_size())
    return full


class ShardedParams(FullParams):
    """ZeRO stage 3: only parameter shards stay; a unit is all-gathered before its module runs (forward
    and backward) and freed after, with the next unit prefetched.

    `slots[i]`: the units of the i-th module that runs as a whole (root, then the blocks) and
    `modules[i]` the modules whose forward needs them (zero_unit.modules_to_gather); `keeps_full_grads`:
    the reduce policy keeps gradients until the step (then a block is freed once its backward is done);
    `prefetch`: the slots gathered ahead of the running one (order.py)."""

    loads_full_params = False

    @torch.no_grad()
    def __init__(self, units: list[Unit], slots: list[list[Unit]], modules: list[list[nn.Module]],
                 param_dtype: torch.dtype, device, pipeline: bool, keeps_full_grads: bool,
                 reshard_after_forward: bool = True, prefetch: int = 1):
        self.units, self.slots = units, slots
        self.param_dtype, self.device = param_dtype, device
        self.pipeline, self.keeps_full_grads = pipeline, keeps_full_grads
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.param_shards = []
        for u in units:
            self.param_shards.append(u.shard_of([p.data for p in u.params], param_dtype, device))
            for p in u.params:
                p.data = torch.empty(0, dtype=param_dtype, device=device)
        self._hooks = []
        self._install_hooks(modules)

    def use(self, state) -> None:
        """With the parameters in the store (ZeRO-3 nvme) the device keeps no shard between uses."""
        self.state = state
        if state.holds_params:
            self.param_shards = []

    def param_bytes(self) -> int:
        return nbytes(self.param_shards)

    def after_step(self) -> None:
        """The shards were updated in place: the next forward gathers them."""

    def load_params(self, j: int, flat: torch.Tensor) -> None:
        """Only shards: the loaded master already set them."""

    # -- gather before use, free after -----------------------------------------------------------
    def _gather_async(self, slot: int) -> None:
        for u in self.slots[slot]:
            if u.gathered or u.gather_handle is not None:
                continue
            u.full = regather_buffer(u.full, u.padded, self.param_dtype, self.device)
            if self.state.holds_params:   # from the store into its own slot of the gathered buffer, gathered in place
                shard = u.full[u.lo:u.hi]
                self.state.read_params(u.pos, shard)
            else:
                shard = self.param_shards[u.pos]
            u.gather_handle = comm.all_gather(u.full, shard, u.group, async_op=True)

    def _gather(self, slot: int) -> None:
        self._gather_async(slot)
        for u in self.slots[slot]:
            if u.gather_handle is not None:
                u.gather_handle.wait()
                u.gather_handle = None
                for p, v in zip(u.params, u.views(u.full)):
                    p.data = v
                u.gathered = True

    def _free_unit(self, u: Unit) -> None:
        if u.gathered:
            for p in u.params:
                p.data = torch.empty(0, dtype=self.param_dtype, device=self.device)
            free_bytes(u.full)
            u.gathered = False

    def _free(self, slot: int) -> None:
        for u in self.slots[slot]:
            self._free_unit(u)

    def after_reduce(self, u: Unit) -> None:
        if not self.keeps_full_grads and not (self.pipeline and u.name == "root"):   # the root stays for the step
            self._free_unit(u)

    def after_grad(self, u: Unit, p: nn.Parameter) -> None:
        """Under a pipeline the reduction waits for the step's end: free a block unit as soon as this
        backward has produced all its gradients (the root stays gathered for the step)."""
        if not self.pipeline or u.name == "root":
            return
        u.seen.add(p)
        if len(u.seen) == len(u.params):
            u.seen = set()
            self._free_unit(u)

    def finish(self) -> None:
        for slot in range(len(self.slots)):
            self._free(slot)

    def release(self) -> None:
        """After forwards without a backward (an evaluation): free every gathered unit, as a step's end does."""
        for slot in range(len(self.slots)):
            self._free(slot)

    def _install_hooks(self, modules: list[list[nn.Module]]) -> None:
        """The gather/free order of order.py (which the planner replays)."""
        last = len(self.slots) - 1

        def pre_forward(idx):
            def hook(module, args):
                self._gather(idx)
                if torch.is_grad_enabled():
                    for ahead in forward_prefetch(idx, last, self.pipeline, self.prefetch):
                        self._gather_async(ahead)
            return hook

        def post_forward(idx):
            def hook(module, args, output):
                if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(lambda grad, idx=idx: self._pre_backward(idx) or grad)
                if frees_after_forward(idx, self.reshard_after_forward, self.pipeline):
                    self._free(idx)  # the root's hook fires after the whole forward
                return output
            return hook

        for idx, holders in enumerate(modules):
            for module in holders:
                self._hooks.append(module.register_forward_pre_hook(pre_forward(idx)))
                self._hooks.append(module.register_forward_hook(post_forward(idx)))

    def _pre_backward(self, idx: int) -> None:
        """Before slot idx's backward: gather it (if freed) and prefetch the slot that runs next."""
        self._gather(idx)
        if self.pipeline:
            for u in self.slots[idx]:
                u.seen = set()   # this backward's gradients: free the unit once all have arrived
            return
        for ahead in backward_prefetch(idx, len(self.slots), self.pipeline, self.prefetch):
            self._gather_async(ahead)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
