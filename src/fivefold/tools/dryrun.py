"""`fivefold train --dry-run`: the real runtime at any size, on no memory and no peers (an application above
train/ and plan/, like calibrate.py).

A selected rank builds the same `Trainer` — the meta model, `parallelize`, the engines, the pipeline
runtime, the ledger — and takes `steps` steps, under torch's `FakeTensorMode` (every tensor has its
shape, dtype and device but no storage, so a 405B layer costs nothing) with torch's fake process group
(collectives return at once; each is still recorded in our ledger, by the same code as a real run). The
ranks run one after another in this process; `--ranks stages` (the default) takes one rank per pipeline
stage — the rank with tp = cp = dp = ep = 0 on that stage — because the other ranks of a stage hold the
same shapes (tp, cp and ep pieces are equal by the layout rules; dp and ZeRO shards differ by at most the
padding of one unit), so their memory and traffic are the stage's.

Measured per rank, by kind (the planner's names):
    weights, grads, optimizer  the engine's state counted from its tensors between steps
                               (`Engine.state_bytes`: exact, as in a real run's run.json)
    activations                the peak of what autograd saved for backward (train/activations.py)
    total                      the state plus the peak of every storage allocated during a step and
                               still alive (`LiveBytes`: storages counted when an op makes them, uncounted
                               when freed)
    buffers                    the peak of what is alive during a step and not saved for backward:
                               communication and ZeRO buffers (gathered units, gradient buckets in
                               flight, posted pipeline receives), gradients and a backward's or the
                               loss's working set. Each kind has its own peak, as the planner plans
                               it; `total` is the peak of their sum, which may fall below the sum of
                               the peaks (on the last stage the loss's peak and the layers' do not meet)
and the ledger's rows per (dim, op, tier), next to the planner's prediction for the rank's stage
(`run_plan.planned_memory`, `plan.traffic`). Values are never read: loss, norm and the stop flag read as 0
(the step's collectives all run). Every MoE layer dispatches by shape (parallel/expert.py
`ShapeDispatch`): in capacity mode the same (E, B, C) buffers through the same all-to-alls and expert
matmuls, filled from no index (exact); dropless routing, whose counts are values fake tensors do not
have, as perfectly balanced (each expert t·k/E rows of every rank: what the planner plans), through the
dropless path's counts exchange and uneven all-to-alls.
"""
from __future__ import annotations

import json
import weakref
from pathlib import Path

from ..config import Config, ConfigError
from ..grid import coords, grid_sizes, parse_order

KINDS = ("weights", "grads", "optimizer", "activations", "buffers", "total")


class DoesNotFit(Exception):
    """A dry run's rank needs more than --device-memory (the CLI exits 1 with this line)."""


def stage_plan(cfg: Config, stage: int) -> dict:
    """The planner's bytes by kind for one rank of `stage` (tools/run_plan.py planned_memory, with NCCL's
    collectives: the fake process group stands for a GPU run), or {} when the planner cannot estimate it."""
    from .run_plan import planned_memory

    row = next((r for r in planned_memory(cfg, "nccl").get("stages", []) if r["stage"] == stage), {})
    return {k: row[k] for k in KINDS if k in row}


def live_bytes(saved=None):
    """A TorchDispatchMode counting the bytes of the storages made by ops inside it and still alive
    (`now`, `peak`): each storage counted when an op makes it, recounted when it is resized in place
    (`UntypedStorage.resize_`, which no op reports), uncounted when it is freed. With `saved` (the
    step's ActivationMeter: its `now` is the bytes autograd keeps for the backward) also `peak_other`,
    the most bytes alive at once that are not saved activations: the buffers' own peak (communication
    buffers, gradients in flight, the working sets of a backward or the loss), sampled whenever bytes
    are added. (Made here, so that importing this module, and a bad command line, need no torch.)"""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live: dict[int, int] = {}
            self.now = self.peak = self.peak_other = 0

        def _grew(self) -> None:
            self.peak = max(self.peak, self.now)
            if saved is not None:
                self.peak_other = max(self.peak_other, self.now - saved.now)

        def _add(self, t) -> None:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live:
                return
            n = storage.nbytes()
            self.live[key] = n
            self.now += n
            self._grew()
            weakref.finalize(storage, self._free, key)

        def _free(self, key: int) -> None:
            self.now -= self.live.pop(key, 0)

        def _resized(self, storage, nbytes: int) -> None:
            """A storage given back or given bytes in place (ZeRO-3's gathered units: parallel/zero/engine.py
            `free_bytes`), which no op reports."""
            key = storage._cdata
            if key in self.live:
                self.now += nbytes - self.live[key]
                self.live[key] = nbytes
                self._grew()

        def __enter__(self):
            counter, resize = self, torch.UntypedStorage.resize_
            self._resize = resize

            def counted_resize(storage, nbytes):
                out = resize(storage, nbytes)
                counter._resized(storage, int(nbytes))
                return out
            torch.UntypedStorage.resize_ = counted_resize
            return super().__enter__()

        def __exit__(self, *exc):
            torch.UntypedStorage.resize_ = self._resize
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            # an output on an input's storage (a view, an in-place op) allocated nothing
            inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.layout == torch.strided}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided and \
                        t.untyped_storage()._cdata not in inputs:
                    self._add(t)
            return out

    return LiveBytes()


def model_of_preset(name: str):
    """Our ModelConfig for a planner preset or a Hugging Face config.json (`fivefold plan --model`), when
    the runtime builds that architecture (`plan.models.to_model_config`: one field table both ways).
    DeepSeek-V3's score-correction bias makes the router sigmoid_bias (the bias a buffer, as in the
    runtime); its routing groups and scaling factor change no shape and are left at their defaults."""
    from ..plan.models import load_model, to_model_config

    return to_model_config(load_model(name), where=f"--model {name}")


# What a dry run costs this process, fitted on a 2-core machine (torch 2.13, FakeTensorMode; docs/dry-run.md "Will it
# fit?"): a fixed start, every layer of the meta model built (all of them, whatever the rank holds), each
# layer a rank runs for each micro-batch and step (forward and backward op by op), and each slice of
# STEP_CHUNK elements the step's chunked optimizer, norm and reductions walk over the rank's parameters.
# Measured: 64 / 256 / 1024 layers of hidden 256 at 1 step: 9.0 / 22.2 / 73.2 s, 331 / 366 / 507 MiB
# (estimated 9.5 / 22.9 / 76.7 s, 332 / 368 / 510 MiB); 256 layers at 3 steps 62.3 s and at 4 micro-batches
# 80.3 s (estimated 58.8, 76.7); 2 layers of hidden 65,536 (70.9G parameters: 16.9k slices) 86.9 s and
# 466 MiB (estimated 89.7 s, 452 MiB). Building the meta model costs memory, not measurable time.
DRY_START_S, DRY_LAYER_MB_S, DRY_SLICE_S = 5.0, 0.07, 0.005
DRY_START_BYTES, DRY_LAYER_BYTES, DRY_SLICE_BYTES = 320 * 2**20, 190 * 2**10, 8 * 2**10


def stage_of(cfg: Config, rank: int) -> int:
    """The pipeline stage of `rank` in this layout (grid.coords)."""
    dense, _ = grid_sizes(cfg.parallel)
    return coords(rank, dense, parse_order(cfg.parallel.order))["pp"]


def dry_run_cost(cfg: Config, ranks: list[int], steps: int) -> tuple[float, float]:
    """(seconds, peak host bytes) this process will spend on the dry run of `ranks`: DRY_* above, with the
    planner's layers and parameters of each rank's stage (torch-free; nothing is built)."""
    from ..plan.layout import microbatches
    from ..plan.run import plan_of
    from ..plan.units import frozen_params, layout_layers, stage_params
    from ..rules import STEP_CHUNK

    run = plan_of(cfg, "nccl")
    model, layout, work = run.model, run.layout, run.work
    m = microbatches(layout, work)
    stages = layout_layers(model, layout)
    seconds, peak = DRY_START_S, 0.0
    for r in ranks:
        stage = stage_of(cfg, r)
        held = sum(stage_params(model, layout, stage)) + frozen_params(model, layout, stage)
        slices = held / STEP_CHUNK
        chunks = [c for c in range(len(stages)) if c % layout.pp == stage]   # a rank's (virtual) stages
        layers = sum(len(stages[c]) for c in chunks)
        seconds += steps * (DRY_LAYER_MB_S * layers * m + DRY_SLICE_S * slices)
        peak = max(peak, DRY_START_BYTES + DRY_LAYER_BYTES * cfg.model.layers + DRY_SLICE_BYTES * slices)
    return seconds, peak


def check_dry_run(cfg: Config) -> None:
    """What a dry run cannot run yet, in one line (before anything is built)."""
    if cfg.train.init_hf:
        raise ConfigError("--dry-run takes the model's shape only: drop --init-hf (use --set model.* or --config)")


def stage_ranks(cfg: Config) -> list[int]:
    """One rank per pipeline stage: the rank at tp = cp = dp = ep = 0 of each stage (module docstring)."""
    p = cfg.parallel
    dense, _ = grid_sizes(p)
    order = parse_order(p.order)
    by_stage = {}
    for r in range(p.world_size):
        c = coords(r, dense, order)
        if all(v == 0 for k, v in c.items() if k != "pp"):
            by_stage.setdefault(c["pp"], r)
    return [by_stage[s] for s in sorted(by_stage)]


def dry_rank(cfg: Config, rank: int, steps: int, limit: float | None = None) -> dict:
    """One rank's dry run: measured memory by kind, the ledger's rows, the planner's prediction. With
    `limit` (bytes), a rank whose model state alone exceeds it stops before its steps (the caller refuses it)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..train.trainer import Trainer

    world = cfg.parallel.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            t = Trainer(cfg, rank, world, quiet=True, dry=True)
            state = t.model_state_bytes()
            live = live_bytes(t.activations)
            if limit is None or state["total"] <= limit:
                with live:
                    for step in range(steps):
                        t.step(step)
        rows = t.ledger.rows()
    finally:
        dist.destroy_process_group()
    stage = t.mesh.coords["pp"]
    held = state["params"] + state["grads"] + state["optimizer"]
    total = held + live.peak
    measured = {"weights": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
                "activations": t.activations.peak, "total": total}
    measured["buffers"] = live.peak_other
    planned = stage_plan(cfg, stage)
    plan_rows = planned_rows(cfg, stage, t.mesh.coords["dp"], steps)
    return {"rank": rank, "stage": stage, "measured": measured, "planned": planned, "ledger": rows,
            "planned_ledger": [{"dim": d, "op": o, **r} for (d, o), r in sorted((plan_rows or {}).items())],
            "ledger_equals_plan": ledger_equals_plan(rows, plan_rows), "steps": steps}


def planned_rows(cfg: Config, stage: int, dp_rank: int, steps: int) -> dict[tuple[str, str], dict] | None:
    """The planner's (dim, op) rows for one rank of `stage` over `steps` steps (plan.traffic.stage_flows),
    or None when the planner cannot estimate the layout."""
    try:
        from ..plan.run import plan_of
        from ..plan.traffic import stage_flows

        run = plan_of(cfg, "nccl")
        flows = stage_flows(run.model, run.layout, run.work, stage, dp_rank)
    except Exception:   # noqa: BLE001 - the comparison is a report
        return None
    out: dict[tuple[str, str], dict] = {}
    for fl in flows:
        row = out.setdefault((fl.dim, fl.op), {"calls": 0, "message_bytes": 0.0, "bytes_sent": 0.0})
        row["calls"] += fl.calls * steps
        row["message_bytes"] += fl.message_bytes * steps
        row["bytes_sent"] += fl.bytes_sent * steps
    return out


def ledger_equals_plan(rows: list[dict], planned: dict | None) -> bool:
    """Every (dim, op) row the rank recorded is the planner's, and the planner predicts no other."""
    if planned is None:
        return False
    got = {(r["dim"], r["op"]): r for r in rows}
    return got.keys() == planned.keys() and all(
        got[k]["calls"] == planned[k]["calls"] and got[k]["message_bytes"] == planned[k]["message_bytes"]
        and abs(got[k]["bytes_sent"] - planned[k]["bytes_sent"]) <= 1e-9 * max(1.0, planned[k]["bytes_sent"])
        for k in planned)


def dry_run(cfg: Config, ranks: list[int], steps: int, out: Path, device_memory_gib: float | None = None) -> dict:
    """Run `ranks` one after another; write OUT/dryrun.json (and run.json, comm.json of the first)."""
    check_dry_run(cfg)
    limit = device_memory_gib * 2**30 if device_memory_gib else None
    if limit:   # the planner's model state is the runtime's to the byte (tests/ranks/test_dry_run.py): refuse before building
        for r in ranks:
            stage = stage_of(cfg, r)
            plan = stage_plan(cfg, stage)
            state = sum(plan.get(k, 0) for k in ("weights", "grads", "optimizer"))
            if state > limit:
                raise DoesNotFit(f"rank {r} (pipeline stage {stage}) holds {state / 2**30:.1f} GiB of model state "
                                 f"alone by the planner (exact for the runtime's) > --device-memory "
                                 f"{device_memory_gib:g} GiB; fivefold plan --search suggests a layout that fits")
    results = [dry_rank(cfg, r, steps, limit) for r in ranks]
    out.mkdir(parents=True, exist_ok=True)
    report = {"ranks": [{k: r[k] for k in ("rank", "stage", "measured", "planned", "ledger_equals_plan")}
                        for r in results],
              "ledger_equals_plan": all(r["ledger_equals_plan"] for r in results),
              "ledger_by_rank": {str(r["rank"]): {"measured": r["ledger"], "planned": r["planned_ledger"]}
                                 for r in results},
              "steps": steps, "config": cfg.to_dict()}
    (out / "dryrun.json").write_text(json.dumps(report, indent=1))
    if limit:
        for r in results:
            if r["measured"]["total"] > limit:
                biggest = sorted(((v, k) for k, v in r["measured"].items() if k != "total"), reverse=True)[:2]
                raise DoesNotFit(f"rank {r['rank']} (pipeline stage {r['stage']}) needs "
                                  f"{r['measured']['total'] / 2**30:.1f} GiB > --device-memory {device_memory_gib:g}"
                                  f" GiB, mostly {', '.join(f'{k} {v / 2**30:.1f} GiB' for v, k in biggest)}; "
                                  f"fivefold plan --search suggests a layout that fits")
    return report


def table(report: dict) -> str:
    """Measured beside planned, GiB, a line per rank and kind."""
    lines = [f"{'rank':>6} {'stage':>5} " + " ".join(f"{k:>22}" for k in KINDS)]
    for r in report["ranks"]:
        cells = []
        for k in KINDS:
            m, p = r["measured"].get(k), r["planned"].get(k)
            cells.append(f"{m / 2**30:9.2f} / {p / 2**30 if p is not None else float('nan'):9.2f}")
        lines.append(f"{r['rank']:>6} {r['stage']:>5} " + " ".join(f"{c:>22}" for c in cells))
    return "GiB measured / planned\n" + "\n".join(lines)
