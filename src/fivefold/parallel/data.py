"""Data parallelism: replicate the model, sum gradients across replicas, overlapped with backward.

Paper: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020):
gradient bucketing, and all-reduce overlapped with the backward pass.

How it works here:
- Parameters are packed (in reverse registration order, close to the order backward produces their
  gradients) into buckets of at most `bucket_mb` MiB. Each bucket owns one flat gradient buffer, and
  each parameter's gradient (`param.main_grad`) is a view into it.
- A post-accumulate-grad hook counts, per bucket, the parameters whose gradient is final. When the last
  one arrives, the bucket's buffer is all-reduced asynchronously while backward goes on. Buckets are
  launched strictly in index order so every rank issues the same collectives in the same order.
- Gradient accumulation: with `sync=False` (every micro-batch but the last) hooks only accumulate; no
  byte is sent until the last micro-batch.
- When compute is fp32, autograd accumulates directly into the bucket view (no copy). When compute is
  bf16, the gradient buffer is fp32: the hook adds the bf16 gradient into it and frees it ("main grads").
- `finish()` launches any bucket still pending (parameters that got no gradient) and waits for all.

Communication per step, per rank: one ring all-reduce of every gradient, 2·Φ·(n-1)/n · bytes-per-grad,
in the "dp" dimension of the ledger. Gradients are summed, not averaged: the trainer's loss is already
divided by the global token count (pass `average=True` for the usual mean over replicas).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .. import comm
from ..comm import Group


class Bucket:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, index: int):
        self.params = params
        self.index = index
        self.numel = sum(p.numel() for p in params)
        self.grad = torch.zeros(self.numel, dtype=dtype)
        self.pending = set()
        self.handle = None
        offset = 0
        self.offsets = {}
        for p in params:
            self.offsets[p] = offset
            offset += p.numel()

    def view(self, p: nn.Parameter) -> torch.Tensor:
        o = self.offsets[p]
        return self.grad[o:o + p.numel()].view_as(p)

    def reset(self) -> None:
        self.pending = set(self.params)
        self.handle = None


def bucketize(params: list[nn.Parameter], bucket_bytes: int, itemsize: int) -> list[list[nn.Parameter]]:
    """Split params (in backward order) into consecutive groups of at most bucket_bytes each."""
    out, cur, size = [], [], 0
    for p in params:
        if cur and size + p.numel() * itemsize > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel() * itemsize
    if cur:
        out.append(cur)
    return out


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, each tied weight once, in registration order."""
    seen, out = set(), []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class DataParallel:
    """Bucketed, overlapped gradient all-reduce for `module` over `group`.

    Use:
        dp = DataParallel(model, mesh["dp"])
        for i, mb in enumerate(micro_batches):
            with dp.sync(i == len(micro_batches) - 1):
                loss(model(mb)).backward()
        dp.finish()            # gradients now in p.main_grad (also p.grad when fp32)
        ... optimizer step on main_grad ...
        dp.zero_grad()
    """

    def __init__(self, module: nn.Module, group: Group, bucket_mb: float = 25.0,
                 grad_dtype: torch.dtype = torch.float32, average: bool = False):
        self.module, self.group, self.average = module, group, average
        self.params = unique_params(module)
        self.grad_dtype = grad_dtype
        itemsize = torch.empty((), dtype=grad_dtype).element_size()
        self.buckets = [Bucket(ps, grad_dtype, i) for i, ps in
                        enumerate(bucketize(list(reversed(self.params)), int(bucket_mb * 2**20), itemsize))]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._sync = True
        self._next = 0
        self._hooks = []
        for p in self.params:
            p.main_grad = self.bucket_of[p].view(p)
            if p.dtype == grad_dtype:
                p.grad = p.main_grad  # autograd accumulates in place, into the bucket
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.zero_grad()

    # -- backward hooks ----------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is not None and p.grad.data_ptr() != p.main_grad.data_ptr():
            # bf16 compute: add into the fp32 main grad and free the low-precision one
            p.main_grad.add_(p.grad)
            p.grad = None if p.dtype != self.grad_dtype else p.main_grad
        if not self._sync:
            return
        bucket = self.bucket_of[p]
        bucket.pending.discard(p)
        if not bucket.pending:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.handle = comm.all_reduce(bucket.grad, self.group, async_op=True, dim="dp")

    # -- public ------------------------------------------------------------------------------
    @contextmanager
    def sync(self, enabled: bool = True):
        """Inside `sync(False)`, backward accumulates gradients without communicating."""
        old, self._sync = self._sync, enabled
        try:
            yield
        finally:
            self._sync = old

    def finish(self) -> None:
        """Launch buckets not yet sent (parameters without gradients), wait for all reductions."""
        for b in self.buckets[self._next:]:
            b.pending.clear()
        self._launch_ready()
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                if self.average:
                    b.grad.div_(self.group.size)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()
            b.reset()
        self._next = 0
        for p in self.params:
            p.grad = p.main_grad if p.dtype == self.grad_dtype else None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


class DataParallelOptimizer:
    """Plain data parallelism with its optimizer: every rank holds full parameters, gradients (in
    `DataParallel`'s buckets) and optimizer state. The same interface as `Zero`, so the trainer drives
    either one: sync / finish / owned_grads / step / zero_grad / state_bytes / full_state."""

    def __init__(self, model: nn.Module, group: Group, make_optimizer, bucket_mb: float = 25.0,
                 master_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None):
        self.model = model
        self.params = unique_params(model)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.reducer = DataParallel(model, group, bucket_mb, grad_dtype=grad_dtype or master_dtype)
        self.param_dtype = self.params[0].dtype
        self.separate_master = self.param_dtype != master_dtype
        if not self.separate_master:
            self.master = [p.data for p in self.params]
        else:
            self.master = [p.detach().to(master_dtype).clone() for p in self.params]
        self.optimizer = make_optimizer(self.master, [p.dim() >= 2 for p in self.params])

    def sync(self, enabled: bool = True):
        return self.reducer.sync(enabled)

    def finish(self) -> None:
        self.reducer.finish()

    def owned_grads(self, exclude: tuple = ()) -> list[torch.Tensor]:
        """Full gradients: replicated across the DP group, so the norm needs no DP reduction. Parameters
        in `exclude` are left out (a tied copy counted on another rank)."""
        skip = {id(p) for p in exclude}
        return [p.main_grad for p in self.params if id(p) not in skip]

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """p's accumulated gradient on this rank, before (or without) the DP reduction; in place."""
        return p.main_grad

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.optimizer.step(self.owned_grads(), lr)
        if self.separate_master:
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def state_bytes(self) -> dict:
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        params = nb(self.params)
        grads = nb(b.grad for b in self.reducer.buckets)
        opt = self.optimizer.state_bytes() + (nb(self.master) if self.separate_master else 0)
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}

    def full_state(self) -> dict:
        names = [self.names[id(p)] for p in self.params]
        return {"model": {n: m.detach().clone() for n, m in zip(names, self.master)},
                "exp_avg": {n: e.clone() for n, e in zip(names, self.optimizer.exp_avg)},
                "exp_avg_sq": {n: e.clone() for n, e in zip(names, self.optimizer.exp_avg_sq)},
                "opt_t": self.optimizer.t}

    @torch.no_grad()
    def load_full_state(self, state: dict) -> None:
        names = [self.names[id(p)] for p in self.params]
        for n, p, m, ea, es in zip(names, self.params, self.master, self.optimizer.exp_avg,
                                   self.optimizer.exp_avg_sq):
            m.copy_(state["model"][n])
            p.copy_(m)
            ea.copy_(state["exp_avg"][n])
            es.copy_(state["exp_avg_sq"][n])
        self.optimizer.t = state["opt_t"]
