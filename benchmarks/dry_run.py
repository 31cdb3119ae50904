"""Wall time and peak host RSS of `fivefold train --dry-run --ranks stages` (fivefold/tools/dryrun.py), and the
measured-vs-planned memory per stage it prints.

    PYTHONPATH=src python benchmarks/dry_run.py                 # Llama-3 405B, tp8 x pp16 x dp128, every stage
    PYTHONPATH=src python benchmarks/dry_run.py --stages 0 15   # some stages only
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-405b", help="a planner preset (or `tiny`)")
    ap.add_argument("--layout", default="tp=8,pp=16,dp=128,microbatches=16")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--stages", type=int, nargs="*", help="pipeline stages to run (default: every stage)")
    ap.add_argument("--out", default="/tmp/fivefold-dry-run")
    a = common.parse_options(ap, model="tiny", layout="tp=2,pp=2,microbatches=2", seq=32, global_batch=2,
                             stages=[0])
    from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from fivefold.tools.dryrun import dry_run, model_of_preset, stage_ranks, table

    if a.model == "tiny":   # --smoke: the suite's tiny Llama
        model_of_preset = lambda _: ModelConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128,  # noqa: E731
                                                max_seq=64)

    par = {k: int(v) for k, v in (kv.split("=") for kv in a.layout.split(","))}
    cfg = Config(model=model_of_preset(a.model), parallel=ParallelConfig(**par),
                 train=TrainConfig(steps=1, global_batch=a.global_batch, seq_len=a.seq, dtype="bf16", warmup=1,
                                   checkpoint=False))
    cfg.validate(cfg.parallel.world_size)
    ranks = stage_ranks(cfg)
    if a.stages is not None:
        ranks = [ranks[s] for s in a.stages]
    t0 = time.perf_counter()
    report = dry_run(cfg, ranks, 1, Path(a.out))
    wall = time.perf_counter() - t0
    print(table(report))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{a.model} {a.layout} seq {a.seq}: {len(ranks)} stage rank(s) in {wall:.0f} s, peak RSS {peak:.2f} GiB, "
          f"ledger equals plan: {report['ledger_equals_plan']}")


if __name__ == "__main__":
    main()
