"""run.json: what a run was and what it held, written once at the end by rank 0 (train/outputs.py writes it).

Besides the config and the parameter counts: each rank's model-state bytes (counted from the tensors that
exist), its peak activation bytes (what autograd saved, train/activations.py), its device and peak memory
(`memory_info`), the planner's prediction for the layout when the launcher passed one
(tools/run_plan.py planned_memory) beside each rank's measured figures, the data the run read and, for a
mixture, the tokens per source, and the versions. The ranks' figures are gathered once, by `gather` (a
collective: every rank calls it).
"""
from __future__ import annotations

import sys

import torch

from .. import __version__
from ..comm import gather_objects
from ..config import Config
from ..process import host_cpu, host_platform


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


def peak_memory(device: torch.device) -> int | None:
    """A rank's peak memory so far: the device's (max_memory_allocated) on CUDA, the process's peak resident
    set on the CPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()


def memory_info(device: torch.device, pp_stage: int) -> dict:
    """This rank's device and peak memory so far: `peak_device_bytes` is torch.cuda.max_memory_allocated on
    CUDA (every tensor the caching allocator handed out since the trainer started; None on the CPU, which
    has no such counter), `peak_rss_bytes` the process's peak resident set (the interpreter and torch's
    libraries included, so only a coarse upper bound of the tensors'; None where the platform does not
    report it)."""
    cuda = device.type == "cuda"
    return {"device": str(device), "device_name": torch.cuda.get_device_name(device) if cuda else host_cpu(),
            "pp_stage": pp_stage, "peak_device_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "peak_rss_bytes": peak_rss_bytes()}


class RunRecord:
    """The run's record: `planned` is the planner's memory for this layout (or None)."""

    def __init__(self, cfg: Config, world_size: int, n_params: int, n_trainable: int, data_id: dict,
                 planned: dict | None, records: dict | None = None):
        self.cfg, self.world_size, self.planned, self.data_id = cfg, world_size, planned, data_id
        self.records = records   # train.records padded / packed: rows, records, cut, dropped, padding
        self.n_params, self.n_trainable = n_params, n_trainable
        self.ranks: dict[str, list] = {}   # every rank's figures, once gathered

    def gather(self, state_bytes: dict, activation_bytes: int, memory: dict) -> None:
        """Every rank's model-state bytes, activation peak and memory (call on every rank)."""
        self.ranks = {"state": gather_objects(state_bytes), "activations": gather_objects(activation_bytes),
                      "memory": gather_objects(memory)}

    def info(self, state_bytes: dict, activation_bytes: int, memory: dict, mixture: dict | None) -> dict:
        """run.json (this rank's figures where the ranks' were not gathered). `planned_memory`: the planner's
        rows per pipeline stage; `planned_memory_bytes_by_rank`: each rank's stage total, the number to hold
        against its measured peak (null without a prediction)."""
        mem = self.ranks.get("memory") or [memory]
        stages = (self.planned or {}).get("stages")
        planned = [stages[m["pp_stage"]]["total"] if stages else None for m in mem]
        return {**({"data_mixture": mixture} if mixture else {}), **({"records": self.records} if self.records else {}),
                "config": self.cfg.to_dict(), "data": self.data_id,
                "params": self.n_params, "trainable_params": self.n_trainable,
                "world_size": self.world_size, "model_state_bytes_per_rank": state_bytes,
                "model_state_bytes_by_rank": self.ranks.get("state"),
                "peak_activation_bytes_per_rank": activation_bytes,
                "peak_activation_bytes_by_rank": self.ranks.get("activations"),
                "device": mem[0]["device"], "device_name": mem[0]["device_name"],
                "device_by_rank": [m["device"] for m in mem],
                "peak_device_memory_bytes_by_rank": [m["peak_device_bytes"] for m in mem],
                "peak_rss_bytes_by_rank": [m["peak_rss_bytes"] for m in mem],
                "planned_memory_bytes_by_rank": planned, "planned_memory": self.planned,
                "versions": {"fivefold": __version__, "torch": torch.__version__,
                             "python": sys.version.split()[0], "platform": host_platform()}}
