"""Benchmark: our ZeRO vs PyTorch FSDP2 (`fully_shard`), our DP, and DeepSpeed ZeRO where it installs.

Same model (benchmarks/common.py BENCH_MODEL), same batch, 2 gloo ranks, one run; each implementation
in its own fresh processes so its peak RSS is its own. A step is forward + backward + optimizer step.
Rows: ours ZeRO-1/2/3 (ZeRO-3 also with its prefetch depth 2) and our DP; torch FSDP2 (per-block fully_shard, reshard after forward);
DeepSpeed ZeRO-1/2/3 (CPU accelerator) when `import deepspeed` works. Ratios: ZeRO-3 vs FSDP2
(goal <= 1.0 in time and memory), ZeRO-1/2 vs our DP.

    python benchmarks/zero.py [--steps 10] [--rounds 2] [--no-deepspeed]
"""
from __future__ import annotations

import argparse

from common import BENCH_MODEL, best_of_rounds, deepspeed_step, parse_options, peak_rss_mb, time_steps



def bench_rank(rank, world, impl, steps, batch, seq):
    import torch

    from fivefold.model import Transformer

    model = Transformer(BENCH_MODEL, seed=0)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, BENCH_MODEL.vocab, (batch, seq), generator=gen)
    y = torch.roll(x, -1, 1)
    n_tokens = y.numel() * world
    if impl.startswith("ours"):
        step = ours_step(model, rank, world, impl, x, y, n_tokens)
    elif impl == "fsdp2":
        step = fsdp2_step(model, world, x, y, n_tokens)
    else:
        step = deepspeed_step(model, {"stage": int(impl[-1]), "reduce_bucket_size": 2**20,
                                      "allgather_bucket_size": 2**20}, x, y, n_tokens)
    return {"times": time_steps(step, warmup=2, steps=steps), "rss_mb": peak_rss_mb()}


def ours_step(model, rank, world, impl, x, y, n_tokens):
    from fivefold.comm import CommLedger
    from fivefold.config import ParallelConfig
    from fivefold.mesh import ParallelMesh
    from fivefold.model import loss_sum
    from fivefold.parallel.data import DataParallelOptimizer
    from fivefold.parallel.zero.engine import ZeroEngine
    from fivefold.parallel.zero.spec import ZeroSpec
    from fivefold.train.optim import AdamW

    mesh = ParallelMesh(ParallelConfig(dp=world), rank, CommLedger(rank, world))
    make = lambda params, decay: AdamW(params, decay, weight_decay=0.1)  # noqa: E731
    stage = int(impl[4])                      # "ours3" or "ours3-prefetch2" (parallel.zero_prefetch)
    depth = int(impl.rsplit("prefetch", 1)[1]) if "prefetch" in impl else 1
    engine = (ZeroEngine(model, mesh, ZeroSpec(stage, prefetch=depth), make, bucket_mb=4) if stage else
              DataParallelOptimizer(model, mesh, make, bucket_mb=4))

    def step():
        (loss_sum(model(x), y) / n_tokens).backward()
        engine.end_backward()
        engine.finish()
        engine.step(1e-4)
        engine.zero_grad()
    return step


def fsdp2_step(model, world, x, y, n_tokens):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fivefold.model import loss_sum

    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step():
        (loss_sum(model(x), y) / n_tokens).backward()
        opt.step()
        opt.zero_grad()
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--no-deepspeed", action="store_true")
    a = parse_options(ap, steps=1, rounds=1, batch=1, seq=32)
    impls = [("fsdp2", "torch FSDP2"), ("ours3", "fivefold ZeRO-3"), ("ours3-prefetch2", "fivefold ZeRO-3 depth 2"),
             ("ours0", "fivefold DP"), ("ours1", "fivefold ZeRO-1"), ("ours2", "fivefold ZeRO-2")]
    if not a.no_deepspeed:
        try:
            import deepspeed  # noqa: F401
            impls += [(f"ds{s}", f"DeepSpeed ZeRO-{s}") for s in (1, 2, 3)]
        except Exception as e:  # noqa: BLE001
            print(f"DeepSpeed not available: {e}")
    print(f"model: {BENCH_MODEL.num_params() / 1e6:.2f} M parameters, batch {a.batch}x{a.seq} per rank, "
          f"{a.nproc} gloo ranks, {a.steps} timed steps, best of {a.rounds} rounds")
    best = best_of_rounds(bench_rank, a.nproc, impls, lambda impl: (impl, a.steps, a.batch, a.seq), a.rounds,
                          keep_going=not a.smoke)
    print(f"{'impl':<22}{'median step':>13}{'peak RSS':>11}{'time ratio':>20}{'mem ratio':>11}")
    base = {"fivefold ZeRO-3": "torch FSDP2", "fivefold ZeRO-3 depth 2": "torch FSDP2",
            "fivefold ZeRO-1": "fivefold DP", "fivefold ZeRO-2": "fivefold DP"}
    for name, r in best.items():
        ratio = ""
        if name in base and base[name] in best:
            b = best[base[name]]
            ratio = (f"{r['median_s'] / b['median_s']:>8.3f} vs {base[name]:<11}"
                     f"{r['peak_rss_mb'] / b['peak_rss_mb']:>6.3f}")
        print(f"{name:<22}{r['median_s'] * 1e3:>10.1f} ms{r['peak_rss_mb']:>8.0f} MB  {ratio}")


if __name__ == "__main__":
    main()
