"""The plan of a run: the one way from a runtime `Config` to what the planner reads, its model
(`models.from_model_config`: the model's fields, with the run's LoRA or frozen weights), layout and
workload (`layout.from_config`). `fivefold plan --config`, the trainer's run.json figures and MFU
(tools/run_plan.py), the dry run and the tests all start here, so they plan the same run.
"""
from __future__ import annotations

from dataclasses import dataclass

from .layout import Layout, Workload, from_config
from .models import PlanModel, from_model_config


@dataclass(frozen=True)
class RunPlan:
    model: PlanModel
    layout: Layout
    work: Workload


def plan_of(cfg, backend: str | None = None, name: str = "custom") -> RunPlan:
    """The planner's model, layout and workload of the run `cfg` (a `Config`) describes. `backend`: whose
    collectives' algorithms (None: NCCL for train.device = "cuda", else gloo; the dry run passes "nccl")."""
    layout, work = from_config(cfg, backend)
    return RunPlan(from_model_config(cfg.model, name=name, train=cfg.train), layout, work)
