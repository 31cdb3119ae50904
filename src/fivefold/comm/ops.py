"""Recorded collectives: every byte fivefold sends goes through these wrappers.

A `Group` is a process group with a name (the parallel dimension it serves: "dp", "tp", ...), the
global ranks in it, the `CommLedger` it records into, the network tier it crosses ("intra": one
node, "inter": several; the mesh sets it from parallel.ranks_per_node), the tier between this rank and
each member (`peer_tiers`) and the backend whose algorithms run on it. Each wrapper issues the
torch.distributed collective, then records calls, message bytes and seconds under (dim, op) on the
group's tier, where dim defaults to the group's name, and the bytes sent (`comm/volume.py`, by the
backend's algorithm) on the tier of the link each byte takes: a ring's to the next rank, an
all-to-all's chunk to each peer, a send to its peer (`volume.peer_bytes`). A ring over 4 ranks on 2
nodes puts two ranks' bytes on "inter" and two on "intra", as the links carry them. Asynchronous calls
return a `Handle` whose `wait()` adds the seconds spent waiting. A group of one rank sends nothing and
records nothing.

Every blocking wait (a Handle's `wait`, `gather_objects`) is marked while it lasts (comm/waits.py), so
the launcher's hang watchdog names a rank that stalled, not one waiting for it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import volume
from .ledger import CommLedger
from .waits import waiting


@dataclass
class Group:
    name: str
    ranks: list[int]
    rank: int                      # this process's index inside the group
    pg: object = None              # torch ProcessGroup (None when size == 1)
    ledger: CommLedger = field(default_factory=CommLedger)
    tier: str = "intra"            # the network tier its ranks span: "intra" (one node) | "inter"
    peer_tiers: tuple = ()         # the tier between this rank and each member (empty: all on `tier`, one node)
    backend: str = "gloo"          # whose algorithms run on it (comm/volume.py ALGORITHMS): "gloo" | "nccl"

    def peer_tier(self, group_rank: int) -> str:
        return self.peer_tiers[group_rank] if self.peer_tiers else self.tier

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    @staticmethod
    def single(name: str = "world", ledger: CommLedger | None = None) -> "Group":
        return Group(name, [0], 0, None, ledger or CommLedger())


class Handle:
    """An in-flight collective; `wait()` blocks and records the waiting time."""

    def __init__(self, work, ledger: CommLedger, dim: str, op: str, then=None, tier: str | None = None):
        self.work, self.ledger, self.dim, self.op, self.then, self.tier = work, ledger, dim, op, then, tier

    def wait(self) -> None:
        if self.work is None:
            return
        t0 = time.perf_counter()
        with waiting():
            self.work.wait()
        self.ledger.add_seconds(self.dim, self.op, time.perf_counter() - t0, self.tier)
        self.work = None
        if self.then is not None:
            self.then()

    def done(self) -> bool:
        """Whether the operation has finished (never blocks; `wait` then returns at once)."""
        return self.work is None or finished(self.work)


DONE = Handle(None, CommLedger(), "", "")


def finished(work) -> bool:
    """A work's `is_completed`; torch's fake process group (the dry run's) finishes every operation when
    it is issued but answers False, so its works count as finished."""
    return type(work).__name__ == "FakeWork" or work.is_completed()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(group: Group, dim: str, op: str, message_bytes: int, seconds: float, peer: int = -1, **kw) -> None:
    """One call: calls, message and seconds on the group's tier; its bytes on the tier of each peer they go to
    (a group on one tier: all on it)."""
    sent = volume.peer_bytes(op, message_bytes, group.size, group.rank, group.backend, **kw)
    if not group.peer_tiers:
        group.ledger.record(dim, op, message_bytes, sum(b for _, b in sent), seconds, tier=group.tier)
        return
    by_tier: dict[str, float] = {}
    for p, b in sent:
        t = group.peer_tier(peer if p < 0 else p)
        by_tier[t] = by_tier.get(t, 0.0) + b
    group.ledger.record_split(dim, op, message_bytes, by_tier, seconds,
                              group.peer_tier(peer) if peer >= 0 else group.tier)


def _issue(group: Group, dim: str | None, op: str, message_bytes: int, fn, async_op: bool, then=None, **kw):
    dim = dim or group.name
    t0 = time.perf_counter()
    work = fn()
    seconds = time.perf_counter() - t0
    _record(group, dim, op, message_bytes, seconds, **kw)
    handle = Handle(work, group.ledger, dim, op, then, group.tier)
    if not async_op:
        handle.wait()
    return handle


# torch 2.13 renamed the tensor collectives (the old names warn); older releases have only the old ones
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, group: Group, reduce_op: str = "sum", async_op: bool = False,
               dim: str | None = None) -> Handle:
    """In-place all-reduce of t over group (reduce_op: sum | max | min | avg; the ledger's op is
    "all_reduce" whichever)."""
    if group.size == 1:
        return DONE
    avg = reduce_op == "avg"
    then = (lambda: t.div_(group.size)) if avg else None
    red = _REDUCE["sum" if avg else reduce_op]
    return _issue(group, dim, "all_reduce", nbytes(t),
                  lambda: dist.all_reduce(t, red, group=group.pg, async_op=True), async_op, then)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False,
               dim: str | None = None) -> Handle:
    """Gather equal shards `inp` from every rank into `out` (concatenated along dim 0)."""
    if group.size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp.view_as(out))
        return DONE
    return _issue(group, dim, "all_gather", nbytes(out),
                  lambda: _all_gather_tensor(out, inp, group=group.pg, async_op=True), async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False,
                   dim: str | None = None, own: torch.Tensor | None = None) -> Handle:
    """Sum `inp` over the group and leave this rank's 1/n chunk (along dim 0) in `out`. On gloo a pairwise
    exchange of the chunks, then their sum (`_sum_chunks`); elsewhere the backend's reduce-scatter.

    `own` (gloo's pairwise exchange only, `takes_own_later`): this rank's own chunk, which may still be
    computed after the launch, as long as it is final when the handle is waited for; `inp`'s own chunk is
    then never read (the exchange keeps each rank's own chunk at home), so the caller need not fill it."""
    if group.size == 1:
        src = inp if own is None else own
        if out.data_ptr() != src.data_ptr():
            out.copy_(src.view_as(out))
        return DONE
    if takes_own_later(group):
        received = torch.empty(inp.shape, dtype=inp.dtype, device=inp.device)
        return _issue(group, dim, "reduce_scatter", nbytes(inp),
                      lambda: dist.all_to_all_single(received, inp.contiguous(), group=group.pg, async_op=True),
                      async_op, lambda: _sum_chunks(out, received, group.size, own, group.rank))
    if own is not None:
        raise ValueError(f"reduce_scatter on {group.backend}: the own chunk must be in the input at launch")
    return _issue(group, dim, "reduce_scatter", nbytes(inp),
                  lambda: _reduce_scatter_tensor(out, inp, group=group.pg, async_op=True), async_op)


def takes_own_later(group: Group) -> bool:
    """Whether `reduce_scatter` on this group takes this rank's own chunk after the launch (`own`): where it
    runs as gloo's pairwise exchange, which never sends a rank's own chunk."""
    return group.size > 1 and volume.ALGORITHMS[group.backend]["reduce_scatter"][0] == "pairwise"


def _sum_chunks(out: torch.Tensor, received: torch.Tensor, n: int, own: torch.Tensor | None = None,
                rank: int = 0) -> None:
    """gloo's reduce-scatter, second half: `received` holds chunk r (this rank's) of every rank's input, in
    rank order; their sum is this rank's chunk of the total.

    gloo's own reduce-scatter (ProcessGroupGloo, torch 2.13) all-reduces a clone of the whole input and
    copies its chunk out: 2(n-1)/n·S bytes a rank and 3n-2 message latencies. Exchanging the chunks pairwise
    (one all-to-all) and summing them here sends (n-1)/n·S, a ring's bytes, in one round: measured on 2
    gloo ranks, 2.0-3.2x faster from 256 KiB to 16 MiB (2.1-2.2x on 4 ranks). The receive buffer is S, as
    gloo's clone is. With 2 ranks the sum is gloo's bit for bit (one addition, commutative); with more it
    is summed in rank order, in the dtype's accumulator (one rounding for bf16). `own`: this rank's chunk,
    put in its place first (what the exchange copied there is not read), so the sum is the same."""
    chunks = received.view(n, -1)
    if own is not None:
        chunks[rank].copy_(own.reshape(-1))
    if out.is_contiguous():
        torch.sum(chunks, dim=0, out=out.view(-1))
    else:
        out.copy_(chunks.sum(dim=0).view(out.shape))


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None, async_op: bool = False, dim: str | None = None) -> Handle:
    """Exchange chunks of dim 0: chunk i of `inp` goes to rank i; `out` holds what each rank sent us."""
    if group.size == 1:
        out.copy_(inp)
        return DONE
    row = nbytes(inp) // max(inp.shape[0], 1)
    chunks = [s * row for s in in_splits] if in_splits is not None else [nbytes(inp) // group.size] * group.size
    return _issue(group, dim, "all_to_all", nbytes(inp),
                  lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group.pg, async_op=True),
                  async_op, chunks=chunks)


class _Joined:
    """Several works waited for as one (idempotent)."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self):
        for w in self.works:
            w.wait()
        self.works = []

    def is_completed(self) -> bool:
        return all(finished(w) for w in self.works)


def send_recv(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Group,
              async_op: bool = False, dim: str | None = None) -> Handle:
    """Batched point-to-point: send each (tensor, peer) and receive into each (tensor, peer).

    Peers are ranks inside the group. Sends and receives are issued together with batch_isend_irecv,
    so two ranks exchanging in both directions cannot deadlock. The returned Handle waits for the whole
    batch; `handle.parts` holds one Handle per op (the sends, then the receives, in the order given), so
    a caller can wait for one receive just before it needs the tensor (the pipeline runtime does).
    """
    if not sends and not recvs:
        return DONE
    dim = dim or group.name
    ops = [dist.P2POp(dist.isend, t, group.global_rank(p), group=group.pg) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, group.global_rank(p), group=group.pg) for t, p in recvs]
    t0 = time.perf_counter()
    works = dist.batch_isend_irecv(ops)
    seconds = time.perf_counter() - t0
    for t, p in sends:
        _record(group, dim, "send", nbytes(t), seconds / len(ops), peer=p)
    for t, p in recvs:
        _record(group, dim, "recv", nbytes(t), seconds / len(ops), peer=p)

    if len(works) != len(ops):  # a backend that coalesces the batch into one work (NCCL): wait for all
        works = [_Joined(works)] * len(ops)
    peers = [p for _, p in sends] + [p for _, p in recvs]
    parts = [Handle(w, group.ledger, dim, "send" if i < len(sends) else "recv", tier=group.peer_tier(peers[i]))
             for i, w in enumerate(works)]

    class _All:
        def wait(self):
            for part in parts:
                part.wait()
    handle = Handle(_All(), CommLedger(), dim, "send")  # the parts record the waiting time
    handle.parts = parts
    if not async_op:
        handle.wait()
    return handle


def gather_objects(obj) -> list:
    """Every rank's obj (a bookkeeping exchange outside the ledger, like CommLedger.gather)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    with waiting():
        dist.all_gather_object(out, obj)
    return out
