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
- **Allocator slack** (`ALLOCATOR_SLACK`, a share of the planned bytes): what PyTorch's caching allocator
  holds at the peak beyond the tensors alive then (blocks split and cached, not returned), measured by
  benchmarks/gpu.py as peak reserved over peak allocated on an H200 (torch 2.11, CUDA 13, 2026-12-04):
  the 1.07B Llama at seq 2048, micro-batch 16, 70.0 GiB allocated: 4.0% compiled and 4.2% eager with the
  default allocator, 3.3% and 3.7% with expandable segments; a 0.16B model at micro-batch 128 x seq 1024
  (90.1 GiB of mostly activations): 10.3% and 9.3%. The plan counts the main model's default-allocator
  figure, 4.2%; a layout whose activations are many small tensors can need twice that. A CPU "device"
  (glibc's malloc, `host_is_device`) counts none: the planner's host rows are held to RSS directly.

The same run read the CUDA context after training at 767 MiB (685 MiB after a first tensor and a GEMM:
CUDA 13 loads kernels lazily), below the 1,343 MB the plan keeps; the plan keeps the published figure,
which also covers a run that loads its kernels eagerly (CUDA_MODULE_LOADING=EAGER, older stacks).
"""
from __future__ import annotations

from .layout import Workload
from .topology import Accelerator

FRAMEWORKS = ("fivefold", "megatron", "deepspeed")
CUDA_CONTEXT_BYTES = 1343e6          # PyTorch's CUDA context and kernels (HF Transformers docs, measured)
DEEPSPEED_OVERLAP_FACTOR = 4.5       # overlap_comm's footprint in bucket sizes (HF Transformers docs)
DEEPSPEED_BUCKET = 5e8               # DeepSpeed's default allgather_bucket_size and reduce_bucket_size
ALLOCATOR_SLACK = 0.042              # PyTorch's caching allocator: peak reserved / peak allocated - 1 (measured)


def allocator_slack(acc: Accelerator) -> float:
    """The share of the planned bytes the device's allocator holds beyond them at the peak (none on a CPU)."""
    return 0.0 if acc.host_is_device else ALLOCATOR_SLACK


def _fixed(acc: Accelerator, work: Workload) -> tuple[float, float]:
    """(context, framework buffers): the reserve's parts that do not grow with the planned bytes."""
    framework = 0.0
    if work.framework == "deepspeed":
        framework = DEEPSPEED_OVERLAP_FACTOR * work.param_bytes * 2 * (work.ds_bucket or DEEPSPEED_BUCKET)
    return acc.context_bytes, framework


def device_reserve(acc: Accelerator, work: Workload, planned: float = 0.0) -> dict:
    """{"context", "framework", "fragmentation", "total"} bytes a device keeps beyond `planned` bytes of
    planned tensors, "slack" (the allocator's share) and "framework_name" (each part's source: the module
    docstring)."""
    context, framework = _fixed(acc, work)
    slack = allocator_slack(acc)
    fragmentation = slack * planned
    return {"context": context, "framework": framework, "fragmentation": fragmentation, "slack": slack,
            "total": context + framework + fragmentation, "framework_name": work.framework}


def planned_limit(acc: Accelerator, work: Workload) -> float:
    """The most planned bytes a device holds with its reserve: planned + reserve(planned) <= memory."""
    context, framework = _fixed(acc, work)
    return (acc.memory - context - framework) / (1 + allocator_slack(acc))


def reserve_text(reserve: dict) -> str:
    """One line: the reserve's parts and what is not counted."""
    gib = 2**30
    extra = (f" + DeepSpeed's overlap_comm buckets {reserve['framework'] / gib:.2f} GiB" if reserve["framework"] else "")
    slack = (f" + allocator slack {reserve['fragmentation'] / gib:.2f} GiB ({reserve['slack']:.1%} of the planned "
             f"bytes, measured)" if reserve["slack"] else "")
    return (f"device reserve: {reserve['total'] / gib:.2f} GiB (CUDA context and kernels "
            f"{reserve['context'] / gib:.2f} GiB{extra}{slack})")
