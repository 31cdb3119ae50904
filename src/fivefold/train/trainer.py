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
from ..parallel.data import DataParallelOptimizer, unique_params
from ..parallel.zero import Zero
from . import checkpoint
from .data import Batches, read_tokens
from .optim import AdamW, clip_, global_grad_norm, lr_at

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def supported(cfg: Config) -> None:
    """Layouts the runtime does not run yet fail at start, naming what is missing."""
    p = cfg.parallel
    missing = [f"{d}={getattr(p, d)}" for d in ("tp", "pp", "cp", "ep") if getattr(p, d) > 1]
    if missing:
        raise ConfigError(f"this runtime supports data parallelism and ZeRO only so far; unsupported: "
                          f"{', '.join(missing)} (use `fivefold plan` to estimate other layouts)")


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
        self.params = unique_params(self.model)
        self.n_params = sum(q.numel() for q in self.params)

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
        for i, (x_bs, y_bs) in enumerate(mbs):
            with self.engine.sync(i == len(mbs) - 1):
                loss = loss_sum(self.model(x_bs), y_bs) / n_tokens
                loss.backward()
            loss_local += loss.detach().double()
        self.engine.finish()
        grads = self.engine.owned_grads()
        norm = global_grad_norm(grads, self.norm_group)
        clip_(grads, norm, cfg.grad_clip)
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        self.engine.step(lr)
        self.engine.zero_grad()
        comm.all_reduce(loss_local, self.mesh["dp"], dim="loss")
        self.step_count = step + 1
        return {"step": step, "loss": float(loss_local), "grad_norm": norm, "lr": lr, "tokens": n_tokens,
                "seconds": time.perf_counter() - t0}

    # -- state -------------------------------------------------------------------------------
    def model_state_bytes(self) -> dict:
        """Bytes of model state held by this rank, counted from the tensors that exist."""
        return self.engine.state_bytes()

    def full_state(self) -> dict:
        """Full model and optimizer state keyed by parameter name (fp32 masters). Call on every rank."""
        return self.engine.full_state()

    def load_full_state(self, state: dict) -> None:
        self.engine.load_full_state(state)

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
