"""Benchmark: ZeRO-Offload. Our ZeRO-2 with the optimizer on the host (`offload="cpu"`) or on disk
(`offload="nvme"`) against our ZeRO-2 without offload and DeepSpeed's ZeRO-Offload (ZeRO-2 with
`offload_optimizer: {device: cpu}` and its DeepSpeedCPUAdam, CPU accelerator) and DeepSpeed ZeRO-2.

Same model (benchmarks/common.py BENCH_MODEL), same batch, 2 gloo ranks; each implementation in its own
fresh processes. A step is forward + backward + optimizer step. On this CPU-only machine host = device,
so offload cannot save memory here: what it shows is the cost of the copies and of the host step, and
the state that leaves the device (our engine's `state_bytes()`: device / host / disk). Ratios: ours
cpu vs DeepSpeed's ZeRO-Offload (goal <= 1.0), and each offload mode vs the same engine without it.

    python benchmarks/offload.py [--steps 8] [--rounds 2] [--no-deepspeed]
"""
from __future__ import annotations

import argparse
import os
import tempfile

from common import BENCH_MODEL, best_of_rounds, deepspeed_step, parse_options, peak_rss_mb, time_steps


def bench_rank(rank, world, impl, steps, batch, seq, scratch):
    import torch

    from fivefold.model import Transformer

    model = Transformer(BENCH_MODEL, seed=0)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, BENCH_MODEL.vocab, (batch, seq), generator=gen)
    y = torch.roll(x, -1, 1)
    n_tokens = y.numel() * world
    out = {}
    if impl.startswith("ours"):
        step, engine = ours_step(model, rank, world, impl.split("-")[1], x, y, n_tokens, scratch)
    else:
        offload = impl == "ds-offload"   # ZeRO-Offload proper: state and step on the host, DeepSpeedCPUAdam
        zero = {"stage": 2, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        step, engine = deepspeed_step(model, zero, x, y, n_tokens, torch_adam=not offload), None
    out["times"] = time_steps(step, warmup=2, steps=steps)
    out["rss_mb"] = peak_rss_mb()
    if engine is not None:
        out["state"] = engine.state_bytes()
    return out


def ours_step(model, rank, world, offload, x, y, n_tokens, scratch):
    from fivefold.comm import CommLedger
    from fivefold.config import ParallelConfig
    from fivefold.mesh import ParallelMesh
    from fivefold.model import loss_sum
    from fivefold.parallel.zero.engine import ZeroEngine
    from fivefold.parallel.zero.spec import ZeroSpec
    from fivefold.train.optim import AdamW

    mesh = ParallelMesh(ParallelConfig(dp=world), rank, CommLedger(rank, world))
    make = lambda params, decay: AdamW(params, decay, weight_decay=0.1)  # noqa: E731
    engine = ZeroEngine(model, mesh, ZeroSpec(2, offload=offload), make, bucket_mb=4,
                        offload_dir=os.path.join(scratch, "offload") if offload == "nvme" else "")

    def step():
        (loss_sum(model(x), y) / n_tokens).backward()
        engine.end_backward()
        engine.finish()
        engine.step(1e-4)
        engine.zero_grad()
    return step, engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--no-deepspeed", action="store_true")
    a = parse_options(ap, steps=1, rounds=1, batch=1, seq=32)
    impls = [("ours-none", "fivefold ZeRO-2"), ("ours-cpu", "fivefold ZeRO-2 cpu"),
             ("ours-nvme", "fivefold ZeRO-2 nvme")]
    if not a.no_deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed  # noqa: F401
            impls += [("ds-none", "DeepSpeed ZeRO-2"), ("ds-offload", "DeepSpeed ZeRO-Offload")]
        except Exception as e:  # noqa: BLE001
            print(f"DeepSpeed not available: {e}")
    print(f"model: {BENCH_MODEL.num_params() / 1e6:.2f} M parameters, batch {a.batch}x{a.seq} per rank, "
          f"{a.nproc} gloo ranks, {a.steps} timed steps, best of {a.rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="fivefold-offload-bench-") as scratch:
        best = best_of_rounds(bench_rank, a.nproc, impls,
                              lambda impl: (impl, a.steps, a.batch, a.seq, scratch), a.rounds,
                              keep_going=not a.smoke)
    base = {"fivefold ZeRO-2 cpu": "DeepSpeed ZeRO-Offload", "fivefold ZeRO-2 nvme": "fivefold ZeRO-2 cpu",
            "DeepSpeed ZeRO-Offload": "DeepSpeed ZeRO-2"}
    print(f"{'impl':<26}{'median step':>12}{'peak RSS':>10}  {'state on device / host / disk (MiB)':<36}ratio")
    for name, r in best.items():
        state = r.get("state")
        where = ""
        if state:
            host, disk = state.get("host", {}).get("total", 0), state.get("disk", {}).get("total", 0)
            where = f"{state['total'] / 2**20:.1f} / {host / 2**20:.1f} / {disk / 2**20:.1f}"
        ratio = ""
        if name in base and base[name] in best:
            b = best[base[name]]
            ratio = f"{r['median_s'] / b['median_s']:.3f} time vs {base[name]}"
        print(f"{name:<26}{r['median_s'] * 1e3:>9.1f} ms{r['peak_rss_mb']:>7.0f} MB  {where:<36}{ratio}")
    none = best.get("fivefold ZeRO-2")
    if none:
        for name in ("fivefold ZeRO-2 cpu", "fivefold ZeRO-2 nvme"):
            if name in best:
                print(f"{name} / fivefold ZeRO-2: {best[name]['median_s'] / none['median_s']:.3f} time")


if __name__ == "__main__":
    main()
