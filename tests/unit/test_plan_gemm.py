"""GEMM efficiency by shape (plan/gemm.py; docs/plan.md, "GEMM efficiency by shape"): a roofline of
arithmetic intensity against the accelerator's peak and HBM bandwidth, plus a per-kernel floor."""
from dataclasses import replace

import pytest

from fivefold.plan.estimate import estimate
from fivefold.plan.gemm import gemm_factor, gemm_seconds, layer_gemms
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.models import PRESETS
from fivefold.plan.topology import ACCELERATORS, TOPOLOGIES, topology_from_dict

H100 = ACCELERATORS["h100"]
RATE = 989e12 * 0.6          # bf16 dense peak x the default efficiency


def test_roofline_and_floor_by_hand():
    # compute bound: 2·4096·512·512 = 2.147 GFLOP at 593.4 TFLOP/s = 3.619 us (bytes: 8.9 MB, 2.66 us) + 4 us
    assert gemm_seconds(4096, 512, 512, RATE, 3.35e12, 2, 4e-6) == pytest.approx(3.619e-6 + 4e-6, rel=1e-3)
    # memory bound: 64 rows by a 4096 x 4096 weight: 2·(64·4096 + 4096² + 64·4096) = 34.6 MB at 3.35 TB/s
    assert gemm_seconds(64, 4096, 4096, RATE, 3.35e12, 2, 4e-6) == pytest.approx(10.33e-6 + 4e-6, rel=1e-3)
    assert H100.gemm_kernel == 4e-6


def test_layer_gemms_carry_the_layers_flops():
    """The shapes' FLOPs are the model's matmul weights per token (norms aside) at tp = 1; with tp the
    projections split, MLA's down-projections and the router are whole on each rank."""
    for name in ("llama3-8b", "mixtral-8x7b", "deepseek-v3"):
        m = PRESETS[name]
        i = m.layers - 1
        flops = sum(2 * a * b * c for a, b, c in layer_gemms(m, m.is_moe_layer(i), 1024.0, 1, 8 if m.moe else 1))
        weights = m.layer_params(i, m.top_k if m.is_moe_layer(i) else None) - 2 * m._norm(m.hidden)
        assert flops == pytest.approx(2 * 1024 * weights, rel=1e-3), name


def test_small_models_and_thin_tensor_parallel_gemms_are_slower():
    m = PRESETS["llama3-8b"]
    big = gemm_factor(PRESETS["llama3-405b"], "dense", 8192.0, 8, 1, RATE, H100.hbm_bandwidth, 2, 4e-6)
    wide = gemm_factor(m, "dense", 4096.0, 1, 1, RATE, H100.hbm_bandwidth, 2, 4e-6)
    thin = gemm_factor(m, "dense", 4096.0, 8, 1, RATE, H100.hbm_bandwidth, 2, 4e-6)
    small = replace(m, name="llama-h512", hidden=512, heads=8, kv_heads=8, ffn=1536)
    tiny = gemm_factor(small, "dense", 4096.0, 1, 1, RATE, H100.hbm_bandwidth, 2, 4e-6)
    assert 1.0 <= big < 1.005 < wide < thin < tiny
    topo, w = TOPOLOGIES["dgx-h100"], Workload(seq=4096, global_batch=8)
    for model, lay in ((m, Layout(tp=8, sp_mode="megatron")), (small, Layout(dp=8))):
        shaped = estimate(model, lay, w, topo).time
        flat = estimate(model, lay, replace(w, gemm="flat"), topo).time
        assert shaped.compute_s > flat.compute_s and shaped.mfu < flat.mfu


def test_calibrated_accelerators_keep_their_measured_rates():
    """A custom accelerator without gemm_kernel_us (a peak that is an achieved rate) plans flat; `fivefold
    calibrate` writes the floor it fitted (tests/ranks/test_calibrate.py)."""
    cpu = topology_from_dict({"accelerator": {"name": "cpu", "memory_gb": 64, "hbm_gbps": 20,
                                              "peak_tflops": {"fp32": 0.1}},
                              "tier": [{"name": "intra", "size": 8, "bandwidth_gbps": 5}]})
    assert cpu.accelerator.gemm_kernel is None
    model = replace(PRESETS["llama3-8b"], name="small", hidden=256, heads=4, kv_heads=4, ffn=768, layers=2, vocab=1000)
    w = Workload(seq=256, global_batch=8, dtype="fp32", efficiency=1.0)
    shape = estimate(model, Layout(dp=2), w, cpu, 2).time
    flat = estimate(model, Layout(dp=2), replace(w, gemm="flat"), cpu, 2).time
    assert shape.step_time_s == flat.step_time_s
