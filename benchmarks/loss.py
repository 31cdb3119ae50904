"""Benchmark: the loss alone, fivefold's (model/loss.py: the gradient made in the forward, a block of rows at
a time) against `F.cross_entropy` as a plain transformers loop calls it (logits upcast to fp32, summed), one
rank, one intra-op thread.

For each (tokens, vocab, logits dtype): the median forward + backward seconds over `--steps` calls of each,
alternating, after one warm-up each; then, once each under fivefold's byte counter (tools/dryrun.py
`live_bytes`: every storage an op makes, while it is alive), the most bytes made and alive at once, forward to
backward, beyond one tensor of the logits' size: the logits' gradient, the backward's output, alike for both.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/loss.py [--steps 8] [--shapes 2048x8192 512x128256]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import common  # puts src/ on the path
import torch
import torch.nn.functional as F

from fivefold.model.loss import IGNORE_INDEX, loss_sum
from fivefold.tools.dryrun import live_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def plain(logits_tv, targets_t):
    return F.cross_entropy(logits_tv.float(), targets_t, reduction="sum", ignore_index=IGNORE_INDEX)


def ours(logits_tv, targets_t):
    return loss_sum(logits_tv[None], targets_t[None])


def one_call(fn, logits_tv, targets_t) -> float:
    x = logits_tv.detach().requires_grad_()
    t0 = time.perf_counter()
    (fn(x, targets_t) / targets_t.numel()).backward()
    return time.perf_counter() - t0


def bytes_beyond(fn, logits_tv, targets_t) -> int:
    """The most bytes made and alive at once while `fn` runs forward and backward, less the logits' gradient."""
    x = logits_tv.detach().requires_grad_()
    with live_bytes() as live:
        (fn(x, targets_t) / targets_t.numel()).backward()
    return live.peak - x.numel() * x.element_size()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--shapes", nargs="+", default=["2048x8192", "512x128256"], help="tokens x vocab")
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    a = common.parse_options(ap, steps=1, shapes=["64x256"])
    torch.set_num_threads(1)
    print("| tokens x vocab | logits | F.cross_entropy | fivefold | time ours / plain | bytes beyond the gradient, "
          "plain | fivefold | bytes ours / plain |\n|---|---|---|---|---|---|---|---|")
    for shape in a.shapes:
        tokens, vocab = map(int, shape.split("x"))
        gen = torch.Generator().manual_seed(0)
        targets_t = torch.randint(0, vocab, (tokens,), generator=gen)
        targets_t[::9] = IGNORE_INDEX
        for name in a.dtype:
            logits_tv = (torch.randn(tokens, vocab, generator=gen) * 2).to(DTYPES[name])
            times = {"plain": [], "ours": []}
            for fn in (plain, ours):
                one_call(fn, logits_tv, targets_t)
            for i in range(a.steps):
                for fn in ((plain, ours) if i % 2 == 0 else (ours, plain)):
                    times[fn.__name__].append(one_call(fn, logits_tv, targets_t))
            med = {k: statistics.median(v) for k, v in times.items()}
            mem = {fn.__name__: bytes_beyond(fn, logits_tv, targets_t) for fn in (plain, ours)}
            print(f"| {shape} | {name} | {med['plain'] * 1e3:.1f} ms | {med['ours'] * 1e3:.1f} ms | "
                  f"{med['ours'] / med['plain']:.3f} | {mem['plain'] / 2**20:.1f} MiB | {mem['ours'] / 2**20:.1f} MiB | "
                  f"{mem['ours'] / mem['plain']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
