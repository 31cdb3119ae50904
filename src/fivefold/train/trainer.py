"""The training loop: one rank's view of a run.

`Trainer(cfg, rank, world_size)` builds the mesh, the model (the same seeded weights on every rank),
the data-parallel gradient reducer, the AdamW optimizer (on fp32 master weights when compute is bf16)
and the data. `step(k)` runs one optimizer step over the global batch of step k and returns its metrics.
`run()` trains `cfg.train.steps` steps and writes, on rank 0:

    OUT/metrics.jsonl  one line per step: step, loss, grad_norm, lr, tokens, seconds
    OUT/comm.json      the communication ledger summed over ranks (see comm/ledger.py)
    OUT/run.json       resolved config, parameter count, world size, versions, model-state bytes
    OUT/checkpoint.pt  full model and optimizer state at the end

Loss rule: each micro-batch's summed token loss is divided by the number of tokens in the *global*
batch, and gradients are summed across data-parallel ranks; so loss and gradients are those of the mean
over the global batch, however it is split.
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
from ..parallel.data import DataParallel, unique_params
from . import checkpoint
from .data import Batches, read_tokens
from .optim import AdamW, clip_, global_grad_norm, lr_at

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def supported(cfg: Config) -> None:
    """Layouts the runtime does not run yet fail at start, naming what is missing."""
    p = cfg.parallel
    missing = [f"{d}={getattr(p, d)}" for d in ("tp", "pp", "cp", "ep") if getattr(p, d) > 1]
    if p.zero:
        missing.append(f"zero={p.zero}")
    if missing:
        raise ConfigError(f"this runtime supports data parallelism only so far; unsupported: {', '.join(missing)} "
                          f"(use dp and microbatches, or `fivefold plan` to estimate other layouts)")


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

        self.model = Transformer(cfg.model, seed=t.seed).to(self.dtype)
        self.params = unique_params(self.model)
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        # gradients and optimizer math in fp32 (fp64 when the model is fp64, for exactness checks)
        self.master_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.dp = DataParallel(self.model, self.mesh["dp"], p.bucket_mb, grad_dtype=self.master_dtype)
        if self.dtype == self.master_dtype:
            self.master = [q.data for q in self.params]
        else:
            self.master = [q.detach().to(self.master_dtype).clone() for q in self.params]
        self.opt = AdamW(self.master, [q.dim() >= 2 for q in self.params], (t.beta1, t.beta2), t.eps,
                         t.weight_decay)
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
        for i, (x_bs, y_bs) in enumerate(mbs):
            with self.dp.sync(i == len(mbs) - 1):
                loss = loss_sum(self.model(x_bs), y_bs) / n_tokens
                loss.backward()
            loss_local += loss.detach().double()
        self.dp.finish()
        grads = [q.main_grad for q in self.params]
        norm = global_grad_norm(grads, self.mesh["mp"])
        clip_(grads, norm, cfg.grad_clip)
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        self.opt.step(grads, lr)
        if self.dtype != self.master_dtype:
            with torch.no_grad():
                for q, m in zip(self.params, self.master):
                    q.copy_(m)
        self.dp.zero_grad()
        comm.all_reduce(loss_local, self.mesh["dp"], dim="loss")
        self.step_count = step + 1
        return {"step": step, "loss": float(loss_local), "grad_norm": norm, "lr": lr, "tokens": n_tokens,
                "seconds": time.perf_counter() - t0}

    # -- state -------------------------------------------------------------------------------
    def model_state_bytes(self) -> dict:
        """Bytes of model state held by this rank, counted from the tensors that exist."""
        params = sum(q.numel() * q.element_size() for q in self.params)
        grads = sum(b.grad.numel() * b.grad.element_size() for b in self.dp.buckets)
        opt = self.opt.state_bytes()
        if self.dtype != self.master_dtype:
            opt += sum(m.numel() * m.element_size() for m in self.master)
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}

    def full_state(self) -> dict:
        """Full model and optimizer state keyed by parameter name (fp32 masters)."""
        names = [self.names[id(q)] for q in self.params]
        return {"model": {n: m.detach().clone() for n, m in zip(names, self.master)},
                "exp_avg": {n: e.clone() for n, e in zip(names, self.opt.exp_avg)},
                "exp_avg_sq": {n: e.clone() for n, e in zip(names, self.opt.exp_avg_sq)},
                "opt_t": self.opt.t}

    def load_full_state(self, state: dict) -> None:
        names = [self.names[id(q)] for q in self.params]
        with torch.no_grad():
            for n, q, m, ea, es in zip(names, self.params, self.master, self.opt.exp_avg, self.opt.exp_avg_sq):
                m.copy_(state["model"][n])
                q.copy_(m)
                ea.copy_(state["exp_avg"][n])
                es.copy_(state["exp_avg_sq"][n])
        self.opt.t = state["opt_t"]

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
        total = self.ledger.gather()
        state = self.full_state() if cfg.checkpoint else None
        if self.rank == 0:
            total.write(out / "comm.json")
            (out / "run.json").write_text(json.dumps(self.run_info(), indent=1))
            if state is not None:
                checkpoint.save(out / "checkpoint.pt", state, self.step_count, self.cfg)
        return {"history": history, "comm": total.to_dict(), "state_bytes": self.model_state_bytes()}

    def run_info(self) -> dict:
        return {"config": self.cfg.to_dict(), "params": sum(q.numel() for q in self.params),
                "world_size": self.world_size, "model_state_bytes_per_rank": self.model_state_bytes(),
                "versions": {"fivefold": __version__, "torch": torch.__version__,
                             "python": sys.version.split()[0], "platform": platform.platform()}}


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
