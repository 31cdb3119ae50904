"""What a run asks the planner, in one place: the planner's memory per rank for the layout it trains
(run.json, beside the measured peaks), and the model FLOPs per token and a peak FLOP/s for MFU (the
trainer may not import the planner itself: train/ and plan/ are one floor and neither imports the other).
"""
from __future__ import annotations

from pathlib import Path

from ..config import ConfigError

def planned_memory(cfg, backend: str | None = None) -> dict:
    """The planner's memory per rank for the layout `cfg` trains (run.json beside the measured peaks; the
    dry run's comparison): `plan.memory.memory` of `plan.run.plan_of(cfg, backend)`, every pipeline stage,
    with the attention the runtime runs on any device (SDPA's fused kernels: no s x s scores stored). A
    layout the planner cannot estimate gives {"error": ...}: a run never fails for its prediction."""
    from ..plan.memory import COMPONENTS, memory
    from ..plan.run import plan_of

    try:
        run = plan_of(cfg, backend)
        rows = memory(run.model, run.layout, run.work).stages
    except Exception as e:  # noqa: BLE001 - the prediction is a report, not a precondition
        return {"error": f"{type(e).__name__}: {e}"}
    keys = (*COMPONENTS, "total", "host", "disk")   # host, disk: offloaded optimizer state (off the device)
    return {"source": "fivefold.plan.memory.memory (plan.run.plan_of)", "flash": run.work.flash,
            "stages": [{"stage": r["stage"], **{k: int(r[k]) for k in keys if k in r}} for r in rows]}


def speed_model(cfg, device_type: str, device_name: str = "") -> dict:
    """What the trainer needs for TFLOP/s and MFU (train/speed.py), which it may not compute itself
    (the planner is off limits to it): the planner's model FLOPs per token at the run's seq_len
    (`PlanModel.flops_per_token`, causal attention halved) and one rank's peak FLOP/s in the run's dtype:
    on CUDA the datasheet peak of the accelerator (plan/topology.py ACCELERATORS) whose name the device
    name contains (H100, H200, A100, B200); on the CPU the peak `fivefold calibrate` measured, read from
    train.calibration when that file exists. No peak found: no MFU (peak_flops 0), never an error."""
    from ..plan.models import from_model_config
    from ..plan.topology import ACCELERATORS, load_topology

    t = cfg.train
    try:
        flops = from_model_config(cfg.model).flops_per_token(t.seq_len)
    except Exception:  # noqa: BLE001 - a report, not a precondition
        return {}
    peak, source = 0.0, ""
    if device_type == "cuda":
        accel = next((a for key, a in ACCELERATORS.items() if key in device_name.lower()), None)
        if accel is not None and t.dtype in accel.peak_flops:
            peak, source = accel.peak(t.dtype), f"{accel.name} {t.dtype}"
    elif t.calibration and Path(t.calibration).is_file():
        try:
            peak, source = load_topology(t.calibration).accelerator.peak(t.dtype), f"{t.calibration} {t.dtype}"
        except (ConfigError, OSError, ValueError, KeyError):
            peak, source = 0.0, ""
    return {"flops_per_token": flops, "peak_flops": peak, "peak_source": source}


def peak_text(speed: dict, calibration: str) -> str:
    """The banner's word on MFU: the peak it is measured against, or why there is none."""
    if speed.get("peak_flops"):
        return f"MFU against {speed['peak_flops'] / 1e12:.4g} TFLOP/s per rank ({speed['peak_source']})"
    return (f"no MFU: no peak known for this device (on the CPU: fivefold calibrate --out {calibration}, or "
            f"train.calibration)")


def device_name(device_type: str) -> str:
    """The current CUDA device's name (to find its peak), "" elsewhere (no torch imported there)."""
    if device_type != "cuda":
        return ""
    import torch

    return torch.cuda.get_device_name()
