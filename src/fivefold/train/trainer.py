"""The training loop: one rank's view of a run.

`Trainer(cfg, rank, world_size)` builds the mesh, the full model (the same seeded weights on every
rank), applies the parallel dimensions to it (`parallelize`: tp → cp → ep → pp, each writing the
placements of the parameters it shards), wraps what this rank holds in the gradient engine (DDP or
ZeRO over the placements' groups, with AdamW on fp32 master weights when compute is bf16) and reads the
data. `step(k)` runs one optimizer step over the global batch of step k and returns its metrics.
`run()` trains `cfg.train.steps` steps and writes, on rank 0:

    OUT/metrics.jsonl  one line per step: step (1-based: steps done, as checkpoints/step-N and the
                       console count), loss, grad_norm, lr, tokens, seconds, tokens_per_s, tflops and
                       mfu where known (speed.py), peak_memory_bytes (the largest rank's so far), eta_s
                       (seconds left at the run's pace: the console's ETA), tokens_seen (tokens trained through
                       this step) and epoch (tokens_seen over the training data's tokens) (NaN/inf: null);
                       with experts the routing counts, expert_imbalance and dropped_fraction;
                       eval_loss, eval_ppl, eval_loss_tokens on the steps followed by an evaluation
                       (`evaluate`); data_tokens (tokens per source) when the data is a mixture;
                       a resumed run keeps the lines of the steps before its start and appends
    OUT/comm.json      the communication ledger summed over ranks (see comm/ledger.py); the
                       evaluations' traffic apart, under "eval"
    OUT/run.json       resolved config, parameter count, world size, versions, model-state bytes; the
                       device and each rank's peak memory beside the planner's prediction (`run_info`)
    OUT/checkpoints/step-N/  sharded checkpoints (checkpoint.py): every train.checkpoint_every steps,
                       at the end, and when a stop signal arrives (SIGTERM / SIGINT)
    OUT/pipeline.json  (pp > 1) the last step's measured per-rank timeline beside the simulated one,
    OUT/pipeline.svg   and their drawing
    OUT/tensorboard/   (train.tensorboard) the same scalars for TensorBoard (scalars.py)

The loop's components, each owning its state (as torchtitan's checkpointer, validator and metrics):
`Evaluator` (evaluator.py: cadence, the held-out batches, the keep-best judgement), `Checkpointer`
(checkpointer.py: cadence, retention, keep-best, resume), `StepGuard` (step_guard.py: non-finite steps
skipped until train.max_skips stop the run, a non-finite state never saved; once per step the ranks'
agreement on a stop signal, the largest peak memory and the straggler, one 24-byte all-reduce, ledger dim
"control"), `RunRecord` (run_record.py: run.json) and `RunOutputs` (outputs.py: metrics.jsonl, TensorBoard,
W&B, comm.json). The trainer builds the rank's model and engine and runs the steps between them.

Devices: the full model is built and parallelized on the host, then moved to the rank's device
(train.device, `launch.resolve_device`: CUDA under torchrun/NCCL or a single process, else the CPU);
every tensor the engines, the dimensions and the loop make after that is made on the model's device
(tests/ranks/test_device.py walks them). On the host by design: the token batches and the context-parallel
indices that shard them (moved per step), the offload store's state, and the generators that draw the
same dropout masks on every device. With `train.dtype = "bf16"` the model
computes in bf16 while the engine keeps fp32 master weights and fp32 main gradients; `train.compile`
compiles each transformer block in place with torch.compile (`compile_blocks`).

Loss rule: each micro-batch's summed token loss is divided by the number of tokens in the *global*
batch, and gradients are summed across data-parallel ranks; so loss and gradients are those of the mean
over the global batch, however it is split. The dimensions (parallel/parallelize.py) are applied in one
order and the loop names none of them: with pp > 1 the pipeline dimension runs every micro-batch's forward
and backward in the schedule's order, and its loss group (pp) sums the last stage's loss so every rank
reports it.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm, rules
from ..comm import CommLedger, gather_objects
from ..config import Config, ConfigError
from ..mesh import ParallelMesh
from ..model import Transformer, loss_sum
from ..model.documents import Documents, document_positions
from ..model.init import InitSource, cast_meta, materialize
from ..model.lora import AdapterSource, choose_trainable
from ..model.random_routing import token_keys
from ..model.transformer import Block
from ..parallel.data import DataParallelOptimizer
from ..parallel.engine import Engine, sum_partial_grads, unique_params
from ..parallel.expert import moe_step_stats
from ..parallel.microbatch import MicroBatch, cut as cut_micro_batches
from ..parallel.parallelize import loss_function, parallelize, positions_of, shard_batch, step_functions, sum_loss
from ..parallel.zero.engine import ZeroEngine
from ..parallel.zero.spec import ZeroSpec
from . import rundir
from .activations import ActivationMeter
from .checkpointer import Checkpointer
from .evaluator import Evaluator
from .run_record import RunRecord, memory_info, peak_memory, peak_rss_bytes  # noqa: F401 - tests read peak_rss_bytes here
from .step_guard import StepGuard
from .data import BatchSource, SyntheticBatches, local_rows, make_batches, make_eval_batches
from .corpus import data_identity
from .launch import heartbeat, resolve_device
from .optim import AdamW, clip_, global_grad_norm, lr_at
from .progress import Progress
from .rank_state import RankState
from .link_counters import LinkCounters
from .malloc import return_freed_memory
from .outputs import RunOutputs
from .speed import Speed
from .timeline import draw_pipeline

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
# Each rank's default torch stream (dropout without a generator, sampling) is seeded seed + stride·rank;
# a prime stride keeps the streams of nearby seeds and ranks apart. Weight init uses its own generator.
RANK_SEED_STRIDE = 7919
COMPILE_BACKEND = "inductor"           # train.compile's torch.compile backend (CPU tests may swap in aot_eager)


def supported(cfg: Config) -> None:
    """Layouts the runtime does not run yet fail at start, naming what is missing (rules.py); LoRA targets
    and freeze patterns that match nothing of this model, or leave nothing to train (a meta model: free)."""
    rules.check_runtime_support(cfg.parallel, cfg.train, cfg.model)
    if rules.trains_a_subset(cfg.train):
        try:
            meta = choose_trainable(Transformer(cfg.model, device="meta"), cfg.train)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not unique_params(meta):
            raise ConfigError(f"train.freeze {cfg.train.freeze} freezes every parameter: nothing would train; "
                              f"valid: patterns that leave some parameters out")
        idle = idle_stages(meta, cfg)
        if idle:
            raise ConfigError(f"train.freeze {cfg.train.freeze} leaves pipeline stage(s) {idle} of {cfg.parallel.pp} "
                              f"nothing to train (a stage's backward needs a trainable weight); valid: patterns that "
                              f"leave a weight of every stage, or fewer stages")


def idle_stages(meta: torch.nn.Module, cfg: Config) -> list[int]:
    """Pipeline stages (the runtime's split, parallel/pipeline/partition.py) that hold no trainable parameter."""
    from ..parallel.pipeline.partition import partition_layers

    p = cfg.parallel
    if p.pp == 1:
        return []
    part = partition_layers(cfg.model.layers, p.pp, p.vpp, p.partition)
    trained = {n for n, q in meta.named_parameters() if q.requires_grad}
    idle = []
    for stage in range(p.pp):
        prefixes = [f"layers.{i}." for i in part.layers_of_rank(stage)]
        prefixes += ["embed."] if stage == 0 else []
        prefixes += ["norm.", "head."] if stage == p.pp - 1 else []
        if not any(n.startswith(tuple(prefixes)) for n in trained):
            idle.append(stage)
    return idle


class Trainer:
    """One rank of a run: config → mesh → the full seeded model → `parallelize` (tp → cp → ep → pp, each
    dimension shards what it owns and writes its placements) → the gradient engine over the placement
    groups → the loop."""

    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1, tokens=None, quiet: bool = False,
                 planned: dict | None = None, dry: bool = False, fill: bool = True, speed: dict | None = None):
        cfg.validate(world_size)
        supported(cfg)
        if rules.pins_mmap_threshold(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.zero):
            return_freed_memory()   # a rank that gathers and frees pieces of the model (train/malloc.py)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.quiet = quiet or rank != 0
        t, p = cfg.train, cfg.parallel
        self.device = resolve_device(t.device, dist.get_backend() if dist.is_initialized() else None)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)   # run.json's peak: this trainer's, not the process's
        self.speed = Speed.from_dict(speed, world_size)   # FLOPs per token and peak from the CLI (tools/run_plan.py speed_model)
        self.link_counters = LinkCounters(rank)          # an emulated cluster's links (tools/cluster.py), else none
        torch.manual_seed(t.seed + RANK_SEED_STRIDE * rank)
        self.ledger = CommLedger(rank, world_size)
        self.mesh = ParallelMesh(p, rank, self.ledger, kv_replicas=rules.kv_replicas(p.tp, cfg.model.kv_heads),
                                 ulysses=rules.cp_degrees(p.cp_mode, p.cp, cfg.model.heads, p.tp, p.ulysses)[0])
        self.dtype = DTYPES[t.dtype]
        # optimizer math in fp32 (fp64 when the model is fp64, for exactness checks)
        self.master_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32

        # the model on the meta device: every dimension cuts meta parameters, nothing is allocated
        # until this rank materialises what it holds (model/init.py; docs/architecture.md's first paragraph)
        meta = choose_trainable(cast_meta(Transformer(cfg.model, device="meta"), self.dtype), t)   # LoRA, freeze
        self.n_params = sum(q.numel() for q in meta.parameters())
        self.n_trainable = sum(q.numel() for q in unique_params(meta))
        # (a dry run's fake tensors route no values: its MoE layers dispatch capacity-mode buffers by shape)
        self.model, self.dims = parallelize(meta, self.mesh, cfg, dry=dry and bool(cfg.model.experts))
        # DDP holds its pieces whole; ZeRO keeps them in its own flat buffers or shards, so its
        # parameters start as placeholders and never exist at their full size here
        materialize(self.model, self.device, whole=lambda q: not p.zero or not q.requires_grad)   # frozen: no engine
        if t.compile:
            compile_blocks(self.model)
        self.loss_sum = loss_function(self.dims, loss_sum)
        self.forward_backward, self.forward_only = step_functions(self.dims)   # pp: its schedule, else direct
        self.params = unique_params(self.model)
        # what this rank holds and how it meets a checkpoint; its layout is recorded before the engine
        # exists (ZeRO-3 frees the parameters' storage)
        self.state = RankState(self.model, self.mesh, self.dims)
        positions = positions_of(self.dims)
        self.positions = None if positions is None else positions.to(self.device)   # (cp: not contiguous)
        self.engine = make_engine(cfg, self.model, self.mesh, self.dtype, self.master_dtype, self.quiet)
        self.state.attach(self.engine)
        self.source = weight_source(cfg)   # the seeded init, or a Hugging Face folder (--init-hf)
        self.filled = dry                   # a dry run's fake tensors take no values
        if fill:   # fill=False: a checkpoint will be restored (run), so the init is not drawn only to be replaced
            self.fill_from_source()
        self.activations = ActivationMeter()
        # --dry-run (tools/dryrun.py): fake tensors hold no values, so batches are token-less stand-ins and
        # scalars read back from the step (loss, norm, stop flag) are 0
        self.read = zeros_of_shape if dry else torch.Tensor.tolist   # a tensor's numbers (fake ones: zeros)
        self.value = lambda t: float(self.read(t.reshape(())) if isinstance(t, torch.Tensor) else t)   # one number
        self.batches: BatchSource = SyntheticBatches(t) if dry else make_batches(t, cfg.model.vocab, tokens)
        self.data_id = data_identity(t)   # saved in checkpoints: a resume on other data is warned about
        records = None if dry else self.batches.summary() if t.records != "stream" else \
            getattr(self.batches, "stream_records", None)
        if records and not self.quiet:
            print(records_line(records, t.records), file=sys.stderr)
        self.evaluator = Evaluator(t, None if dry else make_eval_batches(t, cfg.model.vocab, tokens), self.quiet)
        self.checkpointer = Checkpointer(cfg, rank, world_size, self.quiet)
        self.record = RunRecord(cfg, world_size, self.n_params, self.n_trainable, self.data_id, planned, records)
        self.guard = StepGuard(t, rank, self.mesh["world"], p.ranks_per_node, self.device, self.value, self.quiet)
        self.step_count = 0
        self.stop = None        # a stop signal the ranks agreed on at the end of the last step

    # -- one step ----------------------------------------------------------------------------
    def micro_batches(self, step: int, batches=None, loss_tokens: int | None = None) -> list[MicroBatch]:
        """This rank's micro-batches of step `step` of `batches` (default: the training batches), `rank_micro_batches`."""
        return rank_micro_batches(self.cfg, self.mesh.coords["dp"], self.dims, self.device,
                                  self.batches if batches is None else batches, step, loss_tokens, training=batches is None)

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        comm_s0 = self.ledger.total(field="seconds")
        cfg = self.cfg.train
        n_tokens = self.batches.tokens_per_step()
        n_loss = self.batches.loss_tokens(step)      # the targets the loss averages over (a loss mask keeps fewer)
        with self.activations:   # counts what autograd saves for backward (peak over the run)
            loss_local = self.forward_backward(self.model, self.loss_sum, self.engine,
                                               self.micro_batches(step, loss_tokens=n_loss), self.positions)
        self.model.aux.take(self.value)   # auxiliary losses were trained in that backward; not reported yet
        self.engine.finish()
        sum_partial_grads(self.engine, self.mesh)                  # e.g. SP norms, replicated K/V
        norm = global_grad_norm(self.engine.norm_grads(), self.engine.norm_group, self.device, self.value)
        sum_loss(loss_local, self.mesh, self.dims)   # the step's loss, the same on every rank
        loss = self.value(loss_local)
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps, cfg.lr_schedule, cfg.decay_fraction)
        finite = math.isfinite(loss) and math.isfinite(norm)   # both global: every rank decides alike
        if finite:
            clip_(self.engine.owned_grads(), norm, cfg.grad_clip)
            self.engine.step(lr)
            self.guard.passed()
        else:
            self.guard.skip(step, loss, norm)
        self.engine.zero_grad()
        routing = moe_step_stats(self.model, self.mesh["world"], self.cfg.model.layers, self.read,
                                 self.cfg.model.experts) if self.cfg.model.experts else {}
        busy = time.perf_counter() - t0 - (self.ledger.total(field="seconds") - comm_s0)
        self.stop, peak, slowest = self.guard.agree(peak_memory(self.device), busy)
        self.step_count = step + 1
        seconds = time.perf_counter() - t0
        seen = (step + 1) * n_tokens   # every step trains global_batch x seq_len tokens, whatever the layout
        return {"step": step + 1, "loss": loss, "grad_norm": norm, "lr": lr, "tokens": n_tokens,   # step: 1-based
                "tokens_seen": seen, "epoch": seen / max(self.batches.data_tokens(), 1),
                **({"loss_tokens": n_loss} if self.batches.masked else {}),
                "seconds": seconds, "time": time.time(),
                **self.link_counters.read_at_step_end(self.mesh["world"], self.device),
                **self.speed.scalars(n_tokens, seconds),
                "peak_memory_bytes": peak, **slowest, **({} if finite else {"skipped": True}), **routing}

    # -- evaluation (train/evaluator.py) ------------------------------------------------------
    def evaluate(self) -> dict:
        """The model's loss on the evaluation batches (`Evaluator.evaluate`): forward only (the pipeline's
        forward-only action list with pp > 1), summed over dp × cp and the pipeline as the training loss is
        (`sum_loss`), so it is the same under every layout. Its traffic is recorded in the ledger's "eval"
        section (comm.json "eval"), apart from the training steps'. Call on every rank."""
        batches = self.evaluator.batches

        def forward(b: int, n_tokens: int) -> torch.Tensor:
            return self.forward_only(self.model, self.loss_sum, self.micro_batches(b, batches, n_tokens), self.positions)

        def finish(loss_local: torch.Tensor) -> None:
            self.engine.release_params()   # ZeRO-3: free what the forwards gathered
            sum_loss(loss_local, self.mesh, self.dims)

        with self.ledger.section("eval"):
            return self.evaluator.evaluate(self.model, forward, finish, self.device, self.step_count or None)

    # -- state -------------------------------------------------------------------------------
    def model_state_bytes(self) -> dict:
        """Bytes of model state held by this rank, counted from the tensors that exist: the engine's, and
        the frozen weights beside it (LoRA's base, train.freeze) under "params"."""
        out = dict(self.engine.state_bytes())
        frozen = sum(q.numel() * q.element_size() for q in {id(q): q for q in self.frozen().values()}.values())
        out["params"] += frozen
        out["total"] += frozen
        return out

    def full_state(self) -> dict:
        """Full model and optimizer state keyed by parameter name (`RankState.full_state`)."""
        return self.state.full_state()

    def load_full_state(self, state: dict) -> None:
        self.state.load_full_state(state)

    # -- checkpoints -------------------------------------------------------------------------
    def frozen(self) -> dict[str, torch.nn.Parameter]:
        return self.state.frozen()

    def save(self, out: Path, step: int) -> Path:
        """Checkpoint `step` (steps done) into OUT/checkpoints (train/checkpointer.py)."""
        meta = {"skips": self.guard.skips, "data": self.data_id, **self.evaluator.state()}
        return self.checkpointer.save(out, step, self.state, self.device, meta, self.evaluator.best_step())

    def restore(self, ckpt: str | Path) -> int:
        """Load a checkpoint written by any layout (train/checkpointer.py); returns its step."""
        index = self.checkpointer.restore(ckpt, self.state, self.device)
        self.filled = True
        self.guard.skips = index.get("skips", 0)
        self.evaluator.load(index)   # the lowest eval loss so far (train.keep_best, stop_after)
        return index["step"]

    def fill_from_source(self) -> None:
        """A fresh start: the state from the seeded init or the Hugging Face folder (once)."""
        if not self.filled:
            self.state.fill(self.source)
            self.filled = True
        self.ledger.reset()   # the ledger counts training: filling the state (offload: its first disk writes) is set-up

    # -- the run -----------------------------------------------------------------------------
    def run(self, out: str | Path | None = None, resume: str | Path | None = None) -> dict:
        """Train from the checkpoint `resume` (a checkpoint or run folder, `auto`, or None) to
        train.steps. Returns the history of this call's steps and, on a stop signal, its name."""
        cfg = self.cfg.train
        out = Path(out or cfg.out)
        ckpt = rundir.resolve_resume(str(resume), out) if resume else None
        if ckpt:
            start = self.restore(ckpt)
        else:
            self.fill_from_source()
            start = 0
        self.step_count = start
        if self.rank == 0:
            for gone in rundir.start_run(out, start):   # a branch: the abandoned run's newer checkpoints go
                if not self.quiet:
                    print(f"note: branching at step {start}: removed {gone.name}, a checkpoint of the run it "
                          f"leaves", file=sys.stderr)
        bar = Progress(cfg.steps, enabled=not self.quiet, log_every=cfg.log_every, start=start, speed=self.speed)
        outputs = RunOutputs(out, self.cfg, self.rank, start)   # metrics.jsonl, TensorBoard, W&B (outputs.py)
        history, stopped = [], None
        for step in range(start, cfg.steps):
            m = self.step(step)
            mixture = self.batches.mixture(step)
            if mixture:   # the step's tokens per source
                m["data_tokens"] = mixture["tokens"]
            improved = False
            if self.evaluator.due(step):
                m.update(self.evaluate())
                improved = self.evaluator.judge(step + 1, m["eval_loss"])
            m["eta_s"] = bar.eta_seconds(step + 1)
            history.append(m)
            outputs.log(m)
            bar.update(m)
            heartbeat(step + 1)
            stopped = self.stop or self.evaluator.patience_out(step + 1)
            if self.checkpointer.due(step + 1, bool(stopped), improved):
                self.save(out, step + 1)
            if improved and cfg.keep_best:
                self.checkpointer.mark_best(out, step + 1, m["eval_loss"])   # once its checkpoint is complete
            if stopped:
                break
        bar.close()
        outputs.close()
        return self.finish(out, outputs, history, stopped)

    def finish(self, out: Path, outputs: RunOutputs, history: list, stopped) -> dict:
        """The end of `run`: the pipeline's timeline, the last checkpoint, comm.json and run.json."""
        if history:
            for d in self.dims:
                d.write(out, gather_objects, self.rank, draw=draw_pipeline)
        total = self.ledger.gather()
        evals = self.ledger.part("eval").gather() if self.evaluator.count else None
        self.record.gather(self.model_state_bytes(), self.activations.peak, self.memory_info())
        if self.checkpointer.due_at_end(self.step_count, bool(history)):
            self.save(out, self.step_count)
        comm = total.to_dict()
        if evals is not None:   # the evaluations' traffic, apart from the training steps' rows
            comm["eval"] = {**evals.to_dict(), "evaluations": self.evaluator.count,
                            "batches": self.evaluator.batches.count}   # global batches per evaluation
        outputs.finish(comm, self.run_info() if self.rank == 0 else {})
        return {"history": history, "comm": total.to_dict(), "state_bytes": self.model_state_bytes(),
                "stopped": stopped, "step": self.step_count}

    def memory_info(self) -> dict:
        """This rank's device and peak memory so far (train/run_record.py memory_info)."""
        return memory_info(self.device, self.mesh.coords["pp"])

    def run_info(self) -> dict:
        """run.json (train/run_record.py)."""
        mixture = self.batches.mixture(0, self.step_count)   # tokens per source over steps 0 .. step_count - 1
        return self.record.info(self.model_state_bytes(), self.activations.peak, self.memory_info(), mixture)


def make_engine(cfg: Config, model: torch.nn.Module, mesh: ParallelMesh, dtype: torch.dtype,
                master_dtype: torch.dtype, quiet: bool) -> Engine:
    """DDP, or ZeRO-1/2/3, over the groups the parameters' placements name, with AdamW on `master_dtype`
    masters and the gradients in fp32 (train.main_grads_fp32) or the compute `dtype`."""
    p, t = cfg.parallel, cfg.train
    grad_dtype = master_dtype if t.main_grads_fp32 else dtype

    def make_optimizer(params, decay):
        return AdamW(params, decay, (t.beta1, t.beta2), t.eps, t.weight_decay)

    if not p.zero:
        return DataParallelOptimizer(model, mesh, make_optimizer, p.bucket_mb, master_dtype, grad_dtype,
                                     only_dp=rules.reduces_only_over_dp(p.cp, cfg.model.experts, p.ep, p.etp),   # as plan.traffic
                                     decay_embeddings=t.decay_embeddings)
    if p.dp == 1 and not quiet:
        print(f"note: ZeRO-{p.zero} with dp=1 shards over a single rank and saves no memory", file=sys.stderr)
    return ZeroEngine(model, mesh, ZeroSpec.of(p), make_optimizer, p.bucket_mb, master_dtype, grad_dtype,
                      p.offload_dir, t.decay_embeddings)   # the setting as one value (parallel/zero/spec.py)


def rank_micro_batches(cfg: Config, dp_rank: int, dims: list, device: torch.device, batches, step: int,
                       loss_tokens: int | None = None, training: bool = True) -> list[MicroBatch]:
    """A rank's micro-batches of step `step` (parallel/microbatch.py): tokens, targets, with
    train.document_mask their `Documents` (model/documents.py: positions restarting per document, sharded
    like the tokens, and the document ids of the whole rows, which every cp rank keeps), the loss's divisor,
    `loss_tokens` (default: the step's targets that count), and under random routing, in training, the
    tokens' keys (model/random_routing.py), sharded like the tokens."""
    p, t = cfg.parallel, cfg.train
    x_bs, y_bs = batches.local(step, dp_rank, p.dp)
    tensors_bs = (x_bs, y_bs)
    if t.document_mask:
        ids_bS = batches.local_documents(step, dp_rank, p.dp)
        tensors_bs += (document_positions(ids_bS),)
    draws = training and cfg.model.experts > 0 and cfg.model.random_routing
    if draws:
        first, stop = local_rows(t.global_batch, dp_rank, p.dp)
        tensors_bs += (token_keys(step, t.global_batch, first, stop - first, t.seq_len),)
    tensors_bs = shard_batch(dims, *tensors_bs)
    x_bs, y_bs = tensors_bs[0].to(device), tensors_bs[1].to(device)
    docs = Documents(tensors_bs[2], ids_bS).to(device) if t.document_mask else None
    keys_bs = tensors_bs[-1].to(device) if draws else None
    n_loss = batches.loss_tokens(step) if loss_tokens is None else loss_tokens
    return cut_micro_batches(x_bs, y_bs, p.microbatches, n_loss, docs, keys_bs)


def records_line(records: dict, mode: str) -> str:
    """The start-up line on instruction data's records: how rows hold them and what they cut."""
    if mode == "stream":
        return (f"note: {records['cut']:,} of {records['records']:,} records straddle rows of seq_len + 1 tokens "
                f"(train.records = stream), trained without all of their context; --set train.records=padded (or "
                f"packed with train.document_mask) keeps each record whole in one row")
    return (f"records: {records['records']:,} in {records['rows']:,} rows ({mode}, {records['padding']:.1%} padding); "
            f"{records['cut']:,} cut to seq_len + 1, {records['dropped']:,} dropped")


def zeros_of_shape(t: torch.Tensor):
    """A dry run's reading of a tensor: zeros in its shape, as `tolist` gives (fake tensors hold no values)."""
    out = 0.0
    for n in reversed(t.shape):
        out = [out] * n if not isinstance(out, list) else [list(out) for _ in range(n)]
    return out


def weight_source(cfg: Config):
    """Where a fresh run's weights come from: the Hugging Face folder train.init_hf (read slice by slice,
    model/hf_weights.py), else the seeded init (model/init.py)."""
    if cfg.train.init_hf:
        from ..model.hf_weights import HFWeights

        base = HFWeights(cfg.train.init_hf, cfg.model)
    else:
        base = InitSource(cfg.model, cfg.train.seed)
    return AdapterSource(base, cfg.train.seed) if cfg.train.lora_rank else base


def compile_blocks(model: torch.nn.Module, backend: str | None = None) -> int:
    """train.compile: torch.compile every transformer block of `model` in place (`Module.compile`: the
    block keeps its parameters, buffers, hooks and name, so placements, engines, checkpoints and the
    pipeline's chunks see the same objects). Called after `parallelize`, so what is compiled is the block
    as this rank runs it (its tensor-parallel layers; their collectives are graph breaks and still go
    through comm/, recorded in the ledger). Returns how many blocks were compiled."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for b in blocks:
        b.compile(backend=backend or COMPILE_BACKEND)
    return len(blocks)


def train_rank(rank: int, world_size: int, cfg_dict: dict, out: str | None = None, resume: str | None = None,
               planned: dict | None = None, speed: dict | None = None) -> dict:
    """Entry point for one rank (used by the launcher and the tests). `planned`: the planner's memory for
    this layout, written to run.json beside the measured peaks (tools/run_plan.py planned_memory); `speed`: FLOPs per
    token and the device peak for TFLOP/s and MFU (tools/run_plan.py speed_model, train/speed.py)."""
    # a given checkpoint replaces the whole state: no init is drawn first ("auto" may find none)
    trainer = Trainer(Config.from_dict(cfg_dict), rank, world_size, planned=planned,
                      fill=resume in (None, "auto"), speed=speed)
    try:
        result = trainer.run(out, resume)
    finally:
        trainer.engine.remove()   # its hooks, and offloaded state: nvme's file and its rank-R folder (when empty)
    return result if rank == 0 else {"state_bytes": result["state_bytes"]}
