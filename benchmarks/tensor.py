"""Benchmark: our tensor parallelism (parallel/tensor.py) vs PyTorch DTensor tensor parallelism, with and
without sequence parallelism.

Same model (benchmarks/common.py BENCH_MODEL, tied embeddings), same batch on both tp ranks, same
optimizer (torch AdamW, foreach=False: DTensor's foreach
kernels refuse a mix of DTensor and plain parameters, as the TP plan leaves the norms), 2 gloo ranks, tp = 2. Each implementation runs in its own fresh processes so
its peak RSS is its own; the implementations alternate for `--rounds` rounds and each keeps its best
round (machine noise). A step is forward + backward + optimizer step.

Peer plans (`parallelize_module`), written as torchtitan does for Llama:
- TP: embedding RowwiseParallel (vocab-parallel), per block PrepareModuleInput on each block part's
  `enter` Identity (one f per block part; the part's other arguments need no layouts) + ColwiseParallel wq/wk/wv, gate/up + RowwiseParallel wo, down; LM head ColwiseParallel with
  sharded logits and `loss_parallel()` (vocab-parallel cross-entropy).
- SP: the same with SequenceParallel norms, the row layers' outputs Shard(1) (reduce-scatter) and the
  block parts' inputs gathered from Shard(1) (all-gather).

Prints median step time, peak RSS, the ratio ours / DTensor (goal <= 1.0) and each run's first loss
(they must agree: the same computation).

    python benchmarks/tensor.py [--steps 10] [--rounds 3] [--batch 8] [--seq 256]
"""
from __future__ import annotations

import argparse

from common import BENCH_MODEL, best_of_rounds, parse_options, peak_rss_mb, time_steps



def bench_rank(rank, world, impl, steps, batch, seq):
    import torch

    from fivefold.model import Transformer

    model = Transformer(BENCH_MODEL, seed=0)
    gen = torch.Generator().manual_seed(0)  # tensor-parallel ranks see the same batch
    x = torch.randint(0, BENCH_MODEL.vocab, (batch, seq), generator=gen)
    y = torch.roll(x, -1, 1)
    sp = impl.endswith("sp")
    make = ours_step if impl.startswith("ours") else dtensor_step
    step = make(model, rank, world, sp, x, y)
    first = step()
    times = time_steps(step, warmup=1, steps=steps)
    return {"times": times, "rss_mb": peak_rss_mb(), "first_loss": first}


def ours_step(model, rank, world, sp, x, y):
    import torch

    from fivefold import comm
    from fivefold.comm import CommLedger
    from fivefold.config import ParallelConfig
    from fivefold.mesh import ParallelMesh
    from fivefold.model import loss_sum
    from fivefold.parallel.placement import by_group
    from fivefold.parallel.tensor import TensorParallelism

    mesh = ParallelMesh(ParallelConfig(tp=world), rank, CommLedger(rank, world))
    tp = TensorParallelism(mesh, sp, seed=0)
    tp.apply(model)
    vocab_parallel_loss = tp.loss(loss_sum)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=False)
    partial = by_group(params, "partial").get("tp", [])   # norm weights saw only this rank's tokens

    def step():
        loss = vocab_parallel_loss(model(x), y) / y.numel()
        loss.backward()
        if partial:
            flat = torch.cat([p.grad.reshape(-1) for p in partial])
            comm.all_reduce(flat, mesh["tp"])
            offset = 0
            for p in partial:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())
    return step


def dtensor_plan(model, sp):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    between = Shard(1) if sp else Replicate()  # layout of activations between block parts
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
           "head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    blocks = []
    for block in model.layers:
        plan = {
            # on the `Enter` each block part opens with (model/layers.py: called with x and the part's input
            # projections, which are modules, not tensors: None), so the part's other arguments (rotary
            # tables, KV cache) never have to be listed here
            "attn.enter": PrepareModuleInput(input_layouts=(between, None, None, None),
                                             desired_input_layouts=(Replicate(), None, None, None),
                                             use_local_output=False),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=between),
            "mlp.enter": PrepareModuleInput(input_layouts=(between, None, None),
                                            desired_input_layouts=(Replicate(), None, None), use_local_output=False),
            "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=between),
        }
        if sp:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        blocks.append((block, plan))
    return top, blocks


def dtensor_loss_sum(logits_bsv, targets_bs):
    """The peer's loss as torchtitan writes it: F.cross_entropy on the DTensor logits inside `loss_parallel()`
    (vocab-parallel; fivefold's `loss_sum` takes plain tensors)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits_bsv.flatten(0, 1).float(), targets_bs.flatten(), reduction="sum")


def dtensor_step(model, rank, world, sp, x, y):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    top, blocks = dtensor_plan(model, sp)
    for block, plan in blocks:
        parallelize_module(block, mesh, plan)
    parallelize_module(model, mesh, top)
    if model.cfg.tie_embeddings:
        model.head.weight = model.embed.weight  # both Shard(0) by vocabulary rows: tie them again
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=False)

    def step():
        with loss_parallel():
            loss = dtensor_loss_sum(model(x), y) / y.numel()
            loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    a = parse_options(ap, steps=1, rounds=1, batch=1, seq=32)
    impls = [("dtensor", "DTensor TP"), ("ours", "fivefold TP"),
             ("dtensor_sp", "DTensor TP+SP"), ("ours_sp", "fivefold TP+SP")]
    print(f"model: {BENCH_MODEL.num_params() / 1e6:.2f} M parameters, batch {a.batch}x{a.seq}, tp={a.nproc} "
          f"gloo ranks, {a.steps} timed steps, best of {a.rounds} rounds")
    best = best_of_rounds(bench_rank, a.nproc, impls, lambda impl: (impl, a.steps, a.batch, a.seq), a.rounds)
    print(f"{'impl':<18}{'median step':>13}{'peak RSS':>11}{'first loss':>12}   ours / DTensor (time, memory)")
    peer = {"fivefold TP": "DTensor TP", "fivefold TP+SP": "DTensor TP+SP"}
    for name, r in best.items():
        ratio = ""
        if name in peer:
            b = best[peer[name]]
            ratio = f"{r['median_s'] / b['median_s']:.3f}, {r['peak_rss_mb'] / b['peak_rss_mb']:.3f}"
        print(f"{name:<18}{r['median_s'] * 1e3:>10.1f} ms{r['peak_rss_mb']:>8.0f} MB{r['first_loss']:>12.6f}   {ratio}")


if __name__ == "__main__":
    main()
