"""GEMM time by shape: arithmetic intensity against the accelerator's roofline, plus a per-kernel floor.

A GEMM of an (M x K) input by a (K x N) weight does 2·M·N·K FLOPs and moves at least b·(M·K + K·N + M·N)
bytes through HBM (b bytes per element). On a roofline (Williams, Waterman and Patterson 2009) it takes

    t = max(2·M·N·K / (η·peak),  b·(M·K + K·N + M·N) / hbm_bandwidth) + t_kernel

η·peak the rate large GEMMs reach (`Workload.efficiency`, the flat figure's meaning), hbm_bandwidth the
accelerator's, t_kernel its per-kernel floor (`Accelerator.gemm_kernel`: launch and tail of one kernel).
A linear layer's dgrad and wgrad read and write the same three matrices in another arrangement, so they
take the forward's time each. `gemm_factor` is the ratio of this time to the flat one, 2·M·N·K/(η·peak),
summed over a layer's GEMMs: >= 1, near 1 for large GEMMs, larger for small models, thin tensor-parallel
slices and few tokens per expert. The FLOPs themselves stay the model's (`PlanModel.flops_per_token`).

Flat (`Workload.gemm = "flat"`, or an accelerator without `gemm_kernel`: a custom one whose peak is an
achieved rate) keeps the factor at 1: every GEMM at efficiency × peak. Both take `efficiency`; `gemm`
says which model it enters. `fivefold calibrate` measures the local curve: it fits this model's rate
(written as the peak) and floor (`gemm_kernel_us`) to F.linear's forward + backward at a grid of shapes.
"""
from __future__ import annotations

from functools import lru_cache

from .models import PlanModel


def gemm_seconds(m: float, n: float, k: float, rate: float, hbm: float, nbytes: float, kernel: float) -> float:
    """Roofline time of one (m x k) @ (k x n) GEMM at `rate` FLOP/s and `hbm` bytes/s, plus `kernel` s."""
    return max(2.0 * m * n * k / rate, nbytes * (m * k + k * n + m * n) / hbm) + kernel


def layer_gemms(model: PlanModel, moe: bool, tokens: float, tp: int, ep: int, etp: int = 1) -> list[tuple[float, float, float]]:
    """(M, N, K) of one tensor-parallel rank's forward GEMMs in one layer for `tokens` tokens of its group
    (a micro-batch's tokens on the cp rank): column-parallel projections split N over tp, row-parallel
    outputs split K. Routed experts (the expert grid, parallel/expert.py): E/ep experts per rank, each fed
    the rows its ep sources route to it from their tokens/tp each, gathered over etp (ep·etp·tokens/tp·top_k/E
    rows), 1/etp of its width."""
    h = model.hidden
    out = []
    if model.mla:
        if model.q_lora_rank:
            out += [(tokens, model.q_lora_rank, h), (tokens, model.q_width / tp, model.q_lora_rank)]
        else:
            out.append((tokens, model.q_width / tp, h))
        out += [(tokens, model.kv_lora_rank + model.qk_rope_dim, h),
                (tokens, model.heads * (model.qk_nope_dim + model.v_head_dim) / tp, model.kv_lora_rank)]
    else:
        out.append((tokens, (model.q_width + model.kv_width + model.v_width) / tp, h))
    out.append((tokens, h, model.attn_out_width / tp))
    mats = 2 if model.mlp == "swiglu" else 1    # gate and up as one GEMM
    if not (moe and model.moe):
        return out + [(tokens, mats * model.ffn / tp, h), (tokens, h, model.ffn / tp)]
    out.append((tokens, model.experts, h))      # router
    if model.shared_experts:
        width = model.shared_experts * model.moe_ffn / tp
        out += [(tokens, mats * width, h), (tokens, h, width)]
    rows = ep * etp * tokens / tp * model.top_k / model.experts
    per_rank = model.experts // ep
    return out + [(rows, mats * model.moe_ffn / etp, h)] * per_rank + [(rows, h, model.moe_ffn / etp)] * per_rank


@lru_cache(maxsize=65536)
def gemm_factor(model: PlanModel, kind: str, tokens: float, tp: int, ep: int, rate: float, hbm: float,
                nbytes: float, kernel: float, etp: int = 1) -> float:
    """Roofline-and-floor time over flat time, Σ gemm_seconds / Σ 2·M·N·K/rate, of one layer's GEMMs
    ("dense" or "moe") or the LM head ("head": M = tokens, N = vocab/tp, K = hidden)."""
    if kind == "head":
        shapes = [(tokens, model.vocab / tp, model.hidden)]
    else:
        shapes = layer_gemms(model, kind == "moe", tokens, tp, ep, etp)
    flat = sum(2.0 * m * n * k for m, n, k in shapes) / rate
    if flat <= 0:
        return 1.0
    return sum(gemm_seconds(m, n, k, rate, hbm, nbytes, kernel) for m, n, k in shapes) / flat


def shaped(work, acc) -> bool:
    """GEMMs by shape: asked for (`Workload.gemm`) and the accelerator has a kernel floor (datasheet presets)."""
    return work.gemm == "shape" and acc.gemm_kernel is not None


def linear_rate(acc, work) -> float:
    """FLOP/s the linear layers' large GEMMs reach: efficiency × the dtype's peak; with `fp8_gemm`,
    efficiency × `Accelerator.fp8_gemm_ratio` × the FP8 peak (an FP8 GEMM reaches a smaller share of its
    peak than a BF16 one of its own; docs/plan.md "FP8")."""
    if work.fp8_gemm:
        return acc.peak("fp8") * work.efficiency * acc.fp8_gemm_ratio
    return acc.peak(work.dtype) * work.efficiency


@lru_cache(maxsize=16384)
def fp8_cast_elements(model: PlanModel, moe: bool, tokens: float, tp: int, ep: int,
                      etp: int = 1) -> tuple[float, float, float]:
    """What FP8 quantizes in one layer's linear GEMMs for `tokens` rows (`layer_gemms`), in elements:
    (forward inputs Σ M·K, output gradients Σ M·N, weights Σ K·N). Transformer Engine's recipe (per-tensor
    scaling, Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; TE's cast_transpose): in the forward
    each GEMM's input is read in the activation dtype and written in FP8 twice, as is for the forward GEMM
    and transposed for the weight gradient's; in the backward each output gradient likewise; each weight
    once a step (TE keeps its FP8 copy for the step's later micro-batches). The per-tensor amax is a
    reduction over what the cast reads anyway."""
    shapes = layer_gemms(model, moe, tokens, tp, ep, etp)
    return (sum(m * k for m, _, k in shapes), sum(m * n for m, n, _ in shapes), sum(k * n for _, n, k in shapes))


def linear_seconds(model: PlanModel, work, acc, rows: float, tp: int, ep: int, dense: float, moe: float,
                   head: float, etp: int = 1) -> tuple[float, float]:
    """(linear layers, LM head) seconds of `dense`, `moe` and `head` forward FLOPs on one rank whose GEMMs
    have `rows` rows (a micro-batch's tokens on its cp rank): flat at `linear_rate` (the FP8 rate for the
    layers with `fp8_gemm`; the LM head stays in the model's dtype), times `gemm_factor` of each kind when
    `shaped`."""
    rate = acc.peak(work.dtype) * work.efficiency
    rate_mm = linear_rate(acc, work)
    if not shaped(work, acc):
        return (dense + moe) / rate_mm, head / rate
    b_mm = 1 if work.fp8_gemm else work.act_bytes
    hbm, kernel = acc.hbm_bandwidth, acc.gemm_kernel
    layers = dense / rate_mm * (gemm_factor(model, "dense", rows, tp, ep, rate_mm, hbm, b_mm, kernel) if dense else 1)
    layers += moe / rate_mm * (gemm_factor(model, "moe", rows, tp, ep, rate_mm, hbm, b_mm, kernel, etp) if moe else 1)
    return layers, head / rate * (gemm_factor(model, "head", rows, tp, ep, rate, hbm, work.act_bytes, kernel)
                                  if head else 1)
