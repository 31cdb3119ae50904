"""Benchmark: our mixture of experts (model/moe.py) and expert parallelism (parallel/expert.py).

Same model, same weights, same tokens for every implementation of a part. Each implementation runs in
its own fresh gloo processes (one intra-op thread each) so its peak RSS is its own; the implementations
alternate for `--rounds` rounds and each keeps its best round (machine noise).

Model: benchmarks/common.py BENCH_MODEL (4 layers, hidden 256, 8 heads / 4 kv heads, vocab 256, tied
embeddings) with every layer's MLP a mixture of 8 SwiGLU experts of width 512, top-2, Mixtral router
(softmax, top-2 renormalised): 13.45 M parameters of which 12.58 M are experts; per token the two experts
do 4x the multiply-adds of the attention projections.

Part 1, ours expert parallel vs DeepSpeed's MoE layer, ep = 2 over dp = 2 (2 ranks, each with its own
batch rows of the same global batch; each rank holds 4 of the 8 experts of every layer). A step is
forward + backward + optimizer step. Both sides are the same fivefold Transformer (attention, norms,
embeddings identical), and differ only in each layer's MoE block:
- ours: `MoE` with `ExpertParallelism(mesh, cfg).apply(model)` (ParallelConfig(dp=2, ep=2)), its
  all-to-all dispatcher `AllToAllDispatch` (given by parallelize's `configure_moe`);
- DeepSpeed 0.19.8: `deepspeed.moe.layer.MoE(hidden, SwiGLU(hidden, 512), num_experts=8, ep_size=2, k=2,
  use_rts=False, top2_2nd_expert_sampling=False)` after `set_deepspeed_parallelism()` (no engine), its
  gate (fp32, like ours) and experts loaded with the same weights (global expert r·4 + j is rank r's
  local expert j); its aux loss goes through the model's auxiliary-loss channel as ours does.
With the 2nd-expert Gumbel sampling off, DeepSpeed routes exactly like our softmax_topk_norm router, so
dropless first losses agree. Two capacity settings, each a pair of rows:
- capacity: ours capacity_factor c (per sequence C = ceil(c·s·k/E), GShard drop and zero padding) vs
  DeepSpeed capacity_factor c, drop_tokens=True (per rank C = ceil(c·b·s·k/E)): the same E·b·s·k·c/E-row
  buffers, so the same all-to-all bytes; they drop different assignments (ours per sequence in (token,
  slot) order; DeepSpeed per rank's batch, first choices before second, and it renormalises the kept
  weights), so the first losses differ slightly;
- dropless: ours capacity_factor 0 (one count exchange, then uneven all-to-alls of exactly the routed
  rows) vs DeepSpeed drop_tokens=False (all-reduce of the largest expert load, then every expert's buffer
  padded to it).
Gradients of the dense weights are summed over the 2 ranks with one flat all-reduce on both sides
(ours through the ledger, dim "dp"; not counted for DeepSpeed); expert gradients need no reduction
(expert-data-parallel groups of one); torch AdamW (foreach=False) on both sides. Loss printed: the
cross-entropy of the global batch (without the load-balance term), from rank 0 after an all-reduce.
All-to-all bytes per rank per step: ours from the ledger (dim "ep", rank 0); DeepSpeed counted at
torch.distributed.all_to_all_single during the first step ((N-1)/N of each input: the chunk a rank keeps
is not sent).

Part 3 (`--part folded`; `--part all` runs 1, 2 and 3), a folded layout, ours vs DeepSpeed, 4 ranks: tp 2 x
dp 2, attention and dense parts cut by our tensor parallelism on both sides, experts with ep 4 over all
four ranks (MoE parallel folding: ep spans the tp pair and dp). Ours: `parallelize` with
ParallelConfig(tp=2, dp=2, ep=4): each tp rank routes its half of the replicated rows, one all-to-all group
of four. DeepSpeed: `MoE(..., ep_size=4)` with our tp group as its mpu (`groups.mpu`): its default
(expert tensor parallelism off) puts ep over all ranks, routes every row on both tp ranks, drops the
duplicate half of the dispatch buffer before the all-to-all and all-gathers it over tp after (its
"drop duplicate tokens"). gloo's all_gather_into_tensor wants its output shaped, not flat: the harness
reshapes DeepSpeed's flat buffer (the same bytes). Gradients are summed by each parameter's placement
(parallel/placement.py) with one flat all-reduce per group on both sides; DeepSpeed's gate over dp, its
experts (expert-data-parallel groups of one) not at all. DeepSpeed's tp all-gathers are not counted.

Part 2, ours single-process MoE vs transformers' Mixtral block (1 process): a stack of `--layers`
residual MoE layers (x <- x + moe(x)), forward + backward of sum(out²)/numel, no optimizer:
- ours: `MoE` with `LocalDispatch` (sort the assignments by expert, one index_select, the per-expert
  SwiGLU matmuls on contiguous blocks, one index_add); aux_loss_coef 0 (Mixtral's block has none);
- transformers: `MixtralSparseMoeBlock` from a MixtralConfig of the same sizes with
  experts_implementation "eager" (the per-expert loop: one-hot mask, torch.where, gather, index_add_ per
  expert), router and packed gate_up_proj / down_proj loaded from ours (model/hf.py's mapping);
  optionally (`--hf-grouped`) transformers' "grouped_mm" experts as a third row.
Memory (both parts): peak RSS of the fresh process; "imports", its peak RSS right after importing torch,
fivefold and the implementation's library (deepspeed, transformers), before any model is built; "act
peak", bytes autograd saved for backward in the first step (ActivationMeter).

    python benchmarks/expert.py [--steps 5] [--rounds 3] [--batch 8] [--seq 256] [--layers 4]
                                [--capacity-factor 1.25] [--part both|peer|local|folded|all] [--no-deepspeed]
                                [--hf-grouped] [--profile IMPL]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
from dataclasses import replace
from pathlib import Path

from common import BENCH_MODEL, AllToAllCount, LedgerCount, best_of_rounds, parse_options, peak_rss_mb, measured_first_step, sum_grads, time_steps

ROOT = Path(__file__).resolve().parents[1]
MOE = dict(experts=8, top_k=2, moe_ffn=512, router="softmax_topk_norm")
AUX_COEF = 0.01


def moe_model(seq: int, layers: int, capacity_factor: float):
    return replace(BENCH_MODEL, layers=layers, max_seq=max(seq, BENCH_MODEL.max_seq), capacity_factor=capacity_factor,
                   aux_loss_coef=AUX_COEF, **MOE)


# -- part 1: expert parallel, ours vs DeepSpeed --------------------------------------------------------------
def peer_rank(rank, world, impl, steps, batch, seq, layers, cf, profile=False):
    import torch

    from fivefold.model import Transformer, loss_sum
    from fivefold.model.moe import MoE

    if impl.startswith("ds"):
        import deepspeed.moe.layer  # noqa: F401
    base_rss = peak_rss_mb()                     # after the imports: what the libraries cost before any work
    mode = impl.split("_")[1]                    # cap | dropless
    mcfg = moe_model(seq, layers, cf if mode == "cap" else 0.0)
    model = Transformer(mcfg, seed=0)
    for m in model.modules():
        if isinstance(m, MoE):   # the trainer's scaling: aux loss = coef x mean over sequences
            m.configure(global_sequences=world * batch)
    gen = torch.Generator().manual_seed(0)       # one global batch; rank r keeps rows r·batch ...
    x = torch.randint(0, mcfg.vocab, (world * batch, seq), generator=gen)
    y = torch.roll(x, -1, 1)
    x, y = x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]
    make = ours_ep if impl.startswith("ours") else deepspeed_ep
    reduce_grads, counter = make(model, rank, world, mcfg, world * batch)
    params = list(model.parameters())
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=False)
    n_tokens = world * batch * seq

    def step():
        loss = loss_sum(model(x), y) / n_tokens
        loss.backward()
        model.aux.take()
        sum_grads(dense, reduce_grads)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    first = measured_first_step(step, counter)
    if profile:
        return {"profile": profile_steps(step, rank)}
    times = time_steps(step, warmup=1, steps=steps)
    return {"times": times, "rss_mb": peak_rss_mb(), **first, "base_rss_mb": base_rss}


def ours_ep(model, rank, world, mcfg, sequences):
    from fivefold import comm
    from fivefold.comm import CommLedger
    from fivefold.config import Config, ParallelConfig, TrainConfig
    from fivefold.mesh import ParallelMesh
    from fivefold.parallel.expert import ExpertParallelism
    from fivefold.parallel.parallelize import configure_moe

    cfg = Config(model=mcfg, parallel=ParallelConfig(dp=world, ep=world),
                 train=TrainConfig(seq_len=mcfg.max_seq, global_batch=sequences)).validate(world)
    ledger = CommLedger(rank, world)
    mesh = ParallelMesh(cfg.parallel, rank, ledger)
    ExpertParallelism(mesh, cfg).apply(model)
    configure_moe(model, mesh, cfg)   # the all-to-all dispatcher, the step's totals (as parallelize does)

    return lambda flat: comm.all_reduce(flat, mesh["dp"]), LedgerCount(ledger)


def deepspeed_ep(model, rank, world, mcfg, sequences):
    import torch.distributed as tdist
    from torch import nn

    # DeepSpeed reads its launcher's variables; this process group is already up (gloo)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")   # wraps torch's group; first call JIT-builds a shm op

    class DeepSpeedBlock(nn.Module):
        """Our MoE block's contract (x_bsh -> y_bsh, aux loss through the model's channel) on DeepSpeed's layer."""

        def __init__(self, ours):
            super().__init__()
            self.aux = ours.aux
            self.moe = deepspeed_moe_of(ours, mcfg, world, rank)   # ep_size_2 groups, no engine needed

        def forward(self, x_bsh):
            y_bsh, l_aux, _ = self.moe(x_bsh)
            return self.aux.add(y_bsh, l_aux * (AUX_COEF / world))   # DeepSpeed's l_aux: this rank's mean

    for block in model.layers:
        block.mlp = DeepSpeedBlock(block.mlp)        # the full experts are freed here, as ours' apply does

    return lambda flat: tdist.all_reduce(flat), AllToAllCount("ep")


# -- part 3: a folded layout, ours vs DeepSpeed ----------------------------------------------------------------
def folded_rank(rank, world, impl, steps, batch, seq, layers, cf, profile=False):
    """tp 2 x dp 2 on 4 ranks, attention and dense parts cut by our tensor parallelism on both sides; the
    experts with ep 4 over all four ranks (folded over tp and dp). Ours: `parallelize` with
    ParallelConfig(tp=2, dp=2, ep=4) (each tp rank routes its half of the replicated rows). DeepSpeed:
    the same model parallelised with ep = 1, then each layer's MoE replaced by DeepSpeed's with ep_size 4
    and our tp group as its mpu (it routes every row on both tp ranks, drops the duplicate half of the
    dispatch buffer before its all-to-all and all-gathers it over tp after). Gradients are summed by
    each parameter's placement (parallel/placement.py) with one flat all-reduce a group on both sides."""
    import torch

    from fivefold import comm
    from fivefold.comm import CommLedger
    from fivefold.config import Config, ParallelConfig, TrainConfig
    from fivefold.mesh import ParallelMesh
    from fivefold.model import Transformer, loss_sum
    from fivefold.parallel.engine import unique_params
    from fivefold.parallel.parallelize import loss_function, parallelize
    from fivefold.parallel.placement import by_group

    if impl.startswith("ds"):
        import deepspeed.moe.layer  # noqa: F401
    base_rss = peak_rss_mb()
    mode = impl.split("_")[1]                    # cap | dropless
    mcfg = moe_model(seq, layers, cf if mode == "cap" else 0.0)
    tp, dp = 2, world // 2
    ours = impl.startswith("ours")
    par = ParallelConfig(tp=tp, dp=dp, ep=world if ours else 1)
    cfg = Config(model=mcfg, parallel=par, train=TrainConfig(seq_len=seq, global_batch=dp * batch)).validate(world)
    ledger = CommLedger(rank, world)
    mesh = ParallelMesh(par, rank, ledger)
    model, dims = parallelize(Transformer(mcfg, seed=0), mesh, cfg)
    counter = LedgerCount(ledger)
    if not ours:
        counter = deepspeed_folded(model, mesh, mcfg, world)
    gen = torch.Generator().manual_seed(0)       # one global batch; dp rank d keeps rows d·batch ...
    x = torch.randint(0, mcfg.vocab, (dp * batch, seq), generator=gen)
    y = torch.roll(x, -1, 1)
    d = mesh.coords["dp"]
    x, y = x[d * batch:(d + 1) * batch], y[d * batch:(d + 1) * batch]
    params = unique_params(model)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=False)
    n_tokens = dp * batch * seq
    lossf = loss_function(dims, loss_sum)

    def step():
        loss = lossf(model(x), y) / n_tokens
        loss.backward()
        model.aux.take()
        for field in ("reduce", "partial"):      # the engine's reduction, then the partial sums (as the trainer)
            for group, ps in by_group([p for p in params if p.grad is not None], field).items():
                if mesh[group].size > 1:
                    sum_grads(ps, lambda flat, g=mesh[group]: comm.all_reduce(flat, g))
        opt.step()
        opt.zero_grad()
        return loss.detach() / tp                # both tp ranks hold the whole loss: summed once over the ranks

    first = measured_first_step(step, counter)
    if profile:
        return {"profile": profile_steps(step, rank)}
    times = time_steps(step, warmup=1, steps=steps)
    return {"times": times, "rss_mb": peak_rss_mb(), **first, "base_rss_mb": base_rss}


def deepspeed_folded(model, mesh, mcfg, world):
    """Each MoE layer of `model` (tp-parallelised, experts whole on every rank) swapped for DeepSpeed's MoE
    with ep_size = world, our tp group as DeepSpeed's mpu; its gate summed over dp, its experts (an
    expert-data-parallel group of one) not at all."""
    from torch import nn

    os.environ.update(LOCAL_RANK=str(mesh.rank), RANK=str(mesh.rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    import deepspeed
    from deepspeed.utils import groups as ds_groups
    from deepspeed.utils import logger as ds_logger

    from fivefold.model.moe import MoE
    from fivefold.parallel.placement import place

    ds_logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")
    tp = mesh["tp"]

    class TensorGroup:   # the Megatron mpu calls DeepSpeed's drop_tokens / gather_tokens make
        def get_tensor_model_parallel_world_size(self):
            return tp.size

        def get_tensor_model_parallel_rank(self):
            return tp.rank

        def get_tensor_model_parallel_group(self):
            return tp.pg

    ds_groups.mpu = TensorGroup()
    plain_gather = deepspeed.comm.all_gather_into_tensor

    def gather_shaped(output, tensor, *args, **kwargs):   # gloo wants the output shaped (n·d0, ...), not flat
        shaped = output.view((output.numel() // tensor.numel() * tensor.shape[0],) + tuple(tensor.shape[1:]))
        return plain_gather(shaped, tensor, *args, **kwargs)
    deepspeed.comm.all_gather_into_tensor = gather_shaped
    rank = mesh.rank

    class DeepSpeedBlock(nn.Module):
        def __init__(self, ours):
            super().__init__()
            self.aux = ours.aux
            self.moe = deepspeed_moe_of(ours, mcfg, world, rank)
            place(self.moe.deepspeed_moe.gate.wg.weight, reduce="dp")
            for p in self.moe.deepspeed_moe.experts.parameters():
                place(p, reduce=None)

        def forward(self, x_bsh, keys_bs=None):
            y_bsh, l_aux, _ = self.moe(x_bsh)
            return self.aux.add(y_bsh, l_aux * (AUX_COEF / (world // tp.size)))

    for block in model.layers:
        if isinstance(block.mlp, MoE):
            block.mlp = DeepSpeedBlock(block.mlp)
    return AllToAllCount("ep")


def deepspeed_moe_of(ours, mcfg, ep_size: int, rank: int):
    """DeepSpeed's MoE layer with ep_size = `ep_size` and our layer's weights (its gate from our router, its
    local expert j from our global expert rank·(E/ep) + j), after `set_deepspeed_parallelism()`."""
    import torch
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from fivefold.model.layers import SwiGLU

    local = mcfg.experts // ep_size
    moe = DeepSpeedMoE(mcfg.hidden, SwiGLU(mcfg.hidden, mcfg.expert_ffn), num_experts=mcfg.experts, ep_size=ep_size,
                       k=mcfg.top_k, capacity_factor=mcfg.capacity_factor or 1.0, drop_tokens=mcfg.capacity_factor > 0,
                       use_rts=False, top2_2nd_expert_sampling=False)
    moe.set_deepspeed_parallelism()
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for j, ex in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            g = rank * local + j
            ex.gate.weight.copy_(ours.experts.w_gate[g])
            ex.up.weight.copy_(ours.experts.w_up[g])
            ex.down.weight.copy_(ours.experts.w_down[g])
    return moe


def capacity_rows(batch, seq, cf):
    """Rows of the dispatch buffer per rank per layer: ours E·b·ceil(c·s·k/E), DeepSpeed E·ceil(c·k·b·s/E)."""
    e, k = MOE["experts"], MOE["top_k"]
    return e * batch * math.ceil(cf * seq * k / e), e * math.ceil(cf * k * batch * seq / e)


# -- part 2: one process, ours LocalDispatch vs transformers' Mixtral block -------------------------------
def local_rank(rank, world, impl, steps, batch, seq, layers, profile=False):
    import torch
    from torch import nn

    from fivefold.model.moe import MoE
    from fivefold.train.activations import ActivationMeter

    if impl.startswith("hf"):
        import transformers.models.mixtral.modeling_mixtral  # noqa: F401
    base_rss = peak_rss_mb()                     # after the imports: what the libraries cost before any work
    mcfg = moe_model(seq, layers, 0.0)
    mcfg = replace(mcfg, aux_loss_coef=0.0)
    torch.manual_seed(0)
    ours = nn.ModuleList(MoE(mcfg) for _ in range(layers))
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.05)
    if impl == "ours":
        stack = ours
    else:
        import transformers
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        hf_cfg = transformers.MixtralConfig(hidden_size=mcfg.hidden, intermediate_size=mcfg.expert_ffn,
                                            num_local_experts=mcfg.experts, num_experts_per_tok=mcfg.top_k,
                                            router_jitter_noise=0.0, hidden_act="silu",
                                            experts_implementation="grouped_mm" if impl == "hf_grouped" else "eager")
        stack = nn.ModuleList(MixtralSparseMoeBlock(hf_cfg) for _ in range(layers))
        with torch.no_grad():
            for mine, theirs in zip(ours, stack):     # model/hf.py: gate_up_proj = [w_gate; w_up] along dim 1
                theirs.gate.weight.copy_(mine.router.weight)
                theirs.experts.gate_up_proj.copy_(torch.cat([mine.experts.w_gate, mine.experts.w_up], dim=1))
                theirs.experts.down_proj.copy_(mine.experts.w_down)
        del ours
    stack.train()
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(batch, seq, mcfg.hidden, generator=gen)

    def step():
        x = x0.clone().requires_grad_()
        h = x
        for layer in stack:
            h = h + layer(h)
        loss = h.pow(2).mean()
        loss.backward()
        stack.zero_grad()
        return loss.detach()

    meter = ActivationMeter()
    with meter:
        first = step()
    if profile:
        return {"profile": profile_steps(step, rank)}
    times = time_steps(step, warmup=1, steps=steps)
    return {"times": times, "rss_mb": peak_rss_mb(), "first_loss": float(first), "sent": {}, "act_peak": meter.peak,
            "base_rss_mb": base_rss}


# -- profiling, rounds, tables ----------------------------------------------------------------------------
def profile_steps(step, rank, n=3):
    """Self CPU time by op over n steps (rank 0's table; the slowest ops first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25) if rank == 0 else ""


def table(best, pairs, label):
    """pairs: row name -> the row it is divided by (ratios ours / peer)."""
    print(f"{'impl':<36}{'median step':>13}{'peak RSS':>10}{'imports':>9}{'act peak':>10}{'first loss':>12}"
          f"  {'MB sent per rank/step':<30}{label} (time, memory)")
    for name, r in best.items():
        ratio = ""
        if pairs.get(name) in best:
            b = best[pairs[name]]
            ratio = f"{r['median_s'] / b['median_s']:.3f}, {r['peak_rss_mb'] / b['peak_rss_mb']:.3f}"
        sent = " ".join(f"{d} {v / 1e6:.2f}" for d, v in r["sent"].items() if v >= 1e4)  # not the scalars
        rounds = ", ".join(f"{t * 1e3:.0f}" for t in r["rounds"])
        print(f"{name:<36}{r['median_s'] * 1e3:>10.1f} ms{r['peak_rss_mb']:>7.0f} MB{r['base_rss_mb']:>6.0f} MB"
              f"{r['act_peak'] / 2**20:>7.0f} MB"
              f"{r['first_loss']:>12.6f}  {sent:<30}{ratio:<14}[rounds: {rounds} ms]")


def folded_race(a):
    print(f"\n3. a folded layout: tp 2 x dp 2 on 4 gloo ranks, experts ep 4 over all four, batch {a.batch}x{a.seq} "
          f"tokens per dp rank, {a.steps} timed steps, best of {a.rounds} rounds; grads summed by placement")
    impls = [("ours_cap", f"fivefold ep4 folded, capacity {a.capacity_factor:g}"),
             ("ours_dropless", "fivefold ep4 folded, dropless")]
    if not a.no_deepspeed and importlib.util.find_spec("deepspeed") is not None:
        impls = [("ds_cap", f"DeepSpeed ep4 over tp x dp, capacity {a.capacity_factor:g}"), impls[0],
                 ("ds_dropless", "DeepSpeed ep4 over tp x dp, dropless"), impls[1]]
    else:
        print("DeepSpeed skipped (--no-deepspeed, or not installed)")
    best = best_of_rounds(folded_rank, 4, impls, lambda impl: (impl, a.steps, a.batch, a.seq, a.layers, a.capacity_factor),
                          a.rounds, keep_going=not a.smoke, worst=("base_rss_mb",))
    names = dict(impls)
    table(best, {names["ours_cap"]: names.get("ds_cap"), names["ours_dropless"]: names.get("ds_dropless")},
          "ours / DeepSpeed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank (part 1) / per step (part 2)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--part", choices=("both", "peer", "local", "folded", "all"), default="both",
                    help="both: parts 1 and 2; all: 1, 2 and 3 (the folded layout, 4 ranks)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--hf-grouped", action="store_true", help="also time transformers' grouped_mm experts")
    ap.add_argument("--profile", default="", help="profile one implementation (e.g. ours_cap, ds_dropless, "
                                                    "ours, hf) and print its op table instead of timing")
    a = parse_options(ap, steps=1, rounds=1, batch=2, seq=32, layers=2, part="all")
    nproc = 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "runs" / "torch_extensions"))  # DeepSpeed's JIT op
    m = moe_model(a.seq, a.layers, a.capacity_factor)
    expert_params = m.layers * m.experts * 3 * m.hidden * m.expert_ffn
    print(f"model: {m.num_params() / 1e6:.2f} M parameters ({expert_params / 1e6:.2f} M in experts; {m.layers} layers, "
          f"hidden {m.hidden}, {m.experts} experts of {m.expert_ffn}, top-{m.top_k}, {m.heads} heads / {m.kv_heads} kv)")
    if a.profile:
        from fivefold.train.launch import run_ranks
        if a.profile in ("ours", "hf", "hf_grouped"):
            out = run_ranks(local_rank, 1, (a.profile, a.steps, a.batch, a.seq, a.layers, True), timeout_s=900)
        else:
            out = run_ranks(peer_rank, nproc, (a.profile, a.steps, a.batch, a.seq, a.layers, a.capacity_factor, True),
                            timeout_s=900)
        print(out[0]["profile"])
        return
    if a.part in ("both", "peer", "all"):
        print(f"\n1. expert parallel, ep = dp = {nproc} gloo ranks, batch {a.batch}x{a.seq} tokens per rank, "
              f"{a.steps} timed steps, best of {a.rounds} rounds; fwd + bwd + torch AdamW; dense grads summed by one "
              f"all-reduce (its bytes: dp in ours' ledger, not counted for DeepSpeed)")
        impls = [("ours_cap", f"fivefold EP capacity {a.capacity_factor:g}"), ("ours_dropless", "fivefold EP dropless")]
        if a.no_deepspeed:
            print("DeepSpeed skipped (--no-deepspeed)")
        else:
            # not imported here: a spawned rank's peak RSS starts at this process's (Linux keeps maxrss over exec)
            if importlib.util.find_spec("deepspeed") is not None:
                impls = [("ds_cap", f"DeepSpeed EP capacity {a.capacity_factor:g}"), impls[0],
                         ("ds_dropless", "DeepSpeed EP dropless"), impls[1]]
            else:
                print("DeepSpeed not available (not installed)")
        best = best_of_rounds(peer_rank, nproc, impls,
                              lambda impl: (impl, a.steps, a.batch, a.seq, a.layers, a.capacity_factor),
                              a.rounds, keep_going=not a.smoke, worst=("base_rss_mb",))
        names = dict(impls)
        pairs = {names["ours_cap"]: names.get("ds_cap"), names["ours_dropless"]: names.get("ds_dropless")}
        table(best, pairs, "ours / DeepSpeed")
        ours_rows, ds_rows = capacity_rows(a.batch, a.seq, a.capacity_factor)
        formula = m.layers * 4 * ours_rows * m.hidden * 4 * (nproc - 1) / nproc
        print(f"capacity buffer per rank per layer: ours {ours_rows} rows, DeepSpeed's {ds_rows} rows; capacity "
              f"all-to-alls by formula (layers x 4 x rows x hidden x 4 B x (N-1)/N): {formula / 1e6:.2f} MB per rank "
              f"per step" + ("" if "ds_cap" not in names else
                             " (DeepSpeed's ep column is counted at torch.distributed.all_to_all_single)"))
    if a.part in ("folded", "all"):
        folded_race(a)
    if a.part in ("both", "local", "all"):
        print(f"\n2. one process, {a.layers} residual MoE layers, batch {a.batch}x{a.seq} tokens, forward + backward, "
              f"{a.steps} timed steps, best of {a.rounds} rounds")
        impls = [("hf", "transformers Mixtral block (eager)"), ("ours", "fivefold MoE (LocalDispatch)")]
        if a.hf_grouped:
            impls.append(("hf_grouped", "transformers Mixtral (grouped_mm)"))
        best = best_of_rounds(local_rank, 1, impls, lambda impl: (impl, a.steps, a.batch, a.seq, a.layers),
                              a.rounds, keep_going=not a.smoke, worst=("base_rss_mb",))
        names = dict(impls)
        table(best, {names["ours"]: names["hf"], names.get("hf_grouped"): names["hf"]}, "vs Mixtral eager")


if __name__ == "__main__":
    main()
