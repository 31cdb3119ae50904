"""Benchmark: the seconds a training step waits on each dimension's collectives, per layout.

Every collective goes through fivefold.comm, whose ledger adds the seconds a call spends issuing and
waiting (comm/ops.py `Handle.wait`): what the step did not hide behind compute. For each layout this runs
the trainer (`Trainer.step`, the same model and batch, 2 gloo ranks, fp32) and prints the median step time
and, per ledger dimension, the median seconds a step spent inside its collectives on the slowest rank
(issue 36 item 3: exposed communication before and after each overlap change).

    python benchmarks/exposed_comm.py [--steps 6] [--warmup 2] [--only dp2,tp2] [--rounds 3]

`--rounds` runs the layouts in turn that many times (before/after pairs alternate: tp2-blocking is tp2
with parallel.tp_overlap off, the collectives waited where they are issued).
"""
from __future__ import annotations

import argparse
import statistics

from common import BENCH_MODEL, parse_options

GLOBAL_BATCH, SEQ = 8, 256
MOE = dict(experts=4, top_k=2, moe_ffn=352)
LAYOUTS = {   # name -> (parallel config, model changes)
    "dp2": (dict(dp=2), {}),
    "zero1-dp2": (dict(dp=2, zero=1), {}),
    "zero2-dp2": (dict(dp=2, zero=2), {}),
    "zero3-dp2": (dict(dp=2, zero=3), {}),
    "zero3-dp2-prefetch0": (dict(dp=2, zero=3, zero_prefetch=0), {}),   # each unit gathered when it runs
    "zero3-dp2-prefetch2": (dict(dp=2, zero=3, zero_prefetch=2), {}),
    "tp2": (dict(tp=2, sp_mode="none"), {}),
    "tp2-sp": (dict(tp=2, sp_mode="megatron"), {}),
    "tp2-blocking": (dict(tp=2, sp_mode="none", tp_overlap=False), {}),        # tp's collectives not overlapped
    "tp2-sp-blocking": (dict(tp=2, sp_mode="megatron", tp_overlap=False), {}),
    "pp2-1f1b": (dict(pp=2, microbatches=4), {}),
    "cp2-ulysses": (dict(cp=2, cp_mode="ulysses"), {}),
    "cp2-ring": (dict(cp=2, cp_mode="ring"), {}),
    "ep2-dp2": (dict(dp=2, ep=2), MOE),
}


def config(parallel: dict, model: dict, steps: int, seq: int, hidden: int | None):
    from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig

    shape = {**BENCH_MODEL.__dict__, **model, "max_seq": max(seq, 8)}
    if hidden:
        shape.update(hidden=hidden, ffn=2 * hidden, **({"moe_ffn": hidden} if model else {}))
    return Config(model=ModelConfig(**shape), parallel=ParallelConfig(**parallel),
                  train=TrainConfig(steps=steps, global_batch=GLOBAL_BATCH, seq_len=seq, dtype="fp32", warmup=1,
                                    checkpoint=False, data_limit_mb=1.0))


def bench_rank(rank: int, world: int, cfg_dict: dict, warmup: int) -> list[dict]:
    """Per timed step: its seconds and the ledger's seconds per dimension added in it."""
    from fivefold.config import Config
    from fivefold.train.trainer import Trainer

    return timed_steps(Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True), warmup)


def timed_steps(trainer, warmup: int) -> list[dict]:
    """Train every step of `trainer`'s run; per step after the first `warmup`: its seconds and the ledger's
    seconds per dimension added in it."""
    def by_dim() -> dict[str, float]:
        out: dict[str, float] = {}
        for row in trainer.ledger.rows():
            out[row["dim"]] = out.get(row["dim"], 0.0) + row["seconds"]
        return out

    steps = []
    for k in range(trainer.cfg.train.steps):
        before = by_dim()
        m = trainer.step(k)
        after = by_dim()
        if k >= warmup:
            steps.append({"seconds": m["seconds"], "comm": {d: after[d] - before.get(d, 0.0) for d in after}})
    return steps


def slowest(per_rank: list[list[dict]]) -> tuple[list[float], dict[str, float]]:
    """(each step's seconds on the slowest rank, per dimension the median over steps of the slowest rank's
    seconds) from every rank's `timed_steps`."""
    step_s = [max(r[k]["seconds"] for r in per_rank) for k in range(len(per_rank[0]))]
    dims = sorted({d for r in per_rank for s in r for d in s["comm"]})
    comm = {d: statistics.median(max(r[k]["comm"].get(d, 0.0) for r in per_rank) for k in range(len(step_s)))
            for d in dims}
    return step_s, comm


def measure(name: str, steps: int, warmup: int, seq: int, hidden: int | None) -> dict:
    from fivefold.train.launch import run_ranks

    parallel, model = LAYOUTS[name]
    cfg = config(parallel, model, steps + warmup, seq, hidden)
    per_rank = run_ranks(bench_rank, 2, (cfg.to_dict(), warmup), timeout_s=1800)
    step_s, comm = slowest(per_rank)
    return {"name": name, "step_s": statistics.median(step_s), "spread": (min(step_s), max(step_s)), "comm": comm}


def summary(rows: list[dict]) -> str:
    """Per layout over its rounds: the median of the rounds' median steps, and of each dimension's seconds."""
    lines = ["| layout | rounds | step, median of rounds | exposed comm per dim, median of rounds (ms) |", "|---|---|---|---|"]
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        dims = sorted({d for r in mine for d in r["comm"]})
        comm = {d: statistics.median(r["comm"].get(d, 0.0) for r in mine) for d in dims}
        text = ", ".join(f"{d} {s * 1e3:.1f}" for d, s in sorted(comm.items(), key=lambda x: -x[1]) if s >= 5e-5)
        lines.append(f"| {name} | {len(mine)} | {statistics.median(r['step_s'] for r in mine) * 1e3:.0f} ms | "
                     f"{text or '-'} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| layout | step (median; min-max) | exposed comm per dim, ms a step (slowest rank) | comm share |",
             "|---|---|---|---|"]
    for r in rows:
        lo, hi = r["spread"]
        dims = ", ".join(f"{d} {s * 1e3:.1f}" for d, s in sorted(r["comm"].items(), key=lambda x: -x[1]) if s >= 5e-5)
        share = sum(r["comm"].values()) / r["step_s"]
        lines.append(f"| {r['name']} | {r['step_s'] * 1e3:.0f} ms ({lo * 1e3:.0f}-{hi * 1e3:.0f}) | {dims or '-'} | "
                     f"{share:.0%} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", default="", help="comma list of layouts (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="run the layouts in turn this many times")
    a = parse_options(ap, steps=1, warmup=1, only="dp2,tp2-sp", seq=32, hidden=64)
    names = [n for n in a.only.split(",") if n] or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; valid: {', '.join(LAYOUTS)}")
    seq, hidden = getattr(a, "seq", SEQ), getattr(a, "hidden", None)
    rows = []
    for k in range(getattr(a, "rounds", 1)):
        for name in names:
            rows.append(measure(name, a.steps, a.warmup, seq, hidden))
            print(f"round {k + 1} {name}: {rows[-1]['step_s'] * 1e3:.0f} ms", flush=True)
    print(table(rows))
    if getattr(a, "rounds", 1) > 1:
        print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
