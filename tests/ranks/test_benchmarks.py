"""Every script in benchmarks/ still runs: each with --smoke (benchmarks/common.py `parse_options`: one timed
step of one round at a tiny size, ours and the PyTorch peer, DeepSpeed where it is installed; any
implementation's failure is an error). A benchmark that stops matching the code it races fails here, not
the next time someone wants its figures. benchmarks/gpu.py without CUDA plans its micro-batch only."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name != "common.py")
TIMEOUT_S = 600   # a hang, not a budget: a smoke run takes seconds to a minute on 2 shared cores
# The smoke runs are spread over SHARDS xdist groups (conftest.py: a test's group is its file's unless its
# id ends with "@name"), so that pytest-xdist runs them side by side instead of one worker running them all at the
# suite's end. Rough relative costs place them (longest first, each to the lightest shard); a script not
# listed counts as 30.
SHARDS = 3
COST = {"context.py": 95, "pipeline.py": 56, "zero.py": 54, "plan_vs_run.py": 52, "expert.py": 50, "tensor.py": 49,
        "ddp.py": 45, "checkpoint.py": 37, "offload.py": 23, "moe_balance_hf.py": 16, "startup.py": 15,
        "moe_balance.py": 15, "dry_run.py": 14, "network.py": 14, "one_rank.py": 30, "lora.py": 45, "gpu.py": 5, "plan_search.py": 3,
        "loss.py": 3}


def shard_scripts(shard: int) -> list[str]:
    """The scripts of one shard (0..SHARDS-1); together the shards hold every script once."""
    loads, out = [0] * SHARDS, [[] for _ in range(SHARDS)]
    for script in sorted(SCRIPTS, key=lambda name: (-COST.get(name, 30), name)):
        i = loads.index(min(loads))
        loads[i] += COST.get(script, 30)
        out[i].append(script)
    return sorted(out[shard])


def smoke(script: str, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    """benchmarks/`script` --smoke in its own process, one intra-op thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", *extra], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=env, cwd=cwd)


def extra_options(script: str, tmp_path: Path) -> list[str]:
    """Where a script writes files, into the test's folder."""
    if script == "plan_vs_run.py":
        return ["--out", str(tmp_path / "plan_vs_run")]
    if script == "gpu.py":
        return ["--out", str(tmp_path / "gpu.json")]
    return []


def test_every_benchmark_is_smoke_tested():
    """A new script is picked up by the glob; it only needs to take --smoke (common.parse_options)."""
    assert {"ddp.py", "zero.py", "tensor.py", "pipeline.py", "context.py", "expert.py", "offload.py",
            "checkpoint.py", "plan_vs_run.py", "plan_search.py", "gpu.py"} <= set(SCRIPTS)
    for script in SCRIPTS:
        assert "parse_options(" in (BENCHMARKS / script).read_text(), f"{script} takes no --smoke"


def test_the_shards_hold_every_script_once():
    held = [s for i in range(SHARDS) for s in shard_scripts(i)]
    assert sorted(held) == SCRIPTS


def run_one_step(script: str, tmp_path: Path) -> None:
    r = smoke(script, *extra_options(script, tmp_path), cwd=tmp_path)
    assert r.returncode == 0, f"benchmarks/{script} --smoke exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert r.stdout.strip(), f"benchmarks/{script} --smoke printed nothing"
    assert "failed" not in r.stdout, r.stdout[-3000:]


@pytest.mark.ranks
@pytest.mark.parametrize("script", [pytest.param(script, id=f"{script}@smoke-{shard}")
                                    for shard in range(SHARDS) for script in shard_scripts(shard)])
def test_benchmark_runs_one_step(script, tmp_path):
    run_one_step(script, tmp_path)


@pytest.mark.ranks
def test_gpu_benchmark_without_cuda_says_so_in_one_line(tmp_path):
    """Without --smoke and without CUDA, gpu.py refuses in one line, exit 2 (with CUDA this test is skipped)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu.py would run")
    r = subprocess.run([sys.executable, str(BENCHMARKS / "gpu.py"), "--out", str(tmp_path / "gpu.json")],
                       capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no CUDA device" in r.stderr
