"""Benchmark: `fivefold plan` searching every preset at 16,384 GPUs (topology llama3), as a whole process.

What a user waits for: a fresh `python -m fivefold.cli plan --model M --gpus 16384 --topology llama3`
process, imports included. Per preset, best of `--rounds` runs (the machine is shared):
- cpu: the process's CPU seconds (user + system, from getrusage of the child), which a loaded machine
  inflates less than the wall clock;
- wall: its wall-clock seconds;
- search: the seconds the search itself reports ("searched N layouts in X s").
The first row is the imports alone (`import fivefold.tools.plan` and the presets), the floor under every
other row. Goal (issues 6 and 13): every preset under 1 s of CPU.

    OMP_NUM_THREADS=1 python benchmarks/plan_search.py [--rounds 3] [--models llama3-405b,deepseek-v3] [--gpus 16384]
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import common

SRC = Path(common.__file__).resolve().parents[1] / "src"
IMPORTS = "import fivefold.tools.plan, fivefold.cli"


def run_process(argv: list[str]) -> tuple[float, float, str]:
    """(CPU seconds, wall seconds, stdout) of one fresh Python process running `argv` after the interpreter."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(SRC))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return cpu, wall, p.stdout


def search_seconds(out: str) -> float | None:
    """The search's own seconds from the table's first line, "searched N layouts in X s"."""
    m = re.search(r"searched \d+ layouts (?:\([^)]*\) )?in ([0-9.]+) s", out)
    return float(m.group(1)) if m else None


def best_of(argv: list[str], rounds: int) -> dict:
    """The fastest (by CPU) of `rounds` runs of the process `argv`."""
    best = None
    for _ in range(rounds):
        cpu, wall, out = run_process(argv)
        if best is None or cpu < best["cpu"]:
            best = {"cpu": cpu, "wall": wall, "search": search_seconds(out), "best": "best layout" in out}
    return best


def main() -> int:
    from fivefold.plan.models import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default=",".join(PRESETS), help=f"comma-separated, of {', '.join(PRESETS)}")
    ap.add_argument("--gpus", type=int, default=16384)
    ap.add_argument("--topology", default="llama3")
    a = common.parse_options(ap, rounds=1, models="llama3-8b")
    print(f"fivefold plan --gpus {a.gpus} --topology {a.topology}, one process per run, best of {a.rounds} by CPU")
    print(f"{'model':<16}{'cpu':>9}{'wall':>9}{'search':>9}  best layout found")
    floor = best_of(["-c", IMPORTS], a.rounds)
    print(f"{'(imports)':<16}{floor['cpu']:>7.2f} s{floor['wall']:>7.2f} s{'':>9}", flush=True)
    missing = []
    for model in a.models.split(","):
        r = best_of(["-m", "fivefold.cli", "plan", "--model", model, "--gpus", str(a.gpus), "--topology", a.topology],
                    a.rounds)
        search = "" if r["search"] is None else f"{r['search']:>7.2f} s"
        print(f"{model:<16}{r['cpu']:>7.2f} s{r['wall']:>7.2f} s{search:>9}  {'yes' if r['best'] else 'NO'}",
              flush=True)
        if not r["best"]:
            missing.append(model)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
