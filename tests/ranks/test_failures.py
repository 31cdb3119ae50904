"""What a demanding user does to a run: stop it, kill a rank, run twice into one folder, resume the wrong
way, feed it a crafted file, restart it under torchrun. Each case ends with the work kept and a
one-line answer; every subprocess has a hard timeout."""
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fivefold.train import checkpoint, rundir

from tests.support.spawn import shell_signals
from tests.support.cli import TINY, fivefold, metrics

LONG = [a if a != "4" else "3000" for a in TINY]   # long enough to be interrupted


def start(*args) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "fivefold.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=shell_signals)


def wait_for(cond, timeout=120.0, what="condition"):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def newest_step(out: Path) -> int:
    ck = rundir.newest_checkpoint(out)
    return int(ck.name.split("-")[1]) if ck else 0


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text()


def rank_pids(pid: int, marker: str) -> list[int]:
    """The rank processes torchrun's agent `pid` started (not multiprocessing's resource tracker)."""
    return [c for c in children(pid) if marker in cmdline(c) and "resource_tracker" not in cmdline(c)]


def local_rank_pids(pid: int) -> list[int]:
    """The ranks of a `--nproc` launcher, in rank order: the children of its fork server (launch.py)."""
    servers = [c for c in children(pid) if "multiprocessing.forkserver" in cmdline(c)]
    return sorted(r for server in servers for r in children(server))


def finish(p: subprocess.Popen, timeout=90) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    return p.returncode, err


@pytest.mark.ranks
def test_sigterm_saves_a_second_run_is_refused_and_resume_auto_finishes(tmp_path):
    out = tmp_path / "run"
    p = start("train", "--nproc", "2", *LONG, "--out", str(out))
    try:
        wait_for(lambda: lines(out) >= 3, what="three steps")
        second = fivefold("train", *TINY, "--resume", "auto", "--out", str(out))
        assert second.returncode == 2 and "is in use by another run" in second.stderr
        p.send_signal(signal.SIGTERM)
        code, err = finish(p)
    finally:
        p.kill()
    assert code == 128 + signal.SIGTERM, err[-2000:]
    step = newest_step(out)
    assert step >= 3 and f"stopped by SIGTERM after step {step}" in err
    assert [m["step"] for m in metrics(out)] == list(range(1, step + 1))
    more = [a if a != "3000" else str(step + 2) for a in LONG]
    r = fivefold("train", "--nproc", "2", *more, "--resume", "auto", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning: resuming with a changed setting: train.steps" in r.stderr
    assert [m["step"] for m in metrics(out)] == list(range(1, step + 3))


@pytest.mark.ranks
def test_a_killed_rank_is_named_and_the_periodic_checkpoint_is_complete(tmp_path):
    out = tmp_path / "run"
    p = start("train", "--nproc", "2", *LONG, "--set", "train.checkpoint_every=2", "--out", str(out))
    try:
        wait_for(lambda: newest_step(out) >= 4, what="a periodic checkpoint")
        os.kill(local_rank_pids(p.pid)[1], signal.SIGKILL)
        code, err = finish(p)
    finally:
        p.kill()
    assert code == 1
    first = err.split("fivefold: ", 1)[1].splitlines()[0]
    assert "was killed by SIGKILL" in first, err[-2000:]
    step = newest_step(out)
    model = checkpoint.to_model(out)                        # the newest checkpoint is whole
    assert sum(q.numel() for q in model.parameters()) > 0
    more = [a if a != "3000" else str(step + 1) for a in LONG]
    r = fivefold("train", "--nproc", "2", *more, "--resume", "auto", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert [m["step"] for m in metrics(out)] == list(range(1, step + 2))


@pytest.mark.ranks
def test_the_run_folder_is_never_written_over(tmp_path):
    out = tmp_path / "run"
    short = [a if a != "4" else "2" for a in TINY]
    assert fivefold("train", *short, "--out", str(out)).returncode == 0
    before = (out / "metrics.jsonl").read_text()
    ck = rundir.newest_checkpoint(out)
    mtime = (ck / "index.json").stat().st_mtime_ns

    again = fivefold("train", *short, "--out", str(out))
    assert again.returncode == 2 and "already holds a run" in again.stderr
    done = fivefold("train", *short, "--resume", "auto", "--out", str(out))   # a finished run: nothing to do
    assert done.returncode == 0 and "nothing to do" in done.stderr
    assert (out / "metrics.jsonl").read_text() == before and (ck / "index.json").stat().st_mtime_ns == mtime

    shape = fivefold("train", *TINY, "--set", "model.layers=3", "--resume", "auto", "--out", str(out))
    assert shape.returncode == 2 and "model.layers: checkpoint 2, now 3" in shape.stderr
    assert "Traceback" not in shape.stderr

    over = fivefold("train", *short, "--overwrite", "--out", str(out))
    assert over.returncode == 0 and [m["step"] for m in metrics(out)] == [1, 2]
    assert rundir.newest_checkpoint(out).name == "step-00000002"


@pytest.mark.ranks
def test_bad_input_is_refused_before_any_rank_starts(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    crafted = tmp_path / "checkpoint.pt"
    crafted.write_bytes(pickle.dumps(Payload()))
    r = fivefold("train", *TINY, "--resume", str(crafted), "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and "--resume" in r.stderr and not marker.exists()

    for bad in ("train.lr=nan", "train.grad_clip=inf", "train.weight_decay=nan"):
        r = fivefold("train", *TINY, "--set", bad, "--out", str(tmp_path / "b"))
        assert r.returncode == 2 and "must be a finite number" in r.stderr, bad

    tokens = tmp_path / "tok.u16"
    import numpy as np

    ids = np.random.default_rng(0).integers(0, 256, (1 << 20) + 5000).astype(np.uint16)
    ids[-1] = 300                               # past the first 2^20 tokens
    ids.tofile(tokens)
    r = fivefold("train", "--nproc", "2", "--tp", "2", *TINY, "--data", str(tokens), "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "token id 300" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.ranks
def test_nonfinite_loss_stops_naming_the_step_and_saves_nothing(tmp_path):
    out = tmp_path / "run"
    r = fivefold("train", *[a if a != "4" else "12" for a in TINY], "--lr", "1e30",
                 "--set", "train.checkpoint_every=1", "--out", str(out))
    assert r.returncode == 1
    assert "non-finite steps in a row" in r.stderr and "Traceback" not in r.stderr
    rows = metrics(out)
    assert rows[-1]["grad_norm"] is None and json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    for ck in rundir.checkpoints(out):                   # only the finite steps were saved
        assert checkpoint.full_tensors(ck)["embed.weight"].isfinite().all()


@pytest.mark.skipif(not Path("/proc").exists(), reason="finds the worker through /proc")
@pytest.mark.ranks
def test_torchrun_restart_resumes_from_the_newest_checkpoint(tmp_path):
    out = tmp_path / "run"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    steps = [a if a != "4" else "300" for a in TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m",
                          "fivefold.cli", "train", *steps, "--set", "train.checkpoint_every=5", "--resume", "auto",
                          "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for(lambda: newest_step(out) >= 4, what="a periodic checkpoint")
        killed_at = newest_step(out)
        workers = rank_pids(p.pid, "fivefold.cli")
        os.kill(workers[-1], signal.SIGKILL)
        code, err = finish(p, timeout=180)
    finally:
        p.kill()
    assert code == 0, err[-3000:]
    assert re.search(r"resuming from \S+/checkpoints/step-\d{8} \(step \d+\)", err), err[-3000:]
    assert killed_at < 300                                        # killed while training
    assert [m["step"] for m in metrics(out)] == list(range(1, 301))  # trimmed at the checkpoint, then appended


@pytest.mark.ranks
def test_killing_the_torchrun_agent_kills_its_ranks(tmp_path):
    out = tmp_path / "run"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "fivefold.cli", "train", *LONG,
                          "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for(lambda: lines(out) >= 2, what="two steps")
        workers = rank_pids(p.pid, "fivefold.cli")
        assert len(workers) == 2
        p.kill()
        p.wait(30)
        wait_for(lambda: not any(alive(w) for w in workers), timeout=20, what="the ranks to die")
    finally:
        p.kill()


def alive(pid: int) -> bool:
    try:
        return "\tZ" not in Path(f"/proc/{pid}/status").read_text().split("State:")[1][:4]
    except (FileNotFoundError, IndexError):
        return False


def test_ctrl_c_of_the_launcher_saves_and_exits_130(tmp_path):
    out = tmp_path / "run"
    p = start("train", "--nproc", "2", *LONG, "--out", str(out))
    try:
        wait_for(lambda: lines(out) >= 2, what="two steps")
        p.send_signal(signal.SIGINT)
        code, err = finish(p)
    finally:
        p.kill()
    assert code == 128 + signal.SIGINT, err[-2000:]            # 130, as for any Ctrl-C'd command
    step = newest_step(out)
    assert f"stopped by SIGINT after step {step}" in err and "Traceback" not in err


def test_a_token_file_truncated_during_training_is_named_in_one_line(tmp_path):
    import numpy as np

    tokens = tmp_path / "tok.u16"
    np.random.default_rng(0).integers(0, 256, 200_000).astype(np.uint16).tofile(tokens)
    out = tmp_path / "run"
    p = start("train", "--nproc", "2", *LONG, "--data", str(tokens), "--out", str(out))
    try:
        wait_for(lambda: lines(out) >= 2, what="two steps")
        os.truncate(tokens, 0)
        code, err = finish(p)
    finally:
        p.kill()
    assert code == 1, err[-2000:]
    first = err.split("fivefold: ", 1)[1].splitlines()[0]
    assert f"data file {tokens} ends before byte" in first and "truncated" in first, err[-2000:]
    assert "Traceback" not in err
