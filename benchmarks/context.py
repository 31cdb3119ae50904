"""Benchmark: our context parallelism (parallel/context.py, parallel/ring.py) on long sequences.

Same model (benchmarks/common.py BENCH_MODEL, tied embeddings, 8 heads / 4 kv heads of 32, but
max_seq = the benchmark's sequence), same weights, same tokens for every implementation, 2 gloo ranks,
one intra-op thread each. Each implementation runs in its own fresh processes so its peak RSS is its
own; the implementations alternate for `--rounds` rounds and each keeps its best round (machine noise).
A step is forward + backward + optimizer step.

Part 1, ours Ulysses vs DeepSpeed Ulysses (cp = 2): the same fivefold Transformer, every layer's
attention core (`block.attn.core`: (q_bnsd, k_bksd, v_bksd) -> o_bnsd, causal) replaced by
- ours: `ContextAttention` through `ContextParallelism(mesh, cfg).apply(model)` (mode ulysses; batches
  cut by `shard_batch`, the rank's position ids passed to the model);
- DeepSpeed 0.19.8: `deepspeed.sequence.layer.DistributedAttention(local_attn, group, scatter_idx=2,
  gather_idx=1)` on [b, s, h, d] (an adapter transposes from / to [b, h, s, d]). DeepSpeed's partition
  follows the KV groups, so the 4 kv heads go through unrepeated, as ours (2 per rank); both local
  attentions are fivefold's `attention_core` (torch SDPA, kv heads repeated locally).
Each rank holds the contiguous half of every sequence (token_indices with a ring of one). Gradients
are summed over the 2 ranks with one flat all-reduce on both sides, then torch AdamW (foreach=False).
Loss = sum of token cross-entropy / tokens of the batch (each rank's share, summed for the printed loss).
Bytes per rank per step: ours from the ledger (dim "cp"); DeepSpeed from the all-to-all formula
(layers x 2 passes x 4 all-to-alls (q, k, v, o) x (N-1)/N of the local tensor), cross-checked by
counting torch.distributed.all_to_all_single during the first step.

Part 2, ours ring vs ours Ulysses vs our Megatron SP, through `Trainer` (our AdamW, grad clipping):
cp = 2 ring (zig-zag), cp = 2 Ulysses, tp = 2 with sp_mode megatron. Bytes per rank per step by ledger
dimension, and the counted activation peak (`Trainer.activations`: bytes autograd saved for backward).

Prints median step time, peak RSS, first loss (must agree within a part: the same computation) and the
ratios ours / DeepSpeed (part 1) and each mode / our Ulysses (part 2).

    python benchmarks/context.py [--steps 5] [--rounds 2] [--batch 1] [--seq 4096] [--part both|peer|modes]
                                 [--no-deepspeed]
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from common import BENCH_MODEL, AllToAllCount, LedgerCount, best_of_rounds, parse_options, peak_rss_mb, measured_first_step, sum_grads, time_steps

ROOT = Path(__file__).resolve().parents[1]


def model_config(seq):
    return replace(BENCH_MODEL, max_seq=max(seq, BENCH_MODEL.max_seq))


# -- part 1: the attention core, ours vs DeepSpeed --------------------------------------------------------
def peer_rank(rank, world, impl, steps, batch, seq):
    import torch

    from fivefold.model import Transformer, loss_sum

    mcfg = model_config(seq)
    model = Transformer(mcfg, seed=0)
    gen = torch.Generator().manual_seed(0)     # the same batch on both ranks; each keeps its tokens
    x = torch.randint(0, mcfg.vocab, (batch, seq), generator=gen)
    y = torch.roll(x, -1, 1)
    make = ours_core if impl == "ours" else deepspeed_core
    x, y, positions, reduce_grads, counter = make(model, rank, world, x, y, seq, batch)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=False)
    n_tokens = batch * seq

    def step():
        loss = loss_sum(model(x, positions), y) / n_tokens
        loss.backward()
        sum_grads(params, reduce_grads)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    first = measured_first_step(step, counter)
    times = time_steps(step, warmup=1, steps=steps)
    return {"times": times, "rss_mb": peak_rss_mb(), **first}


def ours_core(model, rank, world, x, y, seq, batch):
    from fivefold import comm
    from fivefold.comm import CommLedger
    from fivefold.config import Config, ParallelConfig, TrainConfig
    from fivefold.mesh import ParallelMesh
    from fivefold.parallel.context import ContextParallelism

    cfg = Config(model=model.cfg, parallel=ParallelConfig(cp=world, cp_mode="ulysses"),
                 train=TrainConfig(seq_len=seq, global_batch=batch)).validate(world)
    ledger = CommLedger(rank, world)
    mesh = ParallelMesh(cfg.parallel, rank, ledger, ulysses=world)
    cp = ContextParallelism(mesh, cfg)
    cp.apply(model)
    x, y = cp.shard_batch(x, y)

    return x, y, cp.positions, lambda flat: comm.all_reduce(flat, mesh["dp_cp"]), LedgerCount(ledger)


def deepspeed_core(model, rank, world, x, y, seq, batch):
    import torch
    import torch.distributed as tdist

    # DeepSpeed reads its launcher's variables; this process group is already up (gloo)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import DistributedAttention

    from fivefold.model.attention import attention_core

    deepspeed.init_distributed(dist_backend="gloo")   # wraps torch's group; first call JIT-builds a shm op
    group = dist.new_group(ranks=list(range(world)))

    def local_attn(q_bshd, k_bskd, v_bskd):   # [b, s_full, heads/N, d] from DeepSpeed (batch_dim_idx=0)
        o_bnsd = attention_core(q_bshd.transpose(1, 2), k_bskd.transpose(1, 2), v_bskd.transpose(1, 2), True)
        return o_bnsd.transpose(1, 2)

    class DeepSpeedCore(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = DistributedAttention(local_attn, group, scatter_idx=2, gather_idx=1)

        def forward(self, q_bnsd, k_bksd, v_bksd):
            o_bshd = self.attn(q_bnsd.transpose(1, 2), k_bksd.transpose(1, 2), v_bksd.transpose(1, 2), 0, None)
            return o_bshd.transpose(1, 2)

    for block in model.layers:
        block.attn.core = DeepSpeedCore()
    shard = seq // world
    index = torch.arange(rank * shard, (rank + 1) * shard)   # contiguous halves, as ours with no ring

    return x[:, index], y[:, index], index, lambda flat: tdist.all_reduce(flat), AllToAllCount("cp")


def ulysses_formula_bytes(batch, seq, world):
    """Bytes a rank sends per step through Ulysses all-to-alls: per layer, forward q, k, v, o and backward
    their gradients, each (N-1)/N of the rank's local tensor (b, s/N, heads or kv heads, d) in fp32."""
    m = BENCH_MODEL
    local = batch * seq // world * m.head_dim * 4
    return m.layers * 2 * (world - 1) / world * local * (2 * m.heads + 2 * m.kv_heads)


# -- part 2: the three modes through the Trainer ---------------------------------------------------------
MODES = {"ring": dict(cp=2, cp_mode="ring"), "ulysses": dict(cp=2, cp_mode="ulysses"),
         "megatron": dict(tp=2, sp_mode="megatron")}


def trainer_rank(rank, world, impl, steps, batch, seq):
    import numpy as np

    from fivefold.config import Config, ParallelConfig, TrainConfig
    from fivefold.train.trainer import Trainer

    tokens = np.random.default_rng(0).integers(0, BENCH_MODEL.vocab, 1 << 16, dtype=np.int64)
    cfg = Config(model=model_config(seq), parallel=ParallelConfig(**MODES[impl]),
                 train=TrainConfig(steps=steps + 2, global_batch=batch, seq_len=seq, seed=0, checkpoint=False))
    tr = Trainer(cfg, rank, world, tokens=tokens, quiet=True)
    snap = tr.ledger.snapshot()
    first = tr.step(0)["loss"]
    per_step = tr.ledger.since(snap)
    sent = {d: per_step.total(d) for d in sorted({r["dim"] for r in per_step.rows()})}
    k = iter(range(1, steps + 2))
    times = time_steps(lambda: tr.step(next(k)), warmup=1, steps=steps)
    return {"times": times, "rss_mb": peak_rss_mb(), "first_loss": first, "sent": sent,
            "act_peak": tr.activations.peak}


# -- rounds ------------------------------------------------------------------------------------------------
def table(best, base, label):
    print(f"{'impl':<30}{'median step':>13}{'peak RSS':>10}{'act peak':>10}{'first loss':>12}"
          f"  {'MB sent per rank/step':<24}{label} (time, memory)")
    for name, r in best.items():
        ratio = ""
        if base in best and name != base:
            b = best[base]
            ratio = f"{r['median_s'] / b['median_s']:.3f}, {r['peak_rss_mb'] / b['peak_rss_mb']:.3f}"
        sent = " ".join(f"{d} {v / 1e6:.2f}" for d, v in r["sent"].items() if v >= 1e4)  # not the scalars
        rounds = ", ".join(f"{t * 1e3:.0f}" for t in r["rounds"])
        print(f"{name:<30}{r['median_s'] * 1e3:>10.1f} ms{r['peak_rss_mb']:>7.0f} MB{r['act_peak'] / 2**20:>7.0f} MB"
              f"{r['first_loss']:>12.6f}  {sent:<24}{ratio:<14}[rounds: {rounds} ms]")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--part", choices=("both", "peer", "modes"), default="both")
    ap.add_argument("--no-deepspeed", action="store_true")
    a = parse_options(ap, steps=1, rounds=1, batch=1, seq=64)
    nproc = 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "runs" / "torch_extensions"))  # DeepSpeed's JIT op
    m = model_config(a.seq)
    print(f"model: {m.num_params() / 1e6:.2f} M parameters ({m.layers} layers, hidden {m.hidden}, {m.heads} heads / "
          f"{m.kv_heads} kv heads of {m.head_dim}), batch {a.batch}x{a.seq} tokens per step, {nproc} gloo ranks, "
          f"{a.steps} timed steps, best of {a.rounds} rounds")
    if a.part in ("both", "peer"):
        impls = [("ours", "fivefold Ulysses core")]
        if a.no_deepspeed:
            print("DeepSpeed skipped (--no-deepspeed)")
        else:
            try:
                import deepspeed  # noqa: F401
                impls.insert(0, ("deepspeed", "DeepSpeed Ulysses core"))
            except Exception as e:  # noqa: BLE001
                print(f"DeepSpeed not available: {e}")
        best = best_of_rounds(peer_rank, nproc, impls, lambda impl: (impl, a.steps, a.batch, a.seq),
                              a.rounds, keep_going=not a.smoke)
        print(f"\n1. attention core, cp = {nproc} Ulysses: same Transformer, torch AdamW foreach=False, grads summed by "
              f"one all-reduce (its bytes: dp in ours' ledger, not counted for DeepSpeed)")
        table(best, "DeepSpeed Ulysses core", "ours / DeepSpeed")
        formula = f"{ulysses_formula_bytes(a.batch, a.seq, nproc) / 1e6:.2f} MB per rank per step"
        if "DeepSpeed Ulysses core" in best:
            print(f"DeepSpeed cp bytes by formula: {formula} (its cp column above is counted at "
                  f"torch.distributed.all_to_all_single)")
        else:
            print(f"Ulysses all-to-all formula: {formula}")
    if a.part in ("both", "modes"):
        impls = [("ulysses", "fivefold Ulysses (cp=2)"), ("ring", "fivefold ring (cp=2)"),
                 ("megatron", "fivefold Megatron SP (tp=2)")]
        best = best_of_rounds(trainer_rank, nproc, impls, lambda impl: (impl, a.steps, a.batch, a.seq),
                              a.rounds, keep_going=not a.smoke)
        print(f"\n2. modes through Trainer (our AdamW, grad clip): bytes per rank per step by ledger dim")
        table(best, "fivefold Ulysses (cp=2)", "vs Ulysses")


if __name__ == "__main__":
    main()
