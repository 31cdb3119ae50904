"""`fivefold calibrate`: measure this machine as N local ranks use it, and write a planner topology.

Why. `fivefold plan` predicts a step from an accelerator (peak FLOP/s per dtype, memory, memory
bandwidth) and network tiers (per-rank bandwidth, latency per hop). For a local CPU run those figures
are on no datasheet, and they depend on how many ranks share the cores. This module measures them the
way `fivefold train --nproc N` uses the machine and writes them as a topology TOML that
`fivefold.plan.topology.load_topology` reads.

Method. `calibrate(nproc, quick)` starts N gloo ranks with `run_ranks` (the trainer's launcher: one
intra-op thread per rank), so they compete for the cores exactly as a training run's ranks do. Every
measurement starts on all ranks together (a barrier). A compute or memory figure is the mean call over
one window of wall time that every rank computes through (`_windowed`: at least 120 ms of one rank's
time, stretched by the ranks a core serves), because a step pays the mean and its ranks step in
lockstep: with more ranks than cores a rank computes in scheduler slices, and each keeps its fair share
only while all are busy. The median over ranks is written. Collectives: a block of calls, repeated (2;
a gloo call here is bimodal).

1. Compute (`peak_tflops`, `gemm_kernel_us`). Forward + backward of `F.linear` (the op of every
   `nn.Linear` in the model): 6·T·k·n FLOPs, the forward GEMM and the two backward ones, at transformer
   shapes (T tokens × k in × n out: hidden², hidden × ffn, ffn × hidden, hidden × kv width). The local
   GEMM curve is the planner's own model (plan/gemm.py: per GEMM 2·T·k·n / rate + a per-kernel floor,
   the roofline's memory term aside, these shapes being compute bound): the floor (`gemm_kernel_us`) is
   one forward F.linear at 8 × 8 × 8 outside autograd (GEMM_FLOOR_SHAPE: arithmetic negligible, the time
   is what every kernel pays: dispatch, allocation), and the rate of a dtype
   (`peak_tflops`) the median over the grid's shapes of FLOPs / (time − 3 · floor) (`gemm_curve`; one
   shape disturbed by a neighbour's burst does not move it): fp32, bf16 (CPU bf16 may be faster or slower
   than fp32), fp64. The plain median rate (the flat figure) is a comment. The attention core
   (`model.attention.attention_core`: causal SDPA, K/V heads repeated) forward + backward, FLOPs counted
   as the planner counts them (forward 2·s·heads·(d_qk + d_v)/2 per token, backward twice that), is
   written beside it: `attention_tflops` (median; the planner charges attention FLOPs at it) and
   `attention_tflops_by_seq` (a record).
2. Network (the one [[tier]] "loopback"). all_reduce, all_gather, reduce_scatter and all_to_all through
   `fivefold.comm` on the world group (the group a dp = N mesh builds, recorded in its own ledger as a
   run's would be), and send (each rank of the pairs 0-1, 2-3, ... sends to and receives from the other
   at once, as a pipeline's steady state does), at message sizes 4 KiB ... 16 MiB, in two regimes:
   - in a step: every call follows a ~3 ms compute burst on every rank, and the burst's own time,
     measured alone beside each block (the machine's speed drifts by tens of percent within minutes), is
     subtracted. This is how a training step meets its collectives,
     and on this kind of machine (a VM whose idle vCPUs wake late) it costs far more than the same call
     back to back: a rank that waits for its peer sleeps, and waking it can take a scheduler tick;
   - back to back (recorded in comments): calls with nothing between them, a network's usual benchmark.
   A call's time is the mean over a block of calls (a step pays the mean; single calls are bimodal), per
   repetition the slowest rank's, then the median over repetitions. The times are fitted by the
   planner's own model, t = hops · alpha + bytes_sent / bandwidth, with
   hops = `topology.collective_latency(op, N, 1, "gloo")` and bytes_sent = `comm.volume.bytes_sent(op, S, N, "gloo")`
   (so bandwidth is per-rank bytes/s in the units the planner divides by), by least squares on the
   relative error (the sizes span four decades): jointly over every op for the tier's `latency_us` and
   `bandwidth_gbps`, and per op for the tier's `ops` table (the planner's fit for that op). Every raw
   median goes into the TOML's comments with the joint fit's error.
   A layer's own collectives are then measured where they happen: the Trainer runs real steps of a small
   model at tp = N (`TP_MODEL`, three sequence lengths, without and with Megatron SP, each collective
   blocking: `parallel.tp_overlap = false`, the planner hides the overlapped share), and each op's
   ledger seconds per step (slowest rank, median over steps) against its calls' hops and bytes give
   all_reduce, all_gather and reduce_scatter their fits in the `ops` table (`tp_step_rows`). The burst
   probe above moved 2-4x between calibrations minutes apart (its call after a burst is bimodal: the
   peer's wake-up), while the real steps hold; all_to_all and send keep the burst fits.
3. Memory bandwidth (`hbm_gbps`). In-place add of two fp32 tensors larger than the last-level cache
   (read 2, write 1), on every rank at once; per rank. A plain copy (read 1, write 1) is recorded too,
   and the time of one eager op on 8 floats (`op_overhead_us`: the floor every op pays, however small
   its tensors) and of the model's own Block forward + backward on 16 tokens of width 64
   (`layer_overhead_us`: the fixed cost of a layer per micro-batch, dispatch, autograd and allocation of
   its ~170 ops, less the floors of the GEMMs the planner charges apart, `layer_overhead_beyond_gemms`).
   The planner charges `layer_overhead_us` per layer per micro-batch, and, as the TOML's
   `elementwise = 1` says, each layer's element-wise traffic (`PlanModel.elementwise_per_token`) at
   `hbm_gbps`: eager PyTorch runs norms, RoPE, SiLU and residual adds as separate memory-bound ops.
4. Memory (`memory_gib`). The machine's RAM divided by N: the ranks share it, and the planner checks
   one rank's memory against the accelerator's.
5. Overlap (the tier's `overlap`): the share of an asynchronous 4 MiB all-reduce that hides behind a
   ~12 ms compute burst on the same rank (burst alone, after it, and async beside it, side by side in each
   repetition; the median over repetitions of each one's share). The planner hides only this share of what its schedule says
   gradient reductions and ZeRO gathers hide behind compute (1.0, all of it, on datasheet tiers). Read
   as interference (docs/plan.md, "Overlap is not free": the pair takes max(c, t + f·c)) it is 1 − f, f
   the share of the compute rate the collective takes; the TOML's comments give f.
6. Pipeline actions (`action_overhead_us`): N ranks run a real 1F1B step of a small model (pp = N, the
   Trainer and pipeline runtime `fivefold train` uses) and the measured makespan is set against the
   schedule simulator's for the same actions with their measured durations and the send fit per
   transfer; the excess per compute action is what the runtime spends between its blocks (posting the
   batched P2P, waiting on receives, a sleeping rank waking late). The planner adds it to each action.
7. Shared cores (`ranks_per_core`): N ranks over the cores this process may use (its affinity), at least
   1. Every rate above is measured with all N ranks busy; with more ranks than cores, a pipeline rank
   idle in its bubble leaves its core to the busy ones, which the planner counts (`time.shared_cores_makespan`:
   a bubble up to min(ranks_per_core, pp) times faster).
8. First touch (`fresh_gbps`): filling a fresh 8 MiB block, above the mmap threshold the ranks fix
   (train/malloc.py), so each is a new mapping whose pages the kernel faults in on first write, far
   slower than the same fill of warm memory (docs/plan.md, "First touch"). The planner charges ZeRO-2/3's
   blocks made anew each step at it (`time.first_touch_bytes`).

The peaks written are achieved rates, not datasheet peaks: plan with `--efficiency 1.0` against this
topology (the TOML says so).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..process import host_cpu

KiB, MiB, GiB = 2**10, 2**20, 2**30
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


@dataclass(frozen=True)
class Sizes:
    """What one calibration measures (full or quick)."""

    gemm: tuple[tuple[int, int, int], ...]          # (tokens, in, out) of F.linear
    gemm_other: tuple[tuple[int, int, int], ...]    # shapes for bf16 and fp64
    attention: tuple[tuple[int, int, int, int, int], ...]   # (batch, heads, kv_heads, seq, head_dim)
    messages: tuple[int, ...]                       # collective message bytes
    compute_reps: int
    comm_reps: int
    memory_mib: int


FULL = Sizes(
    gemm=tuple((t, k, n) for t in (256, 1024) for k, n in ((256, 256), (256, 704), (704, 256), (256, 128),
                                                         (512, 512), (512, 1408), (1408, 512))),
    gemm_other=((1024, 256, 704), (1024, 512, 512)),
    attention=((8, 8, 4, 128, 32), (2, 8, 4, 512, 32), (1, 8, 4, 2048, 32)),
    messages=tuple(4 * KiB * 4**i for i in range(7)),     # 4 KiB ... 16 MiB
    compute_reps=7, comm_reps=7, memory_mib=64)

GEMM_FLOOR_SHAPE = (8, 8, 8)    # F.linear whose arithmetic is negligible: what every GEMM kernel pays

QUICK = Sizes(
    gemm=((256, 256, 256), (256, 256, 704)),
    gemm_other=((256, 256, 256),),
    attention=((2, 4, 2, 128, 32),),
    messages=(4 * KiB, 256 * KiB, 2 * MiB),
    compute_reps=2, comm_reps=3, memory_mib=32)


# -- measured on each rank -----------------------------------------------------------------------------
def _windowed(fn, seconds: float, barrier) -> float:
    """Seconds per call of fn, every rank computing through one shared window of wall time: a warm-up
    call, the barrier, then calls until `seconds` have passed; the calls that ended inside the window
    are counted (the one running at its end finishes uncounted). Every rank is busy from the barrier to
    the window's end, so with more ranks than cores each is timed at its fair share of them, as ranks
    stepping in lockstep run. A count of calls sized by each rank's own warm-up (the way before) timed
    short calls inside one scheduler slice and let the first ranks to finish leave their cores to the
    rest: on 8 ranks and 2 cores the GEMM floor read 6.5-8.7 µs where the window reads 23-27 (2 ranks:
    5.6), and fp32 GEMMs 15.1-24.0 GFLOP/s a rank where it reads 17.2-17.4 (benchmarks/README.md,
    2026-12-05)."""
    fn()
    barrier()
    t0 = time.perf_counter()
    end, last, calls = t0 + seconds, t0, 0
    while True:
        fn()
        t = time.perf_counter()
        if t > end:
            return (last - t0) / calls if calls else t - t0
        last, calls = t, calls + 1


def window_s(reps: int, world: int, cores: int, block_s: float = 0.03) -> float:
    """The shared window: reps blocks of block_s (at least 4) of one rank's time, stretched by the ranks
    a core serves, so each rank computes for about the same seconds of its own share at any world size."""
    return max(4, reps) * block_s * ranks_per_core(world, cores)


def _linear_step(tokens: int, k: int, n: int, dtype):
    """Forward + backward of F.linear on (tokens, k) by an (n, k) weight, and its FLOPs."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(tokens, k, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, n, dtype=dtype)
    return (lambda: F.linear(x, w).backward(dy)), 6.0 * tokens * k * n


def _tiny_gemm(tokens: int, k: int, n: int):
    """One forward F.linear outside autograd: at 8 x 8 x 8 its arithmetic is negligible, so its time is
    the floor one GEMM kernel pays (dispatch, allocation; a GPU's launch and tail)."""
    import torch
    import torch.nn.functional as F

    x, w = torch.randn(tokens, k), torch.randn(n, k)

    def gemm():
        with torch.no_grad():
            F.linear(x, w)
    return gemm


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention, the planner's convention (models.py): forward
    2·s·heads·(d_qk + d_v) per token, halved for the causal mask; backward twice the forward."""
    return 3.0 * batch * seq * 2.0 * seq * heads * (2 * head_dim) * 0.5


def _attention_step(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int):
    """Forward + backward of the model's attention core (causal), and its FLOPs."""
    import torch

    from ..model.attention import attention_core

    q = torch.randn(batch, heads, seq, head_dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, head_dim, requires_grad=True)
    dy = torch.randn(batch, heads, seq, head_dim)
    return (lambda: attention_core(q, k, v, causal=True).backward(dy)), attention_flops(batch, heads, seq, head_dim)


def _measure_compute(sizes: Sizes, barrier, window: float) -> dict:
    """Seconds per call of each GEMM (per dtype) and attention shape, all ranks computing through one
    window (`_windowed`)."""
    import torch

    out: dict = {"gemm": {}, "attention": []}
    grids = {"fp32": (torch.float32, sizes.gemm), "bf16": (torch.bfloat16, sizes.gemm_other),
             "fp64": (torch.float64, sizes.gemm_other)}
    for name, (dtype, shapes) in grids.items():
        rows = []
        for shape in shapes:
            step, flops = _linear_step(*shape, dtype)
            rows.append((list(shape), flops, _windowed(step, window, barrier)))
        out["gemm"][name] = rows
    out["gemm_floor_s"] = _windowed(_tiny_gemm(*GEMM_FLOOR_SHAPE), window, barrier)
    for shape in sizes.attention:
        step, flops = _attention_step(*shape)
        out["attention"].append((list(shape), flops, _windowed(step, window, barrier)))
    return out


# A block above the mmap threshold the ranks fix (rules.MMAP_THRESHOLD_BYTES): each one a fresh mapping
FRESH_BYTES = 8 * MiB


def _fresh_fill() -> None:
    """Fill a new private anonymous mapping of FRESH_BYTES, as malloc maps a block above the threshold the
    ranks fix: every page is faulted in on first write. Mapped here, not through torch.empty, so the
    figure does not hang on this process's malloc state (glibc's own threshold rises after the first
    mapped block is freed, and the blocks after it reuse warm heap pages: one process here filled them
    at 16-48 GB/s where a fresh mapping fills at 1.3-1.5; the 8-rank calibrations read 6-11 GB/s a rank
    so, against 0.32-0.37 now)."""
    import mmap

    import torch

    block = mmap.mmap(-1, FRESH_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = torch.frombuffer(block, dtype=torch.float32)
    view.fill_(1.0)
    del view
    block.close()


def _measure_memory(sizes: Sizes, barrier, window: float) -> dict:
    """Seconds of an in-place add (3 streams) and a copy (2 streams) of fp32 tensors, all ranks through
    one window (`_windowed`); of one eager op, of the tiny Block, and of filling a fresh FRESH_BYTES
    block (first touch)."""
    import torch

    n = sizes.memory_mib * MiB // 4
    a, b = torch.ones(n), torch.ones(n)
    add = _windowed(lambda: a.add_(b), window, barrier)
    copy = _windowed(lambda: a.copy_(b), window, barrier)
    x, y = torch.ones(8), torch.ones(8)
    op = _windowed(lambda: x.add_(y), window, barrier)
    layer = _windowed(_tiny_layer_step(), window, barrier)
    fresh = _windowed(_fresh_fill, window, barrier)
    return {"bytes": 4 * n, "add_s": add, "copy_s": copy, "op_s": op, "layer_s": layer, "fresh_s": fresh}


TINY_LAYER = dict(vocab=16, hidden=64, layers=1, heads=4, kv_heads=2, ffn=176, max_seq=16)


def layer_overhead_beyond_gemms(layer_s: float, floor: float) -> float:
    """`layer_overhead_us` as the planner charges it beside the GEMM floors: the tiny Block's measured
    forward + backward less the floors of the GEMMs the planner counts in such a layer (plan/gemm.py
    `layer_gemms`, three kernels each: forward, dgrad, wgrad), which it charges apart; at least 0. So the
    planner's time for the tiny Block, layer overhead plus GEMM floors, is the measured time."""
    from ..config import ModelConfig
    from ..plan.gemm import layer_gemms
    from ..plan.models import from_model_config

    cfg = ModelConfig(**TINY_LAYER)
    kernels = 3 * len(layer_gemms(from_model_config(cfg), False, float(cfg.max_seq), 1, 1))
    return max(0.0, layer_s - kernels * floor)


def _tiny_layer_step():
    """Forward + backward of the model's own transformer Block on 16 tokens of width 64: its arithmetic is
    negligible, so the time is what every layer pays per micro-batch whatever its size (op dispatch,
    autograd, allocation)."""
    import torch

    from ..config import ModelConfig
    from ..model import Transformer

    model = Transformer(ModelConfig(**TINY_LAYER), seed=0)
    block, cos_sin = model.layers[0], model.rope(16)
    x = torch.randn(1, 16, 64, requires_grad=True)
    return lambda: block(x, *cos_sin).sum().backward()


# The pipeline probe: a real 1F1B step of a small model, pp = N (two layers a stage), 8 micro-batches of
# one sequence; its message is PIPELINE_SHAPE's batch x seq x hidden fp32 activation.
PIPELINE_MODEL = dict(vocab=256, hidden=128, heads=4, kv_heads=2, ffn=256, max_seq=64)
PIPELINE_MICROBATCHES, PIPELINE_STEPS = 8, 5


def _measure_pipeline(rank: int, world: int, quick: bool) -> list[list[tuple]]:
    """Each step's compute timeline (kind, micro-batch, chunk, start, end) of this rank running the real
    pipeline runtime (`Trainer` with pp = N): what the runtime spends per action beyond its compute."""
    import numpy as np

    from ..config import Config, ModelConfig, ParallelConfig, TrainConfig
    from ..train.trainer import Trainer

    m, steps = PIPELINE_MICROBATCHES, 3 if quick else PIPELINE_STEPS
    seq = PIPELINE_MODEL["max_seq"]
    cfg = Config(model=ModelConfig(layers=2 * world, **PIPELINE_MODEL), parallel=ParallelConfig(pp=world, microbatches=m),
                 train=TrainConfig(steps=steps, global_batch=m, seq_len=seq, warmup=1, checkpoint=False))
    tokens = np.random.default_rng(0).integers(0, PIPELINE_MODEL["vocab"], 64 * m * seq).astype(np.int64)
    trainer = Trainer(cfg, rank, world, tokens=tokens, quiet=True)
    runtime = next(d for d in trainer.dims if getattr(d, "name", None) == "pp").runtime
    out = []
    for k in range(steps):
        trainer.step(k)
        out.append([tuple(b) for b in runtime.timeline])
    return out[1:]   # the first step warms up


# The tensor-parallel probe: real training steps of a small model at tp = N, without and with Megatron
# SP, at three sequence lengths (their activations: the messages), whose ledger gives the in-step cost of
# the collectives a layer makes: all_reduce (tp), all_gather and reduce_scatter (SP).
TP_MODEL = dict(vocab=256, hidden=128, heads=8, kv_heads=8, ffn=320, layers=2)
TP_BATCH, TP_SEQS, TP_STEPS = 8, (32, 128, 256), 9
TP_SEQS_QUICK = (32, 256)   # --quick: two lengths, 3 steps (each op's fit then passes through both points)
TP_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def tp_probe_fits(world: int) -> bool:
    """Whether the tensor-parallel probe's model splits over `world` ranks (heads and ffn divisible)."""
    return TP_MODEL["heads"] % world == 0 and TP_MODEL["kv_heads"] % world == 0 and TP_MODEL["ffn"] % world == 0


def _measure_tp_steps(rank: int, world: int, quick: bool) -> list[dict]:
    """Per probe config (sp mode, sequence length), per timed step, this rank's tp ledger rows
    {op: (calls, bytes_sent, seconds)} of the real Trainer at tp = N: the in-step cost of a layer's
    collectives, with the skew and late wake-ups a real step has (the burst probe only imitates them).
    Blocking (`parallel.tp_overlap = false`): the ops table holds a collective's whole in-step cost, and
    the planner hides its overlapped share itself (plan/time.py `tp_hidden`); measured with the overlap on,
    the ledger's seconds would be what is left after hiding, and the plan would hide it twice."""
    import numpy as np

    from ..config import Config, ModelConfig, ParallelConfig, TrainConfig
    from ..train.trainer import Trainer

    if not tp_probe_fits(world):
        return []
    steps, seqs = (3, TP_SEQS_QUICK) if quick else (TP_STEPS, TP_SEQS)
    out = []
    for sp in ("none", "megatron"):
        for seq in seqs:
            parallel = ParallelConfig(tp=world, sp_mode=sp, tp_overlap=False)
            cfg = Config(model=ModelConfig(max_seq=seq, **TP_MODEL), parallel=parallel,
                         train=TrainConfig(steps=steps + 1, global_batch=TP_BATCH, seq_len=seq, warmup=1,
                                           checkpoint=False))
            tokens = np.random.default_rng(0).integers(0, TP_MODEL["vocab"], 64 * TP_BATCH * seq).astype(np.int64)
            trainer = Trainer(cfg, rank, world, tokens=tokens, quiet=True)
            trainer.step(0)                                    # warm-up
            rows = []
            for k in range(1, steps + 1):
                before = {r["op"]: r for r in trainer.ledger.rows() if r["dim"] == "tp"}
                trainer.step(k)
                after = {r["op"]: r for r in trainer.ledger.rows() if r["dim"] == "tp"}
                rows.append({op: tuple(r[f] - before.get(op, {}).get(f, 0.0) for f in ("calls", "bytes_sent", "seconds"))
                             for op, r in after.items() if op in TP_OPS})
            out.append({"sp": sp, "seq": seq, "steps": rows})
    return out


def tp_step_rows(per_rank: list[list[dict]], world: int) -> dict[str, list[tuple[float, float, float]]]:
    """Per op, one row (hops, bytes_sent, seconds) per probe config for `fit_alpha_beta`: a step's calls ×
    the op's hops and bytes sent, and its seconds, the slowest rank's per step, the median over steps
    (as plan_vs_run and a step pay them)."""
    from ..plan.topology import collective_latency

    out: dict[str, list] = {}
    for c, config in enumerate(per_rank[0]):
        for op in TP_OPS:
            steps = [[r[c]["steps"][k].get(op) for r in per_rank] for k in range(len(config["steps"]))]
            if not steps or any(row is None for ranks in steps for row in ranks):
                continue
            calls, sent, _ = steps[0][0]
            seconds = statistics.median(max(row[2] for row in ranks) for ranks in steps)
            out.setdefault(op, []).append((calls * collective_latency(op, world, 1.0, "gloo"), sent, seconds))
    return out


def pipeline_action_overhead(per_rank_steps: list[list[list[tuple]]], world: int, send_s: float) -> float:
    """Seconds per compute action that the planner's pipeline model misses: per step, the measured
    makespan minus the makespan the schedule simulator gives for the same action list with each action's
    measured duration and `send_s` per transfer (the planner's own p2p cost for the message), over the
    actions per rank; the median over steps, at least 0."""
    from ..parallel.pipeline.schedules import build_schedule, simulate
    from ..rules import ONE_F_ONE_B

    actions = build_schedule(ONE_F_ONE_B, world, PIPELINE_MICROBATCHES, 1)
    per_rank_actions = sum(1 for a in actions[0] if not a.is_comm)
    excess = []
    for k in range(len(per_rank_steps[0])):
        rows = [steps[k] for steps in per_rank_steps]
        start = min(b[3] for row in rows for b in row)
        end = max(b[4] for row in rows for b in row)
        took = {(kind, mb, c): e - s for row in rows for kind, mb, c, s, e in row}
        cost = lambda a: took[(a.kind, a.microbatch, a.chunk)]   # noqa: E731
        sim = simulate(actions, cost, cost, cost, cost, send_s)
        excess.append((end - start - sim.makespan) / per_rank_actions)
    return max(0.0, statistics.median(excess))


def _collective_call(op: str, size: int, group):
    """A no-argument call of one collective with a message of about `size` bytes, and its message bytes
    (what comm/volume.py calls S)."""
    import torch

    from .. import comm

    n, r = group.size, group.rank
    elems = max(n, size // 4 // n * n)
    full = torch.ones(elems)
    part = torch.ones(elems // n)
    if op == "all_reduce":
        return (lambda: comm.all_reduce(full, group, dim="calibrate")), full.nbytes
    if op == "all_gather":
        return (lambda: comm.all_gather(full, part, group, dim="calibrate")), full.nbytes
    if op == "reduce_scatter":
        return (lambda: comm.reduce_scatter(part, full, group, dim="calibrate")), full.nbytes
    if op == "all_to_all":
        other = torch.empty_like(full)
        return (lambda: comm.all_to_all(other, full, group, dim="calibrate")), full.nbytes
    peer = r ^ 1
    got = torch.empty_like(full)
    if peer >= n:                       # odd world: the last rank has no partner
        return (lambda: None), full.nbytes
    # both ways at once, as a pipeline's steady state sends activations one way and gradients the other
    return (lambda: comm.send_recv([(full, peer)], [(got, peer)], group, dim="calibrate")), full.nbytes


def _per_block(size: int, quick: bool) -> int:
    """Calls timed together; a call's time is the block's mean (a step pays the mean of many calls, and
    a gloo call here is bimodal: see the module doc)."""
    return max(2, min(4, MiB // size)) if quick else max(4, min(16, 4 * MiB // size))


def _call_s(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _burst(target_s: float = 0.003):
    """A compute burst of about target_s (forward GEMMs), like a layer's compute between two collectives."""
    import torch
    import torch.nn.functional as F

    x, w = torch.randn(512, 256), torch.randn(704, 256)
    F.linear(x, w)                      # warm-up
    one = min(_call_s(lambda: F.linear(x, w)) for _ in range(3))
    n = max(1, round(target_s / one))

    def burst():
        for _ in range(n):
            F.linear(x, w)
    return burst


def _block_means(call, burst, k: int, reps: int, barrier) -> list[float]:
    """Per repetition, the mean seconds of k × (burst, then call), every rank starting together."""
    out = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            burst()
            call()
        out.append((time.perf_counter() - t0) / k)
    return out


def _measure_collectives(sizes: Sizes, group, barrier) -> dict:
    """Per op: [(message bytes, back-to-back seconds per rep, after-compute seconds per rep)]. After
    compute: each call follows a ~3 ms compute burst on every rank, and the burst's own time (measured
    alone in the same repetition, just before) is subtracted: the regime of a training step, where a rank
    reaches each collective after computing. Back to back: calls with nothing between them."""
    def nothing():
        pass

    burst = _burst()
    out = {}
    for op in COLLECTIVES:
        rows = []
        for size in sizes.messages:
            call, message = _collective_call(op, size, group)
            call()                                          # warm-up: connections, buffers
            k = _per_block(size, sizes is QUICK)
            b2b, after = [], []
            for _ in range(sizes.comm_reps):   # the burst alone beside each block: the machine's speed drifts
                b2b += _block_means(call, nothing, k, 1, barrier)
                base = _block_means(nothing, burst, k, 1, barrier)[0]
                after.append(_block_means(call, burst, k, 1, barrier)[0] - base)
            rows.append((message, b2b, after))
        out[op] = rows
    return out


OVERLAP_BYTES = 4 * MiB


def _measure_overlap(sizes: Sizes, group, barrier) -> dict:
    """How much of an asynchronous all-reduce hides behind compute on the same rank, as DDP's bucket
    reduction and ZeRO-3's prefetch rely on: seconds of (a) a ~12 ms compute burst alone, (b) the
    all-reduce of 4 MiB after a burst (in a step), (c) the all-reduce issued asynchronously, the burst,
    then the wait. hidden = (a + b - c) / b: 1 when the collective costs the rank nothing, 0 when it is
    serial. A gloo collective needs the CPU (copies, sums, sockets): with one core per rank it competes
    with the compute it should hide behind."""
    import torch

    from .. import comm

    burst, t = _burst(0.012), torch.ones(OVERLAP_BYTES // 4)

    def nothing():
        pass

    def overlapped():
        handle = comm.all_reduce(t, group, async_op=True, dim="calibrate")
        burst()
        handle.wait()

    def serial():
        comm.all_reduce(t, group, dim="calibrate")

    serial()
    out = {"burst": [], "serial": [], "overlapped": []}
    for _ in range(2 * sizes.comm_reps):   # the three side by side in each repetition: the machine's speed drifts
        out["burst"] += _block_means(nothing, burst, 4, 1, barrier)
        out["serial"] += _block_means(serial, burst, 4, 1, barrier)
        out["overlapped"] += _block_means(overlapped, nothing, 4, 1, barrier)
    return out


def _rank(rank: int, world: int, quick: bool) -> dict:
    """One rank's raw measurements (runs inside `run_ranks`)."""
    import torch.distributed as dist

    from ..comm import CommLedger
    from ..config import ParallelConfig
    from ..mesh import ParallelMesh

    sizes = QUICK if quick else FULL
    group = ParallelMesh(ParallelConfig(dp=world), rank, CommLedger(rank, world))["dp"]
    barrier = dist.barrier
    window = window_s(sizes.compute_reps, world, usable_cores())
    out = {"compute": _measure_compute(sizes, barrier, window), "memory": _measure_memory(sizes, barrier, window),
           "comm": _measure_collectives(sizes, group, barrier), "overlap": _measure_overlap(sizes, group, barrier)}
    barrier()
    out["pipeline"] = _measure_pipeline(rank, world, quick)
    barrier()
    out["tp_steps"] = _measure_tp_steps(rank, world, quick)
    return out


# -- other users of the machine -------------------------------------------------------------------------
def _machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot, hypervisor steal included (None: no /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and everything it started: its own, its reaped children's, and each live
    descendant's with the children that one reaped. Ranks fork from a fork server (train/launch.py), so they
    are the server's children: `os.times()` alone would count them as another process's load."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _descendants_cpu_s(os.getpid())


def _descendants_cpu_s(root: int) -> float:
    """utime + stime + cutime + cstime of every live descendant of `root` (/proc; 0 without it)."""
    children, cpu = {}, {}
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue                      # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(pid))
        cpu[int(pid)] = sum(int(x) for x in fields[11:15])
    total, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += cpu[pid]
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """Cores' worth of CPU that other processes (or the hypervisor) took while the block ran: the machine's
    busy time minus this process tree's (`_own_cpu_s`: the ranks too), over the wall time. None where
    /proc/stat is missing. A measurement is trustworthy only when this is near 0."""

    def __enter__(self) -> "ForeignLoad":
        self.cores = None
        self._start = (_machine_busy_s(), _own_cpu_s(), time.monotonic())
        return self

    def __exit__(self, *exc) -> None:
        busy0, own0, t0 = self._start
        busy1 = _machine_busy_s()
        if busy0 is not None and busy1 is not None:
            wall = max(time.monotonic() - t0, 1e-9)
            self.cores = max(0.0, (busy1 - busy0) - (_own_cpu_s() - own0)) / wall


# -- combined in the launcher --------------------------------------------------------------------------
def fit_alpha_beta(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(alpha seconds per hop, bandwidth bytes/s) minimising the relative error of
    t = hops·alpha + bytes/bandwidth over rows of (hops, bytes, seconds); neither term negative."""
    a11 = a12 = a22 = r1 = r2 = 0.0
    for hops, nbytes, t in rows:
        h, b = hops / t, nbytes / t
        a11, a12, a22, r1, r2 = a11 + h * h, a12 + h * b, a22 + b * b, r1 + h, r2 + b
    det = a11 * a22 - a12 * a12
    alpha = (r1 * a22 - r2 * a12) / det if det > 0 else 0.0
    inv_bw = (a11 * r2 - a12 * r1) / det if det > 0 else 0.0
    if alpha < 0 or det <= 0:
        alpha, inv_bw = 0.0, r2 / a22
    if inv_bw <= 0:
        alpha, inv_bw = r1 / a11, 1e-15
    return alpha, 1.0 / inv_bw


def _rate(rows: list[tuple[list, float, float]]) -> float:
    """Median over a grid's shapes of FLOPs / seconds (robust to a neighbour's burst during one shape)."""
    return statistics.median(f / t for _, f, t in rows)


def gemm_curve(rows: list[tuple[list, float, float]], floor: float) -> float:
    """The rate (FLOP/s) of the planner's GEMM model (plan/gemm.py) given the per-kernel `floor`, from rows
    of ((T, k, n), FLOPs, seconds) of F.linear forward + backward: three GEMMs of the forward's time
    each, t = 3·(2·T·k·n / rate + floor), so each shape gives FLOPs / (t − 3·floor); the median over the
    shapes (the plain median rate where the floor takes a whole time, a disturbed measurement)."""
    rates = [f / (t - 3 * floor) for _, f, t in rows if t > 3 * floor]
    return statistics.median(rates) if rates else _rate(rows)


def _over_ranks(per_rank: list[dict], path, index: int) -> float:
    """Median over ranks of the seconds at per_rank[r][path...][index][2]."""
    vals = []
    for r in per_rank:
        rows = r
        for key in path:
            rows = rows[key]
        vals.append(rows[index][2])
    return statistics.median(vals)


def _compute_summary(per_rank: list[dict]) -> dict:
    first = per_rank[0]["compute"]
    out = {}
    for dtype, rows in first["gemm"].items():
        out[dtype] = [(shape, flops, _over_ranks(per_rank, ("compute", "gemm", dtype), i))
                      for i, (shape, flops, _) in enumerate(rows)]
    out["attention"] = [(shape, flops, _over_ranks(per_rank, ("compute", "attention"), i))
                        for i, (shape, flops, _) in enumerate(first["attention"])]
    return out


def _comm_summary(per_rank: list[dict], world: int, regime: int) -> dict:
    """Per op: [(message bytes, hops, bytes_sent, seconds)] of one regime (1: back to back, 2: after
    compute); seconds: per repetition the slowest rank, then the median over repetitions."""
    from ..comm import volume
    from ..plan.topology import collective_latency

    out = {}
    for op, rows in per_rank[0]["comm"].items():
        table = []
        for i, row in enumerate(rows):
            message = row[0]
            reps = zip(*(r["comm"][op][i][regime] for r in per_rank))
            seconds = max(statistics.median(max(rep) for rep in reps), 1e-5)   # noise floor
            table.append((message, collective_latency(op, world, 1.0, "gloo"), volume.bytes_sent(op, message, world, "gloo"),
                          seconds))
        out[op] = table
    return out


def hidden_share(burst: float, serial: float, both: float) -> float:
    """The share of a collective hidden behind compute: (burst + comm − both) / comm, comm = serial − burst,
    within [0, 1]."""
    comm_s = max(serial - burst, 1e-9)
    return min(1.0, max(0.0, (burst + comm_s - both) / comm_s))


def _overlap_summary(per_rank: list[dict]) -> dict:
    """Median seconds (slowest rank per repetition) of the overlap test's three blocks, and the hidden share:
    the median over repetitions of each repetition's own share (its three blocks ran side by side, so a
    drift of the machine's speed between repetitions moves all three)."""
    reps = {key: [max(rep) for rep in zip(*(r["overlap"][key] for r in per_rank))]
            for key in ("burst", "serial", "overlapped")}
    burst, serial, both = (statistics.median(reps[k]) for k in ("burst", "serial", "overlapped"))
    hidden = statistics.median(hidden_share(*row) for row in zip(reps["burst"], reps["serial"], reps["overlapped"]))
    return {"burst_s": burst, "comm_s": max(serial - burst, 1e-9), "overlapped_s": both, "hidden": hidden}


def _fits(comm: dict) -> dict:
    """The joint (latency, bandwidth) fit over every op, and each op's own."""
    rows = [(h, b, t) for table in comm.values() for _, h, b, t in table]
    return {"joint": fit_alpha_beta(rows),
            "per_op": {op: fit_alpha_beta([(h, b, t) for _, h, b, t in table]) for op, table in comm.items()}}


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; the machine's count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def ranks_per_core(nproc: int, cores: int) -> float:
    """Local ranks per core: nproc / cores when the ranks outnumber the cores, else 1 (a core each)."""
    return max(1.0, nproc / max(1, cores))


def _ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def summarize(per_rank: list[dict], nproc: int, quick: bool) -> dict:
    """The calibration from every rank's raw measurements."""
    compute = _compute_summary(per_rank)
    comm = {"in_step": _comm_summary(per_rank, nproc, 2), "back_to_back": _comm_summary(per_rank, nproc, 1)}
    fits = {regime: _fits(table) for regime, table in comm.items()}
    tp_rows = tp_step_rows([r["tp_steps"] for r in per_rank], nproc) if per_rank[0].get("tp_steps") else {}
    fits["tp_steps"] = {op: fit_alpha_beta(rows) for op, rows in tp_rows.items() if len(rows) >= 2}
    alpha, bandwidth = fits["in_step"]["joint"]
    overlap = _overlap_summary(per_rank)
    mem = per_rank[0]["memory"]
    add = statistics.median(r["memory"]["add_s"] for r in per_rank)
    copy = statistics.median(r["memory"]["copy_s"] for r in per_rank)
    op = statistics.median(r["memory"]["op_s"] for r in per_rank)
    layer = statistics.median(r["memory"]["layer_s"] for r in per_rank)
    fresh = statistics.median(r["memory"]["fresh_s"] for r in per_rank)
    ram = _ram_bytes()
    send_latency, send_bandwidth = fits["in_step"]["per_op"]["send"]
    message = PIPELINE_MODEL["hidden"] * PIPELINE_MODEL["max_seq"] * 4
    action = pipeline_action_overhead([r["pipeline"] for r in per_rank], nproc,
                                      send_latency + message / send_bandwidth)
    floor = statistics.median(r["compute"]["gemm_floor_s"] for r in per_rank)
    return {
        "nproc": nproc, "quick": quick, "host": platform.node(), "cpu": host_cpu(),
        "cores": usable_cores(), "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "peak_flops": {d: gemm_curve(compute[d], floor) for d in ("fp32", "bf16", "fp64")},
        "median_flops": {d: _rate(compute[d]) for d in ("fp32", "bf16", "fp64")}, "gemm_kernel": floor,
        "attention_flops": _rate(compute["attention"]),
        "compute": compute,
        "memory_bandwidth": 3 * mem["bytes"] / add, "copy_bandwidth": 2 * mem["bytes"] / copy,
        "fresh_bandwidth": FRESH_BYTES / fresh,
        "memory_test_bytes": mem["bytes"], "op_overhead": op, "layer_s": layer,
        "layer_overhead": layer_overhead_beyond_gemms(layer, floor), "action_overhead": action,
        "ram_bytes": ram, "memory_per_rank": ram / nproc,
        "overlap": overlap, "latency": alpha, "bandwidth": bandwidth,
        "per_op_fit": {**fits["in_step"]["per_op"], **fits["tp_steps"]}, "tp_rows": tp_rows,
        "tp_seqs": sorted({c["seq"] for c in per_rank[0].get("tp_steps") or []}),
        "fits": fits, "comm": comm,
    }


QUIET_CORES = 0.1     # foreign load (cores) under which a calibration counts as undisturbed


def calibrate(nproc: int, quick: bool, attempts: int | None = None) -> dict:
    """Measure this machine with `nproc` local gloo ranks running together (see the module doc). On a
    shared machine, up to `attempts` calibrations (default 1 quick, 3 full) run until one is undisturbed
    (`ForeignLoad` below QUIET_CORES); the least disturbed is kept, its foreign load recorded."""
    from ..config import ConfigError
    from ..train.launch import run_ranks

    if nproc < 2:
        raise ConfigError(f"calibrate needs at least 2 ranks to measure collectives; got --nproc {nproc}")
    best = None
    for _ in range(attempts or (1 if quick else 3)):
        with ForeignLoad() as load:
            per_rank = run_ranks(_rank, nproc, (quick,), timeout_s=600)
        cal = summarize(per_rank, nproc, quick)
        cal["foreign_cores"] = load.cores
        if best is None or (load.cores or 0.0) < (best["foreign_cores"] or 0.0):
            best = cal
        if load.cores is None or load.cores < QUIET_CORES:
            break
    return best


# -- the TOML ------------------------------------------------------------------------------------------
def _g(x: float) -> str:
    return f"{x:.4g}"


def _comment_lines(cal: dict) -> list[str]:
    """What was measured: sizes and raw medians, one comment line each."""
    from ..plan.gemm import gemm_seconds

    floor, hbm = cal["gemm_kernel"], cal["memory_bandwidth"]
    tiny = "x".join(map(str, GEMM_FLOOR_SHAPE))
    lines = ["# GEMM, F.linear forward+backward (6·T·k·n FLOPs), median seconds -> GFLOP/s per rank; the curve",
             "# (plan/gemm.py): 3 x (2·T·k·n / peak + gemm_kernel_us), the floor one forward F.linear at "
             f"{tiny} ({floor * 1e6:.1f} us),",
             "# the peak the median of FLOPs / (time - 3 x floor); fit: the planner's time for the shape, memory",
             "# term at hbm_gbps included:"]
    for dtype in ("fp32", "bf16", "fp64"):
        rate, nbytes = cal["peak_flops"][dtype], {"fp32": 4, "bf16": 2, "fp64": 8}[dtype]
        for (t, k, n), flops, s in cal["compute"][dtype]:
            fit = 3 * gemm_seconds(t, n, k, rate, hbm, nbytes, floor)   # the planner's time, roofline included
            lines.append(f"#   {dtype} T={t} k={k} n={n}: {s * 1e3:.3f} ms, {flops / s / 1e9:.1f} GFLOP/s "
                         f"(fit {fit * 1e3:.3f} ms, {fit / s:.2f}x)")
    med = ", ".join(f"{d} {v / 1e9:.1f}" for d, v in cal["median_flops"].items())
    lines.append(f"#   median rate over the shapes (a record; the flat figure): {med} GFLOP/s")
    lines.append("# attention core (causal SDPA, GQA), forward+backward, planner FLOPs -> GFLOP/s per rank:")
    for (b, h, kv, s_, d), flops, s in cal["compute"]["attention"]:
        lines.append(f"#   b={b} heads={h} kv={kv} seq={s_} d={d}: {s * 1e3:.3f} ms, {flops / s / 1e9:.1f} GFLOP/s")
    mb = cal["memory_test_bytes"] / MiB
    lines.append(f"# memory: in-place add of two {mb:.0f} MiB fp32 tensors (3 streams) "
                 f"{cal['memory_bandwidth'] / 1e9:.2f} GB/s per rank; copy (2 streams) "
                 f"{cal['copy_bandwidth'] / 1e9:.2f} GB/s per rank")
    lines.append(f"# fresh_gbps: filling a fresh {FRESH_BYTES // MiB} MiB block (above the ranks' mmap threshold: new pages "
                 f"faulted in on first touch) {cal['fresh_bandwidth'] / 1e9:.2f} GB/s per rank; the planner charges ZeRO's "
                 "re-gathered units and gradient buffers at it (plan/time.py first_touch_bytes)")
    lines.append("# op_overhead_us (a record; the planner reads layer_overhead_us): an in-place add of 8 floats, the cost of one "
                 f"eager op call: {cal['op_overhead'] * 1e6:.2f} us")
    lines.append("# layer_overhead_us: forward + backward of the model's Block on 16 "
                 f"tokens of width 64, the fixed cost of a layer per micro-batch: {cal['layer_s'] * 1e6:.0f} us, less "
                 "its GEMMs' floors (charged apart):")
    lines.append(f"#   {cal['layer_overhead'] * 1e6:.0f} us")
    lines.append(f"# action_overhead_us: a real 1F1B step (pp = {cal['nproc']}, {PIPELINE_MICROBATCHES} micro-batches) "
                 "took this much longer per compute action than the schedule simulator says with the measured "
                 f"durations and the send fit: {cal['action_overhead'] * 1e6:.0f} us")
    lines.append(f"# ranks_per_core: {cal['nproc']} ranks on {cal['cores']} usable cores; above 1, a pipeline rank idle in its "
                 "bubble leaves its core to the busy ones (plan/time.py shared_cores_makespan)")
    lines.append(f"# RAM {cal['ram_bytes'] / GiB:.2f} GiB shared by {cal['nproc']} ranks: memory_gib is the share of "
                 "one")
    foreign = cal.get("foreign_cores")
    lines.append("# other processes during the calibration: " + ("unknown" if foreign is None else
                 f"{foreign:.2f} cores on average" + (" (disturbed: calibrate again when quiet)"
                                                      if foreign >= QUIET_CORES else "")))
    lines += [
        "# collectives through fivefold.comm on the world group (send: each rank of a pair sends and receives",
        "# at once). Per call: mean over a block of calls, slowest rank, median over repetitions; in a step",
        "# (each call after a ~3 ms compute burst on every rank, the burst's own time subtracted: what the tier",
        "# holds) and back to back. message bytes S, hops, bytes_sent, time in a step (joint fit) | back to back:"]
    a, bw = cal["latency"], cal["bandwidth"]
    b2b = cal["comm"]["back_to_back"]
    for op, table in cal["comm"]["in_step"].items():
        pa, pbw = cal["fits"]["in_step"]["per_op"][op]
        ba, bbw = cal["fits"]["back_to_back"]["per_op"][op]
        lines.append(f"#   {op}: own fit in a step {pa * 1e6:.1f} us/hop, {pbw / 1e9:.3f} GB/s; "
                     f"back to back {ba * 1e6:.1f} us/hop, {bbw / 1e9:.3f} GB/s")
        for (message, hops, sent, t), (*_, tb) in zip(table, b2b[op]):
            pred = hops * a + sent / bw
            lines.append(f"#     S={message:>9d} hops={hops:g} sent={sent:>10.0f} {t * 1e6:>9.1f} us "
                         f"(fit {pred * 1e6:.1f} us, {pred / t:.2f}x) | {tb * 1e6:>9.1f} us")
    ja, jbw = cal["fits"]["back_to_back"]["joint"]
    lines.append(f"#   joint fit back to back: {ja * 1e6:.1f} us/hop, {jbw / 1e9:.3f} GB/s")
    lines += _tp_step_lines(cal)
    ov = cal["overlap"]
    lines.append(f"# overlap (the tier's hidden share of async dp collectives): a {OVERLAP_BYTES // MiB} MiB all_reduce "
                 f"takes {ov['comm_s'] * 1e3:.2f} ms after a {ov['burst_s'] * 1e3:.1f} ms compute burst; issued async")
    lines.append(f"#   before the burst and waited after, burst + all_reduce take {ov['overlapped_s'] * 1e3:.2f} ms: "
                 f"{100 * ov['hidden']:.0f}% of the all_reduce hidden (the median of each repetition's own share)")
    lines.append(f"#   as interference (docs/plan.md, \"Overlap is not free\": the pair takes max(c, t + f·c)): compute "
                 f"beside the collective loses f = 1 - hidden = {1 - ov['hidden']:.2f} of its rate; charged through "
                 "overlap, so the accelerator has no sms")
    return lines


def _tp_step_lines(cal: dict) -> list[str]:
    """The tensor-parallel probe's rows and fits (what the ops table holds for its ops)."""
    rows, fits = cal.get("tp_rows") or {}, cal["fits"].get("tp_steps") or {}
    if not fits:
        return [f"# in a real step: no tensor-parallel probe (its model does not split over {cal['nproc']} ranks); "
                "the ops table holds the burst fits"]
    m = TP_MODEL
    lines = [f"# in a real step (the ops table's {', '.join(fits)}): the Trainer at tp = {cal['nproc']}, "
             f"{m['layers']} layers of hidden {m['hidden']}, batch {TP_BATCH}, seq "
             f"{', '.join(map(str, cal['tp_seqs']))}, "
             "without and with SP, each collective blocking (tp_overlap off: the planner hides its share);",
             "# per step its tp ledger's hops, bytes sent and seconds (slowest rank, median over steps), fitted as",
             "# above; the burst fit's time for the same calls beside it:"]
    burst = cal["fits"]["in_step"]["per_op"]
    for op, (a, bw) in fits.items():
        lines.append(f"#   {op}: {a * 1e6:.1f} us/hop, {bw / 1e9:.3f} GB/s")
        ba, bbw = burst[op]
        for hops, sent, t in rows[op]:
            fit = hops * a + sent / bw
            lines.append(f"#     hops={hops:g} sent={sent:>10.0f} {t * 1e3:>8.2f} ms (fit {fit * 1e3:.2f} ms, "
                         f"{fit / t:.2f}x; burst fit {(hops * ba + sent / bbw) * 1e3:.2f} ms)")
    return lines


def _by_seq(cal: dict) -> str:
    """Attention rate per measured sequence length (TOML inline-table body)."""
    return ", ".join(f"{s} = {_g(flops / t / 1e12)}" for (_, _, _, s, _), flops, t in cal["compute"]["attention"])


def _per_op(cal: dict) -> str:
    """Each collective's own (latency, bandwidth) fit (TOML inline-table body)."""
    return ", ".join(f"{op} = {{ latency_us = {_g(a * 1e6)}, bandwidth_gbps = {_g(bw / 1e9)} }}"
                     for op, (a, bw) in cal["per_op_fit"].items())


def to_toml(cal: dict) -> str:
    """The calibration as a topology TOML (`fivefold.plan.topology.topology_from_dict`)."""
    n = cal["nproc"]
    name = f"local-cpu-{n}"
    peaks = ", ".join(f"{d} = {_g(v / 1e12)}" for d, v in cal["peak_flops"].items())
    head = [
        f"# fivefold calibrate --nproc {n}{' --quick' if cal['quick'] else ''}: {cal['host']}, {cal['cores']} cores, "
        f"{cal['when']}",
        f"# Measured with {n} local gloo ranks at once, one intra-op thread each (as `fivefold train --nproc {n}`).",
        "# The peaks are ACHIEVED rates, not datasheet peaks: plan with --efficiency 1.0 against this topology,",
        f"# and only for {n} ranks on this machine (ranks share the cores: other counts need their own calibration).",
        "# peak_tflops, gemm_kernel_us: the GEMM curve of F.linear forward+backward over the grid below",
        "# (the planner's GEMMs by shape; --gemm flat charges every GEMM at peak_tflops alone);",
        "# attention_tflops: the attention core's rate, planner FLOP convention (by_seq: a record per length);",
        "# elementwise = 1, layer_overhead_us: eager PyTorch pays the layers' element-wise traffic at hbm_gbps",
        "# and a fixed cost per layer per micro-batch (plan/time.py elementwise_seconds).",
        "# hbm_gbps: in-place add bandwidth per rank (planner's optimizer term); latency_us, bandwidth_gbps:",
        "# joint least-squares fit (relative error) of t = hops * latency + bytes_sent / bandwidth over every",
        "# collective below, hops as topology.collective_latency, bytes_sent as comm/volume.py counts gloo's",
        "# (backend = \"gloo\": fivefold's reduce-scatter is a pairwise exchange, an all-to-all); the tier's",
        "# ops table holds each op's own fit, which the planner uses for that op: a layer's collectives",
        "# (all_reduce, all_gather, reduce_scatter) fitted from real tensor-parallel steps, the others from the",
        "# burst probe.",
    ]
    body = [
        f'name = "{name}"',
        'backend = "gloo"',
        "",
        "[accelerator]",
        f'name = "{name}"',
        f"peak_tflops = {{ {peaks} }}",
        f"gemm_kernel_us = {_g(cal['gemm_kernel'] * 1e6)}",
        f"attention_tflops = {{ fp32 = {_g(cal['attention_flops'] / 1e12)} }}",
        f"attention_tflops_by_seq = {{ {_by_seq(cal)} }}",
        f"memory_gib = {_g(cal['memory_per_rank'] / GiB)}",
        f"hbm_gbps = {_g(cal['memory_bandwidth'] / 1e9)}",
        f"op_overhead_us = {_g(cal['op_overhead'] * 1e6)}",
        f"layer_overhead_us = {_g(cal['layer_overhead'] * 1e6)}",
        f"action_overhead_us = {_g(cal['action_overhead'] * 1e6)}",
        f"ranks_per_core = {_g(ranks_per_core(n, cal['cores']))}",
        f"fresh_gbps = {_g(cal['fresh_bandwidth'] / 1e9)}",
        "elementwise = 1",
        "",
        "[[tier]]",
        'name = "loopback"',
        f"size = {n}",
        f"bandwidth_gbps = {_g(cal['bandwidth'] / 1e9)}",
        f"latency_us = {_g(cal['latency'] * 1e6)}",
        f"ops = {{ {_per_op(cal)} }}",
        f"overlap = {_g(cal['overlap']['hidden'])}",
    ]
    return "\n".join(head + _comment_lines(cal) + [""] + body) + "\n"


# -- command line --------------------------------------------------------------------------------------
def add_calibrate_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nproc", type=int, default=2, help="local gloo ranks measured together (as `train --nproc`)")
    ap.add_argument("--out", default="local.toml", help="topology TOML to write (never written over)")
    ap.add_argument("--quick", action="store_true", help="few sizes and repetitions (seconds; rough figures)")


def summary_line(cal: dict) -> str:
    p = cal["peak_flops"]
    return (f"{cal['nproc']} ranks: fp32 {p['fp32'] / 1e9:.1f}, bf16 {p['bf16'] / 1e9:.1f}, fp64 "
            f"{p['fp64'] / 1e9:.1f} GFLOP/s per rank (attention {cal['attention_flops'] / 1e9:.1f}); memory "
            f"{cal['memory_bandwidth'] / 1e9:.2f} GB/s; loopback {cal['bandwidth'] / 1e9:.3f} GB/s, "
            f"{cal['latency'] * 1e6:.1f} us per hop; overlap {100 * cal['overlap']['hidden']:.0f}%")


def cmd_calibrate(args: argparse.Namespace) -> int:
    """`fivefold calibrate [--nproc N] [--out local.toml] [--quick]`."""
    out = Path(args.out)
    if out.exists():
        print(f"fivefold calibrate: {out} exists; calibrate never writes over a file: remove it or pass "
              f"another --out", file=sys.stderr)
        return 2
    if not out.parent.is_dir():
        print(f"fivefold calibrate: folder {out.parent} does not exist; create it or pass another --out",
              file=sys.stderr)
        return 2
    if args.nproc < 2:
        print(f"fivefold calibrate: --nproc must be at least 2 (collectives need two ranks); got {args.nproc}",
              file=sys.stderr)
        return 2
    cal = calibrate(args.nproc, args.quick)
    text = to_toml(cal)
    try:
        with open(out, "x") as f:       # exclusive: a file created meanwhile is not written over either
            f.write(text)
    except FileExistsError:
        print(f"fivefold calibrate: {out} exists; calibrate never writes over a file", file=sys.stderr)
        return 2
    print(summary_line(cal))
    print(f"wrote {out}: plan with --topology {out} --efficiency 1.0")
    return 0
