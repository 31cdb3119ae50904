"""Device memory a plan keeps free: what a training process holds beyond the tensors the planner counts.

A layout fits when its most loaded stage's planned bytes plus this reserve fit the device (`Estimate.
device_fits`, the search's limit), and `fivefold plan` states the reserve beside the memory line. Its
parts, each with its source:

- **CUDA context and kernels** (`Accelerator.context_bytes`): what the first CUDA call maps before any
  tensor (the context, cuBLAS/cuDNN and the framework's kernels): 1,343 MB measured with PyTorch
  (Hugging Face Transformers docs, "Model training anatomy": `torch.ones((1, 1)).to("cuda")`, then
  nvidia-smi reads 1343 MB). Every datasheet GPU holds it; a custom accelerator sets `context_mb`; a CPU
  "device" (`host_is_device`, what `fivefold calibrate` measures) holds none.
- **Framework buffers beyond the planned ones** (`Workload.framework`): DeepSpeed with overlap_comm (its
  recipes' setting, e.g. the ZeRO-Offload tutorial's) holds 4.5 × 2 bytes × (allgather_bucket_size + reduce_bucket_size) elements (Hugging Face
  Transformers docs, DeepSpeed integration: "overlap_comm uses 4.5x the allgather_bucket_size and
  reduce_bucket_size values. So if they are set to 5e8, this requires a 9GB footprint"); both buckets
  are `Workload.ds_bucket` elements (0: DeepSpeed's default, 5e8). fivefold's own buckets and Megatron's grad
  buffers are planned rows already ("buffers", "grads"), so they add nothing here.
- **Allocator fragmentation**: not counted. No GPU run of ours has measured it yet (benchmarks/gpu.py
  reads allocated against reserved when a GPU is lent); the output says so.
"""
from __future__ import annotations

from .layout import Workload
from .topology import Accelerator

FRAMEWORKS = ("fivefold", "megatron", "deepspeed")
CUDA_CONTEXT_BYTES = 1343e6          # PyTorch's CUDA context and kernels (HF Transformers docs, measured)
DEEPSPEED_OVERLAP_FACTOR = 4.5       # overlap_comm's footprint in bucket sizes (HF Transformers docs)
DEEPSPEED_BUCKET = 5e8               # DeepSpeed's default allgather_bucket_size and reduce_bucket_size


def device_reserve(acc: Accelerator, work: Workload) -> dict:
    """{"context", "framework", "fragmentation", "total"} bytes a device keeps beyond the planned tensors,
    and "framework_name" (see the module docstring for each part's source)."""
    framework = 0.0
    if work.framework == "deepspeed":
        framework = DEEPSPEED_OVERLAP_FACTOR * work.param_bytes * 2 * (work.ds_bucket or DEEPSPEED_BUCKET)
    context = acc.context_bytes
    return {"context": context, "framework": framework, "fragmentation": 0.0, "total": context + framework,
            "framework_name": work.framework}


def reserve_text(reserve: dict) -> str:
    """One line: the reserve's parts and what is not counted."""
    gib = 2**30
    extra = (f" + DeepSpeed's overlap_comm buckets {reserve['framework'] / gib:.2f} GiB" if reserve["framework"] else "")
    return (f"device reserve: {reserve['total'] / gib:.2f} GiB (CUDA context and kernels "
            f"{reserve['context'] / gib:.2f} GiB{extra}; allocator fragmentation not counted: not measured)")
