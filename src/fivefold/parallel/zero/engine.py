"""ZeRO: shard optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) across the
data-parallel group.

Paper: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020). Per parameter, model state is K bytes of optimizer state (fp32 Adam: m and v, 8 bytes; with
bf16 compute also the fp32 master, 12 bytes) plus the parameter and its gradient. Stage 1 divides the
optimizer state by n, stage 2 also the gradients, stage 3 also the parameters.

The engine here is composed of three parts, each one idea in its own file, chosen by one setting:

* the stage (stages.py: `FullParams` for 1 and 2, `ShardedParams`): what is sharded, where the parameters
  live between uses, what happens after the step (stages 1, 2 all-gather; 3 gathers before each use);
* the reduce policy (reduce.py: `EachMicrobatch`, `OncePerStep`): when a unit's gradients are
  reduce-scattered, after every micro-batch's backward or once per step (the pipeline's
  accumulate-then-reduce);
* the state store (state.py: `DeviceState`; offload.py: `HostState`, `DiskState`): where the
  masters and moments (and ZeRO-3 nvme's parameter shards) live and how the step reaches them.

What stays here is what every combination shares: the units (units.py) and their gradient buffers,
the post-accumulate hooks, the reduce-scatter, the engine protocol (engine.py) and checkpoint state.

Layout. Parameters are partitioned by the group their gradient is summed over (`placement.reduce`:
dp, dp×cp, expert-dp) and each partition is packed into *units*, each a flat buffer padded to a multiple
of its group's size n; rank r of the group owns elements [r·k, (r+1)·k) of every unit, k = padded/n.
Stages 1 and 2 make units of at most `bucket_mb` MiB (in backward order, like data.py); stage 3 makes
one unit per transformer block (and group) plus "root" units (embedding, final norm, head), so a block's
weights can be gathered just before it runs.

Communication per step, per rank, n = group size, Φ parameters, g / w bytes per gradient / parameter:

| stage | backward                                 | after the optimizer step     | total (g = w)     |
|-------|------------------------------------------|------------------------------|-------------------|
| 1     | reduce-scatter each bucket, last micro-batch only | all-gather the params | 2Φ(n-1)/n · w     |
| 2     | reduce-scatter each bucket, every micro-batch     | all-gather the params | 2Φ(n-1)/n · w     |
| 3     | all-gather each unit before its forward and again before its backward (prefetching the next
          unit), reduce-scatter its gradients after, every micro-batch | nothing     | 3Φ(n-1)/n · w     |

(totals for one micro-batch; with m micro-batches stages 2 and 3 repeat their backward traffic m times,
as DeepSpeed and FSDP do, since a rank keeps no full gradient to accumulate into.) With
`reshard_after_forward=False` stage 3 keeps each unit gathered from its forward to its backward: one
all-gather fewer (2Φ(n-1)/n), at the memory cost of full parameters during the step (FSDP's
reshard_after_forward).

Under a pipeline (`pipeline=True`) a stage's micro-batch backwards are spread over the whole step and
interleaved with other micro-batches' forwards, so stages 2 and 3 do what FSDP does under
torch.distributed.pipelining: gradients accumulate unsharded in the unit's buffer from the first
micro-batch's backward and each unit is reduce-scattered once (the bytes of stage 1; the full gradient
lives only during the backward phase, not between steps): as soon as the last backward of the chunks it
belongs to has run (engine.py; overlapped with the rest of the schedule), or at the step's end when the
unit holds a tied copy or `overlap_grad_reduce` is off.
Stage 3 then gathers a block before each forward and each backward it runs (2m all-gathers per block
per step; full recompute re-runs a block after its pre-backward gather: parallel/recompute.py), frees it
after, and keeps the root unit gathered for the step.

The optimizer (train/optim.py's AdamW) updates this rank's shard through per-parameter views, so the
arithmetic on every element is the single-process arithmetic.

Offload (`offload="cpu" | "nvme"`, parallel/zero/offload.py: ZeRO-Offload, ZeRO-Infinity): the masters and
moments of this rank's shards live in host memory or in files instead, and the step runs there unit by
unit (gradient shard device -> host, AdamW, parameter shard host -> device); the device keeps the
parameters; with stages 2 and 3 the gradients too leave it during the backward (`streams_grads`): each
folded reduce-scatter's shard is copied to the host and added there, the unit's buffers freed, so the
device holds only the buckets in flight (`grad_buffer_peak`, which plan/buffers.py predicts). ZeRO-1
keeps its whole gradient on the device. ZeRO-3 with "nvme" (the store `holds_params`, ZeRO-Infinity) keeps the
parameter shards in the file too: the stage's `param_shards` is empty, each all-gather first reads its
unit's shard from disk into the shard's own slot of the gathered buffer (and gathers in place), and the
step writes the updated shards to disk.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ... import comm
from ...comm import Group
from ..engine import Engine, counted, decays, held, nbytes, unique_params
from .order import MAX_INFLIGHT
from .reduce import ReducePolicy, reduce_policy
from .spec import ZeroSpec
from .stages import FullParams, ShardedParams
from .state import StateStore, state_store
from .units import Unit, block_slots, bucket_units, modules_to_gather


class ZeroEngine(Engine):
    """ZeRO over the placement groups: units of this model's parameters, composed of what its stage shards
    (`sharding`: a `FullParams` or `ShardedParams`; the stage number is `spec.stage`), a reduce policy (`policy`)
    and a state store (`state`). An `Engine` (engine.py)."""

    def __init__(self, model: nn.Module, groups: Mapping[str, Group], spec: ZeroSpec, make_optimizer,
                 bucket_mb: float = 25.0, master_dtype: torch.dtype = torch.float32,
                 grad_dtype: torch.dtype | None = None, offload_dir: str = "", decay_embeddings: bool = True):
        """`spec`: the ZeRO setting (spec.py, built once from the config: `ZeroSpec.of(parallel)`), stage 1-3;
        `make_optimizer(params, decay)` makes AdamW (train/optim.py) over this rank's shards; `offload_dir`:
        the files of spec.offload "nvme"."""
        if not spec.shards_states:
            raise ValueError(f"a ZeRO engine shards something: stage 1, 2 or 3, got {spec.stage}")
        self.spec = spec
        self.model = model
        self.policy: ReducePolicy = reduce_policy(spec)
        self.params = unique_params(model)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.norm_group = groups[spec.norm_group()]   # shards differ on every rank
        self.param_dtype, self.device = self.params[0].dtype, self.params[0].device
        self.master_dtype, self.grad_dtype = master_dtype, grad_dtype or master_dtype
        self._sync = True
        self._inflight: list = []   # (unit, handle, reduced shard, source) not yet folded in
        self._hooks = []
        slots = []
        pipeline = spec.pipeline
        if spec.block_units:
            slots = block_slots(model, self.params, self.names, groups, pipeline)
            self.units = [u for slot in slots for u in slot]
        else:
            self.units = bucket_units(self.params, self.names, groups, bucket_mb, self.grad_dtype.itemsize)
        for j, u in enumerate(self.units):
            u.pos = j
            u.held = pipeline and any(held(p) for p in u.params)   # reduced once, after the tied sum
        self.unit_of = {p: u for u in self.units for p in u.params}
        if spec.shards_params:
            modules = [holders for _, _, holders in modules_to_gather(model, self.params, pipeline)]
            self.sharding: FullParams = ShardedParams(self.units, slots, modules, self.param_dtype, self.device, pipeline,
                                                      self.policy.keeps_full_grads, spec.reshard_after_forward,
                                                      spec.prefetch)
        else:
            self.sharding = FullParams(self.units, self.param_dtype, self.device)
        decay = [[decays(u.names[i], u.shapes[i], decay_embeddings) for i, _, _ in u.segments]
                 for u in self.units]
        world = self.norm_group
        # ZeRO-Offload streams the gradients of the stages that shard them (2, 3) to the host in the backward
        self.state: StateStore = state_store(spec.offload, self.units, decay, self.sharding.param_shards, master_dtype,
                                             self.grad_dtype, make_optimizer, world.ledger, offload_dir,
                                             world.global_rank(world.rank), spec.params_on_disk,
                                             streams_grads=spec.streams_grads)
        self.sharding.use(self.state)
        self.grad_buffer_bytes = self.grad_buffer_peak = 0   # device: units' full gradients, results in flight
        # stage 1 keeps full gradients; its shard is its slice of them (the reduced values copied in)
        self.grad_shards = self.state.grad_shards() if self.spec.shards_grads else \
            [self._unit_grad(u)[u.lo:u.hi] for u in self.units]
        self.optimizer = self.state.optimizer
        for p in self.unit_of:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.zero_grad()

    # -- gradients ---------------------------------------------------------------------------
    def _unit_grad(self, u: Unit) -> torch.Tensor:
        if u.grad is None:
            u.grad = torch.zeros(u.padded, dtype=self.grad_dtype, device=self.device)
            self._count(u.grad.numel())
        return u.grad

    def _count(self, numel: int) -> None:
        """Device gradient buffers beyond the shards: + when made, - when freed (`grad_buffer_peak`, which
        the planner's buffers predict: plan/buffers.py)."""
        self.grad_buffer_bytes += numel * self.grad_dtype.itemsize
        self.grad_buffer_peak = max(self.grad_buffer_peak, self.grad_buffer_bytes)

    def _on_grad(self, p: nn.Parameter) -> None:
        u = self.unit_of[p]
        self._unit_grad(u)
        u.grad_view(p).add_(p.grad)
        p.grad = None
        self.sharding.after_grad(u, p)
        if self.policy.reduces(self._sync) and not u.held:
            u.pending.discard(p)
            if not u.pending:
                self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        """Reduce-scatter a complete unit's gradients over its group; fold the result in later."""
        tmp = torch.empty(u.shard_size, dtype=self.grad_dtype, device=self.device)
        self._count(tmp.numel())
        handle = comm.reduce_scatter(tmp, u.grad, u.group, async_op=True)
        self._inflight.append((u, handle, tmp, u.grad))
        if self.spec.shards_grads:
            u.grad = None
        if self.policy.restarts_at_reduce:
            u.pending = set(u.params)   # the next micro-batch's backward of this chunk starts over
        self.sharding.after_reduce(u)
        while len(self._inflight) > MAX_INFLIGHT:
            self._fold(self._inflight.pop(0))

    def _fold(self, item) -> None:
        u, handle, tmp, grad = item
        handle.wait()
        self._count(-tmp.numel())
        if self.spec.shards_grads:   # reduced every micro-batch (or once), summed into the shard (offload:
            self.state.add_grad(u.pos, tmp)   # streamed to the host); the unit's full gradient goes
            self._count(-grad.numel())
        else:                         # stage 1: reduced once per step, into the slice that held the local sum
            self.grad_shards[u.pos].copy_(tmp)

    # -- the engine protocol -----------------------------------------------------------------
    def set_sync(self, enabled: bool) -> None:
        """With sync off, gradients accumulate (stage 1, and every stage under a pipeline); stages 2
        and 3 outside a pipeline reduce every backward regardless (the reduce policy)."""
        self._sync = enabled

    def end_backward(self) -> None:
        """After a backward that reduces: reduce the units still waiting for gradients (parameters that
        got none count as zero; every rank of a group runs the same graph, so all skip the same ones)."""
        if not self.policy.reduces(self._sync):
            return
        for u in self.units:
            if u.pending and u.grad is not None:
                self._reduce(u)
            u.pending = set(u.params)

    def finish(self) -> None:
        """Wait for every reduce-scatter; afterwards `owned_grads()` holds the reduced shards."""
        if self.spec.shards_grads and any(u.grad is not None and u.pending != set(u.params) for u in self.units):
            raise RuntimeError("a unit holds gradients never reduced: call end_backward() after each backward")
        while self._inflight:
            self._fold(self._inflight.pop(0))
        self.state.settle()
        self.sharding.finish()

    def owned_grads(self, params: list[nn.Parameter] | None = None) -> list[torch.Tensor]:
        """This rank's gradient segments (no padding) of `params` (default: all): each element of the
        model on exactly one rank of its reduce group."""
        wanted = None if params is None else {id(p) for p in params}
        return [g[a:a + n] for u, g in zip(self.units, self.grad_shards)
                for i, a, n in u.segments if wanted is None or id(u.params[i]) in wanted]

    def norm_grads(self) -> list[torch.Tensor]:
        return self.owned_grads([p for p in self.params if counted(p)])

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """p's accumulated gradient before the reduce-scatter (a view into its unit's full gradient;
        accumulate with sync off, change it, then reduce). Only engines that keep full gradients
        during the step have one: stage 1, and stages 2/3 under a pipeline."""
        u = self.unit_of[p]
        if not (self.policy.keeps_full_grads or u.held):
            raise RuntimeError(f"ZeRO-{self.spec.stage} reducing every micro-batch keeps no full local gradient")
        self._unit_grad(u)
        return u.grad_view(p)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """AdamW on this rank's shards where the state lives, then the stage's after-step (stages 1, 2:
        all-gather the parameters)."""
        self.state.step(self.grad_shards, self.sharding.param_shards, lr)
        self.sharding.after_step()

    def zero_grad(self) -> None:
        for g in self.grad_shards:
            g.zero_()
        for u in self.units:
            u.pending = set(u.params)
            u.seen = set()
            if self.spec.shards_grads:
                if u.grad is not None:   # a unit whose gradient was never reduced
                    self._count(-u.grad.numel())
                u.grad = None
            else:
                self._unit_grad(u).zero_()

    def release_params(self) -> None:
        """After forwards without a backward (an evaluation): stage 3 frees every gathered unit (the
        stage's `release`; stages 1 and 2 have nothing to free)."""
        self.sharding.release()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.sharding.remove()
        self.state.close()

    # -- accounting and checkpoints ------------------------------------------------------------
    def state_bytes(self) -> dict:
        """Model-state bytes this rank holds between steps on the device, counted from the tensors; with
        offload also "host" and "disk": {params, grads, optimizer, total} kept there (offload.py)."""
        params = self.sharding.param_bytes()
        # stage 1 holds full gradients (its shards are slices of them); the others hold shards
        full = nbytes(u.grad for u in self.units if u.grad is not None)
        shards = 0 if self.state.streams_grads else nbytes(self.grad_shards)   # streamed: in host memory
        grads = shards + full if self.spec.shards_grads else full
        off_device = self.state.bytes()
        opt = off_device.pop("optimizer")
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt, **off_device}

    def _gather_shards(self, shards: list[torch.Tensor], dtype) -> dict[str, torch.Tensor]:
        out = {}
        for u, s in zip(self.units, shards):
            full = torch.empty(u.padded, dtype=dtype, device=self.device)
            comm.all_gather(full, s.to(self.device, dtype).contiguous(), u.group, dim="checkpoint")
            for name, v in zip(u.names, u.views(full)):
                out[name] = v.clone()
        return out

    def full_state(self) -> dict:
        """Full tensors keyed by parameter name (an all-gather per unit, recorded as 'checkpoint')."""
        masters, avgs, avg_sqs = zip(*(self.state.state(j) for j in range(len(self.units))))
        return {"model": self._gather_shards(masters, self.master_dtype),
                "exp_avg": self._gather_shards(avgs, self.master_dtype),
                "exp_avg_sq": self._gather_shards(avg_sqs, self.master_dtype),
                "opt_t": self.optimizer.t}

    def _put(self, j: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Unit j's loaded state into the store, and into the device parameter shard unless the store
        holds it (ZeRO-3 nvme)."""
        self.state.put(j, master, exp_avg, exp_avg_sq)
        if not self.state.holds_params:
            self.sharding.param_shards[j].copy_(master)

    @torch.no_grad()
    def load_full_state(self, state: dict) -> None:
        for j, u in enumerate(self.units):
            flat = u.flatten([state["model"][n] for n in u.names], self.master_dtype, self.device)
            avg, avg_sq = (u.flatten([state[key][n] for n in u.names], self.master_dtype, self.device)[u.lo:u.hi]
                           for key in ("exp_avg", "exp_avg_sq"))
            self._put(j, flat[u.lo:u.hi], avg, avg_sq)
            if self.sharding.loads_full_params:
                self.sharding.load_params(j, flat)
        self.optimizer.t = state["opt_t"]

    def local_state(self) -> tuple[list, int]:
        """This rank's own state, nothing gathered: (parameter name, offset into the flattened
        parameter, {"model", "exp_avg", "exp_avg_sq": 1-D tensor}) per segment of its shards, and
        Adam's step count. A checkpoint writes these pieces as they are (offloaded: host tensors, read
        from disk in nvme mode)."""
        out = []
        for j, u in enumerate(self.units):
            master, avg, avg_sq = self.state.state(j)
            for i, a, n in u.segments:
                out.append((u.names[i], u.lo + a - u.offsets[i],
                            {"model": master[a:a + n], "exp_avg": avg[a:a + n], "exp_avg_sq": avg_sq[a:a + n]}))
        return out, self.optimizer.t

    @torch.no_grad()
    def load_local_state(self, read_into, opt_t: int) -> None:
        """The inverse of `local_state`: read_into(dst, name, offset, section) fills the 1-D tensor dst
        with elements offset.. of this rank's piece of `name`. Each unit's state is read straight into the
        store's tensors (on disk: into a host buffer), then handed to the store and the parameter shard."""
        for j, u in enumerate(self.units):
            state = self.state.load_into(j)
            for i, a, n in u.segments:
                name, start = u.names[i], u.lo + a - u.offsets[i]
                for t, section in zip(state, ("model", "exp_avg", "exp_avg_sq")):
                    read_into(t[a:a + n], name, start, section)
            self._put(j, *state)
            if self.sharding.loads_full_params:   # stages 1-2: every parameter whole, read into its own buffer
                for name, view in zip(u.names, u.views(self.sharding.param_flats[j])):
                    read_param(read_into, view.view(-1), name, self.master_dtype)
        self.optimizer.t = opt_t


def read_param(read_into, dst: torch.Tensor, name: str, master_dtype: torch.dtype) -> None:
    """Parameter `name`'s whole value into `dst` (1-D, the parameter's slice of its unit's flat buffer), as
    the checkpoint holds it (in the master dtype): straight in when the dtypes agree, else through one
    staging copy of this parameter (a 16-bit model's; before, the whole unit was staged twice: its
    tensors and their flattened copy, 70 MiB a rank in benchmarks/checkpoint.py's tp2dp2z1 load)."""
    if dst.dtype == master_dtype:
        read_into(dst, name, 0, "model")
        return
    staged = torch.empty(dst.numel(), dtype=master_dtype, device=dst.device)
    read_into(staged, name, 0, "model")
    dst.copy_(staged)
