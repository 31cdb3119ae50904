"""The training loop: one rank's view of a run.

`Trainer(cfg, rank, world_size)` builds the mesh, the model (the same seeded weights on every rank),
the data-parallel gradient reducer, the AdamW optimizer (on fp32 master weights when compute is bf16)
and the data. `step(k)` runs one optimizer step over the global batch of step k and returns its metrics.
`run()` trains `cfg.train.steps` steps and writes, on rank 0:

    OUT/metrics.jsonl  one line per step: step, loss, grad_norm, lr, tokens, seconds
    OUT/comm.json      the communication ledger summed over ranks (see comm/ledger.py)
    OUT/run.json       resolved config, parameter count, world size, versions, model-state bytes
    OUT/checkpoint.pt  full model and optimizer state at the end
    OUT/pipeline.json  (pp > 1) the last step's measured per-rank timeline beside the simulated one,
    OUT/pipeline.svg   and their drawing

Loss rule: each micro-batch's summed token loss is divided by the number of tokens in the *global*
batch, and gradients are summed across data-parallel ranks; so loss and gradients are those of the mean
over the global batch, however it is split. With pp > 1 each rank holds one stage of the model and the
pipeline runtime (parallel/pipeline/runtime.py) runs every micro-batch's forward and backward in the
schedule's order; the last stage's loss is then summed over pp so every rank reports it.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

from .. import __version__, comm
from ..comm import CommLedger
from ..config import Config, ConfigError
from ..mesh import ParallelMesh
from ..model import Transformer, loss_sum
from ..parallel import tensor
from ..parallel.data import DataParallelOptimizer, unique_params
from ..parallel.pipeline import build_schedule, partition_layers
from ..parallel.pipeline.runtime import PipelineRuntime, Stage, gather_stages, report, stage_names, write_report
from ..parallel.zero import Zero
from . import checkpoint
from .data import Batches, read_tokens
from .optim import AdamW, clip_, global_grad_norm, lr_at

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def supported(cfg: Config) -> None:
    """Layouts the runtime does not run yet fail at start, naming what is missing."""
    p = cfg.parallel
    pipeline_supported(cfg)
    missing = [f"{d}={getattr(p, d)}" for d in ("cp", "ep") if getattr(p, d) > 1]
    if p.sp_mode in ("ulysses", "ring"):
        missing.append(f"sp_mode={p.sp_mode}")
    if missing:
        raise ConfigError(f"this runtime supports data parallelism and ZeRO only so far; unsupported: "
                          f"{', '.join(missing)} (use `fivefold plan` to estimate other layouts)")


def pipeline_supported(cfg: Config) -> None:
    """What the pipeline runtime (pp > 1) composes with, and what train.recompute needs."""
    p, t = cfg.parallel, cfg.train
    if p.pp > 1 and p.zero >= 2:
        raise ConfigError(f"ZeRO-{p.zero} with pp > 1 is not supported: ZeRO-2/3 reduce (and ZeRO-3 gathers) per "
                          f"micro-batch backward, which the pipeline splits across chunks and interleaves; use "
                          f"zero = 1 (or 0) with pp = {p.pp}")
    if p.pp > 1 and p.schedule == "zb" and p.tp > 1 and p.sp_mode == "megatron":
        raise ConfigError("the zb schedule with Megatron sequence parallelism is not supported (its weight-gradient "
                          "pass would repeat the reduce-scatter's backward all-gather); use 1f1b or sp_mode none")
    if p.pp == 1 and t.recompute != "none":
        raise ConfigError(f"train.recompute = {t.recompute!r} is done by the pipeline runtime, so it needs pp > 1 "
                          f"(got pp = 1); use recompute = 'none'")


class Trainer:
    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1, tokens=None, quiet: bool = False):
        cfg.validate(world_size)
        supported(cfg)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.quiet = quiet or rank != 0
        t, p = cfg.train, cfg.parallel
        torch.manual_seed(t.seed + 7919 * rank)  # per-rank stream (dropout, sampling); init uses its own
        self.ledger = CommLedger(rank, world_size)
        self.mesh = ParallelMesh(p, rank, self.ledger)
        self.dtype = DTYPES[t.dtype]
        # optimizer math in fp32 (fp64 when the model is fp64, for exactness checks)
        self.master_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        grad_dtype = self.master_dtype if t.main_grads_fp32 else self.dtype

        self.model = Transformer(cfg.model, seed=t.seed).to(self.dtype)
        self.n_params = sum(q.numel() for q in unique_params(self.model))  # the whole model's
        self.pipeline, self.not_counted = None, []  # pipeline parallel: keep only this rank's stage
        if p.pp > 1:
            self.partition = partition_layers(cfg.model.layers, p.pp, p.vpp, p.partition)
            self.stage_names = stage_names(self.model, self.partition)  # full shapes, before tp shards them
        self.tp = None  # tensor parallel: shard the full seeded model in place, names unchanged
        if p.tp > 1:
            self.tp = tensor.apply(self.model, self.mesh, p.sp_mode == "megatron", t.seed)
        self.loss_sum = self.tp.loss_sum if self.tp else loss_sum
        if p.pp > 1:
            self.model = self.build_pipeline()
        self.params = unique_params(self.model)

        def make_optimizer(params, decay):
            return AdamW(params, decay, (t.beta1, t.beta2), t.eps, t.weight_decay)

        if p.zero:
            if p.dp == 1 and not self.quiet:
                print(f"note: ZeRO-{p.zero} with dp=1 shards over a single rank and saves no memory",
                      file=sys.stderr)
            self.engine = Zero(self.model, self.mesh["dp"], p.zero, make_optimizer, p.bucket_mb,
                               self.master_dtype, grad_dtype, p.reshard_after_forward)
            self.norm_group = self.mesh["world"]   # shards differ on every rank
        else:
            self.engine = DataParallelOptimizer(self.model, self.mesh["dp"], make_optimizer, p.bucket_mb,
                                                self.master_dtype, grad_dtype)
            self.norm_group = self.mesh["mp"]      # replicated across dp: reduce only model-parallel parts
        self.batches = Batches(tokens if tokens is not None else read_tokens(t.data, t.data_limit_mb),
                               t.seq_len, t.global_batch, t.seed, cfg.model.vocab)
        self.step_count = 0

    # -- one step ----------------------------------------------------------------------------
    def micro_batches(self, step: int):
        p = self.cfg.parallel
        x_bs, y_bs = self.batches.local(step, self.mesh.coords["dp"], p.dp)
        return list(zip(x_bs.chunk(p.microbatches), y_bs.chunk(p.microbatches)))

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        cfg = self.cfg.train
        n_tokens = self.batches.tokens_per_step()
        mbs = self.micro_batches(step)
        loss_local = torch.zeros(1, dtype=torch.float64)
        if self.pipeline:  # the schedule runs every micro-batch's forward and backward
            loss_local = self.pipeline_backward(mbs, n_tokens)
        for i, (x_bs, y_bs) in enumerate([] if self.pipeline else mbs):
            with self.engine.sync(i == len(mbs) - 1):
                loss = self.loss_sum(self.model(x_bs), y_bs) / n_tokens
                loss.backward()
            loss_local += loss.detach().double()
        self.engine.finish()
        if self.tp:
            self.tp.sync_grads(self.engine.owned_grads)  # partial grads of tp-replicated params
        grads = self.engine.owned_grads()
        skip = (self.tp.not_counted() if self.tp else []) + self.not_counted  # replicas, tied copies: once
        counted = self.engine.owned_grads(exclude=tuple(skip)) if skip else grads
        norm = global_grad_norm(counted, self.norm_group)
        clip_(grads, norm, cfg.grad_clip)
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        self.engine.step(lr)
        self.engine.zero_grad()
        comm.all_reduce(loss_local, self.mesh["dp"], dim="loss")
        if self.pipeline:  # only the last stage holds the loss
            comm.all_reduce(loss_local, self.mesh["pp"], dim="loss")
        self.step_count = step + 1
        return {"step": step, "loss": float(loss_local), "grad_norm": norm, "lr": lr, "tokens": n_tokens,
                "seconds": time.perf_counter() - t0}

    # -- state -------------------------------------------------------------------------------
    def model_state_bytes(self) -> dict:
        """Bytes of model state held by this rank, counted from the tensors that exist."""
        return self.engine.state_bytes()

    def full_state(self) -> dict:
        """Full model and optimizer state keyed by parameter name (fp32 masters). Call on every rank."""
        state = self.engine.full_state()
        if self.pipeline:
            state = self.stage_state(state, with_copy=False)
        state = self.tp.gather_state(state) if self.tp else state
        return gather_stages(state, self.stage_names, self.mesh["pp"]) if self.pipeline else state

    def load_full_state(self, state: dict) -> None:
        if self.pipeline:
            state = self.stage_state(state, with_copy=True)
        state = self.tp.split_state(state) if self.tp else state
        self.engine.load_full_state(state)

    # -- pipeline parallelism ----------------------------------------------------------------
    def build_pipeline(self) -> Stage:
        """Cut the full model (tp-sharded already when tp > 1) to this rank's stage and set up the
        runtime with this rank's action list (parallel/pipeline/runtime.py)."""
        p, t = self.cfg.parallel, self.cfg.train
        rank = self.mesh.coords["pp"]
        stage = Stage(self.model, self.partition, rank)
        stage.seq_split = p.tp if p.sp_mode == "megatron" else 1
        if stage.tied_copy is not None:
            self.not_counted = [stage.tied_copy]   # the first stage counts the embedding
            if self.tp:
                self.tp.spec_of[stage.tied_copy] = self.tp.specs["head.weight"] = self.tp.specs["embed.weight"]
        if self.tp:  # let the other stages' layers go: tp keeps only this stage's parameters
            mine = {id(q) for q in stage.parameters()}
            self.tp.spec_of = {q: spec for q, spec in self.tp.spec_of.items() if id(q) in mine}
            self.tp.model = stage
        actions = build_schedule(p.schedule, p.pp, p.microbatches, p.vpp)[rank]
        self.pipeline = PipelineRuntime(stage, actions, self.mesh["pp"], self.loss_sum, t.recompute, self.dtype)
        return stage

    def pipeline_backward(self, mbs: list, n_tokens: int) -> torch.Tensor:
        """Forward and backward of every micro-batch by the schedule, gradients accumulating locally;
        then tied-embedding gradients summed (dim "embed"), then the DP/ZeRO-1 reduction starts."""
        with self.engine.sync(False):
            loss_local = self.pipeline.run(mbs, n_tokens)
        self.pipeline.reduce_tied(self.engine, self.mesh["embed"])
        with self.engine.sync(True):  # ZeRO-1 reduce-scatters on leaving; DDP's buckets go in finish()
            pass
        return loss_local

    def stage_state(self, state: dict, with_copy: bool) -> dict:
        """This stage's entries of a full state; with_copy adds the tied head copy (= the embedding),
        without it the copy is dropped (the checkpoint holds the embedding once)."""
        names = {n: n for n, _ in self.stage_names[self.mesh.coords["pp"]]}
        if self.model.tied_copy is not None:
            names = {**names, "head.weight": "embed.weight"} if with_copy else names
        return {k: ({n: v[src] for n, src in names.items()} if isinstance(v, dict) else v) for k, v in state.items()}

    def write_pipeline(self, out: Path) -> None:
        """OUT/pipeline.json and OUT/pipeline.svg: the last step's measured timeline of the pp ranks of
        rank 0's group beside the simulated one (call on every rank: gathers the timelines)."""
        timelines = gather_objects([tuple(b) for b in self.pipeline.timeline])
        if self.rank == 0:
            p = self.cfg.parallel
            rows = [timelines[r] for r in self.mesh["pp"].ranks]
            info = report(rows, p.schedule, p.pp, p.microbatches, p.vpp)
            write_report(out, info)

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
        if self.pipeline and history:
            self.write_pipeline(out)
        total = self.ledger.gather()
        self.all_state_bytes = gather_objects(self.model_state_bytes())
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
                "versions": {"fivefold": __version__, "torch": torch.__version__,
                             "python": sys.version.split()[0], "platform": platform.platform()}}


def gather_objects(obj) -> list:
    """Every rank's obj (a bookkeeping exchange outside the ledger, like CommLedger.gather)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Progress:
    """A one-line progress bar on stderr: step, loss, tokens/s."""

    def __init__(self, total: int, enabled: bool = True, width: int = 24):
        self.total, self.enabled, self.width = total, enabled, width
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.tokens = 0

    def update(self, m: dict) -> None:
        if not self.enabled:
            return
        self.tokens += m["tokens"]
        done = m["step"] + 1
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        fill = int(self.width * done / self.total)
        line = (f"step {done:>5}/{self.total} [{'#' * fill}{'.' * (self.width - fill)}] "
                f"loss {m['loss']:.4f}  grad {m['grad_norm']:.3f}  lr {m['lr']:.2e}  {rate:,.0f} tok/s")
        if self.tty:
            sys.stderr.write("\r" + line)
        elif done == 1 or done == self.total or done % max(self.total // 20, 1) == 0:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def train_rank(rank: int, world_size: int, cfg_dict: dict, out: str | None = None, resume: str | None = None) -> dict:
    """Entry point for one rank (used by the launcher and the tests)."""
    trainer = Trainer(Config.from_dict(cfg_dict), rank, world_size)
    result = trainer.run(out, resume)
    return result if rank == 0 else {"state_bytes": result["state_bytes"]}
