"""ZeRO: shard optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) across the
data-parallel group.

Paper: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020). Per parameter, model state is K bytes of optimizer state (fp32 Adam: m and v, 8 bytes; with
bf16 compute also the fp32 master, 12 bytes) plus the parameter and its gradient. Stage 1 divides the
optimizer state by n, stage 2 also the gradients, stage 3 also the parameters.

Layout. Parameters are packed into *units*, each a flat buffer padded to a multiple of n; rank r owns
elements [r·k, (r+1)·k) of every unit, k = padded/n. Stages 1 and 2 make units of at most `bucket_mb`
MiB (in backward order, like data.py); stage 3 makes one unit per transformer block plus a "root" unit
(embedding, final norm, head), so a block's weights can be gathered just before it runs.

Communication per step, per rank, n = dp size, Φ parameters, g / w bytes per gradient / parameter:

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

The optimizer (train/optim.py's AdamW) updates this rank's shard through per-parameter views, so the
arithmetic on every element is the single-process arithmetic.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .. import comm
from ..comm import Group
from .data import bucketize


class Unit:
    """A flat, padded group of parameters, sharded evenly over n ranks."""

    def __init__(self, name: str, params: list[nn.Parameter], names: list[str], n: int, rank: int):
        self.name, self.params, self.names = name, params, names
        self.shapes = [p.shape for p in params]
        self.offsets, o = [], 0
        for p in params:
            self.offsets.append(o)
            o += p.numel()
        self.numel = o
        self.padded = -(-o // n) * n
        self.k = self.padded // n
        self.lo, self.hi = rank * self.k, (rank + 1) * self.k
        self.index = {p: i for i, p in enumerate(params)}
        # backward state
        self.pending: set = set()
        self.staging: torch.Tensor | None = None
        self.gathered = False
        self.gather_handle = None
        self.full: torch.Tensor | None = None

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=dtype)
        for t, o in zip(tensors, self.offsets):
            flat[o:o + t.numel()].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def segments(self) -> list[tuple[int, int, int]]:
        """(param index, start in shard, length) for each parameter overlapping this rank's shard."""
        out = []
        for i, (o, s) in enumerate(zip(self.offsets, self.shapes)):
            a, b = max(o, self.lo), min(o + s.numel(), self.hi)
            if a < b:
                out.append((i, a - self.lo, b - a))
        return out


def stage3_units(model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """One unit per block of `model.layers`, plus 'root' for everything else (embedding, norm, head)."""
    units = []
    block_ids = set()
    for i, block in enumerate(model.layers):
        names = [f"layers.{i}.{n}" for n, _ in block.named_parameters()]
        units.append((f"layers.{i}", block, names))
        block_ids.update(id(p) for p in block.parameters())
    root = [n for n, p in model.named_parameters() if id(p) not in block_ids]
    return [("root", model, root)] + units


class Zero:
    """ZeRO stage 1, 2 or 3 for `model` over the data-parallel `group`, with AdamW on the shards.

    Use like DataParallel plus the optimizer:
        z = Zero(model, mesh["dp"], stage=3, make_optimizer=lambda params, decay: AdamW(...))
        for i, mb in enumerate(micro_batches):
            with z.sync(i == last):
                loss(model(mb)).backward()
        z.finish()
        norm = global_grad_norm(z.owned_grads(), mesh["dp"]); clip_(z.owned_grads(), norm, max)
        z.step(lr)          # update own shards, then (stages 1, 2) all-gather the parameters
        z.zero_grad()
    """

    def __init__(self, model: nn.Module, group: Group, stage: int, make_optimizer, bucket_mb: float = 25.0,
                 master_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None,
                 reshard_after_forward: bool = True):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.model, self.group, self.stage = model, group, stage
        self.n, self.rank = group.size, group.rank
        self.param_dtype = next(model.parameters()).dtype
        self.master_dtype = master_dtype
        self.grad_dtype = grad_dtype or master_dtype
        self.reshard_after_forward = reshard_after_forward
        self._sync = True
        self._inflight: list = []   # (unit, handle, tmp shard) reduce-scatters not yet folded in
        self._hooks = []
        names = {id(p): n for n, p in model.named_parameters()}
        if stage == 3:
            specs = stage3_units(model)
            named = dict(model.named_parameters())
            self.units = [Unit(name, [named[n] for n in pnames], pnames, self.n, self.rank)
                          for name, _, pnames in specs]
            self.modules = [m for _, m, _ in specs]
        else:
            params = list(reversed(list(dict.fromkeys(model.parameters()))))
            self.units = [Unit(f"bucket{i}", ps, [names[id(p)] for p in ps], self.n, self.rank)
                          for i, ps in enumerate(bucketize(params, int(bucket_mb * 2**20),
                                                           torch.empty((), dtype=self.grad_dtype).element_size()))]
        for j, u in enumerate(self.units):
            u.pos = j
        self.unit_of = {p: u for u in self.units for p in u.params}
        self._build_storage()
        self.grad_shards = [torch.zeros(u.k, dtype=self.grad_dtype) for u in self.units]
        if stage == 1:  # stage 1 keeps full gradients, reduce-scattered once per step
            self.full_grads = [torch.zeros(u.padded, dtype=self.grad_dtype) for u in self.units]
        self._segments = [u.segments() for u in self.units]
        opt_params, decay = [], []
        for u, m, segs in zip(self.units, self.master_shards, self._segments):
            for i, a, n in segs:
                opt_params.append(m[a:a + n])
                decay.append(len(u.shapes[i]) >= 2)
        self.optimizer = make_optimizer(opt_params, decay)
        for p in self.unit_of:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if stage == 3:
            self._install_stage3_hooks()
        self.zero_grad()

    # -- storage -----------------------------------------------------------------------------
    def _build_storage(self) -> None:
        """Stages 1/2: full flat parameters (params are views), own slice of them is the master in fp32.
        Stage 3: only the shard of parameters stays; full parameters exist while a unit is gathered."""
        self.param_flats, self.param_shards, self.master_shards = [], [], []
        with torch.no_grad():
            for u in self.units:
                flat = u.flatten([p.data for p in u.params], self.param_dtype)
                if self.stage == 3:
                    shard = flat[u.lo:u.hi].clone()
                    self.param_shards.append(shard)
                    for p in u.params:
                        p.data = torch.empty(0, dtype=self.param_dtype)
                    master = shard if self.master_dtype == self.param_dtype else shard.to(self.master_dtype)
                else:
                    self.param_flats.append(flat)
                    for p, v in zip(u.params, u.views(flat)):
                        p.data = v
                    shard = flat[u.lo:u.hi]
                    self.param_shards.append(shard)
                    master = shard if self.master_dtype == self.param_dtype else shard.to(self.master_dtype)
                self.master_shards.append(master)

    # -- gradients ---------------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        u = self.unit_of[p]
        i = u.index[p]
        o, n = u.offsets[i], p.numel()
        if self.stage == 1:
            self.full_grads[u.pos][o:o + n].add_(p.grad.reshape(-1))
            p.grad = None
            if not self._sync:
                return
        else:
            if u.staging is None:
                u.staging = torch.zeros(u.padded, dtype=self.grad_dtype)
            u.staging[o:o + n].add_(p.grad.reshape(-1))
            p.grad = None
        u.pending.discard(p)
        if not u.pending:
            self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        """Reduce-scatter a complete unit's gradients; fold the result into the grad shard later."""
        j = u.pos
        src = self.full_grads[j] if self.stage == 1 else u.staging
        tmp = torch.empty(u.k, dtype=self.grad_dtype)
        handle = comm.reduce_scatter(tmp, src, self.group, async_op=True, dim="dp")
        self._inflight.append((j, handle, tmp))
        u.staging = None
        if self.stage == 3:
            self._free(u)
        while len(self._inflight) > 2:  # bound the memory of in-flight reductions
            self._fold(self._inflight.pop(0))

    def _fold(self, item) -> None:
        j, handle, tmp = item
        handle.wait()
        if self.stage == 1:
            self.grad_shards[j].copy_(tmp)
        else:
            self.grad_shards[j].add_(tmp)

    @contextmanager
    def sync(self, enabled: bool = True):
        """Stage 1 sends nothing inside sync(False); stages 2 and 3 reduce every micro-batch."""
        old, self._sync = self._sync, enabled
        try:
            yield
        finally:
            self._sync = old
            if self.stage >= 2 or enabled:
                self._end_backward()

    def _end_backward(self) -> None:
        """After a backward that syncs: reduce units still waiting for gradients (parameters that got
        none count as zero; every rank runs the same graph, so all skip the same ones)."""
        for u in self.units:
            started = u.pending != set(u.params)
            if u.pending and (self.stage == 1 or started):
                self._reduce(u)
            u.pending = set(u.params)

    def finish(self) -> None:
        """Wait for every reduce-scatter; afterwards `owned_grads()` holds the reduced shards."""
        while self._inflight:
            self._fold(self._inflight.pop(0))
        if self.stage == 3:
            for u in self.units:
                self._free(u)

    def owned_grads(self, exclude: tuple = ()) -> list[torch.Tensor]:
        """This rank's gradient segments (no padding): each element of the model on exactly one rank.
        Segments of parameters in `exclude` are left out (a tied copy counted on another rank)."""
        skip = {id(p) for p in exclude}
        return [g[a:a + n] for u, g, segs in zip(self.units, self.grad_shards, self._segments)
                for i, a, n in segs if id(u.params[i]) not in skip]

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """Stage 1: p's accumulated gradient before the reduce-scatter (a view into the full gradient
        buffer; accumulate with sync(False), change it, then reduce). Stages 2 and 3 keep none."""
        if self.stage != 1:
            raise RuntimeError(f"ZeRO-{self.stage} keeps no full local gradient (only stage 1 does)")
        u = self.unit_of[p]
        o = u.offsets[u.index[p]]
        return self.full_grads[u.pos][o:o + p.numel()].view_as(p)

    # -- optimizer step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> None:
        grads = self.owned_grads()
        self.optimizer.step(grads, lr)
        for j, u in enumerate(self.units):
            if self.master_shards[j] is not self.param_shards[j]:
                self.param_shards[j].copy_(self.master_shards[j])
            if self.stage < 3:
                own = self.param_shards[j].clone()
                comm.all_gather(self.param_flats[j], own, self.group, dim="dp")

    def zero_grad(self) -> None:
        for g in self.grad_shards:
            g.zero_()
        if self.stage == 1:
            for g in self.full_grads:
                g.zero_()
        for u in self.units:
            u.pending = set(u.params)
            u.staging = None

    # -- stage 3: gather before use, free after ------------------------------------------------
    def _gather_async(self, u: Unit) -> None:
        if u.gathered or u.gather_handle is not None:
            return
        j = u.pos
        u.full = torch.empty(u.padded, dtype=self.param_dtype)
        u.gather_handle = comm.all_gather(u.full, self.param_shards[j], self.group, async_op=True, dim="dp")

    def _gather(self, u: Unit) -> None:
        self._gather_async(u)
        if u.gather_handle is not None:
            u.gather_handle.wait()
            u.gather_handle = None
            for p, v in zip(u.params, u.views(u.full)):
                p.data = v
            u.gathered = True

    def _free(self, u: Unit) -> None:
        if u.gathered:
            for p in u.params:
                p.data = torch.empty(0, dtype=self.param_dtype)
            u.full = None
            u.gathered = False

    def _install_stage3_hooks(self) -> None:
        def pre_forward(idx):
            def hook(module, args):
                u = self.units[idx]
                self._gather(u)
                nxt = idx + 1 if idx + 1 < len(self.units) else None
                if nxt is not None and torch.is_grad_enabled():
                    self._gather_async(self.units[nxt])  # prefetch the next block
            return hook

        def post_forward(idx):
            def hook(module, args, output):
                u = self.units[idx]
                if torch.is_grad_enabled() and output.requires_grad:
                    output.register_hook(lambda grad, idx=idx: self._pre_backward(idx) or grad)
                if self.reshard_after_forward:
                    self._free(u)  # the root's hook fires after the whole forward
                return output
            return hook

        for idx, module in enumerate(self.modules):
            self._hooks.append(module.register_forward_pre_hook(pre_forward(idx)))
            self._hooks.append(module.register_forward_hook(post_forward(idx)))

    def _pre_backward(self, idx: int) -> None:
        """Before unit idx's backward: gather it (if freed) and prefetch the unit that runs next."""
        self._gather(self.units[idx])
        prev = idx - 1 if idx > 1 else None   # blocks run backward from last to first; root already held
        if idx == 0:
            prev = len(self.units) - 1 if len(self.units) > 1 else None
        if prev is not None:
            self._gather_async(self.units[prev])

    # -- accounting and checkpoints ------------------------------------------------------------
    def state_bytes(self) -> dict:
        """Model-state bytes this rank holds between steps, counted from the tensors."""
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        params = nb(self.param_shards) if self.stage == 3 else nb(self.param_flats)
        grads = nb(self.full_grads) if self.stage == 1 else nb(self.grad_shards)
        opt = self.optimizer.state_bytes()
        if self.master_dtype != self.param_dtype:
            opt += nb(self.master_shards)
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}

    def _gather_shards(self, shards: list[torch.Tensor], dtype) -> dict[str, torch.Tensor]:
        out = {}
        for u, s in zip(self.units, shards):
            full = torch.empty(u.padded, dtype=dtype)
            comm.all_gather(full, s.to(dtype).contiguous(), self.group, dim="checkpoint")
            for name, v in zip(u.names, u.views(full)):
                out[name] = v.clone()
        return out

    def _opt_shards(self, states: list[torch.Tensor]) -> list[torch.Tensor]:
        """Optimizer state (kept per segment) laid back into padded shards."""
        shards, it = [], iter(states)
        for u, segs in zip(self.units, self._segments):
            s = torch.zeros(u.k, dtype=self.master_dtype)
            for _, a, n in segs:
                s[a:a + n].copy_(next(it))
            shards.append(s)
        return shards

    def full_state(self) -> dict:
        """Full tensors keyed by parameter name (an all-gather per unit, recorded as 'checkpoint')."""
        return {"model": self._gather_shards(self.master_shards, self.master_dtype),
                "exp_avg": self._gather_shards(self._opt_shards(self.optimizer.exp_avg), self.master_dtype),
                "exp_avg_sq": self._gather_shards(self._opt_shards(self.optimizer.exp_avg_sq), self.master_dtype),
                "opt_t": self.optimizer.t}

    @torch.no_grad()
    def load_full_state(self, state: dict) -> None:
        for j, u in enumerate(self.units):
            m = self.master_shards[j]
            flat = u.flatten([state["model"][n] for n in u.names], self.master_dtype)
            m.copy_(flat[u.lo:u.hi])
            if m is not self.param_shards[j]:
                self.param_shards[j].copy_(m)
            if self.stage < 3:
                self.param_flats[j].copy_(flat)
        for key, states in (("exp_avg", self.optimizer.exp_avg), ("exp_avg_sq", self.optimizer.exp_avg_sq)):
            it = iter(states)
            for u, segs in zip(self.units, self._segments):
                flat = u.flatten([state[key][n] for n in u.names], self.master_dtype)
                for _, a, n in segs:
                    next(it).copy_(flat[u.lo + a:u.lo + a + n])
        self.optimizer.t = state["opt_t"]
