"""FP8 costs as measured (issue 38, point 3): the casts Transformer Engine does around every FP8 GEMM, and
the share of the FP8 peak its GEMMs reach, fitted to one published BF16/FP8 pair and held to the others.

Source of the fit: NVIDIA/dgxc-benchmarking, nemotron/README_340b.md (NeMo 24.11, TP 8, PP 8, VP 12, MBS 1,
GBS = GPUs / 4, seq 4096): training step seconds, BF16 and FP8, on 128 to 2,048 H100."""
from dataclasses import replace

import pytest

from fivefold.config import ConfigError
from fivefold.plan.estimate import estimate
from fivefold.plan.gemm import fp8_cast_elements, layer_gemms, linear_rate
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.models import PRESETS
from fivefold.plan.time import fp8_cast_seconds
from fivefold.plan.topology import ACCELERATORS, TOPOLOGIES, topology_from_dict

H100 = TOPOLOGIES["dgx-h100"]
NEMOTRON = PRESETS["nemotron4-340b"]
DGXC_340B = {128: (4.61, 3.16), 256: (4.67, 3.21), 512: (4.70, 3.26), 1024: (4.73, 3.34), 2048: (4.84, 3.49)}


def _nemotron(gpus: int, fp8: bool) -> float:
    lay = Layout(tp=8, pp=8, dp=gpus // 64, vpp=12, zero=1, micro_batch=1, sp_mode="megatron", schedule="interleaved")
    w = Workload(seq=4096, global_batch=gpus // 4, fp8_gemm=fp8, grad_dtype="param")   # grad_sync_dtype bf16
    return estimate(NEMOTRON, lay, w, H100, gpus).time.step_time_s


def test_the_casts_are_each_gemm_input_and_output_gradient_written_twice_and_the_weights_once_a_step():
    m = PRESETS["llama3-8b"]
    tokens, tp = 4096.0, 2
    x, dy, w = fp8_cast_elements(m, False, tokens, tp, 1)
    shapes = layer_gemms(m, False, tokens, tp, 1)       # qkv, o, gate+up, down
    assert x == tokens * (m.hidden + m.attn_out_width / tp + m.hidden + m.ffn / tp)
    assert dy == tokens * ((m.q_width + m.kv_width + m.v_width) / tp + m.hidden + 2 * m.ffn / tp + m.hidden)
    assert w == sum(k * n for _, n, k in shapes)
    lay, micro = Layout(tp=tp, pp=2, dp=4), 8
    work = Workload(seq=4096, global_batch=32, fp8_gemm=True)
    layers = 16                                          # the stage's blocks
    f, b = fp8_cast_seconds(m, lay, work, H100.accelerator, 0, micro)
    hbm = H100.accelerator.hbm_bandwidth
    assert f == pytest.approx(layers * ((2 + 2) * x + (2 + 2) * w / micro) / hbm)   # bf16 read, two fp8 writes
    assert b == pytest.approx(layers * (2 + 2) * dy / hbm)
    assert fp8_cast_seconds(m, lay, replace(work, fp8_gemm=False), H100.accelerator, 0, micro) == (0.0, 0.0)


def test_fp8_gemms_reach_the_fitted_share_of_their_peak():
    acc, w = H100.accelerator, Workload(fp8_gemm=True)
    assert linear_rate(acc, w) == pytest.approx(acc.peak("fp8") * w.efficiency * 0.868)
    assert linear_rate(acc, replace(w, fp8_gemm=False)) == acc.peak("bf16") * w.efficiency
    assert ACCELERATORS["h200"].fp8_gemm_ratio == 0.868 and ACCELERATORS["b200"].fp8_gemm_ratio == 1.0   # not measured
    custom = {"accelerator": {"peak_tflops": {"bf16": 100, "fp8": 200}, "memory_gb": 80, "fp8_gemm_ratio": 0.5},
              "tier": [{"name": "nvlink", "size": 8, "bandwidth_gbps": 100}]}
    assert topology_from_dict(custom).accelerator.fp8_gemm_ratio == 0.5
    for bad in (0, -1, 3, "fast", True):
        custom["accelerator"]["fp8_gemm_ratio"] = bad
        with pytest.raises(ConfigError, match=r"fp8_gemm_ratio must be a number in \(0, 2\]"):
            topology_from_dict(custom)


def test_nemotron4_340b_fp8_speedup_is_the_published_one_at_the_fitted_size_and_held_out_sizes():
    """Fitted at 256 H100 (4.67 / 3.21 = 1.455, read 1.455 with r = 0.868 since tp's input collectives hide
    behind the column GEMMs; 1.453 with r = 0.88 before); the other four sizes' speed-ups (1.387-1.459,
    held out) within 5% (read 1.454-1.459), each step within 10% up to 1,024 GPUs. Without the casts and the ratio the planner read
    1.57. Named gap: NVIDIA's steps grow with the cluster (BF16 4.61 -> 4.84 s, FP8 3.16 -> 3.49 s from 128
    to 2,048 GPUs) where the planner's stay flat (it hides the 32-way dp traffic), so at 2,048 it reads 0.92
    (BF16) and 0.87 (FP8) of them (0.95 and 0.91 while it charged every tp collective whole, which NeMo's
    own TP overlap does not: the flat figure had covered part of the gap); held there within 15%."""
    for gpus, (bf16, fp8) in DGXC_340B.items():
        ours_bf16, ours_fp8 = _nemotron(gpus, False), _nemotron(gpus, True)
        step = 0.10 if gpus <= 1024 else 0.15
        assert ours_bf16 == pytest.approx(bf16, rel=step), gpus
        assert ours_fp8 == pytest.approx(fp8, rel=step), gpus
        assert ours_bf16 / ours_fp8 == pytest.approx(bf16 / fp8, rel=0.01 if gpus == 256 else 0.05), gpus


def test_llama31_70b_fp8_speedup_lands_in_the_measured_range():
    """Held out: Llama 3.1 70B on 64 H100 with NVIDIA's recipe (TP 4, PP 4, CP 2, VP 5, MBS 1, GBS 128, seq
    8192): the measured FP8 speed-up over BF16 is 1.34-1.53x (issue 38); the planner read 1.66 before
    FP8's casts and GEMM share were charged."""
    m = replace(PRESETS["llama3-70b"], max_seq=8192)
    lay = Layout(tp=4, pp=4, cp=2, dp=2, vpp=5, zero=1, micro_batch=1, sp_mode="megatron", schedule="interleaved",
                 cp_mode="ring")
    bf16, fp8 = (estimate(m, lay, Workload(seq=8192, global_batch=128, fp8_gemm=f, grad_dtype="param"), H100, 64)
                 .time.step_time_s for f in (False, True))
    assert 1.34 <= bf16 / fp8 <= 1.53
