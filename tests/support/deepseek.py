"""DeepSeek-V3's published training layout and workload, shared by the planner's tests."""
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.models import PRESETS
from fivefold.plan.topology import topology_from_dict

DSV3 = PRESETS["deepseek-v3"]

# DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.1-3.4: 2048 H800 GPUs, 8 a node on NVLink/NVSwitch
# (400 GB/s both ways), 400 Gb/s InfiniBand per GPU; 16-way pipeline (DualPipe), 64-way expert
# parallelism over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism; sequence 4096, batch 15360
# sequences (after the ramp); tokens to at most 4 nodes; FP8 dispatch, GEMMs and activation caching;
# RMSNorm and MLA up-projections recomputed in the backward (§3.4).
H800 = topology_from_dict({"name": "h800", "accelerator": "h100", "tier": [
    {"name": "nvlink", "size": 8, "bandwidth_gbps": 200, "latency_us": 2},
    {"name": "ib", "bandwidth_gbps": 50, "latency_us": 5}]})
DSV3_LAYOUT = Layout(pp=16, dp=128, ep=64, zero=1, micro_batch=1, ep_overlap=True, recompute_norm_mla=True)
DSV3_WORK = Workload(seq=4096, global_batch=15360, capacity_factor=0, fp8_dispatch=True, moe_route_nodes=4,
                     fp8_gemm=True, fp8_act_cache=True)
