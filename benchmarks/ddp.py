"""Benchmark: our data parallel (parallel/data.py) vs torch.nn.parallel.DistributedDataParallel.

Same model, same bucket size, same optimizer (torch AdamW), same batch, 2 gloo ranks, one run; each
implementation runs in its own fresh processes so peak RSS is its own. Prints median step time, peak
RSS and the ratio ours/torch (goal: <= 1.0).

    python benchmarks/ddp.py [--steps 20] [--bucket-mb 4] [--nproc 2]
"""
from __future__ import annotations

import argparse

from common import BENCH_MODEL, best_of_rounds, parse_options, peak_rss_mb, report, time_steps


def bench_rank(rank, world, impl, steps, bucket_mb, batch, seq):
    import torch

    from fivefold.comm import CommLedger
    from fivefold.config import ParallelConfig
    from fivefold.mesh import ParallelMesh
    from fivefold.model import Transformer, loss_sum
    from fivefold.parallel.data import DataParallel

    model = Transformer(BENCH_MODEL, seed=0)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, BENCH_MODEL.vocab, (batch, seq), generator=gen)
    y = torch.roll(x, -1, 1)
    if impl == "ours":
        mesh = ParallelMesh(ParallelConfig(dp=world), rank, CommLedger(rank, world))
        dp = DataParallel(model, mesh, bucket_mb=bucket_mb, average=True)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        loss = loss_sum(net(x), y) / y.numel()
        loss.backward()
        if impl == "ours":
            dp.end_backward()
            dp.finish()
        opt.step()
        if impl == "ours":
            dp.zero_grad()
        else:
            opt.zero_grad(set_to_none=False)

    times = time_steps(step, warmup=3, steps=steps)
    return {"times": times, "rss_mb": peak_rss_mb()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the implementations this many times")
    a = parse_options(ap, steps=1, rounds=1, batch=1, seq=32)
    n = BENCH_MODEL.num_params()
    print(f"model: {n / 1e6:.2f} M parameters, batch {a.batch}x{a.seq} per rank, {a.nproc} gloo ranks, "
          f"bucket {a.bucket_mb} MB, {a.steps} timed steps")
    impls = [("torch", "torch DDP"), ("ours", "fivefold DataParallel")]
    best = best_of_rounds(bench_rank, a.nproc, impls, lambda impl: (impl, a.steps, a.bucket_mb, a.batch, a.seq),
                          a.rounds)
    print(report(list(best.values()), "torch DDP"))


if __name__ == "__main__":
    main()
