"""Benchmark: our pipeline runtime (parallel/pipeline/runtime.py) vs torch.distributed.pipelining.

Same model (BENCH_MODEL; 8 layers for interleaved on 4 ranks, which needs layers >= pp·vpp), same
micro-batches, same schedule (1F1B: Schedule1F1B; interleaved 1F1B with vpp = 2:
ScheduleInterleaved1F1B), same optimizer (torch AdamW), tied embeddings in both (ours sums the two
copies' gradients in the runtime's embed all-reduce; for torch the benchmark does the same all-reduce).
Each implementation runs in its own fresh gloo processes (so peak RSS is its own); the two alternate
for `--rounds` rounds and each keeps its best round (the machine is shared).

Per case: median step time (slowest rank), peak RSS (largest rank), the measured bubble (idle share of
the compute timeline of the last step: F and B blocks timed on every rank) and the simulator's bubble
for the same schedule with unit costs (F=1, B=2) and with the measured mean cost per chunk. Ratios are
ours / torch (goal <= 1.0). Both F blocks include the loss (torch computes it outside forward_one_chunk,
so its timed F block is extended to the loss's end).

    python benchmarks/pipeline.py [--steps 10] [--microbatches 8] [--batch 16] [--seq 256] [--rounds 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from common import BENCH_MODEL, parse_options, peak_rss_mb, time_steps

from fivefold.train.launch import run_ranks

CASES = [  # (pp, schedule, vpp, layers)
    (2, "1f1b", 1, 4), (2, "interleaved", 2, 4), (4, "1f1b", 1, 4), (4, "interleaved", 2, 8),
]


def data(cfg, batch, seq, microbatches):
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)
    y = torch.roll(x, -1, 1)
    from fivefold.parallel.microbatch import cut

    return x, y, cut(x, y, microbatches, y.numel())


def ours(rank, world, cfg, schedule, vpp, batch, seq, microbatches):
    """Our runtime on this rank's stage; returns the step function and the last step's timeline."""
    import torch

    from fivefold import comm
    from fivefold.comm import CommLedger
    from fivefold.config import ParallelConfig
    from fivefold.mesh import ParallelMesh
    from fivefold.model import Transformer, loss_sum
    from fivefold.parallel.pipeline import build_schedule, partition_layers
    from fivefold.parallel.pipeline.runtime import PipelineRuntime, Stage

    mesh = ParallelMesh(ParallelConfig(pp=world, vpp=vpp, schedule=schedule, microbatches=microbatches), rank,
                        CommLedger(rank, world))
    part = partition_layers(cfg.layers, world, vpp)
    stage = Stage(Transformer(cfg, seed=0), part, rank)
    runtime = PipelineRuntime(stage, build_schedule(schedule, world, microbatches, vpp)[rank], mesh["pp"])
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-4, foreach=True)
    _, y, mbs = data(cfg, batch, seq, microbatches)

    def step():
        runtime.run(mbs, loss_sum)
        if stage.tied is not None:
            comm.all_reduce(stage.tied.grad, mesh["embed"], dim="embed")
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step, lambda: [tuple(b) for b in runtime.timeline]


def torch_pipelining(rank, world, cfg, schedule, vpp, batch, seq, microbatches):
    """torch.distributed.pipelining with the same chunks; F/B blocks timed by wrapping the stage's
    forward_one_chunk / backward_one_chunk."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from fivefold.model import Transformer, loss_sum
    from fivefold.parallel.pipeline import partition_layers

    full = Transformer(cfg, seed=0)
    part = partition_layers(cfg.layers, world, vpp)
    last = part.chunks - 1

    class Chunk(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c = c
            self.embed = full.embed if c == 0 else None
            self.layers = nn.ModuleList(full.layers[i] for i in part.layers_of(c))
            if c == last:
                self.norm, self.head = full.norm, full.head
                if cfg.tie_embeddings:
                    self.head.weight = nn.Parameter(full.head.weight.detach().clone())

        def forward(self, x):
            cos, sin = full.rope(x.shape[1])
            if self.embed is not None:
                x = self.embed(x)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.head(self.norm(x)) if self.c == last else x

    chunks = [Chunk(c) for c in part.chunks_of(rank)]
    x, y, _ = data(cfg, batch, seq, microbatches)
    n_tokens = y.numel()
    stages = [PipelineStage(m, m.c, part.chunks, torch.device("cpu")) for m in chunks]
    timeline = []
    for st in stages:
        timed(st, "forward_one_chunk", "F", timeline)
        timed(st, "backward_one_chunk", "B", timeline)

    def loss_fn(logits, target):
        loss = loss_sum(logits, target) / n_tokens
        # torch computes the loss right after the last stage's forward_one_chunk, outside it: counted in that
        # F block, as our runtime's F blocks count theirs, so the two bubbles are measured alike
        if timeline and timeline[-1][0] == "F":
            kind, c, stage_index, t0, _ = timeline[-1]
            timeline[-1] = (kind, c, stage_index, t0, time.perf_counter())
        return loss

    if schedule == "1f1b":
        sched = Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    tied = [p for m in chunks for p in ([m.embed.weight] if m.embed is not None else [])
            + ([m.head.weight] if m.c == last else [])] if cfg.tie_embeddings else []
    ends = dist.new_group([0, world - 1]) if world > 2 else None
    opt = torch.optim.AdamW([p for m in chunks for p in m.parameters()], lr=1e-4, foreach=True)

    def step():
        timeline.clear()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        for p in tied:
            dist.all_reduce(p.grad, group=ends)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step, lambda: list(timeline)


def timed(stage, method: str, kind: str, timeline: list) -> None:
    inner = getattr(stage, method)

    def run(chunk_id, *args, **kwargs):
        t0 = time.perf_counter()
        out = inner(chunk_id, *args, **kwargs)
        timeline.append((kind, chunk_id, stage.stage_index, t0, time.perf_counter()))
        return out
    setattr(stage, method, run)


def bench_rank(rank, world, impl, schedule, vpp, layers, steps, batch, seq, microbatches):
    import torch.distributed as dist

    cfg = dataclasses.replace(BENCH_MODEL, layers=layers)
    make = ours if impl == "ours" else torch_pipelining
    step, timeline = make(rank, world, cfg, schedule, vpp, batch, seq, microbatches)
    times = time_steps(step, warmup=2, steps=steps)
    rows = [None] * world
    dist.all_gather_object(rows, timeline())
    return {"times": times, "rss_mb": peak_rss_mb(), "timeline": rows}


def bubbles(rows, schedule, pp, microbatches, vpp, layers) -> dict:
    from fivefold.parallel.pipeline import Schedule
    from fivefold.parallel.pipeline.runtime import report

    info = report(rows, Schedule.build(schedule, pp, vpp, microbatches, 0, layers))
    return {"measured": info["measured"]["bubble"], "sim_unit": info["simulated_unit_costs"]["bubble"],
            "sim_measured": info["simulated_measured_costs"]["bubble"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (split into micro-batches)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default="all", help="comma list of indices into CASES, or 'all'")
    a = parse_options(ap, steps=1, rounds=1, microbatches=4, batch=4, seq=32, cases="0,1")   # both schedules
    cases = CASES if a.cases == "all" else [CASES[int(i)] for i in a.cases.split(",")]
    print(f"model: hidden {BENCH_MODEL.hidden}, layers as listed, {a.batch}x{a.seq} tokens per step in "
          f"{a.microbatches} micro-batches, gloo on CPU, {a.steps} timed steps, best of {a.rounds} rounds")
    head = (f"{'case':<26}{'impl':<8}{'median step':>13}{'peak RSS':>10}{'bubble':>8}{'sim(unit)':>10}"
            f"{'sim(meas)':>10}{'time ratio':>11}{'mem ratio':>10}")
    lines = [head]
    for pp, schedule, vpp, layers in cases:
        best: dict[str, dict] = {}
        for _ in range(a.rounds):
            for impl in ("torch", "ours"):
                try:
                    per_rank = run_ranks(bench_rank, pp, (impl, schedule, vpp, layers, a.steps, a.batch, a.seq,
                                                          a.microbatches), timeout_s=900)
                except Exception as e:  # noqa: BLE001 - report what failed and go on
                    if a.smoke:
                        raise
                    best.setdefault(impl, {"error": str(e).strip().splitlines()[-1]})
                    continue
                med = max(statistics.median(r["times"]) for r in per_rank)
                row = {"median_s": med, "rss": max(r["rss_mb"] for r in per_rank),
                       **bubbles(per_rank[0]["timeline"], schedule, pp, a.microbatches, vpp, layers)}
                if "median_s" not in best.get(impl, {}) or med < best[impl]["median_s"]:
                    best[impl] = row
        name = f"pp{pp} {schedule}" + (f" v{vpp}" if vpp > 1 else "") + f" L{layers}"
        for impl in ("torch", "ours"):
            r = best[impl]
            if "error" in r:
                lines.append(f"{name:<26}{impl:<8} failed: {r['error']}")
                continue
            ratio = ""
            if impl == "ours" and "median_s" in best["torch"]:
                t = best["torch"]
                ratio = f"{r['median_s'] / t['median_s']:>11.3f}{r['rss'] / t['rss']:>10.3f}"
            lines.append(f"{name:<26}{impl:<8}{r['median_s'] * 1e3:>10.1f} ms{r['rss']:>7.0f} MB{r['measured']:>8.1%}"
                         f"{r['sim_unit']:>10.1%}{r['sim_measured']:>10.1%}{ratio}")
        print("\n".join(lines[-2:]), flush=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
