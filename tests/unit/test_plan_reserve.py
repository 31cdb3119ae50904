"""The device reserve (issue 38, point 4; plan/reserve.py): the CUDA context and kernels every GPU holds
(1,343 MB, Hugging Face Transformers docs "Model training anatomy", measured with PyTorch) and DeepSpeed's
overlap_comm buckets (4.5 × 2 bytes × both buckets, Hugging Face Transformers docs, DeepSpeed integration),
counted against the device, stated in the output; ZeRO-Offload's largest model on a 32 GB V100 against
the paper's 13B (Ren et al. 2021)."""
import json
import re
from dataclasses import replace

import pytest

from fivefold.cli import main
from fivefold.plan.estimate import estimate
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.models import PRESETS, PlanModel
from fivefold.plan.reserve import ALLOCATOR_SLACK, device_reserve, planned_limit
from fivefold.plan.search import search
from fivefold.plan.topology import ACCELERATORS, TOPOLOGIES, GiB, topology_from_dict

DGX = TOPOLOGIES["dgx-h100"]
V100 = replace(DGX, accelerator=replace(DGX.accelerator, memory=32 * GiB))


def test_every_gpu_keeps_its_cuda_context_and_a_cpu_none():
    for acc in ACCELERATORS.values():
        assert device_reserve(acc, Workload())["total"] == acc.context_bytes == 1343e6
    gpu = {"peak_tflops": {"bf16": 100}, "memory_gb": 80, "pcie_gbps": 50}
    tiers = [{"name": "nvlink", "size": 8, "bandwidth_gbps": 100}]
    assert topology_from_dict({"accelerator": gpu, "tier": tiers}).accelerator.context_bytes == 1343e6
    assert topology_from_dict({"accelerator": {**gpu, "context_mb": 600}, "tier": tiers}).accelerator.context_bytes == 600e6
    cpu = {"peak_tflops": {"fp32": 0.1}, "memory_gb": 24}                       # host_is_device: what calibrate writes
    assert topology_from_dict({"accelerator": cpu, "tier": tiers}).accelerator.context_bytes == 0


def test_deepspeed_keeps_four_and_a_half_times_its_buckets():
    acc = DGX.accelerator
    ds = device_reserve(acc, Workload(framework="deepspeed"))
    assert ds["framework"] == 4.5 * 2 * 2 * 5e8 == 9e9                     # "requires a 9GB footprint"
    assert device_reserve(acc, Workload(framework="deepspeed", ds_bucket=2e8))["framework"] == 3.6e9   # "3.6GB"
    assert device_reserve(acc, Workload(framework="megatron"))["framework"] == 0   # its buffers are planned rows


def test_a_layout_fits_only_with_its_reserve_and_the_output_says_so(capsys):
    """A layout whose tensors fit but not with the reserve does not fit; the text and JSON state the reserve."""
    model = PlanModel(name="x", vocab=32000, hidden=5120, layers=40, heads=40, kv_heads=40, ffn=13824,
                      tie_embeddings=False, max_seq=8192)
    work = Workload(seq=1024, global_batch=1, dtype="fp16", grad_dtype="param", reduce_dtype="fp16")
    lay = Layout(dp=1, zero=2, offload="cpu", recompute="full")
    need = estimate(model, lay, work, V100).memory.most_loaded["total"]
    tight = replace(V100, accelerator=replace(V100.accelerator, memory=need * (1 + ALLOCATOR_SLACK) + 1e8))
    assert not estimate(model, lay, work, tight).device_fits                 # 0.1 GB left, 1.34 GB reserved
    assert estimate(model, lay, work, replace(tight, accelerator=replace(tight.accelerator, context_bytes=0))).device_fits
    no_slack = replace(tight, accelerator=replace(tight.accelerator, context_bytes=0, memory=need + 1e8))
    assert not estimate(model, lay, work, no_slack).device_fits              # the allocator's slack alone
    assert main(["plan", "--model", "llama3-8b", "--tp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reserve"]["context"] == 1343e6 and out["reserve"]["framework_name"] == "fivefold"
    assert main(["plan", "--model", "llama3-8b", "--tp", "8", "--framework", "deepspeed", "--ds-bucket", "2e8"]) == 0
    text = capsys.readouterr().out
    reserve = re.search(r"device reserve: ([\d.]+) GiB \(CUDA context and kernels 1.25 GiB \+ DeepSpeed's "
                        r"overlap_comm buckets 3.35 GiB \+ allocator slack ([\d.]+) GiB \(4.2% of the planned bytes, "
                        r"measured\)\)", text)
    assert reserve and float(reserve[1]) == pytest.approx(1.25 + 3.35 + float(reserve[2]), abs=0.011)
    assert f"+ reserve {reserve[1]} GiB of 80.00 GiB" in text


def test_the_allocator_slack_is_the_share_measured_on_an_h200():
    """PyTorch's caching allocator held 4.0-4.2% beyond the peak allocation of benchmarks/gpu.py's 1.07B
    Llama on an H200 (70.04 GiB allocated, 72.88 GiB reserved compiled, 73.00 eager, default allocator;
    2026-12-04): the plan counts 4.2% of the planned bytes, so planned 70.05 GiB + slack reads the measured
    reserve within 0.2%; a CPU device counts none; the search's limit is the planned total whose reserve
    fills the device exactly."""
    acc = ACCELERATORS["h200"]
    planned = 70.05 * GiB
    slack = device_reserve(acc, Workload(), planned)
    assert slack["fragmentation"] == pytest.approx(ALLOCATOR_SLACK * planned) and ALLOCATOR_SLACK == 0.042
    assert (planned + slack["fragmentation"]) / (73.00 * GiB) == pytest.approx(1, abs=0.002)
    cpu = topology_from_dict({"accelerator": {"peak_tflops": {"fp32": 0.1}, "memory_gb": 24},
                              "tier": [{"name": "nvlink", "size": 8, "bandwidth_gbps": 100}]}).accelerator
    assert device_reserve(cpu, Workload(), planned)["fragmentation"] == 0
    for work in (Workload(), Workload(framework="deepspeed")):
        limit = planned_limit(acc, work)
        assert limit + device_reserve(acc, work, limit)["total"] == pytest.approx(acc.memory)


def test_ds_bucket_needs_deepspeed_and_a_size(capsys):
    for argv, match in ((["--ds-bucket", "2e8"], r"--ds-bucket sizes DeepSpeed's buckets; it needs --framework deepspeed"),
                        (["--framework", "deepspeed", "--ds-bucket", "0"], r"--ds-bucket must be"),
                        (["--framework", "deepspeed", "--ds-bucket", "nan"], r"--ds-bucket must be")):
        assert main(["plan", "--model", "llama3-8b", "--tp", "8", *argv]) == 2
        err = capsys.readouterr().err
        assert re.search(match, err) and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit) as e:                 # argparse's own one line for a choice
        main(["plan", "--model", "llama3-8b", "--tp", "8", "--framework", "jax"])
    assert e.value.code == 2 and "--framework: invalid choice: 'jax'" in capsys.readouterr().err


def _largest_on_v100(**kw) -> float:
    """Parameters of the largest Llama-2-13B-shaped model (hidden 5120, more or fewer layers) ZeRO-Offload
    fits on one 32 GB V100: fp16, ZeRO-2 with the optimizer on the CPU, full recompute, seq 1024."""
    best = 0.0
    for layers in range(30, 60):
        m = PlanModel(name="x", vocab=32000, hidden=5120, layers=layers, heads=40, kv_heads=40, ffn=13824,
                      tie_embeddings=False, max_seq=8192)
        w = Workload(seq=1024, global_batch=1, dtype="fp16", grad_dtype="param", reduce_dtype="fp16", **kw)
        if estimate(m, Layout(dp=1, zero=2, offload="cpu", recompute="full"), w, V100).device_fits:
            best = m.num_params()
    return best


def test_zero_offload_largest_model_on_a_v100_with_deepspeeds_reserve():
    """Ren et al. 2021: "up to 13 billion parameters" on one 32 GB V100 (the DeepSpeed ZeRO-Offload tutorial
    trains 10B there with overlap_comm and the default buckets). Without a reserve the planner fit 15.9B
    (issue 38). With the CUDA context and the allocator's measured slack (fivefold's process) 14.6B; DeepSpeed
    with overlap_comm at the 2e8 buckets Hugging Face's DeepSpeed docs advise for small GPUs, 13.02B (1.00 of
    13B; 13.65B before the slack was counted); at DeepSpeed's default 5e8 buckets (9 GB) 10.5B, near the
    tutorial's 10B."""
    assert _largest_on_v100() == pytest.approx(14.60e9, rel=0.01)
    assert 13.0e9 * 0.97 <= _largest_on_v100(framework="deepspeed", ds_bucket=2e8) <= 13.0e9 * 1.03
    assert 10.0e9 <= _largest_on_v100(framework="deepspeed") <= 10.8e9


def test_the_search_leaves_the_reserve_free():
    model, work = PRESETS["llama3-8b"], Workload(seq=4096, global_batch=64, framework="deepspeed")
    res = search(model, work, DGX, 8, top=3)
    assert res.ranked
    for _, lay in res.ranked:
        est = estimate(model, lay, work, DGX, 8)
        assert est.device_fits and est.memory.most_loaded["total"] + est.reserve["total"] <= DGX.accelerator.memory


def test_nemotron4_340b_fits_128_h100_without_recompute_with_the_runs_optimizer():
    """NVIDIA/dgxc-benchmarking's Nemotron-4 340B (nemotron/nemotron4-340b-synth.yaml, NeMo 24.11: TP 8, PP 8,
    VP 12, DP 2, GBS 32, BF16, 4.61 s a step on 128 H100) reduces gradients in bf16 (grad_sync_dtype) and
    runs NeMo's distributed_fused_adam with `dtype: bf16`: Apex's DistributedFusedAdam then keeps both
    moments in bf16 and no master copy (store_params False for a bf16 model). With fp32 Adam state the first
    stage plans at 80.9 GiB + the 1.25 GiB reserve and does not fit (the search fell back to full recompute,
    1.36 x the step); with the run's optimizer 59.4 GiB: it fits without recompute at 0.99 of the step."""
    model = PRESETS["nemotron4-340b"]
    lay = Layout(tp=8, pp=8, dp=2, vpp=12, zero=1, micro_batch=1, sp_mode="megatron", schedule="interleaved")
    work = Workload(seq=4096, global_batch=32, grad_dtype="param")
    fp32 = estimate(model, lay, work, DGX, 128)
    assert not fp32.device_fits and fp32.memory.most_loaded["total"] / GiB == pytest.approx(80.89, abs=0.01)
    run = estimate(model, lay, replace(work, optimizer_dtype="bf16"), DGX, 128)
    assert run.device_fits and run.memory.most_loaded["total"] / GiB == pytest.approx(59.39, abs=0.01)
    assert fp32.memory.most_loaded["optimizer"] == 3 * run.memory.most_loaded["optimizer"]   # 12 B/2 against 4 B/2
    assert run.time.step_time_s == pytest.approx(4.61, rel=0.05)
    res = search(model, replace(work, optimizer_dtype="bf16"), DGX, 128, {"tp": 8, "pp": 8, "vpp": 12, "dp": 2}, top=1)
    assert res.best[0].layout.recompute == "none"
    assert res.best[0].time.step_time_s == pytest.approx(4.61, rel=0.05)


def test_a_bf16_optimizer_needs_bf16_weights_and_no_offload(capsys):
    for argv, match in ((["--dtype", "fp32"], "keeps no master copy, so the weights must be bf16"),
                        (["--offload", "cpu", "--zero", "1"], "is planned on the device only")):
        assert main(["plan", "--model", "llama3-8b", "--tp", "8", "--optimizer-dtype", "bf16", *argv]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err
