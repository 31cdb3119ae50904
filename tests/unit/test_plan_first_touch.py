"""Fresh host pages (`time.first_touch_bytes`, `Accelerator.fresh_bandwidth`, written by `fivefold calibrate`
as `fresh_gbps`): a rank's ZeRO-2/3 buffers above glibc's mmap threshold are new mappings every time they
are made, so a calibrated CPU topology charges their first touch; a GPU's caching allocator does not."""
import dataclasses

import pytest

from fivefold.config import ConfigError, ModelConfig
from fivefold.tools.plan import check_topology
from fivefold.plan.estimate import estimate
from fivefold.plan.layout import from_config
from fivefold.plan.models import from_model_config
from fivefold.plan.time import first_touch_bytes
from fivefold.plan.topology import load_topology, topology_from_dict
from fivefold.rules import MMAP_THRESHOLD_BYTES

from tests.support.tiny import tiny_config

# benchmarks/plan_vs_run.py's model: a block is q, o 256x256, k, v 256x128, three 256x704 and two norms
BLOCK = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 704 + 2 * 256     # 737,792 parameters, 2.95 MB in fp32


def _case(**parallel):
    cfg = tiny_config(**parallel)
    cfg.model = ModelConfig(vocab=256, hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, max_seq=128)
    cfg.train.seq_len, cfg.train.global_batch = 128, 16
    layout, work = from_config(cfg)
    return from_model_config(cfg.model), layout, work


def _topo(fresh_gbps: float):
    return topology_from_dict({
        "name": "cpu", "accelerator": {"name": "cpu", "peak_tflops": {"fp32": 0.05}, "memory_gib": 4, "hbm_gbps": 30,
                                       "fresh_gbps": fresh_gbps},
        "tier": [{"name": "loopback", "size": 4, "bandwidth_gbps": 1.0, "latency_us": 1000}]})


def test_zero3_by_hand():
    """ZeRO-3 dp2, 2 micro-batches: each of the 4 blocks (2.95 MB, above the 2 MiB threshold) is gathered
    before each micro-batch's forward and backward (4 times) and makes its gradient buffer for each
    micro-batch's reduce-scatter (2 times); the root unit (tied embedding and norm, 0.26 MB) comes from
    the heap."""
    assert BLOCK * 4 > MMAP_THRESHOLD_BYTES > 65792 * 4
    model, layout, work = _case(dp=2, zero=3, microbatches=2)
    assert first_touch_bytes(model, layout, work, 0) == (4 * 4 * BLOCK * 4, 4 * 2 * BLOCK * 4)


def test_zero2_zero1_and_ddp_by_hand():
    """ZeRO-2 without a pipeline reduce-scatters each micro-batch: one bucket of every gradient (64 MiB
    buckets), made anew twice; ZeRO-1's gradients and DDP's buckets live for the run."""
    model, layout, work = _case(dp=2, zero=2, microbatches=2, bucket_mb=64)
    whole = 4 * BLOCK + 256 * 256 + 256
    assert first_touch_bytes(model, layout, work, 0) == (0.0, 2 * whole * 4)
    for zero in (0, 1):
        model, layout, work = _case(dp=2, zero=zero, microbatches=2)
        assert first_touch_bytes(model, layout, work, 0) == (0.0, 0.0)


def test_the_step_pays_them_at_the_calibrated_rate_and_a_gpu_does_not():
    model, layout, work = _case(dp=2, zero=3, microbatches=2)
    work = dataclasses.replace(work, efficiency=1.0)
    fresh = estimate(model, layout, work, _topo(2.0)).time
    warm = estimate(model, layout, work, _topo(0.0)).time
    touched = (16 + 8) * BLOCK * 4
    assert fresh.first_touch_s == pytest.approx(touched / 2e9, rel=1e-12)   # 35.4 ms
    assert fresh.step_time_s - warm.step_time_s == pytest.approx(touched / 2e9, rel=1e-9)
    assert warm.first_touch_s == 0.0
    gpu = estimate(model, layout, work, load_topology("dgx-h100")).time
    assert gpu.first_touch_s == 0.0


def test_under_a_pipeline_the_stage_pays_them_per_micro_batch():
    """pp2 ZeRO-3: the stage's fresh seconds join its forward and backward actions, so the makespan grows
    by at least what the slowest stage touches."""
    model, layout, work = _case(dp=2, pp=2, zero=3, microbatches=4)
    fresh = estimate(model, layout, work, _topo(2.0)).time
    warm = estimate(model, layout, work, _topo(0.0)).time
    assert fresh.first_touch_s > 0
    assert fresh.pipeline_s - warm.pipeline_s >= fresh.first_touch_s * (1 - 1e-9)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "fast"])
def test_a_bad_fresh_gbps_is_one_line(bad):
    with pytest.raises(ConfigError, match="fresh_gbps"):
        check_topology(_topo(bad))
