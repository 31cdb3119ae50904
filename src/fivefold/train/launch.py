"""Start ranks: N local gloo processes, or one rank of a `torchrun` job.

`run_ranks(fn, nproc, args, timeout_s)` starts fresh processes (one intra-op thread each), joins them
into a gloo process group and runs `fn(rank, world_size, *args)` in each; it returns every rank's
result, in rank order. No process outlives the call. The CLI's `--nproc` and the tests use it.

Loopback only. The ranks meet through a FileStore in a temporary folder that `run_ranks` creates and
removes (no TCPStore, whose server listens on every interface), and gloo binds and connects on the
loopback interface. torch 2.13 gives no API for gloo's device through `init_process_group` (its
`pg_options` are ignored for gloo), so each rank sets GLOO_SOCKET_IFNAME to the loopback interface
("lo", or "lo0") in its own environment before it joins; a local run opens no socket outside 127.0.0.1/::1.

The launcher imports no torch. `run_ranks` and what it calls on the launcher's side (the fork server, the
pipes, the clocks, the stops) need only the standard library, a rank's plain result comes back as a
pickle of built-in data (`_dumps`), and `fn` may be named as "module:function" (`entry_point`); the
functions a rank runs import torch where they run, free in a rank (the fork server preloaded it). So
`fivefold train` checks a run and starts its ranks without the two CPU-seconds of importing torch, which
only the ranks pay (tests/ranks/test_launch.py holds a launch to it).

Where ranks come from. A fork server (`rank_context`): a fresh interpreter the launcher starts once, which
imports torch and the trainer and then forks each rank, so a rank starts in a tenth of a second instead
of importing torch again (two CPU-seconds each). The server is not a fork of the launcher: ranks inherit
no thread or state from the caller, only the server's clean import.

Ranks die with their launcher. Each rank first asks the kernel for SIGKILL when its parent (the fork
server) dies (Linux: prctl PR_SET_PDEATHSIG; elsewhere a thread that checks the parent pid every second)
and a daemon thread waits on a pidfd of the launcher and ends the rank when the launcher ends; a rank
quits at once if either is already gone. A `kill -9` of the launcher leaves no rank behind (and the server
exits once no rank holds its pipe). Torchrun ranks call `die_with_parent()` (their parent is torchrun's
agent).

Nothing left behind. The CLI ends the fork server when its command returns (`stop_rank_server`). Ranks talk
to the launcher over one pipe each, so no named semaphore exists in /dev/shm; the launcher's temporary
folders (its FileStore's `fivefold-ranks-*`, the fork server's `pymp-*`) carry an owner file (pid and start
time), and a launcher killed with `kill -9` leaves only those, which the next `run_ranks` on the machine
removes once their owner is gone (`remove_orphans`): never a folder without our owner file.

Stopping. `install_stop_handlers()` makes SIGTERM and SIGINT record their name instead of ending the
process; `stop_requested()` returns it (or None). Every local rank installs them before `fn` runs and
the CLI installs them in torchrun ranks; the training loop polls `stop_requested()` between steps, saves
and returns. In the launcher, `run_ranks` (called from the main thread) catches SIGTERM and SIGINT for
its duration: the first one is forwarded to every rank as SIGTERM and the run goes on, so the ranks stop
cleanly and their results are returned as usual (`last_stop_signal()` names the signal); a second one
kills every rank at once and raises `Stopped`. Ranks start with SIGINT blocked (train/signals.py
`sigint_held`), so a Ctrl-C while they start cannot kill them half-started: it waits until their stop
handlers are in, then asks them to stop like any other (and one that reaches the launcher while it starts
ranks waits too, rather than being lost); a rank that has not joined the group yet gets the SIGTERM when it
has. Since ranks only note SIGTERM, the launcher ends them with SIGKILL whenever it has to.

Hang watchdog. `timeout_s` is a limit on silence, not on the run: a rank calls `heartbeat(steps_done)` (the
training loop does, once per step, with the steps finished: metrics.jsonl's step; outside `run_ranks` it does nothing) and the launcher restarts that
rank's clock at each heartbeat and at its result. A rank's clock starts once it has joined the group;
starting up and joining may take max(timeout_s, 60 s), which is also gloo's own timeout. When a rank
that has not finished stays silent for timeout_s, every rank is killed and `TimeoutError` says which
rank and the last step it reported. So a function that never calls `heartbeat` is still killed timeout_s
after its ranks joined. The rank named is one that stalled, not one waiting for it: every rank marks in
shared memory while it is blocked in a collective (comm/waits.py), and of the silent ranks
one that is not blocked is blamed (`stalled_rank`), the blocked ones listed after it.

Failures. A rank that raises makes the call raise `RankError` with that rank's traceback, after every
other rank has been killed. When a rank dies without a result (killed by a signal, e.g. by the OOM
killer, or an exit code), the launcher names it on the first line ("rank 1 was killed by SIGKILL"), with
the traceback of a rank that failed because of it (gloo's "connection closed") below: on any failure it
waits up to a second for the ranks' exit codes and errors before it decides who to blame.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import io
import multiprocessing as mp
import os
import pickle
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING
from multiprocessing import connection, forkserver
from multiprocessing import util as mp_util

from ..config import ConfigError
from .signals import alive, release_sigint, sigint_held
from .torchrun_env import torchrun_env, torchrun_ranks_per_node  # noqa: F401 - part of launch's interface

if TYPE_CHECKING:
    import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STARTUP_S = 60.0     # a rank may take max(timeout_s, this) to start and join the group
_store = None        # a torchrun rank's job store (init_torchrun)
_watchdog = None     # a torchrun rank's hang watchdog (start_watchdog)
GRACE_S = 1.0        # on a failure, how long to wait for the other ranks' exit codes and errors
POLL_S = 0.2         # the launcher's longest wait for a message before it checks exits and clocks
JOIN_S = 30.0        # how long finished ranks get to exit before they are killed
PR_SET_PDEATHSIG = 1


class RankError(RuntimeError):
    """A rank raised or died; the message's first line names it, then a traceback."""


class Stopped(RankError):
    """A second SIGTERM/SIGINT reached `run_ranks`: every rank was killed without saving."""


# ---- stop requests (any process) -------------------------------------------------------------------

_stop_signal: str | None = None     # the first stop signal this process received
_last_stop: str | None = None       # the stop signal the last run_ranks call forwarded to its ranks


def _record_stop(signum, frame) -> None:
    global _stop_signal
    if _stop_signal is None:
        _stop_signal = signal.Signals(signum).name


def install_stop_handlers() -> None:
    """From now on SIGTERM and SIGINT in this process only record their name for `stop_requested()`."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record_stop)


def stop_requested() -> str | None:
    """The name of the first stop signal received ("SIGTERM", "SIGINT"), or None."""
    return _stop_signal


def last_stop_signal() -> str | None:
    """The signal the last `run_ranks` call in this process received and forwarded to its ranks, or None."""
    return _last_stop


# ---- progress (inside a run_ranks rank) ------------------------------------------------------------

_progress = None    # (rank, its pipe to the launcher) while a run_ranks rank runs fn; None elsewhere
_send_lock = threading.Lock()   # one message at a time on a rank's pipe


def heartbeat(steps_done: int | None = None) -> None:
    """Tell the launcher this rank is making progress (`steps_done` steps finished, 1-based as
    metrics.jsonl and checkpoints count them; None before the first), or a torchrun rank's watchdog
    (`start_watchdog`); a no-op otherwise. Both name that number when a rank goes silent."""
    if _watchdog is not None:
        _watchdog.beat(steps_done)
    if _progress is not None:
        rank, channel = _progress
        _send(channel, (rank, "progress", steps_done))


# ---- rank side --------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_thread() -> None:
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set in this process


def _startup_s(timeout_s: float) -> float:
    return max(timeout_s, STARTUP_S)


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def init_gloo(rank: int, world_size: int, store_path: str, timeout_s: float = 300) -> None:
    """Join the local gloo group: rendezvous through the FileStore at store_path, traffic over loopback."""
    import torch.distributed as dist

    lo = _loopback_interface()
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo   # read by gloo when it creates its device, in this rank only
    timeout = timedelta(seconds=_startup_s(timeout_s))
    store = dist.FileStore(store_path, world_size)
    store.set_timeout(timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def _kill_me_with_parent() -> bool:
    """Linux: SIGKILL this process when the thread that started it ends. False when unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        zero = ctypes.c_ulong(0)
        return libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), zero, zero, zero) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    """Elsewhere: a daemon thread that ends this process once its parent is gone (checked every second)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="fivefold-parent-watch", daemon=True).start()


def die_with_parent(parent_pid: int | None = None) -> None:
    """End this process when its parent ends (the launcher, or torchrun's agent for a torchrun rank)."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    if not _kill_me_with_parent():
        _watch_parent(parent_pid)
    if os.getppid() != parent_pid:   # the parent died before we asked: nobody will collect a result
        os._exit(1)


def die_with_launcher(launcher_pid: int) -> None:
    """A local rank's parent is the fork server (rank_context), which lives as long as any rank does, so a
    rank also ends itself when the launcher ends: a daemon thread waits on a pidfd of the launcher (Linux;
    elsewhere it checks the pid every second) and exits the process when it is gone."""
    die_with_parent()
    try:
        fd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:   # gone before we asked: nobody will collect a result
        os._exit(1)
    except (AttributeError, OSError):
        fd = None

    def watch():
        if fd is not None:
            select.select([fd], [], [])
        else:
            while alive(launcher_pid):
                time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="fivefold-launcher-watch", daemon=True).start()




class _PlainUnpickler(pickle.Unpickler):
    """Built-in data only (dicts, lists, strings, numbers, None): any class or function is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def _plain(data: bytes):
    return _PlainUnpickler(io.BytesIO(data)).load()


def _dumps(obj) -> bytes:
    """A rank's result for the launcher: b"P" + a pickle when it is plain data (what `fivefold train`
    returns), so the launcher reads it without torch; else b"T" + torch.save (tensors, for the tests)."""
    data = pickle.dumps(obj)
    try:
        _plain(data)
        return b"P" + data
    except (pickle.UnpicklingError, AttributeError, TypeError):
        import torch

        buf = io.BytesIO()
        torch.save(obj, buf)
        return b"T" + buf.getvalue()


def _loads(data: bytes):
    """`_dumps`'s bytes back; neither way runs code from them (plain data, or torch's weights_only)."""
    if data[:1] == b"P":
        return _plain(data[1:])
    import torch

    return torch.load(io.BytesIO(data[1:]), weights_only=True)


def entry_point(fn):
    """`run_ranks`' function: a callable, or "package.module:function", imported in the rank (the fork
    server has it loaded: PRELOAD), so a launcher need not import the trainer, nor torch, to name it."""
    if not isinstance(fn, str):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def _send(channel, msg) -> None:
    with _send_lock:
        channel.send(msg)


def _worker(rank, world_size, store_path, fn, args, channel, timeout_s, launcher_pid, waits=None):
    """One rank: messages to the parent are (rank, kind, payload), kind in started|progress|ok|error, sent
    on the rank's own pipe (`channel`; a pipe, not a Queue, so no named semaphore exists to outlive a
    `kill -9`). `waits[rank]` is 1 while the rank is blocked in a collective (comm.waits.watch_waits)."""
    import torch.distributed as dist

    global _progress
    die_with_launcher(launcher_pid)
    install_stop_handlers()
    release_sigint()   # a Ctrl-C held while the rank started is a stop request now
    one_thread()
    if waits is not None:
        from ..comm.waits import watch_waits

        watch_waits(waits, rank)
    try:
        if world_size > 1:
            init_gloo(rank, world_size, store_path, timeout_s)
        _progress = (rank, channel)
        _send(channel, (rank, "started", None))
        out = entry_point(fn)(rank, world_size, *args)
        _send(channel, (rank, "ok", _dumps(out)))
    except BaseException as e:  # noqa: BLE001 - any failure is reported with its traceback
        _send(channel, (rank, "error", _describe(e)))
    finally:
        _progress = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _describe(e: BaseException) -> str:
    """A failure for the user: one line for the errors that explain themselves (a config rule, a
    non-finite loss: exceptions with `brief = True`), the traceback for anything else."""
    if isinstance(e, ConfigError) or getattr(e, "brief", False):
        return f"{type(e).__name__}: {e}"
    return traceback.format_exc()


# ---- launcher side ----------------------------------------------------------------------------------

def stalled_rank(late: list[int], blocked: list[int], running: list[int], heard: list[float],
                 held: dict[int, str] | None = None) -> int:
    """The rank a hang is blamed on: a rank whose process the system holds (`held`: stopped or frozen) first,
    since it may have been held inside a collective and so look like one that waits; else a silent rank
    blocked in a collective waits for a rank that is not, so of the running ranks not blocked, the one
    heard from least recently (silent or soon to be); when every running rank is blocked, the silent one
    heard from least recently."""
    held_running = [r for r in running if r in (held or {})]
    free = [r for r in running if r not in blocked]
    return min(held_running or free or late, key=lambda r: heard[r])


def held_state(pid: int) -> str | None:
    """Why the system holds process `pid`, or None: "stopped (SIGSTOP or a debugger)" from its state in
    /proc/PID/stat, "frozen (cgroup freezer)" when its cgroup is frozen (v1 freezer.state FROZEN, v2
    cgroup.freeze 1). A held process neither runs nor waits on the network, so a hang is its doing."""
    try:
        state = _proc_stat(pid)[0]
        with open(f"/proc/{pid}/cgroup") as f:
            cgroups = [line.rstrip("\n").split(":", 2) for line in f]
    except (OSError, IndexError):
        return None
    if state in ("T", "t"):
        return "stopped (SIGSTOP or a debugger)"
    for _, controllers, path in (c for c in cgroups if len(c) == 3):
        if controllers == "freezer":
            check = (f"/sys/fs/cgroup/freezer{path}/freezer.state", "FROZEN")
        elif controllers == "":
            check = (f"/sys/fs/cgroup{path}/cgroup.freeze", "1")
        else:
            continue
        try:
            with open(check[0]) as f:
                if f.read().strip() == check[1]:
                    return "frozen (cgroup freezer)"
        except OSError:
            continue
    return None


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} without a result"


def _silence_message(limit: float, rank: int, started: bool, reported: bool, steps_done) -> str:
    if not started:
        what = "did not start"
    elif not reported:
        what = "never reported"
    elif steps_done is None:
        what = "last reported progress (no step number)"
    else:
        what = f"last reported step {steps_done}"
    return f"no progress for {limit:g} s: rank {rank} {what}"


class _Ranks:
    """The launcher's view of the running ranks: their messages, clocks, exits and the stop state."""

    def __init__(self, procs, readers, timeout_s: float, waits=None):
        self.procs, self.timeout_s = procs, timeout_s
        self.readers = list(readers)        # each rank's pipe; None once it reached its end
        self.waits = waits or [0] * len(procs)   # 1: the rank is blocked in a collective
        now = time.monotonic()
        self.heard = [now] * len(procs)    # when each rank was last heard from (its spawn at first)
        self.started = [False] * len(procs)
        self.steps: dict[int, object] = {}  # rank -> last heartbeat's steps done
        self.out: dict[int, object] = {}
        self.errors: list[tuple[int, str]] = []
        self.signal: str | None = None      # the first stop signal: forwarded
        self.killed: str | None = None      # the second: every rank killed

    # messages
    def _take(self, msg) -> None:
        rank, kind, payload = msg
        self.heard[rank] = time.monotonic()
        if kind == "started":
            self.started[rank] = True
            if self.signal is not None:
                self._terminate(rank)
        elif kind == "progress":
            self.steps[rank] = payload
        elif kind == "ok":
            self.out[rank] = _loads(payload)
        else:
            self.errors.append((rank, payload))

    def _read(self, wait: float) -> bool:
        """Take the messages that arrive within `wait`, then all pending; True once no pipe had more."""
        until = time.monotonic() + 1.0   # a flood of heartbeats cannot keep us here
        timeout = wait
        while time.monotonic() < until:
            pipes = [c for c in self.readers if c is not None]
            ready = connection.wait(pipes, timeout) if pipes else []
            if not ready:
                if not pipes and timeout > 0:
                    time.sleep(timeout)
                return True
            for c in ready:
                try:
                    msg = c.recv()
                except (EOFError, OSError):   # the rank's end is closed: it exited
                    self.readers[self.readers.index(c)] = None
                    c.close()
                    continue
                self._take(msg)
            timeout = 0
        return False

    # processes
    def _final(self, rank: int) -> bool:
        return rank in self.out or any(r == rank for r, _ in self.errors)

    def _unfinished(self) -> list[int]:
        return [r for r in range(len(self.procs)) if not self._final(r)]

    def _dead(self) -> list[int]:
        """Ranks that exited without a message. Exits are read before the pipes are drained: a rank's
        last message is in its pipe before its process ends, so it cannot be missed."""
        exited = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
        if not self._read(0):
            return []
        return [r for r in exited if not self._final(r)]

    def _terminate(self, rank: int) -> None:
        p = self.procs[rank]
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    # signals
    def on_signal(self, signum, frame) -> None:
        global _last_stop
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = _last_stop = name
            print(f"fivefold: {name}: asking the ranks to stop (send it again to kill them)", file=sys.stderr)
            for r in range(len(self.procs)):
                if self.started[r] and not self._final(r):
                    self._terminate(r)
        else:
            self.killed = name
            self.kill_all()

    # the run
    def collect(self) -> list:
        while len(self.out) < len(self.procs):
            self._check_stopped()
            if self._dead() or self.errors:
                raise self._failure()
            self._check_silence()
            self._read(min(POLL_S, self._next_deadline()))
        return [self.out[r] for r in range(len(self.procs))]

    def _check_stopped(self) -> None:
        if self.killed:
            self.kill_all()
            raise Stopped(f"second {self.killed} after {self.signal}: every rank was killed")

    def _limit(self, rank: int) -> float:
        return self.timeout_s if self.started[rank] else _startup_s(self.timeout_s)

    def _next_deadline(self) -> float:
        now = time.monotonic()
        return max(0.0, min((self.heard[r] + self._limit(r) - now for r in self._unfinished()), default=POLL_S))

    def _check_silence(self) -> None:
        now = time.monotonic()
        late = [r for r in self._unfinished() if now - self.heard[r] > self._limit(r)]
        if late:
            blocked = [r for r in self._unfinished() if self.waits[r]]
            held = {r: why for r in self._unfinished() if (why := held_state(self.procs[r].pid))}
            self.kill_all()
            r = stalled_rank(late, blocked, self._unfinished(), self.heard, held)
            blocked = [b for b in blocked if b != r]
            msg = _silence_message(self._limit(r), r, self.started[r], r in self.steps, self.steps.get(r))
            if r in held:
                msg += f" and is {held[r]}"
            if blocked and r not in blocked:
                msg += f"; rank(s) {blocked} wait for it in a collective"
            raise TimeoutError(msg + (f" (finished: {sorted(self.out)})" if self.out else ""))

    def _failure(self) -> RankError:
        """A rank failed or died: wait up to GRACE_S for the rest (a dead rank behind an error, an error
        behind a death), kill every rank and describe it, the dead first."""
        until = time.monotonic() + GRACE_S
        while True:
            dead = self._dead()
            alive = [r for r in self._unfinished() if self.procs[r].exitcode is None]
            if (dead and self.errors) or not alive or time.monotonic() >= until or self.killed:
                break
            time.sleep(0.05)
        self.kill_all()
        self._check_stopped()
        lines = ["; ".join(f"rank {r} {_exit_reason(self.procs[r].exitcode)}" for r in dead)] if dead else []
        if self.errors:
            rank, tb = self.errors[0]
            brief = "\n" not in tb.strip()   # a one-line error (launch._describe) stays on one line
            lines.append(f"rank {rank} failed: {tb.strip()}" if brief else f"rank {rank} failed:\n{tb}")
        return RankError("\n".join(lines))

    def join(self) -> None:
        until = time.monotonic() + JOIN_S
        for p in self.procs:
            p.join(timeout=max(0.0, until - time.monotonic()))


@contextlib.contextmanager
def _catching_stops(handler):
    """Route SIGTERM/SIGINT to handler while inside (main thread only; an ignored signal stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        for sig, h in old.items():
            if h is not signal.SIG_IGN:
                signal.signal(sig, handler)
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)




PRELOAD = ("torch", "fivefold.train.trainer")   # what the fork server imports once, for every rank
RANKS_PREFIX = "fivefold-ranks-"                  # a run_ranks call's folder in $TMPDIR (its FileStore)
UNIX_PATH_BYTES = 107                             # a unix socket's path (sun_path less its NUL)
SOCKET_NAME_BYTES = len("/listener-") + 8         # multiprocessing's name for it inside its temporary folder
OWNER_FILE = "fivefold-owner"                     # in each temporary folder a launcher made: "pid start-time"


def rank_context():
    """Where ranks come from: a fork server, a fresh interpreter started once per launcher (not a fork of
    the launcher: no inherited threads or state) that imports torch and the trainer once (`PRELOAD`, about
    two CPU-seconds) and forks each rank from that clean state, instead of each rank importing them again.
    Each rank dies with the server and with the launcher (`die_with_launcher`); the server ends once the
    launcher and every rank have."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    folder = mp_util.get_temp_dir()   # where the server's socket will live (multiprocessing's pymp-*)
    mark_owned(folder)
    if len(os.fsencode(folder)) + SOCKET_NAME_BYTES > UNIX_PATH_BYTES:
        raise ConfigError(f"the temporary folder {folder} is too long a path for the ranks' fork server socket "
                          f"(at most {UNIX_PATH_BYTES - SOCKET_NAME_BYTES} bytes): set TMPDIR to a shorter folder")
    return ctx


def stop_rank_server() -> None:
    """End the fork server now, when the command that started it returns (rather than when every holder of
    its pipe has gone, up to seconds after the command). Waits for it to exit; a no-op when none runs.
    multiprocessing has no public call for it: `ForkServer._stop` (CPython 3.8 to 3.14) is what its own
    tests use, so it is looked up and skipped where missing."""
    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None and hasattr(server, "_stop"):
        server._stop()


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22), or None when there is no
    such process; "" where /proc is missing. With the pid it names one process, even after pid reuse."""
    try:
        return _proc_stat(pid)[19]
    except FileNotFoundError:
        return None if os.path.isdir("/proc") else ("" if alive(pid) else None)
    except (OSError, IndexError):
        return ""


def _proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first); OSError when unreadable."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def mark_owned(folder: str) -> None:
    """Write OWNER_FILE into a temporary folder this process made, so a later launcher can tell it is ours
    and whether its owner is gone (`remove_orphans`)."""
    path = os.path.join(folder, OWNER_FILE)
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")


def _orphaned(folder: str) -> bool:
    """Whether `folder` holds our OWNER_FILE (a plain file of this user) naming a process that is gone."""
    path = os.path.join(folder, OWNER_FILE)
    try:
        st = os.lstat(path)
        if not os.path.isfile(path) or os.path.islink(path) or st.st_uid != os.getuid():
            return False
        with open(path) as f:
            pid, start = f.read().split()
        now = _start_time(int(pid))
    except (OSError, ValueError):
        return False
    return now is None or (now != "" and start not in ("", "None") and now != start)


def remove_orphans(tmp: str | None = None) -> list[str]:
    """Remove what launchers killed with `kill -9` left in $TMPDIR: each `fivefold-ranks-*` folder (a run's
    store) and each multiprocessing `pymp-*` folder (the fork server's socket) that holds our OWNER_FILE
    naming a process that no longer runs. Nothing else is touched: no folder without our marker, no link.
    Returns what was removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith((RANKS_PREFIX, "pymp-")) or not e.is_dir(follow_symlinks=False):
            continue
        if _orphaned(e.path):
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(e.path)
    return removed


def run_ranks(fn, nproc: int, args: tuple = (), timeout_s: float = 300) -> list:
    """Run fn(rank, nproc, *args) on nproc fresh gloo ranks; return the results in rank order. timeout_s:
    the longest a rank may go without a heartbeat or result (module docstring)."""
    global _last_stop
    _last_stop = None
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the children before torch loads
    ctx = rank_context()
    remove_orphans()
    with tempfile.TemporaryDirectory(prefix=RANKS_PREFIX) as tmp:
        mark_owned(tmp)
        store_path = os.path.join(tmp, "store")
        waits = ctx.Array("b", nproc, lock=False)   # shared: which ranks are blocked in a collective
        pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]   # (launcher's end, rank's end)
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, nproc, store_path, fn, args, pipes[r][1], timeout_s, os.getpid(), waits))
                 for r in range(nproc)]
        ranks = _Ranks(procs, [reader for reader, _ in pipes], timeout_s, waits)
        with _catching_stops(ranks.on_signal):
            try:
                with sigint_held():
                    for p, (_, writer) in zip(procs, pipes):
                        p.start()
                        writer.close()   # the rank holds its end now: its exit closes the pipe
                out = ranks.collect()
                ranks.join()
                return out
            finally:
                ranks.kill_all()
                for p in procs:
                    if p.pid is not None:
                        p.join(timeout=10)
                for reader, writer in pipes:
                    reader.close()
                    writer.close()


def init_torchrun(timeout_s: float = 1800, device: str = "auto") -> tuple[int, int]:
    """Join a torchrun job: NCCL when the run's device (train.device: auto | cpu | cuda) is CUDA, else gloo.
    On CUDA each rank takes the GPU of its local rank (torchrun's LOCAL_RANK)."""
    import torch
    import torch.distributed as dist

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"   # the trainer resolves train.device from this backend
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    global _store
    _store = torchrun_store(rank, world, timeout)
    dist.init_process_group(backend, store=_store, rank=rank, world_size=world, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def start_watchdog(timeout_s: float) -> None:
    """A torchrun rank's hang watchdog (train/watchdog.py): every node's address from the job's store, then a
    thread that ends this rank with one line after `timeout_s` without a heartbeat."""
    import torch.distributed as dist

    from ..comm.waits import blocked
    from .watchdog import Watchdog, publish_nodes

    global _watchdog
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    rank, world = dist.get_rank(), dist.get_world_size()
    node, nodes = rank // local, max(1, world // local)
    addresses = publish_nodes(_store, node, nodes, int(os.environ.get("LOCAL_RANK", "0")), os.environ["MASTER_ADDR"])
    _watchdog = Watchdog(timeout_s, rank, node, addresses, blocked).start()


def torchrun_store(rank: int, world: int, timeout: timedelta):
    """The job's store, with this attempt's keys apart from earlier attempts'.
    - Under torchrun's shared store (TORCHELASTIC_USE_AGENT_STORE, the default since torch 2.4) the agent's
      store outlives the workers across `--max-restarts`, and torch's env:// rendezvous adds no per-attempt
      prefix, so restarted gloo ranks would read the addresses the killed workers published and fail ("Gloo
      connectFullMesh failed ... Connection refused"). The prefix is torchrun's TORCHELASTIC_RESTART_COUNT,
      which agents that restart together agree on.
    - Otherwise (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) rank 0 hosts a store of its own on a port the
      rendezvous round chose; it ends with the attempt, so no key of an earlier attempt is left to read. The
      restart count must not be used there: a node replaced under a restart (a fresh agent) counts from 0 while
      the others count 1, and the ranks would wait on each other's keys under two prefixes."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":   # the agent hosts the store
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"fivefold/attempt_{attempt}", store)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore("fivefold/attempt", store)


def leave_torchrun(code: int) -> None:
    """Leave the job and end this rank's process now with `code`. The process group is destroyed first;
    then the process exits without the interpreter's teardown, during which a native thread torch leaves
    behind intermittently aborts the rank ("terminate called without an active exception", about one run
    in three with gloo on torch 2.13) after all its work is written."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def resolve_device(name: str, backend: str | None) -> torch.device:
    """train.device for ranks joined over `backend` (None: a single process). auto: CUDA when present and
    the ranks talk over NCCL (torchrun), else CPU — local `--nproc` ranks talk over gloo on the CPU.
    cuda: the current CUDA device, which the launcher set from torchrun's local rank."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and backend in (None, "nccl") else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but torch finds no CUDA device; use device = 'cpu' or 'auto'")
    if backend == "gloo":
        raise ConfigError("train.device = 'cuda' needs NCCL: run the job under torchrun (one process per GPU); "
                          "local --nproc ranks run on the CPU over gloo (use device = 'cpu' or 'auto')")
    return torch.device("cuda", torch.cuda.current_device())


GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def gpu_driver_present() -> bool:
    """A GPU driver's device files exist (NVIDIA's, ROCm's /dev/kfd, WSL's /dev/dxg); off Linux: unknown, so
    True. Without one, torch can find no CUDA device, so the answer needs no torch."""
    return not sys.platform.startswith("linux") or any(os.path.exists(f) for f in GPU_DRIVER_FILES)


def launcher_device(name: str, backend: str | None) -> str:
    """`resolve_device`'s device type ("cpu" or "cuda") for a launcher, which imports torch only when the
    answer depends on a GPU: not for cpu, nor auto over gloo, nor auto on a machine without a GPU driver."""
    if name == "cpu" or (name == "auto" and (backend == "gloo" or not gpu_driver_present())):
        return "cpu"
    return resolve_device(name, backend).type
