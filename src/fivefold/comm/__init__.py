"""Every collective fivefold uses, recorded into a CommLedger (see ops.py, ledger.py, volume.py)."""
from .ledger import CommLedger, fmt_bytes
from .ops import (DONE, Group, Handle, all_gather, all_reduce, all_to_all, nbytes, reduce_scatter,
                  send_recv)

__all__ = ["CommLedger", "Group", "Handle", "DONE", "all_reduce", "all_gather", "reduce_scatter",
           "all_to_all", "send_recv", "nbytes", "fmt_bytes"]
