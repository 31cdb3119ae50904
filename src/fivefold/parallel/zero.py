"""ZeRO: shard optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) across the
data-parallel group.

Paper: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020). Per parameter, model state is K bytes of optimizer state (fp32 Adam: m and v, 8 bytes; with
bf16 compute also the fp32 master, 12 bytes) plus the parameter and its gradient. Stage 1 divides the
optimizer state by n, stage 2 also the gradients, stage 3 also the parameters.

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

Offload (`offload="cpu" | "nvme"`, parallel/offload.py: ZeRO-Offload, ZeRO-Infinity): the masters and
moments of this rank's shards live in host memory or in files instead, and the step runs there unit by
unit (gradient shard device -> host, AdamW, parameter shard host -> device); the device keeps the
parameters and gradients. `master_shards` is then empty and the state is reached through `store`.
ZeRO-3 with "nvme" (`params_on_disk`, ZeRO-Infinity) keeps the parameter shards in the file too:
`param_shards` is empty, each all-gather first reads its unit's shard from disk into the shard's own
slot of the gathered buffer (and gathers in place), and the step writes the updated shards to disk.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .. import comm, rules
from ..comm import Group
from ..model.init import is_placeholder
from ..shapes import padded, segments
from .data import bucketize
from .engine import Engine, backward_order, counted, held, nbytes, reduce_partitions, unique_params
from .offload import offloaded_state
from .zero_order import MAX_INFLIGHT, backward_prefetch, forward_prefetch, frees_after_forward


class Unit:
    """A flat, padded group of parameters, sharded evenly over the ranks of `group`."""

    def __init__(self, name: str, params: list[nn.Parameter], names: list[str], group: Group):
        self.name, self.params, self.names, self.group = name, params, names, group
        self.shapes = [p.shape for p in params]
        numels = [p.numel() for p in params]
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        self.numel = sum(numels)
        self.padded = padded(self.numel, group.size)
        self.shard_size = self.padded // group.size
        self.lo, self.hi = group.rank * self.shard_size, (group.rank + 1) * self.shard_size
        self.segments = segments(numels, self.lo, self.hi)   # (param index, start in shard, length)
        self.index = {p: i for i, p in enumerate(params)}
        self.pending: set = set()     # parameters whose final gradient has not arrived
        self.seen: set = set()        # stage 3 under a pipeline: parameters done in this backward
        self.grad: torch.Tensor | None = None   # the unit's full gradient while it accumulates
        self.gathered = False
        self.gather_handle = None
        self.full: torch.Tensor | None = None

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype, device=None) -> torch.Tensor:
        """The unit's padded flat buffer holding `tensors`; a placeholder (a parameter not filled yet:
        model/init.py) leaves its part zero."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for t, o in zip(tensors, self.offsets):
            if not is_placeholder(t):
                flat[o:o + t.numel()].copy_(t.reshape(-1))
        return flat

    def shard_of(self, tensors: list[torch.Tensor], dtype: torch.dtype, device=None) -> torch.Tensor:
        """This rank's shard [lo, hi) of the unit's flat buffer, built from its segments only (the whole
        unit is never allocated); placeholders leave their segments zero."""
        shard = torch.zeros(self.shard_size, dtype=dtype, device=device)
        for i, a, n in self.segments:
            t = tensors[i]
            if not is_placeholder(t):
                start = self.lo + a - self.offsets[i]
                shard[a:a + n].copy_(t.reshape(-1)[start:start + n])
        return shard

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        """p's slice of the unit's full gradient (by its recorded shape: a ZeRO-3 parameter may be freed)."""
        i = self.index[p]
        return self.grad[self.offsets[i]:self.offsets[i] + self.shapes[i].numel()].view(self.shapes[i])


class ShardedOptimizer(Engine):
    """What every ZeRO stage shares: units per reduce group, gradient shards, the reduce-scatter of
    gradients, AdamW on this rank's shards, state gathering. Subclasses decide where parameters live
    (`Zero12`: full flat buffers; `Zero3`: shards only). Implements the engine protocol (engine.py)."""

    stage = 0

    def __init__(self, model: nn.Module, groups: Mapping[str, Group], make_optimizer,
                 master_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None,
                 pipeline: bool = False, reduce_each_microbatch: bool = False, offload: str = "none",
                 offload_dir: str = ""):
        self.model, self.pipeline = model, pipeline
        self.offload = offload
        rules.check_reduce_each_microbatch(reduce_each_microbatch, self.stage)
        self.block_units = rules.block_units(self.stage, 2 if pipeline else 1, reduce_each_microbatch)
        self.params = unique_params(model)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.norm_group = groups[rules.grad_norm_group(self.stage)]   # shards differ on every rank
        self.param_dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.master_dtype = master_dtype
        self.grad_dtype = grad_dtype or master_dtype
        # stage 1 always, stages 2/3 under a pipeline: gradients accumulate unsharded until the sync
        # (unless reduce_each_microbatch: then, as outside a pipeline, only the shard accumulates)
        self.keeps_full_grads = self.stage == 1 or (pipeline and not reduce_each_microbatch)
        self._sync = True
        self._inflight: list = []   # (unit, handle, reduced shard, source) not yet folded in
        self._hooks = []
        self.units = self.make_units(groups)
        for j, u in enumerate(self.units):
            u.pos = j
            u.held = pipeline and any(held(p) for p in u.params)   # reduced once, after the tied sum
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.param_shards, self.master_shards = [], []
        self.build_storage()
        # stage 1 keeps full gradients; its shard is its slice of them (the reduced values copied in)
        self.grad_shards = [self._unit_grad(u)[u.lo:u.hi] if self.stage == 1 else
                            torch.zeros(u.shard_size, dtype=self.grad_dtype, device=self.device) for u in self.units]
        decay = [[len(u.shapes[i]) >= 2 for i, _, _ in u.segments] for u in self.units]
        self.store = None   # offloaded optimizer state (parallel/offload.py)
        # ZeRO-Infinity: ZeRO-3's parameter shards live on disk between uses, read before each all-gather
        self.params_on_disk = offload == "nvme" and self.stage == 3
        if offload == "none":
            opt_params = [m[a:a + n] for u, m in zip(self.units, self.master_shards) for _, a, n in u.segments]
            self.optimizer = make_optimizer(opt_params, [d for ds in decay for d in ds])
        else:   # the optimizer keeps its hyperparameters and step count; the state lives in the store
            self.optimizer = make_optimizer([], [])
            self.master_shards = []
            world = self.norm_group
            self.store = offloaded_state(offload, self.units, decay, self.param_shards, master_dtype,
                                         self.grad_dtype, world.ledger, offload_dir, world.global_rank(world.rank),
                                         self.params_on_disk)
            if self.params_on_disk:
                self.param_shards = []   # the file holds them now: the device keeps none between uses
        for p in self.unit_of:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.zero_grad()

    def make_units(self, groups: Mapping[str, Group]) -> list[Unit]:
        raise NotImplementedError

    def build_storage(self) -> None:
        raise NotImplementedError

    def block_unit_list(self, groups) -> list[Unit]:
        """Units that are whole modules (`rules.block_units`): a "slot" per module that runs as a whole
        (root, then each block), a unit per reduce group in it."""
        self.slots: list[list[Unit]] = []
        for name, params, _ in self.modules_to_gather():
            slot = []
            for group, ps in reduce_partitions(params, groups):
                slot.append(Unit(name, ps, [self.names[id(p)] for p in ps], group))
            self.slots.append(slot)
        return [u for slot in self.slots for u in slot]

    def modules_to_gather(self) -> list[tuple[str, list[nn.Parameter], list[nn.Module]]]:
        """(name, parameters, modules whose forward needs them): 'root' (everything outside the blocks;
        hooked on the model, or under a pipeline on each module holding root parameters), then one
        entry per block of `model.layers` (a ModuleList, or a pipeline stage's ModuleDict)."""
        blocks, in_blocks = [], set()
        layers = getattr(self.model, "layers", nn.ModuleList())
        for key, block in layers.named_children():
            params = [p for p in unique_params(block)]
            blocks.append((f"layers.{key}", params, [block]))
            in_blocks.update(id(p) for p in params)
        root = [p for p in self.params if id(p) not in in_blocks]
        if self.pipeline:
            holders = [m for name, m in self.model.named_children() if name != "layers"
                       and any(id(p) not in in_blocks for p in m.parameters())]
        else:
            holders = [self.model]
        return [("root", root, holders)] + blocks

    def _master(self, shard: torch.Tensor) -> torch.Tensor | None:
        if self.offload != "none":
            return None   # the master lives off the device (the store builds it from the parameters)
        return shard if self.master_dtype == self.param_dtype else shard.to(self.master_dtype)

    # -- gradients ---------------------------------------------------------------------------
    @property
    def reduces_each_backward(self) -> bool:
        """Stages 2 and 3 outside a pipeline reduce every micro-batch: they keep no full gradient."""
        return not self.keeps_full_grads

    def _unit_grad(self, u: Unit) -> torch.Tensor:
        if u.grad is None:
            u.grad = torch.zeros(u.padded, dtype=self.grad_dtype, device=self.device)
        return u.grad

    def _on_grad(self, p: nn.Parameter) -> None:
        u = self.unit_of[p]
        self._unit_grad(u)
        u.grad_view(p).add_(p.grad)
        p.grad = None
        self.after_grad(u, p)
        if (self.reduces_each_backward or self._sync) and not u.held:
            u.pending.discard(p)
            if not u.pending:
                self._reduce(u)

    def after_grad(self, u: Unit, p: nn.Parameter) -> None:
        """Called when p's gradient has been added to its unit (stage 3 frees finished blocks)."""

    def _reduce(self, u: Unit) -> None:
        """Reduce-scatter a complete unit's gradients over its group; fold the result in later."""
        tmp = torch.empty(u.shard_size, dtype=self.grad_dtype, device=self.device)
        handle = comm.reduce_scatter(tmp, u.grad, u.group, async_op=True)
        self._inflight.append((u, handle, tmp, u.grad))
        if self.stage != 1:
            u.grad = None
        if self.pipeline and self.reduces_each_backward:
            u.pending = set(u.params)   # the next micro-batch's backward of this chunk starts over
        self.after_reduce(u)
        while len(self._inflight) > MAX_INFLIGHT:
            self._fold(self._inflight.pop(0))

    def after_reduce(self, u: Unit) -> None:
        """Called when a unit's gradient reduction has been launched."""

    def _fold(self, item) -> None:
        u, handle, tmp, _ = item
        handle.wait()
        if self.stage == 1:   # reduced once per step, into the slice that held the local sum
            self.grad_shards[u.pos].copy_(tmp)
        else:                 # reduced every micro-batch (or once), summed into the shard
            self.grad_shards[u.pos].add_(tmp)

    # -- the engine protocol -----------------------------------------------------------------
    def set_sync(self, enabled: bool) -> None:
        """With sync off, gradients accumulate (stage 1, and every stage under a pipeline); stages 2
        and 3 outside a pipeline reduce every backward regardless."""
        self._sync = enabled

    def end_backward(self) -> None:
        """After a backward that reduces: reduce the units still waiting for gradients (parameters that
        got none count as zero; every rank of a group runs the same graph, so all skip the same ones)."""
        if not (self.reduces_each_backward or self._sync):
            return
        for u in self.units:
            if u.pending and u.grad is not None:
                self._reduce(u)
            u.pending = set(u.params)

    def finish(self) -> None:
        """Wait for every reduce-scatter; afterwards `owned_grads()` holds the reduced shards."""
        if any(u.grad is not None and u.pending != set(u.params) for u in self.units if self.stage != 1):
            raise RuntimeError("a unit holds gradients never reduced: call end_backward() after each backward")
        while self._inflight:
            self._fold(self._inflight.pop(0))

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
        if not (self.keeps_full_grads or u.held):
            raise RuntimeError(f"ZeRO-{self.stage} reducing every micro-batch keeps no full local gradient")
        self._unit_grad(u)
        return u.grad_view(p)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        if self.store is not None:   # offloaded: unit by unit, grads out, parameters back (offload.py)
            self.store.step(self.optimizer, self.grad_shards, self.param_shards, lr)
        else:
            self.optimizer.step(self.owned_grads(), lr)
            for j, u in enumerate(self.units):
                if self.master_shards[j] is not self.param_shards[j]:
                    self.param_shards[j].copy_(self.master_shards[j])
        self.after_step()

    def after_step(self) -> None:
        """Called after the shards were updated (stages 1, 2 all-gather the parameters)."""

    def zero_grad(self) -> None:
        for g in self.grad_shards:
            g.zero_()
        for u in self.units:
            u.pending = set(u.params)
            u.seen = set()
            if self.stage == 1:
                self._unit_grad(u).zero_()
            else:
                u.grad = None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.store is not None:
            self.store.close()

    # -- accounting and checkpoints ------------------------------------------------------------
    def param_bytes(self) -> int:
        raise NotImplementedError

    def state_bytes(self) -> dict:
        """Model-state bytes this rank holds between steps on the device, counted from the tensors; with
        offload also "host" and "disk": {params, grads, optimizer, total} kept there (offload.py)."""
        params = self.param_bytes()
        # stage 1 holds full gradients (its shards are slices of them); the others hold shards
        full = nbytes(u.grad for u in self.units if u.grad is not None)
        grads = full if self.stage == 1 else nbytes(self.grad_shards) + full
        if self.store is not None:
            return {"params": params, "grads": grads, "optimizer": 0, "total": params + grads, **self.store.bytes()}
        opt = self.optimizer.state_bytes()
        if self.master_dtype != self.param_dtype:
            opt += nbytes(self.master_shards)
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}

    def _gather_shards(self, shards: list[torch.Tensor], dtype) -> dict[str, torch.Tensor]:
        out = {}
        for u, s in zip(self.units, shards):
            full = torch.empty(u.padded, dtype=dtype, device=self.device)
            comm.all_gather(full, s.to(self.device, dtype).contiguous(), u.group, dim="checkpoint")
            for name, v in zip(u.names, u.views(full)):
                out[name] = v.clone()
        return out

    def _opt_shards(self, states: list[torch.Tensor]) -> list[torch.Tensor]:
        """Optimizer state (kept per segment) laid back into padded shards."""
        shards, it = [], iter(states)
        for u in self.units:
            s = torch.zeros(u.shard_size, dtype=self.master_dtype, device=self.device)
            for _, a, n in u.segments:
                s[a:a + n].copy_(next(it))
            shards.append(s)
        return shards

    def full_state(self) -> dict:
        """Full tensors keyed by parameter name (an all-gather per unit, recorded as 'checkpoint')."""
        if self.store is not None:
            masters, avgs, avg_sqs = zip(*(self.store.state(j) for j in range(len(self.units))))
        else:
            masters = self.master_shards
            avgs, avg_sqs = self._opt_shards(self.optimizer.exp_avg), self._opt_shards(self.optimizer.exp_avg_sq)
        return {"model": self._gather_shards(masters, self.master_dtype),
                "exp_avg": self._gather_shards(avgs, self.master_dtype),
                "exp_avg_sq": self._gather_shards(avg_sqs, self.master_dtype),
                "opt_t": self.optimizer.t}

    @torch.no_grad()
    def load_full_state(self, state: dict) -> None:
        if self.store is not None:
            for j, u in enumerate(self.units):
                master, avg, avg_sq = (u.flatten([state[key][n] for n in u.names], self.master_dtype)[u.lo:u.hi]
                                       for key in ("model", "exp_avg", "exp_avg_sq"))
                self.store.put(j, master, avg, avg_sq)   # with params on disk: the parameter shard too
                if not self.params_on_disk:
                    self.param_shards[j].copy_(master)
                self.load_params(j, u.flatten([state["model"][n] for n in u.names], self.master_dtype, self.device))
            self.optimizer.t = state["opt_t"]
            return
        for j, u in enumerate(self.units):
            flat = u.flatten([state["model"][n] for n in u.names], self.master_dtype, self.device)
            self.master_shards[j].copy_(flat[u.lo:u.hi])
            if self.master_shards[j] is not self.param_shards[j]:
                self.param_shards[j].copy_(self.master_shards[j])
            self.load_params(j, flat)
        for key, states in (("exp_avg", self.optimizer.exp_avg), ("exp_avg_sq", self.optimizer.exp_avg_sq)):
            it = iter(states)
            for u in self.units:
                flat = u.flatten([state[key][n] for n in u.names], self.master_dtype, self.device)
                for _, a, n in u.segments:
                    next(it).copy_(flat[u.lo + a:u.lo + a + n])
        self.optimizer.t = state["opt_t"]

    def load_params(self, j: int, flat: torch.Tensor) -> None:
        """Stages 1, 2: the full flat parameters of unit j from a loaded state."""

    loads_full_params = False   # stages 1, 2 hold every parameter whole: a load fills them too

    def local_state(self) -> tuple[list, int]:
        """This rank's own state, nothing gathered: (parameter name, offset into the flattened
        parameter, {"model", "exp_avg", "exp_avg_sq": 1-D tensor}) per segment of its shards, and
        Adam's step count. A checkpoint writes these pieces as they are (offloaded: host tensors, read
        from disk in nvme mode)."""
        if self.store is not None:
            out = []
            for j, u in enumerate(self.units):
                master, avg, avg_sq = self.store.state(j)
                for i, a, n in u.segments:
                    out.append((u.names[i], u.lo + a - u.offsets[i],
                                {"model": master[a:a + n], "exp_avg": avg[a:a + n], "exp_avg_sq": avg_sq[a:a + n]}))
            return out, self.optimizer.t
        out, avg, avg_sq = [], iter(self.optimizer.exp_avg), iter(self.optimizer.exp_avg_sq)
        for u, master in zip(self.units, self.master_shards):
            for i, a, n in u.segments:
                out.append((u.names[i], u.lo + a - u.offsets[i],
                            {"model": master[a:a + n], "exp_avg": next(avg), "exp_avg_sq": next(avg_sq)}))
        return out, self.optimizer.t

    @torch.no_grad()
    def load_local_state(self, read_into, opt_t: int) -> None:
        """The inverse of `local_state`: read_into(dst, name, offset, section) fills the 1-D tensor dst
        with elements offset.. of this rank's piece of `name`."""
        avg, avg_sq = iter(self.optimizer.exp_avg), iter(self.optimizer.exp_avg_sq)
        for j, u in enumerate(self.units):
            if self.store is not None:   # the unit's state built on the host, then handed to the store
                state = [torch.zeros(u.shard_size, dtype=self.master_dtype, device="cpu") for _ in range(3)]
                for i, a, n in u.segments:
                    name, start = u.names[i], u.lo + a - u.offsets[i]
                    for t, section in zip(state, ("model", "exp_avg", "exp_avg_sq")):
                        read_into(t[a:a + n], name, start, section)
                self.store.put(j, *state)   # with params on disk: the parameter shard too
                if not self.params_on_disk:
                    self.param_shards[j].copy_(state[0])
            else:
                for i, a, n in u.segments:
                    name, start = u.names[i], u.lo + a - u.offsets[i]
                    read_into(self.master_shards[j][a:a + n], name, start, "model")
                    read_into(next(avg), name, start, "exp_avg")
                    read_into(next(avg_sq), name, start, "exp_avg_sq")
                if self.master_shards[j] is not self.param_shards[j]:
                    self.param_shards[j].copy_(self.master_shards[j])
            if self.loads_full_params:
                whole = [torch.empty(shape.numel(), dtype=self.master_dtype, device=self.device) for shape in u.shapes]
                for name, t in zip(u.names, whole):
                    read_into(t, name, 0, "model")
                self.load_params(j, u.flatten(whole, self.param_dtype, self.device))
        self.optimizer.t = opt_t


class Zero12(ShardedOptimizer):
    """ZeRO stages 1 and 2: full parameters in flat per-unit buffers (the parameters are views), this
    rank's slice is its shard; after the step each unit's shards are all-gathered."""

    def __init__(self, model, groups, stage: int, make_optimizer, bucket_mb: float = 25.0, **kw):
        self.stage, self.bucket_mb = stage, bucket_mb
        super().__init__(model, groups, make_optimizer, **kw)

    def make_units(self, groups) -> list[Unit]:
        if self.block_units:
            return self.block_unit_list(groups)
        itemsize = self.grad_dtype.itemsize
        units = []
        for group, params in reduce_partitions(backward_order(self.params), groups):
            for ps in bucketize(params, int(self.bucket_mb * 2**20), itemsize):
                units.append(Unit(f"bucket{len(units)}", ps, [self.names[id(p)] for p in ps], group))
        return units

    @torch.no_grad()
    def build_storage(self) -> None:
        self.param_flats = []
        for u in self.units:
            flat = u.flatten([p.data for p in u.params], self.param_dtype, self.device)
            self.param_flats.append(flat)
            for p, v in zip(u.params, u.views(flat)):
                p.data = v
            self.param_shards.append(flat[u.lo:u.hi])
            self.master_shards.append(self._master(flat[u.lo:u.hi]))

    def after_step(self) -> None:
        for j, u in enumerate(self.units):
            comm.all_gather(self.param_flats[j], self.param_shards[j].clone(), u.group)

    def param_bytes(self) -> int:
        return nbytes(self.param_flats)

    loads_full_params = True

    def load_params(self, j: int, flat: torch.Tensor) -> None:
        self.param_flats[j].copy_(flat)


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


class Zero3(ShardedOptimizer):
    """ZeRO stage 3: only parameter shards stay; a unit is all-gathered before its module runs
    (forward and backward) and freed after, with the next unit prefetched."""

    stage = 3

    def __init__(self, model, groups, make_optimizer, reshard_after_forward: bool = True, **kw):
        self.reshard_after_forward = reshard_after_forward
        super().__init__(model, groups, make_optimizer, **kw)
        self._install_hooks()

    def make_units(self, groups) -> list[Unit]:
        return self.block_unit_list(groups)

    @torch.no_grad()
    def build_storage(self) -> None:
        for u in self.units:
            shard = u.shard_of([p.data for p in u.params], self.param_dtype, self.device)
            self.param_shards.append(shard)
            self.master_shards.append(self._master(shard))
            for p in u.params:
                p.data = torch.empty(0, dtype=self.param_dtype, device=self.device)

    def param_bytes(self) -> int:
        return nbytes(self.param_shards)

    # -- gather before use, free after -----------------------------------------------------------
    def _gather_async(self, slot: int) -> None:
        for u in self.slots[slot]:
            if u.gathered or u.gather_handle is not None:
                continue
            u.full = regather_buffer(u.full, u.padded, self.param_dtype, self.device)
            if self.params_on_disk:   # from disk into its own slot of the gathered buffer, gathered in place
                shard = u.full[u.lo:u.hi]
                self.store.read_params(u.pos, shard)
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
        if self.reduces_each_backward and not (self.pipeline and u.name == "root"):   # the root stays for the step
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
        super().finish()
        for slot in range(len(self.slots)):
            self._free(slot)

    def release_params(self) -> None:
        """After forwards without a backward (an evaluation): free every gathered unit, as a step's end does."""
        for slot in range(len(self.slots)):
            self._free(slot)

    def _install_hooks(self) -> None:
        """The gather/free order of zero_order.py (which the planner replays)."""
        last = len(self.slots) - 1

        def pre_forward(idx):
            def hook(module, args):
                self._gather(idx)
                ahead = forward_prefetch(idx, last, self.pipeline)
                if ahead is not None and torch.is_grad_enabled():
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

        for idx, (_, _, modules) in enumerate(self.modules_to_gather()):
            for module in modules:
                self._hooks.append(module.register_forward_pre_hook(pre_forward(idx)))
                self._hooks.append(module.register_forward_hook(post_forward(idx)))

    def _pre_backward(self, idx: int) -> None:
        """Before slot idx's backward: gather it (if freed) and prefetch the slot that runs next."""
        self._gather(idx)
        if self.pipeline:
            for u in self.slots[idx]:
                u.seen = set()   # this backward's gradients: free the unit once all have arrived
            return
        ahead = backward_prefetch(idx, len(self.slots), self.pipeline)
        if ahead is not None:
            self._gather_async(ahead)


def Zero(model: nn.Module, groups: Mapping[str, Group], stage: int, make_optimizer, bucket_mb: float = 25.0,
         master_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None,
         reshard_after_forward: bool = True, pipeline: bool = False,
         reduce_each_microbatch: bool = False, offload: str = "none", offload_dir: str = "") -> ShardedOptimizer:
    """ZeRO stage 1, 2 or 3 for `model`, each parameter over `groups[placement.reduce]`, with AdamW
    (from `make_optimizer(params, decay)`) on this rank's shards, on the device or offloaded to host
    memory ("cpu") or to files in offload_dir ("nvme").

        z = Zero(model, mesh, stage=3, make_optimizer=lambda params, decay: AdamW(params, decay))
        ... the engine protocol (engine.py) ...
    """
    kw = dict(master_dtype=master_dtype, grad_dtype=grad_dtype, pipeline=pipeline,
              reduce_each_microbatch=reduce_each_microbatch, offload=offload, offload_dir=offload_dir)
    if stage == 3:
        return Zero3(model, groups, make_optimizer, reshard_after_forward, **kw)
    if stage in (1, 2):
        return Zero12(model, groups, stage, make_optimizer, bucket_mb, **kw)
    raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
