"""Bytes a collective sends, per algorithm.

One file shared by the runtime's ledger and the planner, so a predicted byte and a measured byte are
the same quantity. Every function answers: for one call on a group of `n` ranks whose message is
`message_bytes` (defined per op below), how many bytes leave ONE rank.

| op             | message_bytes S is                 | bytes sent per rank        |
|----------------|------------------------------------|----------------------------|
| all_reduce     | the tensor reduced                 | 2 (n-1)/n S  (ring: RS+AG) |
| all_gather     | the gathered (full) output         | (n-1)/n S                  |
| reduce_scatter | the full input before scattering   | (n-1)/n S                  |
| all_to_all     | the rank's whole input             | S minus the chunk it keeps |
| send           | the tensor sent                    | S                          |
| recv           | the tensor received                | 0                          |
| d2h, h2d       | the tensor copied device<->host    | S                          |
| nvme_read/write| the bytes read / written on disk   | S                          |

These are the bandwidth-optimal volumes (ring / pairwise exchange), what NCCL's ring and pairwise
all-to-all send and what the literature (and the DESIGN table) uses. A backend may run another
algorithm, and then sends other bytes to other peers: `ALGORITHMS` names the one each backend runs for
each op, `bytes_sent(op, S, n, backend=...)` counts its bytes and `peer_bytes` says which group rank
receives them (so the bytes can be placed on the links between the two: `comm/ops.py` for the ledger,
`plan/traffic.py` for the planner). Measured on the links of an emulated cluster (tools/fabric.py: two
network namespaces of two gloo ranks, a 16 MiB message, torch 2.13), the kernel's byte counters of a
node's link equal these to 0.2% (its TCP/IP headers):

| backend | op             | algorithm (source)                                        | rank i sends to   |
|---------|----------------|-----------------------------------------------------------|-------------------|
| gloo    | all_reduce     | ring: reduce-scatter then all-gather around the group     | i-1: 2(n-1)/n S   |
|         |                | (gloo/allreduce.cc `ring`, the default; torch never picks |                   |
|         |                | bcube), 1 MiB segments, nothing padded on the wire        |                   |
| gloo    | all_gather     | ring (gloo/allgather.cc `allgather`)                      | i+1: (n-1)/n S    |
| gloo    | reduce_scatter | fivefold's: the chunks exchanged pairwise (one all-to-all) | j: chunk j, S/n  |
|         |                | and summed by their owner (comm/ops.py `_sum_chunks`);    |                   |
|         |                | gloo's own all-reduces a clone of the whole input (twice   |                   |
|         |                | a ring's bytes, ProcessGroupGloo), so it is not used       |                   |
| gloo    | all_to_all     | pairwise, direct (gloo/alltoall.cc, alltoallv.cc)         | j: its chunk j    |
| nccl    | all_reduce,    | ring over the group (NCCL_ALGO=Ring; NCCL picks a tree for | i+1 (ring order) |
|         | all_gather,    | small all-reduces across nodes: the ring's bytes are what  |                  |
|         | reduce_scatter | large messages send)                                       |                  |
| nccl    | all_to_all     | pairwise send/recv                                         | j: its chunk j   |
| any     | send           | direct                                                     | the peer: S      |

The ring's neighbours are the group's ranks in order (torch's new_group sorts them). gloo's ring sends
2S - c_i - c_(i-1) with chunks c of whole 1 MiB segments: 2(n-1)/n S for messages much larger than n
MiB, a few percent off for the small ones (which are few bytes on any link). Each gloo message adds 96
bytes of headers and a 48-byte notice back (TCP/IP's headers come on top): `fivefold cluster` measures
that overhead apart. NCCL orders its ring (and its channels) by the hardware's topology search and may
run a double binary tree for an all-reduce across nodes when its cost model prefers it (NCCL_ALGO=Ring
forces the ring); fivefold counts the ring over the group's order. Sources: torch 2.13's
ProcessGroupGloo and gloo's allreduce.cc, allgather.cc, alltoall(v).cc; NCCL's device/all_reduce.h
(`runRing`), graph/tuning.cc and enqueue.cc (algorithm choice); measured on torch 2.13's CPU wheel.
"""
from __future__ import annotations

import math

BACKENDS = ("gloo", "nccl")
# op -> (the algorithm a backend runs for it, the ring's direction: group rank i sends to i + step)
ALGORITHMS = {
    "gloo": {"all_reduce": ("ring", -1), "all_gather": ("ring", 1), "reduce_scatter": ("pairwise", 0),
             "all_to_all": ("pairwise", 0), "send": ("direct", 0), "recv": ("direct", 0)},
    "nccl": {"all_reduce": ("ring", 1), "all_gather": ("ring", 1), "reduce_scatter": ("ring", 1),
             "all_to_all": ("pairwise", 0), "send": ("direct", 0), "recv": ("direct", 0)},
}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv")
# copies of offloaded state (parallel/zero/offload.py, comm/transfer.py): one rank's own bytes over PCIe or to disk
COPIES = ("d2h", "h2d", "nvme_read", "nvme_write")


def all_reduce(message_bytes: float, n: int) -> float:
    return 2.0 * (n - 1) / n * message_bytes if n > 1 else 0.0


def all_gather(message_bytes: float, n: int) -> float:
    return (n - 1) / n * message_bytes if n > 1 else 0.0


def reduce_scatter(message_bytes: float, n: int) -> float:
    return (n - 1) / n * message_bytes if n > 1 else 0.0


def all_to_all(message_bytes: float, n: int, kept_bytes: float | None = None) -> float:
    """Bytes leaving the rank; with even splits the rank keeps 1/n of its input."""
    if n <= 1:
        return 0.0
    if kept_bytes is None:
        kept_bytes = message_bytes / n
    return float(message_bytes - kept_bytes)


def send(message_bytes: float, n: int = 2) -> float:
    return float(message_bytes)


def recv(message_bytes: float, n: int = 2) -> float:
    return 0.0


def copy(message_bytes: float, n: int = 1) -> float:
    """A copy between device and host memory or between host memory and disk moves all its bytes."""
    return float(message_bytes)


def backend_of(name: str) -> str:
    """The algorithm table a process group's backend reads: gloo's for "gloo", NCCL's for anything else
    (NCCL itself, and torch's fake process group of the dry run, which stands for a GPU run)."""
    return "gloo" if name == "gloo" else "nccl"


def bytes_sent(op: str, message_bytes: float, n: int, backend: str = "nccl", **kw) -> float:
    """Dispatch by op name (one of OPS or COPIES); `backend` picks the algorithm (`ALGORITHMS`)."""
    try:
        fn = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
              "all_to_all": all_to_all, "send": send, "recv": recv, **{c: copy for c in COPIES}}[op]
    except KeyError:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS + COPIES)}") from None
    return fn(message_bytes, n, **kw)


def latency_hops(op: str, n: int, backend: str = "nccl") -> float:
    """One-way network latencies one call of `op` on n ranks waits for, one after another (the alpha term of
    Thakur et al. 2005), for the algorithm `backend` runs:

    - NCCL: all-reduce the better of a ring's 2(n-1) steps and a tree's 2·log2(n) (it picks a tree for small
      messages across nodes); all-gather, reduce-scatter and pairwise all-to-all n-1; a send 1.
    - gloo: a message moves only once its receiver has posted the buffer and said so (gloo's TCP pair:
      NOTIFY_RECV_READY, then the data), so a step whose receive is posted as it starts costs two
      latencies: a send 2, all-gather's ring 2(n-1), the pairwise all-to-all 2 (every pair at once) and so
      fivefold's reduce-scatter on gloo (comm/ops.py), the all-reduce ring 3n - 2: 2(n-1) for its
      reduce-scatter half, then n-1 for the all-gather half whose receives were posted ahead, and one more.
      Measured with `benchmarks/network.py --latency-hops` (two nodes of two ranks, 10 ms added to the path
      between them, 64-byte messages, median of 12 calls): send 2.12, all-to-all 2.10 (n=2) and 1.90 (n=4),
      all-gather 2.09 and 6.00, all-reduce 4.01 and 10.03; fivefold's pairwise reduce-scatter 2.05 and 1.98
      (gloo's own, an all-reduce, read 4.18 and 10.35).
    A recv waits on its send's hops and adds none."""
    if n <= 1 and op != "send":
        return 0.0
    if op == "recv":
        return 0.0
    if backend == "gloo":
        return {"all_reduce": 3 * n - 2, "reduce_scatter": 2, "all_gather": 2 * (n - 1),
                "all_to_all": 2, "send": 2}[op]
    if op == "all_reduce":
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    return {"all_gather": n - 1, "reduce_scatter": n - 1, "all_to_all": n - 1, "send": 1}[op]


def peer_bytes(op: str, message_bytes: float, n: int, index: int, backend: str = "nccl",
               chunks: list[float] | None = None) -> list[tuple[int, float]]:
    """(group rank, bytes) this rank (group rank `index`) sends to each peer in one call of `op` on a group
    of n: the ring's bytes all to its neighbour (gloo's all-reduce: the previous rank), an all-to-all's
    chunk j to rank j (`chunks`: the bytes of each chunk; none: n even chunks of S). A send names no peer
    here (its caller knows it): it returns [(-1, S)]. The bytes sum to `bytes_sent`."""
    if n <= 1:
        return []
    if op not in ALGORITHMS[backend]:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    algo, step = ALGORITHMS[backend][op]
    if algo == "direct":
        return [(-1, send(message_bytes) if op == "send" else 0.0)]
    if algo == "pairwise":
        if chunks is None:
            chunks = [message_bytes / n] * n
        return [(j, float(chunks[j])) for j in range(n) if j != index]
    return [((index + step) % n, bytes_sent(op, message_bytes, n, backend))]
