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
                       (seconds left at the run's pace: the console's ETA) (NaN/inf: null);
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

Failures: a step whose loss or gradient norm is NaN/inf is skipped (no optimizer update;
train.skip_nonfinite) and the run stops after train.max_skips such steps in a row, naming the step; a
non-finite state is never saved. Once per step the ranks agree whether a stop signal arrived (one
24-byte all-reduce over the world, ledger dim "control", which also carries the largest peak memory
of any rank and the straggler for the metrics): then they save and return.

Stragglers: each rank's busy seconds in a step are its step time less the seconds it spent in
collectives (the ledger's); the control all-reduce's max of busy · 2^20 + rank names the slowest rank
and, from parallel.ranks_per_node, its node: metrics.jsonl's `slowest_rank`, `slowest_busy_s` and,
when the ranks span nodes, `slowest_node` and the console line's "slowest r3@n1 0.41 s". A CPU-throttled
or busy node shows there; a slow link shows as every rank's waiting instead.

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

from .. import __version__, comm, rules
from ..comm import CommLedger, gather_objects
from ..config import Config, ConfigError
from ..mesh import ParallelMesh
from ..process import host_cpu, host_platform
from ..model import Transformer, loss_sum
from ..model.documents import Documents, document_positions
from ..model.init import InitSource, cast_meta, materialize
from ..model.lora import AdapterSource, choose_trainable
from ..model.moe import MoE
from ..model.random_routing import token_keys
from ..model.transformer import Block
from ..parallel.data import DataParallelOptimizer
from ..parallel.engine import Engine, sum_partial_grads, unique_params
from ..parallel.expert import moe_step_stats
from ..parallel.microbatch import MicroBatch, cut as cut_micro_batches
from ..parallel.parallelize import loss_function, parallelize, positions_of, shard_batch, step_functions, sum_loss
from ..parallel.zero import Zero
from . import checkpoint, rundir
from .activations import ActivationMeter
from .data import BatchSource, SyntheticBatches, local_rows, make_batches, make_eval_batches
from .corpus import data_identity
from .launch import heartbeat, resolve_device, stop_requested
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
STOP_SIGNALS = ("SIGINT", "SIGTERM")   # agreed over the ranks as an index + 1 (0: keep going)
COMPILE_BACKEND = "inductor"           # train.compile's torch.compile backend (CPU tests may swap in aot_eager)


class NonFiniteError(RuntimeError):
    """The run stopped on NaN/inf loss or gradient norm (train.skip_nonfinite, train.max_skips)."""

    brief = True   # the message says it all: the launcher reports it without a traceback


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


STRAGGLER_RANK_BITS = 20      # ranks below 2^20 in the low bits; microseconds of busy time above them


def straggler_key(busy_s: float, rank: int) -> int:
    """One int64 whose max over ranks is the slowest rank: busy microseconds, then the rank."""
    return (max(0, int(busy_s * 1e6)) << STRAGGLER_RANK_BITS) | rank


def straggler(key: int, ranks_per_node: int, world: int) -> dict:
    """The metrics of the slowest rank from the agreed key ({} with one rank: no one to compare)."""
    if world <= 1:
        return {}
    rank = key & ((1 << STRAGGLER_RANK_BITS) - 1)
    node = {"slowest_node": rank // ranks_per_node} if 0 < ranks_per_node < world else {}
    return {"slowest_rank": rank, **node, "slowest_busy_s": (key >> STRAGGLER_RANK_BITS) / 1e6}


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
        self.planned = planned   # the planner's memory for this layout (tools/run_plan.py planned_memory), written to run.json
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
        self.engine = self.make_engine()
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
        self.eval_batches = None if dry else make_eval_batches(t, cfg.model.vocab, tokens)   # None: no evaluation
        self.evaluations = 0
        self.step_count = 0
        self.skips = 0          # consecutive skipped (non-finite) steps
        self.best: dict | None = None   # {"step", "eval_loss"} of the lowest eval loss (train.keep_best)
        self.evals_since_best = 0       # evaluations since it (train.stop_after)
        self.stop = None        # a stop signal the ranks agreed on at the end of the last step

    def make_engine(self) -> Engine:
        """DDP, or ZeRO-1/2/3, over the groups the parameters' placements name."""
        p, t = self.cfg.parallel, self.cfg.train
        grad_dtype = self.master_dtype if t.main_grads_fp32 else self.dtype

        def make_optimizer(params, decay):
            return AdamW(params, decay, (t.beta1, t.beta2), t.eps, t.weight_decay)

        if not p.zero:
            return DataParallelOptimizer(self.model, self.mesh, make_optimizer, p.bucket_mb, self.master_dtype, grad_dtype,
                                         only_dp=rules.reduces_only_over_dp(p.cp, self.cfg.model.experts, p.ep, p.etp),   # as plan.traffic
                                         decay_embeddings=t.decay_embeddings)
        if p.dp == 1 and not self.quiet:
            print(f"note: ZeRO-{p.zero} with dp=1 shards over a single rank and saves no memory", file=sys.stderr)
        scheduled = any(d.schedules_backward for d in self.dims)
        return Zero(self.model, self.mesh, p.zero, make_optimizer, p.bucket_mb, self.master_dtype, grad_dtype,
                    p.reshard_after_forward, pipeline=scheduled, reduce_each_microbatch=p.reduce_each_microbatch,
                    offload=p.offload, offload_dir=p.offload_dir,   # offload: parallel/offload.py
                    decay_embeddings=t.decay_embeddings, prefetch=p.zero_prefetch)

    # -- one step ----------------------------------------------------------------------------
    def micro_batches(self, step: int, batches=None, loss_tokens: int | None = None) -> list[MicroBatch]:
        """This rank's micro-batches of step `step` (parallel/microbatch.py): tokens, targets, with
        train.document_mask their `Documents` (model/documents.py: positions restarting per document,
        sharded like the tokens, and the document ids of the whole rows, which every cp rank keeps), the
        loss's divisor, `loss_tokens` (default: the step's targets that count), and under random routing,
        in training (`batches` None), the tokens' keys (model/random_routing.py), sharded like the tokens."""
        p, t = self.cfg.parallel, self.cfg.train
        training = batches is None
        batches = self.batches if batches is None else batches
        dp_rank = self.mesh.coords["dp"]
        x_bs, y_bs = batches.local(step, dp_rank, p.dp)
        tensors_bs = (x_bs, y_bs)
        if t.document_mask:
            ids_bS = batches.local_documents(step, dp_rank, p.dp)
            tensors_bs += (document_positions(ids_bS),)
        draws = training and self.cfg.model.experts > 0 and self.cfg.model.random_routing
        if draws:
            first, stop = local_rows(t.global_batch, dp_rank, p.dp)
            tensors_bs += (token_keys(step, t.global_batch, first, stop - first, t.seq_len),)
        tensors_bs = shard_batch(self.dims, *tensors_bs)
        x_bs, y_bs = tensors_bs[0].to(self.device), tensors_bs[1].to(self.device)
        docs = Documents(tensors_bs[2], ids_bS).to(self.device) if t.document_mask else None
        keys_bs = tensors_bs[-1].to(self.device) if draws else None
        n_loss = batches.loss_tokens(step) if loss_tokens is None else loss_tokens
        return cut_micro_batches(x_bs, y_bs, p.microbatches, n_loss, docs, keys_bs)

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
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps, cfg.lr_schedule, cfg.decay_fraction)
        finite = math.isfinite(loss) and math.isfinite(norm)   # both global: every rank decides alike
        if finite:
            clip_(self.engine.owned_grads(), norm, cfg.grad_clip)
            self.engine.step(lr)
            self.skips = 0
        else:
            self.skip(step, loss, norm)
        self.engine.zero_grad()
        routing = moe_step_stats(self.model, self.mesh["world"], self.cfg.model.layers, self.read,
                                 self.cfg.model.experts) if self.cfg.model.experts else {}
        busy = time.perf_counter() - t0 - (self.ledger.total(field="seconds") - comm_s0)
        self.stop, peak, slowest = self.agree_stop(self.peak_memory(), busy)
        self.step_count = step + 1
        seconds = time.perf_counter() - t0
        return {"step": step + 1, "loss": loss, "grad_norm": norm, "lr": lr, "tokens": n_tokens,   # step: 1-based
                **({"loss_tokens": n_loss} if self.batches.masked else {}),
                "seconds": seconds, "time": time.time(), **self.read_links(),
                **self.speed.scalars(n_tokens, seconds),
                "peak_memory_bytes": peak, **slowest, **({} if finite else {"skipped": True}), **routing}

    def read_links(self) -> dict:
        """An emulated cluster's link counters at this step's end (train/link_counters.py), read by rank 0
        right after `agree_stop`'s world all-reduce, then the gate: an 8-byte all-reduce over the world
        (ledger dim "links") that holds every rank's next step until the read is done, outside the step's
        seconds. {} and no gate in any other run."""
        if not self.link_counters.gated:
            return {}
        reads = self.link_counters.read()
        comm.all_reduce(torch.zeros(1, dtype=torch.int64, device=self.device), self.mesh["world"], dim="links")
        return reads

    def peak_memory(self) -> int | None:
        """This rank's peak memory so far: the device's (max_memory_allocated) on CUDA, the process's
        peak resident set on the CPU (`memory_info`)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss_bytes()

    # -- evaluation --------------------------------------------------------------------------
    def judge(self, step: int, eval_loss: float) -> bool:
        """Whether the evaluation after step `step` (1-based) lowered the best eval loss (kept in
        checkpoints, so a resumed run judges as an uninterrupted one); every rank decides alike (the loss
        is the same on all)."""
        if not math.isfinite(eval_loss) or (self.best is not None and eval_loss >= self.best["eval_loss"]):
            self.evals_since_best += 1
            return False
        self.best, self.evals_since_best = {"step": step, "eval_loss": float(eval_loss)}, 0
        return True

    def patience_out(self, step: int) -> bool:
        """train.stop_after evaluations in a row without a lower eval loss: stop (with one line)."""
        n = self.cfg.train.stop_after
        if not n or self.evals_since_best < n:
            return False
        if self.rank == 0 and not self.quiet:
            print(f"stopping after step {step}: the eval loss has not improved for {n} evaluations (best "
                  f"{self.best['eval_loss']:.6f} after step {self.best['step']})", file=sys.stderr)
        return True

    def evaluates_after(self, step: int) -> bool:
        """Whether step `step` (0-based) is followed by an evaluation: every train.eval_every steps and
        after the run's last step (eval_every 0: never)."""
        every = self.cfg.train.eval_every
        return bool(every and self.eval_batches is not None and ((step + 1) % every == 0
                                                                 or step + 1 == self.cfg.train.steps))

    def evaluate(self) -> dict:
        """The model's loss on the evaluation batches (data.EvalBatches): forward only (the pipeline's
        forward-only action list with pp > 1), no gradient, no optimizer step, dropout off; the mean
        token loss over every evaluated token, summed over dp × cp and the pipeline as the training loss
        is (`sum_loss`), so it is the same under every layout. Its traffic is recorded in the ledger's
        "eval" section (comm.json "eval"), apart from the training steps'. Call on every rank."""
        batches = self.eval_batches
        n_tokens = batches.loss_tokens_total()
        forward = self.forward_only
        was_training = self.model.training
        self.model.eval()
        with self.ledger.section("eval"), torch.no_grad():
            loss_local = torch.zeros(1, dtype=torch.float64, device=self.device)
            for b in range(batches.count):
                loss_local += forward(self.model, self.loss_sum, self.micro_batches(b, batches, n_tokens),
                                      self.positions)
                heartbeat(self.step_count or None)   # progress, not a hang (watchdog)
            self.engine.release_params()   # ZeRO-3: free what the forwards gathered
            sum_loss(loss_local, self.mesh, self.dims)
        self.model.train(was_training)
        self.model.aux.take()   # an evaluation trains nothing: no auxiliary loss, no routing statistics
        for m in self.model.modules():
            if isinstance(m, MoE):
                m.take_step_stats()
        self.evaluations += 1
        loss = float(loss_local)
        return {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_loss_tokens": n_tokens}

    def skip(self, step: int, loss: float, norm: float) -> None:
        """A non-finite step: no update (its gradients are dropped), or the end of the run."""
        cfg = self.cfg.train
        self.skips += 1
        what = f"step {step + 1}: loss {loss}, gradient norm {norm}"   # 1-based, as the console and metrics.jsonl
        if not cfg.skip_nonfinite:
            raise NonFiniteError(f"{what} (train.skip_nonfinite is off); lower train.lr or raise train.warmup")
        if self.skips >= cfg.max_skips:
            raise NonFiniteError(f"{what}: {self.skips} non-finite steps in a row (train.max_skips = "
                                 f"{cfg.max_skips}); stopped without saving: lower train.lr or raise train.warmup")
        if not self.quiet:
            print(f"\nwarning: {what}: step skipped ({self.skips} in a row, stop at {cfg.max_skips})", file=sys.stderr)

    def agree_stop(self, peak_bytes: int | None, busy_s: float = 0.0) -> tuple[str | None, int | None, dict]:
        """The stop signal any rank received (SIGINT / SIGTERM), the largest of the ranks' peak memory
        (`peak_bytes`: this rank's) and the slowest rank by busy seconds (`busy_s`: this rank's step time
        outside collectives), agreed by all: one all-reduce (max) of three int64 (see "Stragglers")."""
        name = stop_requested()
        busy = straggler_key(busy_s, self.rank)
        flags = torch.tensor([STOP_SIGNALS.index(name) + 1 if name in STOP_SIGNALS else 0, peak_bytes or 0, busy],
                             dtype=torch.int64, device=self.device)
        comm.all_reduce(flags, self.mesh["world"], reduce_op="max", dim="control")
        agreed, peak = int(self.value(flags[0])), int(self.value(flags[1]))
        return (STOP_SIGNALS[agreed - 1] if agreed else None), (peak or None), \
            straggler(int(self.value(flags[2])), self.cfg.parallel.ranks_per_node, self.world_size)

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
        """Checkpoint `step` (steps done) into OUT/checkpoints: every rank writes the pieces of state it
        holds (its ZeRO shards as they are), nothing gathered."""
        entries, opt_t = self.state.entries()
        meta = {"opt_t": opt_t, "skips": self.skips, "data": self.data_id, "best": self.best,
                "evals_since_best": self.evals_since_best}
        protect = self.best["step"] if self.best and self.cfg.train.keep_best else None
        return checkpoint.save(out, step, self.cfg, entries, self.state.rng_state(self.device), meta,
                               self.cfg.train.keep_checkpoints, self.rank, protect)

    def restore(self, ckpt: str | Path) -> int:
        """Load a checkpoint written by any layout; returns its step. Each rank reads only the boxes its
        own state covers. Random streams are restored when the layout is the same (then a resumed run
        is bit-exact, dropout included)."""
        reader = checkpoint.open_matching(ckpt, self.state.keys())
        self.state.fill(reader, reader.index["opt_t"])
        self.skips = reader.index.get("skips", 0)
        self.best = reader.index.get("best")   # the lowest eval loss so far (train.keep_best, stop_after)
        self.evals_since_best = reader.index.get("evals_since_best", 0)
        where = ("offload", "offload_dir")   # where optimizer state lives changes no random stream
        layout = lambda par: {k: v for k, v in par.items() if k not in where}   # noqa: E731
        same_layout = (reader.index["world_size"] == self.world_size
                       and layout(reader.index["config"]["parallel"]) == layout(self.cfg.to_dict()["parallel"]))
        if same_layout:
            self.state.set_rng_state(reader.rng(self.rank), self.device)
        elif self.cfg.model.dropout and not self.quiet:
            print("note: the checkpoint was written by another layout: dropout's random streams start afresh",
                  file=sys.stderr)
        return reader.index["step"]

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
            self.filled = True
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
        history, stopped, saved = [], None, start if ckpt else None
        for step in range(start, cfg.steps):
            m = self.step(step)
            mixture = self.batches.mixture(step)
            if mixture:   # the step's tokens per source
                m["data_tokens"] = mixture["tokens"]
            improved = False
            if self.evaluates_after(step):
                m.update(self.evaluate())
                improved = self.judge(step + 1, m["eval_loss"])
            m["eta_s"] = bar.eta_seconds(step + 1)
            history.append(m)
            outputs.log(m)
            bar.update(m)
            heartbeat(step + 1)
            stopped = self.stop or self.patience_out(step + 1)
            every = cfg.checkpoint_every
            if cfg.checkpoint and (stopped or (every and (step + 1) % every == 0) or (improved and cfg.keep_best)):
                self.save(out, step + 1)
                saved = step + 1
            if improved and cfg.keep_best and self.rank == 0:
                rundir.write_best(out, step + 1, m["eval_loss"])   # once its checkpoint is complete
            if stopped:
                break
        bar.close()
        outputs.close()
        if history:
            for d in self.dims:
                d.write(out, gather_objects, self.rank, draw=draw_pipeline)
        total = self.ledger.gather()
        evals = self.ledger.part("eval").gather() if self.evaluations else None
        self.all_state_bytes = gather_objects(self.model_state_bytes())
        self.all_activation_bytes = gather_objects(self.activations.peak)
        self.all_memory = gather_objects(self.memory_info())
        if cfg.checkpoint and history and saved != self.step_count:
            self.save(out, self.step_count)
        comm = total.to_dict()
        if evals is not None:   # the evaluations' traffic, apart from the training steps' rows
            comm["eval"] = {**evals.to_dict(), "evaluations": self.evaluations,
                            "batches": self.eval_batches.count}   # global batches per evaluation
        outputs.finish(comm, self.run_info() if self.rank == 0 else {})
        return {"history": history, "comm": total.to_dict(), "state_bytes": self.model_state_bytes(),
                "stopped": stopped, "step": self.step_count}

    def memory_info(self) -> dict:
        """This rank's device and peak memory so far: `peak_device_bytes` is
        torch.cuda.max_memory_allocated on CUDA (every tensor the caching allocator handed out since the
        trainer started; None on the CPU, which has no such counter), `peak_rss_bytes` the process's peak
        resident set (getrusage ru_maxrss: the interpreter and torch's libraries included, so only a
        coarse upper bound of the tensors'; None where the platform does not report it)."""
        cuda = self.device.type == "cuda"
        return {"device": str(self.device),
                "device_name": torch.cuda.get_device_name(self.device) if cuda else host_cpu(),
                "pp_stage": self.mesh.coords["pp"],
                "peak_device_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None,
                "peak_rss_bytes": peak_rss_bytes()}

    def run_info(self) -> dict:
        """run.json. Besides the config and the model-state bytes: `device` (rank 0's; `device_by_rank`),
        `peak_device_memory_bytes_by_rank` (torch.cuda.max_memory_allocated per rank; null on the CPU),
        `peak_rss_bytes_by_rank` (each process's peak RSS: see `memory_info`) and, when the caller passed
        the planner's prediction for this layout (the CLI does: tools/run_plan.py planned_memory), `planned_memory`
        (the planner's rows per pipeline stage) and `planned_memory_bytes_by_rank` (each rank's stage
        total, the number to hold against the measured peak; null without a prediction)."""
        mem = getattr(self, "all_memory", None) or [self.memory_info()]
        stages = (self.planned or {}).get("stages")
        planned = [stages[m["pp_stage"]]["total"] if stages else None for m in mem]
        mixture = self.batches.mixture(0, self.step_count)   # tokens per source over steps 0 .. step_count - 1
        return {**({"data_mixture": mixture} if mixture else {}), "config": self.cfg.to_dict(), "data": self.data_id, "params": self.n_params,
                "trainable_params": self.n_trainable,
                "world_size": self.world_size, "model_state_bytes_per_rank": self.model_state_bytes(),
                "model_state_bytes_by_rank": self.all_state_bytes,
                "peak_activation_bytes_per_rank": self.activations.peak,
                "peak_activation_bytes_by_rank": self.all_activation_bytes,
                "device": mem[0]["device"], "device_name": mem[0]["device_name"],
                "device_by_rank": [m["device"] for m in mem],
                "peak_device_memory_bytes_by_rank": [m["peak_device_bytes"] for m in mem],
                "peak_rss_bytes_by_rank": [m["peak_rss_bytes"] for m in mem],
                "planned_memory_bytes_by_rank": planned, "planned_memory": self.planned,
                "versions": {"fivefold": __version__, "torch": torch.__version__,
                             "python": sys.version.split()[0], "platform": host_platform()}}


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


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size in bytes, or None. On Linux the memory map's high-water mark
    (/proc/self/status VmHWM), which starts afresh in a spawned rank: getrusage's ru_maxrss survives
    exec, so a rank started by a large parent (a test runner) reported the parent's peak until it
    passed it. Elsewhere ru_maxrss (macOS: bytes)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024   # kB
    except OSError:
        pass
    try:
        import resource   # POSIX only

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, AttributeError, OSError):
        return None
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows (and NaN for a NaN loss)."""
    return math.exp(loss) if loss < 709 or not math.isfinite(loss) else math.inf




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
