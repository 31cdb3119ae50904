"""Signal handling shared by the launcher and `fivefold tokenize` (no torch)."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT ignored inside (main thread only), so processes started there begin with it ignored (exec
    keeps SIG_IGN) until they install their own handlers: Ctrl-C reaches the whole process group, and
    the parent alone decides how to stop its children (which print no traceback)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.SIG_DFL)
