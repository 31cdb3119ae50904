"""Memory per rank and per pipeline stage: model states by ZeRO stage, activations by schedule, buffers.

One row per stage (`stage_memory`), the components COMPONENTS and their total; `memory` takes every
stage (or the candidates for the most loaded) and names the worst. The parts live by idea:

- plan/units.py: a rank's layers and parameters, ZeRO's padded units and shards, the model states (the
  ZeRO paper's (w + g + k)·Φ by stage, per padded unit);
- plan/activations.py: what a layer stores (Korthikanti et al. 2022, term by term, and the mechanisms
  that change it), per stage, at the pipeline schedule's peak of micro-batches in flight;
- plan/buffers.py: ZeRO's buffers replayed in the runtime's order, the backward's, loss's, edges' and
  step's scratch (a stage's buffers are the largest of these moments), and offload's host and disk bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .activations import stage_activations
from .buffers import (backward_scratch, edge_moments, loss_saved, loss_scratch, offload_memory, step_scratch,
                      zero_at_edge, zero_at_loss, zero_buffers)
from .layout import Layout, Workload
from .models import PlanModel
from .dualpipe import device_memory, devices, is_dualpipe
from .units import candidate_stages, head_stage, layout_layers, model_states, optimizer_bytes_per_param

COMPONENTS = ("weights", "grads", "optimizer", "activations", "buffers")


# -- the whole picture -------------------------------------------------------------------------------
@dataclass
class Memory:
    """Per-stage bytes for one rank of each stage, and the most-loaded stage."""

    stages: list[dict] = field(default_factory=list)
    worst: int = 0

    @property
    def most_loaded(self) -> dict:
        return self.stages[self.worst]

    @property
    def host(self) -> float:
        """Host bytes per GPU of the stage that needs the most (offload; 0 without)."""
        return max((s.get("host", 0.0) for s in self.stages), default=0.0)

    @property
    def disk(self) -> float:
        return max((s.get("disk", 0.0) for s in self.stages), default=0.0)

    def to_dict(self) -> dict:
        return {**{c: self.most_loaded[c] for c in COMPONENTS}, "total": self.most_loaded["total"],
                "stage": self.most_loaded["stage"], "offloaded": self.most_loaded.get("offloaded", 0.0),
                "offloaded_params": self.most_loaded.get("offloaded_params", 0.0),
                "host": self.host, "disk": self.disk, "per_stage": self.stages}


def stage_memory(model: PlanModel, layout: Layout, work: Workload, stage: int) -> dict:
    """One rank of `stage`: device bytes per component (COMPONENTS) and their `total`; with offload also
    `offloaded` (the optimizer bytes that left the device), `offloaded_params` (the weight shards that left
    it: ZeRO-3 nvme), `offloaded_grads` (the gradient shards streamed to the host: ZeRO-2/3), `host` and
    `disk` (`offload_memory`)."""
    row = dict(model_states(model, layout, work, stage))
    row["offloaded"] = row["offloaded_params"] = row["offloaded_grads"] = 0.0
    if layout.offload != "none":
        row["offloaded"], row["optimizer"] = row["optimizer"], 0
    if layout.zero_spec.streams_grads:   # ZeRO-2/3 offload: the reduced shards go to the host during the backward
        row["offloaded_grads"], row["grads"] = row["grads"], 0
    if layout.zero_spec.params_on_disk:
        row["offloaded_params"], row["weights"] = row["weights"], 0
    row.update(offload_memory(model, layout, work, stage))
    row["activations"] = stage_activations(model, layout, work, stage)
    owned = (row["optimizer"] + row["offloaded"]) / optimizer_bytes_per_param(work)
    backward = zero_buffers(model, layout, work, stage) + backward_scratch(model, layout, work, stage)
    head = head_stage(layout.pp, layout.head_first)
    loss = zero_at_loss(model, layout, work, stage) + loss_scratch(model, layout, work, stage) if \
        stage == head else 0.0
    embed_edge, head_edge = edge_moments(model, layout, work, stage)
    at_edge = zero_at_edge(model, layout, work, stage) if stage in (0, head) else 0.0
    edge = at_edge + max(embed_edge, head_edge)
    step = step_scratch(owned, work)
    others = max(backward, edge, step)
    row["buffers"] = max(others, loss)
    # the total is the peak of the sum: the loss's gradient is a saved activation too (`loss_saved`), and
    # by the head's backward it has become the logits' gradient (or given way to its 16-bit cast)
    saved = loss_saved(model, layout, work, stage)
    edge_beside = at_edge + max(embed_edge, head_edge - saved)
    beside = max(backward, edge_beside, step, loss - saved if loss else 0.0)
    row["total"] = sum(row[c] for c in COMPONENTS) - row["buffers"] + beside
    row["stage"] = stage
    row["layers"] = len(layout_layers(model, layout)[stage])
    return row


def memory(model: PlanModel, layout: Layout, work: Workload, all_stages: bool = True) -> Memory:
    """Bytes per rank on every pipeline stage (or only the candidates for the most loaded); under DualPipe
    per distinct rank (plan/dualpipe.py: rank j holds stages j and pp-1-j)."""
    if is_dualpipe(layout):
        out = Memory([device_memory(stage_memory, model, layout, work, d) for d in devices(layout)])
        out.worst = max(range(len(out.stages)), key=lambda k: out.stages[k]["total"])
        return out
    stages = range(layout.pp) if all_stages else candidate_stages(model, layout.pp, layout.vpp, layout.partition)
    out = Memory([stage_memory(model, layout, work, j) for j in stages])
    out.worst = max(range(len(out.stages)), key=lambda k: out.stages[k]["total"])
    return out
