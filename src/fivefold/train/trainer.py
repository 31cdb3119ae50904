"""The training loop: one rank's view of a run.

`Trainer(cfg, rank, world_size)` builds the mesh, the full model (the same seeded weights on every
rank), applies the parallel dimensions to it (`parallelize`: tp → cp → ep → pp, each writing the
placements of the parameters it shards), wraps what this rank holds in the gradient engine (DDP or
ZeRO over the placements' groups, with AdamW on fp32 master weights when compute is bf16) and reads the
data. `step(k)` runs one optimizer step over the global batch of step k and returns its metrics.
`run()` trains `cfg.train.steps` steps and writes, on rank 0:

    OUT/metrics.jsonl  one line per step: step, loss, grad_norm, lr, tokens, seconds
    OUT/comm.json      the communication ledger summed over ranks (see comm/ledger.py)
    OUT/run.json       resolved config, parameter count, world size, versions, model-state bytes
    OUT/checkpoint.pt  full model and optimizer state at the end
    OUT/pipeline.json  (pp > 1) the last step's measured per-rank timeline beside the simulated one,
    OUT/pipeline.svg   and their drawing

Loss rule: each micro-batch's summed token loss is divided by the number of tokens in the *global*
batch, and gradients are summed across data-parallel ranks; so loss and gradients are those of the mean
over the global batch, however it is split. The dimensions (parallel/parallelize.py) are applied in one
order and the loop names none of them: with pp > 1 the pipeline dimension runs every micro-batch's forward
and backward in the schedule's order, and its loss group (pp) sums the last stage's loss so every rank
reports it.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import __version__, rules
from ..comm import CommLedger, gather_objects
from ..config import Config, ConfigError
from ..mesh import ParallelMesh
from ..model import Transformer, loss_sum
from ..parallel.data import DataParallelOptimizer
from ..parallel.engine import Engine, sum_partial_grads, unique_params
from ..parallel.expert import moe_step_stats
from ..parallel.parallelize import (direct_forward_backward, gather_state, loss_function, parallelize, split_state,
                                    sum_loss)
from ..parallel.zero import Zero
from . import checkpoint
from .activations import ActivationMeter
from .data import Batches, read_tokens
from .launch import resolve_device
from .optim import AdamW, clip_, global_grad_norm, lr_at
from .progress import Progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
# Each rank's default torch stream (dropout without a generator, sampling) is seeded seed + stride·rank;
# a prime stride keeps the streams of nearby seeds and ranks apart. Weight init uses its own generator.
RANK_SEED_STRIDE = 7919


def supported(cfg: Config) -> None:
    """Layouts the runtime does not run yet fail at start, naming what is missing (rules.py)."""
    rules.check_runtime_support(cfg.parallel, cfg.train, cfg.model)


class Trainer:
    """One rank of a run: config → mesh → the full seeded model → `parallelize` (tp → cp → ep → pp, each
    dimension shards what it owns and writes its placements) → the gradient engine over the placement
    groups → the loop."""

    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1, tokens=None, quiet: bool = False):
        cfg.validate(world_size)
        supported(cfg)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.quiet = quiet or rank != 0
        t, p = cfg.train, cfg.parallel
        self.device = resolve_device(t.device, dist.get_backend() if dist.is_initialized() else None)
        torch.manual_seed(t.seed + RANK_SEED_STRIDE * rank)
        self.ledger = CommLedger(rank, world_size)
        self.mesh = ParallelMesh(p, rank, self.ledger, kv_replicas=rules.kv_replicas(p.tp, cfg.model.kv_heads),
                                 ulysses=rules.cp_degrees(p.cp_mode, p.cp, cfg.model.heads, p.tp, p.ulysses)[0])
        self.dtype = DTYPES[t.dtype]
        # optimizer math in fp32 (fp64 when the model is fp64, for exactness checks)
        self.master_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32

        full = Transformer(cfg.model, seed=t.seed).to(self.dtype)   # the same seeded weights on every rank
        self.n_params = sum(q.numel() for q in unique_params(full))
        self.model, self.dims = parallelize(full, self.mesh, cfg)
        self.model.to(self.device)                                   # parameters keep their placements
        self.loss_sum = loss_function(self.dims, loss_sum)
        self.forward_backward = next((d.forward_backward for d in self.dims if hasattr(d, "forward_backward")),
                                     direct_forward_backward)
        self.params = unique_params(self.model)
        positions = next((d.positions for d in self.dims if hasattr(d, "positions")), None)
        self.positions = None if positions is None else positions.to(self.device)   # (cp: not contiguous)
        self.engine = self.make_engine()
        self.activations = ActivationMeter()
        for m in self.model.modules():   # layers that normalise by the step's totals (MoE aux losses)
            if hasattr(m, "global_sequences"):
                m.global_sequences, m.global_tokens = t.global_batch, t.global_batch * t.seq_len
        self.batches = Batches(tokens if tokens is not None else read_tokens(t.data, t.data_limit_mb),
                               t.seq_len, t.global_batch, t.seed, cfg.model.vocab)
        self.step_count = 0

    def make_engine(self) -> Engine:
        """DDP, or ZeRO-1/2/3, over the groups the parameters' placements name."""
        p, t = self.cfg.parallel, self.cfg.train
        grad_dtype = self.master_dtype if t.main_grads_fp32 else self.dtype

        def make_optimizer(params, decay):
            return AdamW(params, decay, (t.beta1, t.beta2), t.eps, t.weight_decay)

        if not p.zero:
            return DataParallelOptimizer(self.model, self.mesh, make_optimizer, p.bucket_mb, self.master_dtype, grad_dtype)
        if p.dp == 1 and not self.quiet:
            print(f"note: ZeRO-{p.zero} with dp=1 shards over a single rank and saves no memory", file=sys.stderr)
        scheduled = any(getattr(d, "schedules_backward", False) for d in self.dims)
        return Zero(self.model, self.mesh, p.zero, make_optimizer, p.bucket_mb, self.master_dtype, grad_dtype,
                    p.reshard_after_forward, pipeline=scheduled)

    # -- one step ----------------------------------------------------------------------------
    def micro_batches(self, step: int):
        p = self.cfg.parallel
        x_bs, y_bs = self.batches.local(step, self.mesh.coords["dp"], p.dp)
        for d in self.dims:
            if hasattr(d, "shard_batch"):
                x_bs, y_bs = d.shard_batch(x_bs, y_bs)
        x_bs, y_bs = x_bs.to(self.device), y_bs.to(self.device)
        return list(zip(x_bs.chunk(p.microbatches), y_bs.chunk(p.microbatches)))

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        cfg = self.cfg.train
        n_tokens = self.batches.tokens_per_step()
        with self.activations:   # counts what autograd saves for backward (peak over the run)
            loss_local = self.forward_backward(self.model, self.loss_sum, self.engine, self.micro_batches(step),
                                               n_tokens, self.positions)
        self.model.aux.take()   # auxiliary losses were trained in that backward; their values are not reported yet
        self.engine.finish()
        sum_partial_grads(self.engine, self.mesh)                  # e.g. SP norms, replicated K/V
        norm = global_grad_norm(self.engine.norm_grads(), self.engine.norm_group, self.device)
        clip_(self.engine.owned_grads(), norm, cfg.grad_clip)
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        self.engine.step(lr)
        self.engine.zero_grad()
        sum_loss(loss_local, self.mesh, self.dims)
        routing = moe_step_stats(self.model, self.mesh["world"], self.cfg.model.layers) if self.cfg.model.experts else {}
        self.step_count = step + 1
        return {"step": step, "loss": float(loss_local), "grad_norm": norm, "lr": lr, "tokens": n_tokens,
                "seconds": time.perf_counter() - t0, **routing}

    # -- state -------------------------------------------------------------------------------
    def model_state_bytes(self) -> dict:
        """Bytes of model state held by this rank, counted from the tensors that exist."""
        return self.engine.state_bytes()

    def full_state(self) -> dict:
        """Full model and optimizer state keyed by parameter name (fp32 masters), and the persistent
        buffers of every rank merged by name (replicas are equal). Call on every rank."""
        state = gather_state(self.dims, self.engine.full_state())
        buffers = {}
        for part in gather_objects(checkpoint.persistent_buffers(self.model)):   # bookkeeping exchange
            buffers.update(part)
        return {**state, "buffers": buffers}

    def load_full_state(self, state: dict) -> None:
        state = dict(state)
        checkpoint.load_buffers(self.model, state.pop("buffers", {}))
        self.engine.load_full_state(split_state(self.dims, state))

    # -- the run -----------------------------------------------------------------------------
    def run(self, out: str | Path | None = None, resume: str | Path | None = None) -> dict:
        cfg = self.cfg.train
        out = Path(out or cfg.out)
        start = 0
        if resume:
            ck = checkpoint.load(resume)
            self.load_full_state(ck["state"])
            start = ck["step"]
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.jsonl").write_text("")
        bar = Progress(cfg.steps, enabled=not self.quiet)
        history = []
        for step in range(start, cfg.steps):
            m = self.step(step)
            history.append(m)
            if self.rank == 0:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(m) + "\n")
            bar.update(m)
        bar.close()
        if history:
            for d in self.dims:
                if hasattr(d, "write"):
                    d.write(out, gather_objects, self.rank)
        total = self.ledger.gather()
        self.all_state_bytes = gather_objects(self.model_state_bytes())
        self.all_activation_bytes = gather_objects(self.activations.peak)
        state = self.full_state() if cfg.checkpoint else None
        if self.rank == 0:
            total.write(out / "comm.json")
            (out / "run.json").write_text(json.dumps(self.run_info(), indent=1))
            if state is not None:
                checkpoint.save(out / "checkpoint.pt", state, self.step_count, self.cfg)
        return {"history": history, "comm": total.to_dict(), "state_bytes": self.model_state_bytes()}

    def run_info(self) -> dict:
        return {"config": self.cfg.to_dict(), "params": self.n_params,
                "world_size": self.world_size, "model_state_bytes_per_rank": self.model_state_bytes(),
                "model_state_bytes_by_rank": self.all_state_bytes,
                "peak_activation_bytes_per_rank": self.activations.peak,
                "peak_activation_bytes_by_rank": self.all_activation_bytes,
                "versions": {"fivefold": __version__, "torch": torch.__version__,
                             "python": sys.version.split()[0], "platform": platform.platform()}}


def train_rank(rank: int, world_size: int, cfg_dict: dict, out: str | None = None, resume: str | None = None) -> dict:
    """Entry point for one rank (used by the launcher and the tests)."""
    trainer = Trainer(Config.from_dict(cfg_dict), rank, world_size)
    result = trainer.run(out, resume)
    return result if rank == 0 else {"state_bytes": result["state_bytes"]}
