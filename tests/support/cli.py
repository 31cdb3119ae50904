"""`fivefold` as a subprocess (`python -m fivefold.cli`, one intra-op thread), a tiny model's flags, and a
run's metrics.jsonl read back."""
import json
import os
import subprocess
import sys


TINY = ["--set", "model.hidden=64", "--set", "model.layers=2", "--set", "model.ffn=128",
        "--set", "model.max_seq=64", "--seq-len", "32", "--global-batch", "8", "--steps", "4",
        "--set", "train.data_limit_mb=0.25", "--set", "train.warmup=1"]


def fivefold(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fivefold.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

