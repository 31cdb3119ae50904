"""How fast a run trains, as the console line, metrics.jsonl, TensorBoard, W&B and `fivefold report` say it.

    tokens_per_s   tokens of the global batch / the step's seconds
    tflops         achieved model TFLOP/s of all ranks together: tokens/s x FLOPs per token / 1e12
    mfu            model FLOPs utilisation: achieved FLOP/s / (peak FLOP/s per rank x ranks)

FLOPs per token are the planner's (`plan.models.PlanModel.flops_per_token`: 6 x matmul parameters per
token + causal attention, halved as FlashAttention computes and Megatron-LM counts; MoE counts its
active experts), and the peak is the device's (`plan.topology.ACCELERATORS` by CUDA device name) or on
the CPU the one `fivefold calibrate` measured. The trainer may not import the planner (the layers
contract, tests/ranks/test_layers.py): the CLI computes both (`tools/run_plan.py` `speed_model`) and hands them in as a
plain dict, as it does the planned memory. Without FLOPs per token there is no TFLOP/s, without a peak
no MFU.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Speed:
    flops_per_token: float = 0.0   # model FLOPs of one trained token (forward + backward); 0: unknown
    peak_flops: float = 0.0        # peak FLOP/s of one rank's device in the run's dtype; 0: unknown
    ranks: int = 1
    peak_source: str = ""          # where the peak comes from, e.g. "H100-SXM-80GB bf16" or "local.toml fp32"

    @classmethod
    def from_dict(cls, d: dict | None, ranks: int) -> "Speed":
        d = d or {}
        return cls(float(d.get("flops_per_token") or 0.0), float(d.get("peak_flops") or 0.0), ranks,
                   str(d.get("peak_source", "")))

    def scalars(self, tokens: float, seconds: float) -> dict[str, float]:
        """tokens_per_s, and tflops and mfu where known, for `tokens` trained in `seconds`."""
        if not seconds > 0:
            return {}
        rate = tokens / seconds
        out = {"tokens_per_s": rate}
        if self.flops_per_token:
            out["tflops"] = rate * self.flops_per_token / 1e12
            if self.peak_flops:
                out["mfu"] = rate * self.flops_per_token / (self.peak_flops * self.ranks)
        return out
