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

These are the bandwidth-optimal volumes (ring / pairwise exchange). A real library may pick a tree
or a direct algorithm for small messages; the volumes above are what the literature (and the DESIGN
table) uses, and what the ledger and the planner both count.
"""
from __future__ import annotations

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv")
# copies of offloaded state (parallel/offload.py, comm/transfer.py): one rank's own bytes over PCIe or to disk
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


def bytes_sent(op: str, message_bytes: float, n: int, **kw) -> float:
    """Dispatch by op name (one of OPS or COPIES)."""
    try:
        fn = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
              "all_to_all": all_to_all, "send": send, "recv": recv, **{c: copy for c in COPIES}}[op]
    except KeyError:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS + COPIES)}") from None
    return fn(message_bytes, n, **kw)
