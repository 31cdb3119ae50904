"""Signal handling shared by the launcher and `fivefold tokenize` (no torch)."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from multiprocessing import resource_tracker

SIGINT = {signal.SIGINT}


@contextlib.contextmanager
def sigint_held():
    """SIGINT blocked inside (main thread only): a Ctrl-C that arrives meanwhile waits and is delivered
    when the block ends, instead of being lost. Processes started inside begin with it blocked too (fork
    and exec keep the signal mask), so a Ctrl-C to the whole process group cannot kill them half-started;
    each calls `release_sigint` once it has its own handlers, and the parent alone decides how to stop
    its children (which print no traceback).

    multiprocessing's resource tracker is started first: starting it ends with
    `pthread_sigmask(SIG_UNBLOCK, {SIGINT, SIGTERM})` (CPython 3.11-3.13 `resource_tracker.ensure_running`),
    not with the mask it found, so a tracker first needed inside (the first Pool, Queue or forkserver) would
    unblock SIGINT halfway and the rest of the processes would start deaf to nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGINT)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def release_sigint(ignore: bool = False) -> None:
    """In a child started inside `sigint_held`: take SIGINT again, by the handler installed now, or with
    `ignore` not at all (a Ctrl-C held meanwhile is then dropped)."""
    if ignore:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGINT)


def alive(pid: int) -> bool:
    """Whether process `pid` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
