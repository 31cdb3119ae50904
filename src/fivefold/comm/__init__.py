"""Every collective fivefold uses, recorded into a CommLedger (see ops.py, ledger.py, volume.py).

`ops` (and so torch) is imported on first use, so `fivefold.comm.volume` and `fivefold.comm.ledger`
stay importable without torch: the planner uses them and never needs torch.distributed.
"""
from .ledger import CommLedger, fmt_bytes

_OPS = ("DONE", "Group", "Handle", "all_gather", "all_reduce", "all_to_all", "gather_objects", "nbytes",
        "reduce_scatter", "send_recv")

__all__ = ["CommLedger", "fmt_bytes", *_OPS]


def __getattr__(name):
    if name in _OPS:
        from . import ops
        return getattr(ops, name)
    raise AttributeError(f"module 'fivefold.comm' has no attribute {name!r}")
