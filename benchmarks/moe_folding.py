"""Benchmark: MoE parallel folding and expert tensor parallelism against experts replicated over tp (issue 53).

For each layout on 4 gloo ranks (tp2 x dp2 for attention; the experts as each layout folds them) this
trains the same MoE model for a few steps and prints, per layout:
- model-state bytes of rank 0 (weights, gradients, optimizer: `Trainer.model_state_bytes`, what run.json
  records) beside the planner's for the same layout (`plan.units.model_states`), and their ratio;
- the median step and, per ledger dimension, the median seconds a step spent inside its collectives on the
  slowest rank (the exposed communication, as benchmarks/exposed_comm.py measures it).

    python benchmarks/moe_folding.py [--steps 4] [--warmup 1] [--rounds 1] [--only replicated,ep4]

Layouts: "replicated" (ep = etp = 1: every expert whole on every rank, gradients partial over tp and
reduced over dp), "ep2" (ep folded onto the tp pair, edp over dp), "ep4" (ep over all four ranks),
"etp2-ep2" (each expert's width over the tp pair, ep over dp). ZeRO-1 shards the optimizer state over
dp (dense) and edp (experts).
"""
from __future__ import annotations

import argparse
import statistics

from common import BENCH_MODEL, parse_options
from exposed_comm import slowest, timed_steps

WORLD, GLOBAL_BATCH, SEQ = 4, 8, 256
MOE = dict(experts=8, top_k=2, moe_ffn=352)
LAYOUTS = {   # name -> the parallel config over tp2 x dp2
    "replicated": dict(tp=2, dp=2, zero=1, sp_mode="megatron"),
    "ep2": dict(tp=2, dp=2, ep=2, zero=1, sp_mode="megatron"),
    "ep4": dict(tp=2, dp=2, ep=4, zero=1, sp_mode="megatron"),
    "etp2-ep2": dict(tp=2, dp=2, ep=2, etp=2, zero=1, sp_mode="megatron"),
}


def config(parallel: dict, steps: int, seq: int, hidden: int | None, layers: int | None):
    from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig

    shape = {**BENCH_MODEL.__dict__, **MOE, "max_seq": max(seq, 8)}
    if hidden:
        shape.update(hidden=hidden, ffn=2 * hidden, moe_ffn=2 * hidden)
    if layers:
        shape.update(layers=layers)
    return Config(model=ModelConfig(**shape), parallel=ParallelConfig(**parallel),
                  train=TrainConfig(steps=steps, global_batch=GLOBAL_BATCH, seq_len=seq, dtype="fp32", warmup=1,
                                    checkpoint=False, data_limit_mb=1.0))


def bench_rank(rank: int, world: int, cfg_dict: dict, warmup: int) -> dict:
    """Model-state bytes of this rank and, per timed step, its seconds and the ledger's seconds per dim."""
    from fivefold.config import Config
    from fivefold.train.trainer import Trainer

    trainer = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    steps = timed_steps(trainer, warmup)
    return {"state": trainer.model_state_bytes(), "steps": steps}


def planned_state(cfg) -> dict:
    """The planner's model-state bytes of rank 0 of stage 0 for the same config (plan.units.model_states)."""
    from fivefold.plan.run import plan_of
    from fivefold.plan.units import model_states

    run = plan_of(cfg)
    return model_states(run.model, run.layout, run.work, 0)


def measure(name: str, steps: int, warmup: int, seq: int, hidden: int | None, layers: int | None) -> dict:
    from fivefold.train.launch import run_ranks

    cfg = config(LAYOUTS[name], steps + warmup, seq, hidden, layers)
    per_rank = run_ranks(bench_rank, WORLD, (cfg.to_dict(), warmup), timeout_s=1800)
    step_s, comm = slowest([r["steps"] for r in per_rank])
    state = per_rank[0]["state"]
    plan = planned_state(cfg)
    return {"name": name, "step_s": statistics.median(step_s), "comm": comm,
            "state": {"weights": state["params"], "grads": state["grads"], "optimizer": state["optimizer"]},
            "planned": {k: plan[k] for k in ("weights", "grads", "optimizer")}}


def table(rows: list[dict]) -> str:
    lines = ["| layout | model state rank 0, MiB (weights + grads + optimizer) | planned, MiB | run / plan | step | "
             "exposed comm per dim, ms a step (slowest rank) |", "|---|---|---|---|---|---|"]
    for r in rows:
        got, want = sum(r["state"].values()), sum(r["planned"].values())
        parts = " + ".join(f"{r['state'][k] / 2**20:.2f}" for k in ("weights", "grads", "optimizer"))
        dims = ", ".join(f"{d} {s * 1e3:.1f}" for d, s in sorted(r["comm"].items(), key=lambda x: -x[1]) if s >= 5e-5)
        lines.append(f"| {r['name']} | {got / 2**20:.2f} ({parts}) | {want / 2**20:.2f} | {got / want:.4f} | "
                     f"{r['step_s'] * 1e3:.0f} ms | {dims or '-'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--only", default="", help="comma list of layouts (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="run the layouts in turn this many times")
    a = parse_options(ap, steps=1, warmup=0, only="", seq=32, hidden=64, layers=2)
    names = [n for n in a.only.split(",") if n] or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; valid: {', '.join(LAYOUTS)}")
    seq, hidden, layers = getattr(a, "seq", SEQ), getattr(a, "hidden", None), getattr(a, "layers", None)
    rows = []
    for k in range(a.rounds):
        for name in names:
            rows.append(measure(name, a.steps, a.warmup, seq, hidden, layers))
            print(f"round {k + 1} {name}: {rows[-1]['step_s'] * 1e3:.0f} ms", flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
