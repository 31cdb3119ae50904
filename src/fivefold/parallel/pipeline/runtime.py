"""Pipeline runtime: run one rank's action list (schedules.py) for one optimizer step.

Papers: GPipe (Huang et al. 2019), 1F1B / PipeDream-Flush and interleaving (Narayanan et al. 2019,
2021), zero bubble ZB-H1 (Qi et al. 2023), activation recomputation (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost"; selective: Korthikanti et al. 2022), tied embeddings (Press & Wolf 2017).

Stages. Every rank builds the same full, seeded model and keeps only its chunks (`Stage`): chunk 0 also
the embedding, the last chunk also the final norm, the head and the loss. Parameter names stay the
single-process names (`layers.5.attn.wq.weight`), so checkpoints and tests compare directly. With tied
embeddings the last stage holds a *copy* of the embedding as its head weight (same init); after the
backward the two copies' gradients are summed over the `embed` group (first and last rank of the pp
group), so both receive the same update. The copy is left out of the grad norm and the checkpoint.

Execution (`PipelineRuntime.run`). Actions are taken in list order; `steps()` groups consecutive comm
actions into one batch, posted with one `comm.send_recv` (batch_isend_irecv, ledger dim "pp"):

* SEND_F / SEND_B send a chunk's output activation / input gradient, b·s·h elements (b micro-batch,
  s sequence, h hidden) per micro-batch per chunk boundary each way; RECV_F / RECV_B post a receive
  into a fresh buffer, one compute ahead of their batch (`schedules.early_receives`: posted with the batch
  before, so on gloo, which moves a message only once its receiver has posted, it crosses during that
  compute). Receives are waited for only just before the compute that uses them (looked up by
  `message_key`), sends at the end of the step — so interleaving keeps its overlap.
* F runs the chunk's forward (the last chunk adds `MicroBatch.loss`, its token-loss sum over the global
  count of targets: the loss is their sum over micro-batches, whatever the schedule).
* B runs the chunk's full backward: weight gradients accumulate (the DP/ZeRO engine's hooks see them),
  the input gradient goes out with the next SEND_B.
* I (zero bubble) computes only gradients of activations: `autograd.grad` with respect to the chunk
  input *and* to the output of every module that holds weights (recorded by forward hooks), keeping
  the graph. Autograd skips every weight-gradient matmul, since no weight is asked for.
* Gradient sync (`sync`, the engine's `set_sync`): each chunk's last weight-gradient action (B, or W
  under zero bubble) runs with sync on, so the engine reduces that chunk's gradients while the rest of
  the schedule runs (`final_weight_actions`); every other backward only accumulates.
* W then replays, per weight-holding module, `autograd.backward(output, d_output, inputs=weights)`:
  exactly the weight half of the module's backward (dW = dYᵀX for a linear) with the same kernels, and
  the accumulation fires the same gradient hooks as B. Nothing is recomputed.

Activation checkpointing (`recompute`; the code lives in parallel/recompute.py, which names both
granularities): "selective" checkpoints the attention core (softmax(QKᵀ)V); "full" checkpoints each block
of the stage, as at pp = 1, except under zero bubble, whose split backward needs the weight-holding
modules' outputs of an ordinary graph: there F runs without autograd, keeps only the chunk input (and
the RNG states, `recompute.rng_state`, so dropout masks repeat) and re-runs the whole chunk at I.

Measurement: every compute action is timed (`timeline`: kind, micro-batch, chunk, start, end), so a run
can set what happened beside what the simulator predicts (`report`, `write_report`: OUT/pipeline.json).
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ... import comm
from ...comm import Group
from ...model.attention import rope_cos_sin
from ...model.transformer import run_blocks
from ..microbatch import MicroBatch
from ..placement import full_shape, place, placement_of
from ..recompute import RECOMPUTE, rng_state, set_rng_state
from .partition import Partition
from .schedules import (B, F, I, SEND_B, SEND_F, W, Action, Block, input_messages, message_key, simulate, steps_ahead,
                        timeline_stats)
from .spec import Schedule

# -------------------------------------------------------------------------------------------------------
# Stages: the part of the model one rank holds

class Stage(nn.Module):
    """The chunks of `model` that pipeline rank `rank` holds (chunk c on rank c % pp), with the
    single-process parameter names: `embed` (chunk 0), `layers.<i>` for its layers, `norm` and `head`
    (last chunk). With tied embeddings and pp > 1 the head weight is a separate copy of the embedding
    (`tied_copy`); on the first stage `tied` is the embedding itself. `seq_split`: Megatron sequence
    parallelism's tp degree (boundary activations are sequence shards: s/tp tokens), else 1."""

    def __init__(self, model: nn.Module, partition: Partition, rank: int, seq_split: int = 1):
        super().__init__()
        self.partition, self.rank = partition, rank
        self.chunk_ids = partition.chunks_of(rank)
        self.last = partition.chunks - 1
        self.hidden = model.cfg.hidden
        self.aux = model.aux   # the auxiliary-loss channel of this stage's blocks
        self.rope_args = (model.cfg.rope_dim, model.cfg.rope_theta)
        self.seq_split = seq_split
        self.tie = model.cfg.tie_embeddings and partition.pp > 1
        if 0 in self.chunk_ids:
            self.embed = model.embed
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in partition.layers_of_rank(rank)})
        if self.last in self.chunk_ids:
            self.norm, self.head = model.norm, model.head
            if self.tie:  # same init, own storage; the first stage counts the weight in the norm
                copy = nn.Parameter(model.head.weight.detach().clone(), requires_grad=model.head.weight.requires_grad)
                copy.placement = placement_of(model.head.weight)
                self.head.weight = place(copy, tied="embed", counted=False)
        if self.tie and 0 in self.chunk_ids:
            place(self.embed.weight, tied="embed")

    @property
    def tied(self) -> nn.Parameter | None:
        """This stage's copy of a tied embedding (the embedding on the first stage, the head weight on
        the last), whose gradient is summed over the embed group; None elsewhere or when untied."""
        if not self.tie:
            return None
        return self.embed.weight if 0 in self.chunk_ids else self.tied_copy

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy, left out of the grad norm and the checkpoint."""
        return self.head.weight if self.tie and self.last in self.chunk_ids else None

    def boundary_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        """Shape of the activation (and its gradient) crossing a chunk boundary: b·s·h (s/tp with
        sequence parallelism)."""
        return (batch, seq // self.seq_split, self.hidden)

    def rope(self, positions, device=None, dtype: torch.dtype = torch.float32):
        """cos, sin for `positions` (a 1-D tensor of position ids, or a length: 0..seq-1), in `dtype`
        (the activations')."""
        return rope_cos_sin(positions, *self.rope_args, device, dtype=dtype)

    def forward_chunk(self, chunk: int, x: torch.Tensor, cos_sd, sin_sd, documents_bS=None, keys_bs=None) -> torch.Tensor:
        """Tokens (chunk 0) or hidden states -> hidden states (or logits for the last chunk);
        `documents_bS`: the micro-batch's document ids (model/documents.py), None without a document mask;
        `keys_bs`: its tokens' keys under random routing (model/random_routing.py), else None."""
        last = chunk == self.last
        return run_blocks(x, [self.layers[str(i)] for i in self.partition.layers_of(chunk)], cos_sd, sin_sd,
                          documents_bS, embed=self.embed if chunk == 0 else None,
                          norm=self.norm if last else None, head=self.head if last else None, keys_bs=keys_bs)


def stage_names(model: nn.Module, partition: Partition) -> list[list[tuple[str, torch.Size]]]:
    """For every pipeline rank, the (name, full shape) of the parameters it owns in the checkpoint (tied
    copies excluded), in the full model's order. Every rank computes the same lists. Shapes are the
    single-process ones (from each parameter's placement), whatever other dimensions sharded."""
    named = list(model.named_parameters())   # a tied head weight appears once, as embed.weight
    out = []
    for r in range(partition.pp):
        chunks = partition.chunks_of(r)
        layers = {str(i) for i in partition.layers_of_rank(r)}
        mine = []
        for name, p in named:
            part = name.split(".")
            if ((part[0] == "embed" and 0 in chunks) or (part[0] == "layers" and part[1] in layers)
                    or (part[0] in ("norm", "head") and partition.chunks - 1 in chunks)):
                mine.append((name, full_shape(p)))
        out.append(mine)
    return out


# -------------------------------------------------------------------------------------------------------
# Running the actions

def final_weight_actions(actions: list[Action]) -> set[tuple[str, int, int]]:
    """(kind, micro-batch, chunk) of each chunk's last action that accumulates weight gradients (B or W,
    in list order): after it the chunk's gradients are final for the step."""
    last = {}
    for a in actions:
        if a.kind in (B, W):
            last[a.chunk] = (a.kind, a.microbatch, a.chunk)
    return set(last.values())


@dataclass
class Saved:
    """What a chunk's forward leaves for its backward."""
    x: torch.Tensor                    # chunk input (tokens for chunk 0)
    out: torch.Tensor | None           # output (the loss for the last chunk); None under full recompute
    ops: list = field(default_factory=list)   # (weights, module output) for a split backward
    rng: tuple | None = None           # RNG states before the forward (full recompute)


def release_sent(handle, sent: torch.Tensor) -> bool:
    """Once a send has completed, give back the bytes of what it sent (True), else keep it (False). A
    forward's output is kept for its backward only as the root of its graph: `autograd.backward(out,
    grad)` reads its grad_fn and shape, never its values (Megatron's `deallocate_output_tensor`), so
    its storage is resized to 0 under the kept tensor; a backward's sent input gradient is not used
    again at all. Without this every sent tensor stayed until the step's end: on Llama-3 405B's first
    stage (tp8 x pp16, 16 micro-batches) 4 GiB (`fivefold train --dry-run`)."""
    if not handle.done():
        return False
    handle.wait()   # finished: records its (zero) waiting time
    sent.untyped_storage().resize_(0)
    return True


class PipelineRuntime:
    """Executes `actions` (this rank's list from `build_schedule`) on `stage` over the pipeline `group`.

    `recompute` is none | full | selective. Each pass (`run`, `run_forward`) is given its loss function
    `loss_fn(logits, targets)` (the sum of token losses) and `run` the engine's `sync` (set_sync, or None:
    never sync): the step's state is arguments, not attributes set from outside. After `run`,
    `timeline` lists this rank's compute blocks (kind, micro-batch, chunk, start, end) in seconds of
    `time.perf_counter` (one clock per host)."""

    def __init__(self, stage: Stage, actions: list[Action], group: Group, recompute: str = "none",
                 dtype: torch.dtype = torch.float32):
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        self.stage, self.actions, self.group = stage, actions, group
        self.recompute, self.dtype = recompute, dtype
        self.pp, self.chunks = stage.partition.pp, stage.partition.chunks
        self.split = any(a.kind in (I, W) for a in actions)
        self.timeline: list[Block] = []
        self.finals = final_weight_actions(actions)
        self._ops: list | None = None
        # zb with full recompute re-runs whole chunks (rules.block_recompute: then the blocks, which
        # parallelize checkpoints once for every layout, keep none of their own)
        self.chunk_recompute = recompute == "full" and self.split
        if self.split:
            self._install_recording()

    # -- one step ------------------------------------------------------------------------------
    def run(self, micro_batches: list[MicroBatch], loss_fn: Callable, positions: torch.Tensor | None = None,
            sync: Callable[[bool], None] | None = None) -> torch.Tensor:
        """Run every action for the step's micro-batches (parallel/microbatch.py), whose tokens sit at
        `positions` (position ids, default 0..s-1), or with packed documents their own (each micro-batch's
        positions and document ids, which stay on the rank: every stage reads them from its own copy of
        the micro-batch, so nothing more crosses a stage boundary); return this rank's share of the loss (nonzero on the last stage only) as a
        float64 tensor of one element. `loss_fn(logits, targets)`: the sum of token losses; `sync`: the
        engine's set_sync, called around each chunk's last weight-gradient action (None: never)."""
        self.begin(micro_batches, loss_fn, positions, sync)
        self.timeline = []
        for item, ahead in steps_ahead(self.actions):
            if isinstance(item, list):
                self.post(item, ahead)
            else:
                self.compute(item)
        for handle, _ in self.sending:
            handle.wait()
        assert not (self.saved or self.deferred or self.inbox or self.outbox), "actions left work undone"
        self.sending = []
        return self.loss

    def begin(self, micro_batches: list[MicroBatch], loss_fn: Callable, positions: torch.Tensor | None,
              sync: Callable[[bool], None] | None = None) -> None:
        """The state one pass over the micro-batches starts from (no message, no saved forward)."""
        self.mbs, self.loss_fn, self.sync = micro_batches, loss_fn, sync
        self.device = micro_batches[0].tokens.device
        b, s = micro_batches[0].tokens.shape
        self.shape = self.stage.boundary_shape(b, s)
        self.cos_sd, self.sin_sd = self.stage.rope(s if positions is None else positions, self.device, self.dtype)
        # packed documents: each micro-batch's own positions (restarting per document) and ids
        self.documents = [mb.documents for mb in micro_batches]
        self.ropes = [None if d is None else self.stage.rope(d.positions_bs, self.device, self.dtype) for d in self.documents]
        self.inbox: dict = {}      # message key -> (buffer, receive handle)
        self.outbox: dict = {}     # message key -> tensor waiting for its SEND
        self.sending: list = []    # (send handle, tensor) until the send is seen complete (`release_sent`)
        self.saved: dict = {}      # (micro-batch, chunk) -> Saved
        self.deferred: dict = {}   # (micro-batch, chunk) -> [(weights, output, d_output)] for W
        self.loss = torch.zeros(1, dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def run_forward(self, micro_batches: list[MicroBatch], loss_fn: Callable,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
        """An evaluation's pass: the forward-only action list (`schedules.forward_only`: F, SEND_F, RECV_F)
        without autograd, keeping nothing for a backward and leaving `timeline` (the last training step's)
        alone; returns this rank's share of the loss (nonzero on the last stage only), as `run` does."""
        from .schedules import forward_only

        self.begin(micro_batches, loss_fn, positions)
        actions = forward_only(self.pp, len(micro_batches), self.chunks // self.pp)[self.stage.rank]
        for item, ahead in steps_ahead(actions):
            if isinstance(item, list):
                self.post(item, ahead)
                continue
            got = {key: self.receive(key) for key in input_messages(item, self.pp, self.chunks)}
            mb, c = item.microbatch, item.chunk
            out = self.run_chunk(c, mb, self.mbs[mb].tokens if c == 0 else got[("F", mb, c - 1)])
            if c == self.last:
                self.loss += out.double()
            else:
                self.outbox[("F", mb, c)] = out
        for handle, _ in self.sending:
            handle.wait()
        assert not (self.inbox or self.outbox), "forward-only actions left messages undelivered"
        self.sending = []
        return self.loss

    def post(self, batch: list[Action], ahead: list[Action] = ()) -> None:
        """Post one batch of sends and receives together (one batch_isend_irecv), with the receives of the
        next batch posted `ahead` (`schedules.early_receives`); do not wait. A receive already posted
        ahead is not posted again."""
        sends = [(self.outbox.pop(message_key(a)).contiguous(), a.peer) for a in batch if a.kind in (SEND_F, SEND_B)]
        posting = [a for a in batch if a.kind not in (SEND_F, SEND_B) and message_key(a) not in self.inbox]
        posting += ahead
        recvs = [(torch.empty(self.shape, dtype=self.dtype, device=self.device), a.peer) for a in posting]
        keys = [message_key(a) for a in posting]
        if not sends and not recvs:     # every receive of the batch was posted ahead
            return
        handle = comm.send_recv(sends, recvs, self.group, async_op=True, dim="pp")
        self.release_completed()
        self.sending += [(h, t) for h, (t, _) in zip(handle.parts[:len(sends)], sends)]
        for key, h, (buf, _) in zip(keys, handle.parts[len(sends):], recvs):
            self.inbox[key] = (buf, h)

    def receive(self, key) -> torch.Tensor:
        buf, handle = self.inbox.pop(key)
        handle.wait()
        return buf

    def release_completed(self) -> None:
        """Give back the bytes of every send seen complete (`release_sent`). Done at each post and
        before each compute, so a forward output whose send completed during the last compute is not
        alive beside the next backward's working set (it was, until the next post: one b·s·h tensor)."""
        self.sending = [(h, t) for h, t in self.sending if not release_sent(h, t)]

    def compute(self, a: Action) -> None:
        """Wait for the inputs a compute action needs, run it, and time it."""
        self.release_completed()
        got = {key: self.receive(key) for key in input_messages(a, self.pp, self.chunks)}
        start = time.perf_counter()
        final = self.sync is not None and (a.kind, a.microbatch, a.chunk) in self.finals
        if final:
            self.sync(True)
        if a.kind == F:
            self.forward(a, got)
        elif a.kind == B:
            self.backward(a, got)
        elif a.kind == I:
            self.backward_input(a, got)
        else:
            self.backward_weight(a)
        if final:
            self.sync(False)
        self.timeline.append(Block(a.kind, a.microbatch, a.chunk, start, time.perf_counter()))

    # -- compute -------------------------------------------------------------------------------
    def forward(self, a: Action, got: dict) -> None:
        mb, c = a.microbatch, a.chunk
        x = self.mbs[mb].tokens if c == 0 else got[("F", mb, c - 1)].requires_grad_()
        full = self.chunk_recompute
        rng = rng_state(self.stage, self.device) if full else None
        with torch.no_grad() if full else nullcontext(), self.recording(self.split and not full) as ops:
            out = self.run_chunk(c, mb, x)
        if c == self.last:
            self.loss += out.detach().double()
        else:
            self.outbox[("F", mb, c)] = out.detach()
        self.saved[(mb, c)] = Saved(x, None if full else out, ops, rng)

    def backward(self, a: Action, got: dict) -> None:
        mb, c = a.microbatch, a.chunk
        x, out, _ = self.restore(mb, c, record=False)
        grad = None if c == self.last else got[("B", mb, c + 1)]
        torch.autograd.backward(out, grad)
        if c > 0:
            self.outbox[("B", mb, c)] = x.grad

    def backward_input(self, a: Action, got: dict) -> None:
        """Zero bubble's I: gradients of the chunk input and of every weight-holding module's output,
        no weight gradient (autograd computes only what leads to the requested tensors)."""
        mb, c = a.microbatch, a.chunk
        x, out, ops = self.restore(mb, c, record=True)
        grad = None if c == self.last else got[("B", mb, c + 1)]
        wanted = ([x] if c > 0 else []) + [o for _, o in ops]
        grads = torch.autograd.grad(out, wanted, grad, retain_graph=True, allow_unused=True)
        if c > 0:
            self.outbox[("B", mb, c)] = grads[0]
            grads = grads[1:]
        self.deferred[(mb, c)] = [(w, o, g) for (w, o), g in zip(ops, grads) if g is not None]

    def backward_weight(self, a: Action) -> None:
        """Zero bubble's W: each module's weight gradients from its kept input and output gradient."""
        for weights, out, grad in self.deferred.pop((a.microbatch, a.chunk)):
            torch.autograd.backward(out, grad, inputs=list(weights))

    @property
    def last(self) -> int:
        return self.chunks - 1

    def run_chunk(self, chunk: int, mb: int, x: torch.Tensor) -> torch.Tensor:
        docs, keys = self.documents[mb], self.mbs[mb].keys
        if docs is None:
            out = self.stage.forward_chunk(chunk, x, self.cos_sd, self.sin_sd, keys_bs=keys)
        else:
            out = self.stage.forward_chunk(chunk, x, *self.ropes[mb], docs.ids_bS, keys)
        if chunk == self.last:
            out = self.mbs[mb].loss(self.loss_fn, out)
        return out

    def restore(self, mb: int, c: int, record: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(input, output, recorded ops) of the forward of (mb, c), recomputing it under full recompute
        (from the RNG states it started with, so dropout draws the same masks)."""
        saved = self.saved.pop((mb, c))
        if saved.out is not None:
            return saved.x, saved.out, saved.ops
        x = saved.x.detach().requires_grad_() if torch.is_floating_point(saved.x) else saved.x
        now = rng_state(self.stage, self.device)
        set_rng_state(self.stage, self.device, saved.rng)
        with torch.enable_grad(), self.recording(record) as ops:
            out = self.run_chunk(c, mb, x)
        set_rng_state(self.stage, self.device, now)
        return x, out, ops

    # -- helpers -------------------------------------------------------------------------------
    def _install_recording(self) -> None:
        """Forward hooks that record (weights, output) of every module holding weights. W replays the
        path from a module's output to its weights, so a weight must belong to one module only."""
        owner: dict[int, nn.Module] = {}
        for m in self.stage.modules():
            weights = tuple(p for p in m.parameters(recurse=False) if p.requires_grad)
            for p in weights:
                if id(p) in owner:
                    raise ValueError("the split backward (zb) needs each weight used by one module; a weight is "
                                     "shared (tied embedding and head on one stage?)")
                owner[id(p)] = m
            if weights:
                m.register_forward_hook(self._record_hook)

    def _record_hook(self, module, args, output):
        """The module's weights are read when it runs: the runtime is built on the meta model, whose
        parameters each rank replaces by real ones afterwards (model/init.py's materialize)."""
        if self._ops is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            weights = tuple(p for p in module.parameters(recurse=False) if p.requires_grad)
            self._ops.append((weights, output))

    @contextmanager
    def recording(self, enabled: bool):
        """Collect (weights, output) of every weight-holding module run inside (for a split backward)."""
        if not enabled:
            yield []
            return
        old, self._ops = self._ops, []
        try:
            yield self._ops
        finally:
            self._ops = old


# -------------------------------------------------------------------------------------------------------
# Full state across stages

def gather_stages(state: dict, names: list[list[tuple[str, torch.Size]]], group: Group) -> dict:
    """Every stage's part of a full state ({"model", "exp_avg", "exp_avg_sq": name -> tensor, "opt_t"})
    on every rank: one all-gather over the pp group (ledger dim "checkpoint") of each stage's tensors,
    flattened and padded to the largest stage."""
    kinds = ("model", "exp_avg", "exp_avg_sq")
    sizes = [sum(shape.numel() for _, shape in spec) for spec in names]
    width = len(kinds) * max(sizes)
    dtype = state["model"][names[group.rank][0][0]].dtype
    device = state["model"][names[group.rank][0][0]].device
    mine = torch.zeros(width, dtype=dtype, device=device)
    flat = [state[k][n].reshape(-1) for k in kinds for n, _ in names[group.rank]]
    if flat:
        torch.cat(flat, out=mine[:sum(t.numel() for t in flat)])
    every = torch.empty(group.size * width, dtype=dtype, device=device)
    comm.all_gather(every, mine, group, dim="checkpoint")
    out = {k: {} for k in kinds}
    for r, spec in enumerate(names):
        o = r * width
        for k in kinds:
            for n, shape in spec:
                out[k][n] = every[o:o + shape.numel()].view(shape).clone()
                o += shape.numel()
    out["opt_t"] = state["opt_t"]
    return out


# -------------------------------------------------------------------------------------------------------
# Measured against simulated

def mean_costs(timeline: list[list[Block]]) -> dict[tuple[str, int], float]:
    """Mean measured seconds per (kind, chunk)."""
    sums: dict = {}
    for row in timeline:
        for b in row:
            s = sums.setdefault((b.kind, b.chunk), [0.0, 0])
            s[0] += b.end - b.start
            s[1] += 1
    return {k: v[0] / v[1] for k, v in sums.items()}


def report(timeline: list[list], schedule: Schedule) -> dict:
    """Measured timeline (per pp rank, seconds from the first start) beside two simulations of the same
    schedule's action lists (the run's `Schedule`, micro-batch group included): with the measured mean
    cost of each (kind, chunk) — what the schedule would give with free, instant communication — and
    with the unit costs F=1, B=2, I=W=1. The schedule's fields lead the dict (`Schedule.to_dict`)."""
    timeline = [[Block(*b) for b in row] for row in timeline]
    t0 = min(b.start for row in timeline for b in row)
    measured = [[Block(b.kind, b.microbatch, b.chunk, b.start - t0, b.end - t0) for b in row] for row in timeline]
    costs = mean_costs(measured)
    cost = {k: (lambda a, k=k: costs[(k, a.chunk)]) for k in "FBIW"}
    sim = simulate(schedule.actions(), cost["F"], cost["B"], cost["I"], cost["W"])
    unit = schedule.simulate()
    stats = timeline_stats(measured)
    return {**schedule.to_dict(),
            "measured": {"bubble": stats["bubble"], "makespan": stats["makespan"], "busy": stats["busy"],
                         "peak_in_flight": stats["peak_in_flight"],
                         "timeline": [[list(b) for b in row] for row in measured]},
            "simulated_measured_costs": {"bubble": sim.bubble, "makespan": sim.makespan,
                                         "costs": {f"{k}{c}": v for (k, c), v in sorted(costs.items())},
                                         "timeline": [[list(b) for b in row] for row in sim.timeline]},
            "simulated_unit_costs": {"bubble": unit.bubble, "makespan": unit.makespan,
                                     "timeline": [[list(b) for b in row] for row in unit.timeline]}}


def write_report(out: str | Path, info: dict) -> Path:
    """OUT/pipeline.json: the measured and simulated data (its drawing, OUT/pipeline.svg, is the
    trainer's: train/timeline.py `draw_pipeline`; the runtime draws nothing)."""
    path = Path(out) / "pipeline.json"
    path.write_text(json.dumps(info))
    return path

