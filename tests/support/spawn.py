"""Ranks in fresh processes with a hard timeout: one function on n gloo ranks, or several jobs in one
spawn (process start-up is the slow part); and the SIGINT a shell gives a subprocess."""
from __future__ import annotations

from fivefold.train.launch import run_ranks

TIMEOUT_S = 180


def ranks(fn, n: int, *args, timeout_s: float = TIMEOUT_S):
    """Run fn(rank, n, *args) on n gloo ranks in fresh processes; kill them all after timeout_s."""
    return run_ranks(fn, n, args, timeout_s=timeout_s)


def run_jobs(rank, world, jobs):
    """Several (name, fn, args) jobs in one spawn (process start-up is the slow part): name -> result."""
    return {name: fn(rank, world, *args) for name, fn, args in jobs}


def spawn_jobs(world: int, jobs: list, timeout_s: float = 400) -> dict:
    """`run_jobs` on `world` fresh ranks: job name -> the list of every rank's result, in rank order."""
    per_rank = ranks(run_jobs, world, jobs, timeout_s=timeout_s)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def shell_signals() -> None:
    """A subprocess's preexec_fn: SIGINT as a shell gives it (default action, not blocked), whatever state
    the pytest worker that starts it is in. The Ctrl-C tests need it: in the full suite a worker was seen
    to pass SIGINT on ignored or blocked to the commands it started (not yet traced to a test), so the
    command never saw the test's Ctrl-C."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
