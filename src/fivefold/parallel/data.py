"""Data parallelism: replicate the model, sum gradients across replicas, overlapped with backward.

Paper: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020):
gradient bucketing, and all-reduce overlapped with the backward pass.

How it works here:
- Parameters are partitioned by the group their gradient is summed over (`placement.reduce`, see
  placement.py: dp, dp×cp, expert-dp); each partition is packed (in reverse registration order, close
  to the order backward produces gradients) into buckets of at most `bucket_mb` MiB, so a bucket never
  mixes groups. Each bucket owns one flat gradient buffer; each parameter's gradient
  (`param.main_grad`) is a view into it.
- A post-accumulate-grad hook counts, per bucket, the parameters whose gradient is final. When the last
  one arrives, the bucket's buffer is all-reduced asynchronously over its group while backward goes on.
  Within a group buckets are launched strictly in index order, so every rank of the group issues the
  same collectives in the same order.
- Gradient accumulation: with `set_sync(False)` (every micro-batch but the last) hooks only accumulate;
  no byte is sent until the last micro-batch. Under a pipeline sync is on for each chunk's last backward
  (engine.py), so a chunk's buckets go while the schedule still runs; tied copies wait for the end.
- When compute is fp32, autograd accumulates directly into the bucket view (no copy). When compute is
  bf16, the gradient buffer is fp32: the hook adds the bf16 gradient into it and frees it ("main grads").
- `end_backward()` launches buckets still pending (parameters that got no gradient); `finish()` waits.

Communication per step, per rank: one ring all-reduce of every gradient over its group,
2·Φ·(n-1)/n · bytes-per-grad, recorded under the group's name ("dp"). Gradients are summed, not
averaged: the trainer's loss is already divided by the global token count (`average=True` gives the
usual mean over replicas).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .. import comm, rules
from ..comm import Group
from ..shapes import bucket_ranges
from .engine import Engine, backward_order, counted, decays, held, nbytes, reduce_partitions, unique_params
from .placement import by_group

__all__ = ["Bucket", "DataParallel", "DataParallelOptimizer", "bucketize", "unique_params"]


class Bucket:
    def __init__(self, params: list[nn.Parameter], group: Group, dtype: torch.dtype, device):
        self.params, self.group = params, group
        self.numel = sum(p.numel() for p in params)
        self.grad = torch.zeros(self.numel, dtype=dtype, device=device)
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


def bucketize(params: list, bucket_bytes: int, itemsize: int) -> list[list]:
    """Split params (in backward order) into consecutive groups of at most bucket_bytes each
    (`shapes.bucket_ranges`, the rule the planner uses too)."""
    return [[params[i] for i in idx] for idx in bucket_ranges([p.numel() for p in params], bucket_bytes, itemsize)]


class DataParallel:
    """Bucketed, overlapped gradient all-reduce for `module`, each parameter over the group its
    placement names (`groups[placement.reduce]`; a plain parameter goes over groups["dp"])."""

    def __init__(self, module: nn.Module, groups: Mapping[str, Group], bucket_mb: float = 25.0,
                 grad_dtype: torch.dtype = torch.float32, average: bool = False):
        self.module, self.average = module, average
        self.params = unique_params(module)
        self.grad_dtype = grad_dtype
        itemsize = grad_dtype.itemsize
        device = self.params[0].device if self.params else None
        self.partitions = reduce_partitions(backward_order(self.params), groups)
        self.lanes = [[Bucket(ps, group, grad_dtype, device) for ps in bucketize(members, int(bucket_mb * 2**20), itemsize)]
                      for group, members in self.partitions]   # one ordered lane of buckets per group
        self.buckets = [b for lane in self.lanes for b in lane]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.lane_of = {id(b): i for i, lane in enumerate(self.lanes) for b in lane}
        self._sync = True
        self._next = [0] * len(self.lanes)
        self._hooks = []
        for p in self.params:
            p.main_grad = self.bucket_of[p].view(p)
            if p.dtype == grad_dtype:
                p.grad = p.main_grad  # autograd accumulates in place, into the bucket
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.zero_grad()

    # -- backward hooks ----------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is not None and p.grad.untyped_storage()._cdata != p.main_grad.untyped_storage()._cdata:
            # bf16 compute: add into the fp32 main grad and free the low-precision one
            p.main_grad.add_(p.grad)
            p.grad = None if p.dtype != self.grad_dtype else p.main_grad
        if not self._sync or held(p):
            return
        bucket = self.bucket_of[p]
        bucket.pending.discard(p)
        if not bucket.pending:
            self._launch_ready(self.lane_of[id(bucket)])

    def _launch_ready(self, lane: int) -> None:
        buckets = self.lanes[lane]
        while self._next[lane] < len(buckets) and not buckets[self._next[lane]].pending:
            b = buckets[self._next[lane]]
            b.handle = comm.all_reduce(b.grad, b.group, async_op=True)
            self._next[lane] += 1

    # -- the engine protocol (engine.py) --------------------------------------------------------
    def set_sync(self, enabled: bool) -> None:
        """With sync off, backward accumulates gradients without communicating."""
        self._sync = enabled

    def end_backward(self) -> None:
        """After a backward that syncs: launch buckets not yet sent (parameters without gradients)."""
        if not self._sync:
            return
        for lane, buckets in enumerate(self.lanes):
            for b in buckets[self._next[lane]:]:
                b.pending.clear()
            self._launch_ready(lane)

    def finish(self) -> None:
        """Wait for all reductions."""
        if self._sync and any(n < len(lane) for n, lane in zip(self._next, self.lanes)):
            raise RuntimeError("buckets left unsent: call end_backward() after the step's last backward")
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
                if self.average:
                    b.grad.div_(b.group.size)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()
            b.reset()
        self._next = [0] * len(self.lanes)
        for p in self.params:
            p.grad = p.main_grad if p.dtype == self.grad_dtype else None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class DataParallelOptimizer(Engine):
    """Plain data parallelism with its optimizer: every rank holds full parameters, gradients (in
    `DataParallel`'s buckets) and optimizer state. Implements the engine protocol (engine.py).

    Norm: gradients are replicated over their reduce group. When every parameter is reduced over "dp",
    the norm needs only the model-parallel ranks (`groups["mp"]`, which hold different pieces); otherwise
    each replicated gradient is counted by rank 0 of its reduce group and the norm goes over the world."""

    def __init__(self, model: nn.Module, groups: Mapping[str, Group], make_optimizer, bucket_mb: float = 25.0,
                 master_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None,
                 only_dp: bool | None = None, decay_embeddings: bool = True):
        """`decay_embeddings`: whether the embedding and LM head decay (`engine.decays`). `only_dp`: whether
        every parameter of the whole model (not only this rank's) is reduced over dp (the layout's fact: cp = ep = 1), so that every rank all-reduces the norm over the same group even
        where its own stage holds no expert (DeepSeek-V3's dense first layers); None: from this rank's."""
        self.model = model
        self.params = unique_params(model)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.reducer = DataParallel(model, groups, bucket_mb, grad_dtype=grad_dtype or master_dtype)
        if only_dp is None:
            only_dp = set(by_group(self.params, "reduce")) <= {"dp"}
        self.norm_group = groups[rules.grad_norm_group(0, only_dp)]
        self._norm_params = [p for p in self.params if counted(p) and
                             (only_dp or self.reducer.bucket_of[p].group.rank == 0)]
        self.param_dtype = self.params[0].dtype
        self.separate_master = self.param_dtype != master_dtype
        if not self.separate_master:
            self.master = [p.data for p in self.params]
        else:
            self.master = [p.detach().to(master_dtype).clone() for p in self.params]
        self.optimizer = make_optimizer(self.master, [decays(self.names[id(p)], p.shape, decay_embeddings)
                                                      for p in self.params])

    def set_sync(self, enabled: bool) -> None:
        self.reducer.set_sync(enabled)

    def end_backward(self) -> None:
        self.reducer.end_backward()

    def finish(self) -> None:
        self.reducer.finish()

    def owned_grads(self, params: list[nn.Parameter] | None = None) -> list[torch.Tensor]:
        """Full gradients of `params` (default: all), replicated across their reduce group."""
        return [p.main_grad for p in (self.params if params is None else params)]

    def norm_grads(self) -> list[torch.Tensor]:
        return self.owned_grads(self._norm_params)

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """p's accumulated gradient on this rank, before (or without) the reduction; in place."""
        return p.main_grad

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.optimizer.step(self.owned_grads(), lr)
        if self.separate_master:
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def remove(self) -> None:
        self.reducer.remove()

    def state_bytes(self) -> dict:
        params = nbytes(self.params)
        grads = nbytes(b.grad for b in self.reducer.buckets)
        opt = self.optimizer.state_bytes() + (nbytes(self.master) if self.separate_master else 0)
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}

    def full_state(self) -> dict:
        names = [self.names[id(p)] for p in self.params]
        return {"model": {n: m.detach().clone() for n, m in zip(names, self.master)},
                "exp_avg": {n: e.clone() for n, e in zip(names, self.optimizer.exp_avg)},
                "exp_avg_sq": {n: e.clone() for n, e in zip(names, self.optimizer.exp_avg_sq)},
                "opt_t": self.optimizer.t}

    def local_state(self) -> tuple[list, int]:
        """(name, 0, {"model", "exp_avg", "exp_avg_sq": the flattened tensor}) per parameter, and Adam's
        step count (engine protocol; every data-parallel replica holds the same)."""
        out = [(self.names[id(p)], 0, {"model": m.view(-1), "exp_avg": a.view(-1), "exp_avg_sq": s.view(-1)})
               for p, m, a, s in zip(self.params, self.master, self.optimizer.exp_avg, self.optimizer.exp_avg_sq)]
        return out, self.optimizer.t

    @torch.no_grad()
    def load_local_state(self, read_into, opt_t: int) -> None:
        for p, m, a, s in zip(self.params, self.master, self.optimizer.exp_avg, self.optimizer.exp_avg_sq):
            name = self.names[id(p)]
            read_into(m.view(-1), name, 0, "model")
            p.copy_(m)
            read_into(a.view(-1), name, 0, "exp_avg")
            read_into(s.view(-1), name, 0, "exp_avg_sq")
        self.optimizer.t = opt_t

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
