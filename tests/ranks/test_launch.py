"""The local launcher (train/launch.py): loopback-only sockets, ranks that die with their parent, a clean
stop on SIGTERM, the hang watchdog and naming the rank that died. Every multi-process test has a hard
limit: run_ranks' own watchdog, or a subprocess timeout."""
import ipaddress
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fivefold.train.launch import RankError, _silence_message, _start_time, heartbeat, held_state, last_stop_signal, run_ranks
from fivefold.train.signals import sigint_held

from tests.support.spawn import shell_signals

HAS_PROC_NET = os.path.exists("/proc/net/tcp")


# ---- 1. loopback only -------------------------------------------------------------------------------

def _hex_address(text: str) -> ipaddress._BaseAddress:
    """/proc/net/tcp{,6} local address: host-order 32-bit words in hex, then :port."""
    host = text.split(":")[0]
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    return ipaddress.ip_address(raw)


def _is_loopback(address: str) -> bool:
    a = ipaddress.ip_address(address)
    return a.is_loopback or bool(getattr(a, "ipv4_mapped", None) and a.ipv4_mapped.is_loopback)


def own_tcp_sockets() -> list[tuple[str, str]]:
    """(local address, state) of this process's TCP sockets; state '0A' is LISTEN."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    found.append((str(_hex_address(cols[1])), cols[3]))
    return found


def _sockets_after_a_collective(rank, world):
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"sum": float(t), "sockets": own_tcp_sockets()}


@pytest.mark.skipif(not HAS_PROC_NET, reason="needs Linux /proc/net/tcp")
@pytest.mark.ranks
def test_local_ranks_listen_on_loopback_only():
    out = run_ranks(_sockets_after_a_collective, 2, timeout_s=60)
    for rank, r in enumerate(out):
        assert r["sum"] == 2.0
        listening = [a for a, state in r["sockets"] if state == "0A"]
        assert listening, f"rank {rank}: gloo should listen somewhere: {r['sockets']}"
        assert all(_is_loopback(a) for a in listening), (rank, r["sockets"])   # none on 0.0.0.0 / ::
        assert all(_is_loopback(a) for a, _ in r["sockets"]), (rank, r["sockets"])
    assert multiprocessing.active_children() == []


# ---- 2-3. subprocess launchers: parent death, SIGTERM -------------------------------------------------

SCRIPT = textwrap.dedent("""
    import os, sys, time
    from fivefold.train.launch import last_stop_signal, run_ranks, stop_requested

    def semaphores(pid):
        with open(f"/proc/{pid}/maps") as f:
            return sum("/dev/shm/sem." in line for line in f)

    def note_pid(rank, folder):
        server = os.getppid()   # the fork server; its parent is the launcher
        with open(f"/proc/{server}/stat") as f:
            launcher = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(os.path.join(folder, f"{rank}.sem"), "w") as f:
            f.write(f"{semaphores(os.getpid())} {semaphores(launcher)}")
        path = os.path.join(folder, f"{rank}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)

    def sleeper(rank, world, folder):
        note_pid(rank, folder)
        time.sleep(60)

    def stopper(rank, world, folder):
        note_pid(rank, folder)
        while not stop_requested():
            time.sleep(0.05)
        return rank

    if __name__ == "__main__":
        fn = {"sleeper": sleeper, "stopper": stopper}[sys.argv[1]]
        res = run_ranks(fn, 2, (sys.argv[2],), timeout_s=120)
        print("results", res, last_stop_signal(), flush=True)
""")


def _start_launcher(tmp_path, mode, **env):
    script = tmp_path / "launcher.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.Popen([sys.executable, str(script), mode, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_pids(tmp_path, parent, n=2, limit_s=60) -> list[int]:
    files = [tmp_path / f"{r}.pid" for r in range(n)]
    until = time.monotonic() + limit_s
    while not all(f.exists() for f in files):
        if parent.poll() is not None:
            raise AssertionError(f"launcher exited early ({parent.returncode}): {parent.communicate()}")
        assert time.monotonic() < until, "ranks did not start"
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead; its new parent reaps it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[:2] == ["State:", "Z"] for line in f)
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _cleanup(parent, pids):
    for pid in [parent.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    parent.communicate(timeout=30)


@pytest.mark.ranks
def test_ranks_die_when_the_launcher_is_killed(tmp_path):
    parent = _start_launcher(tmp_path, "sleeper")
    pids = []
    try:
        pids = _wait_for_pids(tmp_path, parent)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        until = time.monotonic() + 10
        while not all(_gone(p) for p in pids) and time.monotonic() < until:
            time.sleep(0.05)
        assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
    finally:
        _cleanup(parent, pids)


def _unix_sockets_under(folder) -> list[str]:
    """Bound unix sockets (any process) whose path lies in `folder`: a live fork server keeps one."""
    with open("/proc/net/unix") as f:
        return [line.split()[-1] for line in f if str(folder) in line]


@pytest.mark.skipif(not os.path.exists("/proc/net/unix"), reason="needs Linux /proc")
@pytest.mark.ranks
def test_a_launcher_killed_with_sigkill_leaves_what_the_next_start_removes_and_no_semaphore(tmp_path):
    """Ranks talk over pipes: no named semaphore is mapped by a rank or the launcher. After `kill -9` of the
    launcher its folders stay in $TMPDIR with their owner file; the next command removes them, and only
    them (a look-alike without the owner file, one whose owner lives, a link), and leaves no fork server."""
    tmp = Path(tempfile.mkdtemp(prefix="ff-", dir="/tmp"))   # short: the fork server's socket path has 107 bytes
    try:
        _leaves_what_the_next_start_removes(tmp_path, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _leaves_what_the_next_start_removes(tmp_path, tmp):
    (tmp / "pymp-not-ours").mkdir()
    (tmp / "fivefold-ranks-alive").mkdir()
    (tmp / "fivefold-ranks-alive" / "fivefold-owner").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "fivefold-owner").write_text("1 0\n")   # pid 1 started at another time: an orphan's marker
    (tmp / "fivefold-ranks-link").symlink_to(elsewhere)
    keep = sorted(p.name for p in tmp.iterdir())
    parent = _start_launcher(tmp_path, "sleeper", TMPDIR=str(tmp))
    pids = []
    try:
        pids = _wait_for_pids(tmp_path, parent)
        for r in range(2):
            assert (tmp_path / f"{r}.sem").read_text() == "0 0", "a rank or the launcher maps a named semaphore"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        until = time.monotonic() + 10
        while not all(_gone(p) for p in pids) and time.monotonic() < until:
            time.sleep(0.05)
        left = sorted(p.name for p in tmp.iterdir() if p.name not in keep)
        assert any(n.startswith("fivefold-ranks-") for n in left) and any(n.startswith("pymp-") for n in left), left
        r = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", "--nproc", "2", "--steps", "1",
                            "--seq-len", "16", "--global-batch", "2", "--set", "model.layers=1",
                            "--set", "train.data_limit_mb=0.05", "--out", str(tmp_path / "run")],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp)))
        assert r.returncode == 0, r.stderr[-2000:]
        assert sorted(p.name for p in tmp.iterdir()) == keep
        assert (elsewhere / "fivefold-owner").exists()
        assert _unix_sockets_under(tmp) == [], "the fork server outlived the command"
    finally:
        _cleanup(parent, pids)


@pytest.mark.ranks
def test_sigterm_stops_the_ranks_cleanly(tmp_path):
    parent = _start_launcher(tmp_path, "stopper")
    pids = []
    try:
        pids = _wait_for_pids(tmp_path, parent)
        t0 = time.monotonic()
        parent.send_signal(signal.SIGTERM)
        out, err = parent.communicate(timeout=30)
        assert parent.returncode == 0, err
        assert "results [0, 1] SIGTERM" in out, (out, err)
        assert time.monotonic() - t0 < 10
        assert all(_gone(p) for p in pids)
    finally:
        _cleanup(parent, pids)


@pytest.mark.ranks
def test_a_second_sigterm_kills_the_ranks(tmp_path):
    parent = _start_launcher(tmp_path, "sleeper")     # ignores the first signal
    pids = []
    try:
        pids = _wait_for_pids(tmp_path, parent)
        parent.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert parent.poll() is None                    # still waiting for the ranks
        parent.send_signal(signal.SIGTERM)
        out, err = parent.communicate(timeout=30)
        assert parent.returncode != 0 and "Stopped: second SIGTERM" in err, err
        assert all(_gone(p) for p in pids)
    finally:
        _cleanup(parent, pids)


@pytest.mark.ranks
def test_last_stop_signal_is_none_without_a_signal():
    assert run_ranks(_beats, 1, (0, 0), timeout_s=30) == [0] and last_stop_signal() is None


# ---- 4. hang watchdog ---------------------------------------------------------------------------------

def _beats(rank, world, n, every_s):
    for step in range(n):
        heartbeat(step)
        time.sleep(every_s)
    return rank


def _beat_once_then_hang(rank, world, stamp):
    heartbeat(7)
    with open(f"{stamp}.{rank}", "w") as f:
        f.write(repr(time.time()))
    time.sleep(60)


@pytest.mark.ranks
def test_heartbeats_keep_a_long_run_alive():
    t0 = time.monotonic()
    assert run_ranks(_beats, 2, (15, 0.2), timeout_s=1.5) == [0, 1]   # 3 s of work, 1.5 s watchdog
    assert time.monotonic() - t0 >= 3.0
    assert multiprocessing.active_children() == []


@pytest.mark.ranks
def test_silence_after_a_heartbeat_is_a_timeout_naming_the_step(tmp_path):
    stamp = tmp_path / "beat"
    with pytest.raises(TimeoutError, match=r"no progress for 1.5 s: rank [01] last reported step 7"):
        run_ranks(_beat_once_then_hang, 2, (str(stamp),), timeout_s=1.5)
    raised = time.time()
    last_beat = max(float((tmp_path / f"beat.{r}").read_text()) for r in range(2))
    assert raised - last_beat < 1.5 + 2.0
    assert multiprocessing.active_children() == []


def _rank1_stalls_while_rank0_waits(rank, world, stopped=False):
    """Rank 0 reports step 3 and waits for rank 1 in a collective; rank 1 reports step 3 later (so rank 0 is
    the one heard from least recently), then stalls outside any collective, or (`stopped`) is stopped by
    SIGSTOP while it too is marked as waiting, so both look blocked."""
    from fivefold.comm import gather_objects
    from fivefold.comm.waits import waiting

    if rank == 0:
        heartbeat(3)
        gather_objects(rank)
        return
    time.sleep(1.0)
    heartbeat(3)
    if stopped:
        with waiting():
            os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)


def test_the_watchdog_names_the_rank_that_stalled_not_the_one_waiting_for_it():
    with pytest.raises(TimeoutError) as e:
        run_ranks(_rank1_stalls_while_rank0_waits, 2, timeout_s=4)
    assert str(e.value).startswith("no progress for 4 s: rank 1 last reported step 3"), str(e.value)
    assert "rank(s) [0] wait for it in a collective" in str(e.value)
    assert multiprocessing.active_children() == []


@pytest.mark.ranks
def test_the_watchdog_names_a_stopped_rank_even_inside_a_collective():
    with pytest.raises(TimeoutError) as e:
        run_ranks(_rank1_stalls_while_rank0_waits, 2, (True,), timeout_s=4)
    assert str(e.value).startswith("no progress for 4 s: rank 1 last reported step 3 and is stopped (SIGSTOP"), \
        str(e.value)
    assert "rank(s) [0] wait for it in a collective" in str(e.value)
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(not os.access("/sys/fs/cgroup/freezer", os.W_OK), reason="needs a writable cgroup v1 freezer")
def test_a_process_in_a_frozen_cgroup_is_held():
    group = f"/sys/fs/cgroup/freezer/fivefold-test-{os.getpid()}"
    os.mkdir(group)
    p = subprocess.Popen(["sleep", "60"])
    try:
        assert held_state(p.pid) is None
        with open(f"{group}/cgroup.procs", "w") as f:
            f.write(str(p.pid))
        with open(f"{group}/freezer.state", "w") as f:
            f.write("FROZEN")
        assert held_state(p.pid) == "frozen (cgroup freezer)"
    finally:
        with open(f"{group}/freezer.state", "w") as f:
            f.write("THAWED")
        p.kill()
        p.wait(timeout=30)
        os.rmdir(group)


def test_silence_messages():
    assert _silence_message(8, 1, True, False, None) == "no progress for 8 s: rank 1 never reported"
    assert _silence_message(8, 0, True, True, 3) == "no progress for 8 s: rank 0 last reported step 3"
    assert _silence_message(60, 2, False, False, None) == "no progress for 60 s: rank 2 did not start"


# ---- 5. the rank that died ----------------------------------------------------------------------------

def _rank1_killed_during_all_reduce(rank, world):
    import torch
    import torch.distributed as dist
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))   # needs rank 1
    return rank


@pytest.mark.ranks
def test_a_killed_rank_is_named_first():
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        run_ranks(_rank1_killed_during_all_reduce, 2, timeout_s=30)
    lines = str(e.value).splitlines()
    assert lines[0] == "rank 1 was killed by SIGKILL", str(e.value)
    assert time.monotonic() - t0 < 25
    assert multiprocessing.active_children() == []


def _exit_3_on_rank1(rank, world):
    if rank == 1:
        os._exit(3)
    time.sleep(60)


@pytest.mark.ranks
def test_an_exit_code_without_a_result_is_named():
    with pytest.raises(RankError, match=r"^rank 1 exited with code 3 without a result"):
        run_ranks(_exit_3_on_rank1, 2, timeout_s=30)
    assert multiprocessing.active_children() == []


def test_a_ctrl_c_while_processes_start_is_held_not_lost():
    """A SIGINT inside `sigint_held` (where the launcher and tokenize start processes) waits and is
    delivered when it ends; a process started inside begins with SIGINT blocked, so a Ctrl-C to the group
    cannot kill it half-started (it releases SIGINT once its handlers are in)."""
    got = []
    old = signal.signal(signal.SIGINT, lambda *_: got.append("SIGINT"))
    try:
        with sigint_held():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.05)
            held = list(got)
            child = subprocess.run([sys.executable, "-c", "import signal; print(signal.SIGINT in "
                                    "signal.pthread_sigmask(signal.SIG_BLOCK, []))"], capture_output=True, text=True)
        time.sleep(0.05)
        assert held == [] and got == ["SIGINT"]
        assert child.stdout.strip() == "True"
    finally:
        signal.signal(signal.SIGINT, old)


HELD_SPAWN = """
import multiprocessing, signal, sys
from fivefold.train.signals import sigint_held

def blocked(q):
    q.put(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))

if __name__ == "__main__":
    with sigint_held():
        out = []
        for method in ("spawn", "forkserver"):
            ctx = multiprocessing.get_context(method)
            q = ctx.Queue()          # the first Queue starts multiprocessing's resource tracker
            p = ctx.Process(target=blocked, args=(q,))
            p.start()
            out.append(q.get(timeout=60))
            p.join()
    print(out, signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
"""


def test_processes_started_inside_sigint_held_start_deaf_whatever_multiprocessing_does(tmp_path):
    """In a fresh interpreter (no resource tracker yet): spawn and forkserver children started inside
    `sigint_held` begin with SIGINT blocked, and the block ends with the block. Starting the tracker
    unblocks SIGINT in its caller (CPython), which had let the suite's tokenize Ctrl-C test see workers
    die with a KeyboardInterrupt traceback halfway through their start."""
    script = tmp_path / "held.py"
    script.write_text(HELD_SPAWN)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         preexec_fn=shell_signals)
    assert out.stdout.strip() == "[True, True] False", out.stderr[-2000:]


def test_a_temporary_folder_too_long_for_the_fork_servers_socket_is_one_line(tmp_path):
    long_tmp = Path(tempfile.mkdtemp(prefix="ff-" + "x" * 100, dir="/tmp"))
    try:
        r = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", "--nproc", "2", "--steps", "1",
                            "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(long_tmp)))
    finally:
        shutil.rmtree(long_tmp, ignore_errors=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "set TMPDIR to a shorter folder" in r.stderr
    assert not (tmp_path / "run").exists()


def test_both_watchdogs_name_the_step_metrics_jsonl_names():
    """The local launcher and a torchrun rank's watchdog read the same heartbeat, `steps_done` (1-based,
    metrics.jsonl's "step"), and name the same number: before, one printed the 0-based index and the
    other that plus one, so one hang read a step apart depending on the launcher."""
    from fivefold.train.watchdog import Watchdog

    dog = Watchdog(5, rank=0, node=0, addresses={})
    assert "before its first step" in dog.report()
    dog.beat(4)
    assert "after step 4," in dog.report()
    assert _silence_message(5, 0, True, True, 4).endswith("last reported step 4")


# ---- the launcher imports no torch --------------------------------------------------------------------

NO_TORCH_LAUNCHER = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"the launcher imported {name}")

if __name__ == "__main__":
    sys.meta_path.insert(0, NoTorch())   # this process only: the ranks' fork server is a fresh interpreter
    from fivefold.cli import main
    code = main(sys.argv[1:])
    print("launcher imported torch:", "torch" in sys.modules)
    sys.exit(code)
"""


def test_train_launcher_never_imports_torch(tmp_path):
    """`fivefold train --nproc 2` checks the run, starts its ranks and reads their results with torch
    unimportable in the launcher (only the ranks import it), and the ranks train as usual."""
    from tests.support.cli import TINY

    script = tmp_path / "launch_without_torch.py"
    script.write_text(NO_TORCH_LAUNCHER)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(script), "train", "--nproc", "2", "--dp", "2", *TINY, "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "launcher imported torch: False" in r.stdout
    assert "loss " in r.stdout and (out / "metrics.jsonl").read_text().count("\n") == 4


def test_rank_results_come_back_plain_or_through_torch():
    """A plain result travels as a pickle of built-in data, which the launcher reads refusing any class or
    function; one with tensors travels through torch.save and weights_only."""
    import pickle

    import torch

    from fivefold.train.launch import _dumps, _loads

    plain = {"history": [{"loss": 1.5, "step": 1}], "stopped": None, "tags": {1, 2}, "pair": (1, "a")}
    data = _dumps(plain)
    assert data[:1] == b"P" and _loads(data) == plain
    tensors = {"x": torch.arange(3)}
    data = _dumps(tensors)
    assert data[:1] == b"T" and torch.equal(_loads(data)["x"], tensors["x"])
    hostile = b"P" + pickle.dumps(os.getcwd)   # any global (a function, a class) is refused: no code runs
    with pytest.raises(pickle.UnpicklingError, match="not plain data"):
        _loads(hostile)
