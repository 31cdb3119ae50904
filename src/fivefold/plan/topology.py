"""Clusters: accelerators and network tiers, innermost first, and which tier a group of ranks crosses.

A `Topology` is an `Accelerator` (peak FLOP/s per dtype, memory, HBM bandwidth) and a list of `Tier`s,
innermost first. Tier i joins `size` consecutive ranks (a domain); each GPU has `bandwidth` bytes/s
per direction into it, divided by `oversubscription` when the tier above it is oversubscribed.
A group of ranks "lands on" the innermost tier whose domains hold every group of that dimension whole;
its collectives then run at that tier's (slowest) bandwidth.

Presets:
- `dgx-h100`: DGX H100 SuperPOD style. 8 H100 per server on NVLink 4 (900 GB/s bidirectional, so
  450 GB/s each way), one 400 Gb/s (50 GB/s) NIC per GPU on a rail-optimised leaf joining a scalable
  unit of 32 servers (256 GPUs), and a non-blocking spine above (NVIDIA DGX SuperPOD reference
  architecture).
- `llama3`: the Llama-3 training cluster (Dubey et al. 2024, §3.3.1): 8 H100 per server on NVLink,
  400 Gb/s RoCE per GPU, two servers (16 GPUs) per rack switch, 192 racks (3,072 GPUs) per pod at full
  bisection, 8 pods (24,576 GPUs) joined by aggregation switches oversubscribed 1:7.
- any custom TOML (see `load_topology`).
- `node_topology(K)`: nodes of K GPUs, tiers "intra" and "inter" as the runtime's ledger names them.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..comm import volume
from ..comm.volume import BACKENDS
from ..config import ConfigError

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """Peak dense FLOP/s per dtype, memory bytes, HBM bytes/s. An "80 GB" H100 or A100 holds 80 GiB.

    What a datasheet leaves to `efficiency` and a calibration (`fivefold calibrate`) measures:
    `attention_flops` (per dtype; the attention core's rate, planner FLOP convention; absent: the GEMM
    peak), `layer_overhead` (seconds per layer per micro-batch, forward + backward: the fixed cost of a
    layer's many small ops) and `elementwise` (share of the layers' element-wise traffic, `PlanModel.
    elementwise_per_token`, paid at `hbm_bandwidth` beside the GEMMs: 1 for eager PyTorch, 0 where fused
    kernels and `efficiency` cover it) and `action_overhead` (host seconds a pipeline compute action costs
    beyond its compute and its modelled transfer), and `ranks_per_core` (local ranks sharing one core:
    more ranks than cores, as `fivefold calibrate --nproc 4` on 2 cores; the rates are then measured with
    every rank busy, and a rank idle in a pipeline bubble gives its share to the busy ones: time.py
    `shared_cores_makespan`; 1 on any accelerator a rank has to itself), and `fresh_bandwidth` (bytes/s of
    writing freshly mapped host memory, which a CPU rank's ZeRO buffers above the mmap threshold pay on
    every allocation: time.py `first_touch_bytes`; 0 on a GPU, whose caching allocator reuses blocks).

    The host side, per GPU (docs/plan.md, "Offload"; what ZeRO-Offload and disk offload use):
    `pcie_bandwidth` (bytes/s each way between the GPU and host memory), `host_memory` (the GPU's share of
    the node's RAM), `host_bandwidth` (its share of the host's memory bandwidth: the CPU Adam step is
    memory bound) and `nvme_bandwidth` (its share of the node's local NVMe bandwidth, reads and writes
    together). The presets are per-GPU shares of NVIDIA DGX nodes (see ACCELERATORS)."""

    name: str
    peak_flops: dict = field(default_factory=dict)
    memory: float = 80 * GiB
    hbm_bandwidth: float = 3.35e12
    attention_flops: dict = field(default_factory=dict)
    layer_overhead: float = 0.0
    elementwise: float = 0.0
    action_overhead: float = 0.0     # host seconds per pipeline compute action beyond compute and transfer
    pcie_bandwidth: float = 55e9     # host link, bytes/s each way per GPU (PCIe Gen5 x16, achievable)
    host_memory: float = 256 * 2**30   # host RAM per GPU (DGX H100: 2 TiB / 8)
    host_bandwidth: float = 60e9     # host memory bytes/s per GPU (the CPU optimizer step's rate)
    nvme_bandwidth: float = 3.5e9    # local NVMe bytes/s per GPU, reads and writes together
    host_is_device: bool = False     # a CPU "device" (as `fivefold calibrate` measures): offload's d2h / h2d are
                                     # copies within one memory, no PCIe crossed
    gemm_kernel: float | None = None   # per-GEMM-kernel floor, seconds (plan/gemm.py); None: GEMMs at the flat
                                       # efficiency (a custom or calibrated accelerator: its peaks are achieved)
    sms: int = 0                     # streaming multiprocessors (compute units)
    comm_sms: int = 0                # of them, those a collective running beside compute occupies (time.interfered)
    ranks_per_core: float = 1.0      # local ranks per core (> 1: ranks share cores; time.shared_cores_makespan)
    context_bytes: float = 0.0       # device bytes the CUDA context and kernels hold before any tensor (plan/reserve.py)
    fp8_gemm_ratio: float = 1.0      # share of the FP8 peak large FP8 GEMMs reach, over the share BF16 ones reach
                                     # of theirs (gemm.linear_rate; 1.0: the same share, not measured)
    fresh_bandwidth: float = 0.0     # bytes/s writing freshly mapped host pages (first touch); 0: not charged
                                     # (a GPU's caching allocator reuses its blocks; time.first_touch_bytes)

    @property
    def comm_share(self) -> float:
        """Share of the compute rate lost while a collective overlaps it: comm_sms / sms (0: free overlap)."""
        return self.comm_sms / self.sms if self.sms else 0.0

    def peak(self, dtype: str) -> float:
        key = {"fp64": "fp32"}.get(dtype, dtype)
        if key not in self.peak_flops:
            raise ConfigError(f"accelerator {self.name} has no peak for {dtype!r}; known: {', '.join(self.peak_flops)}")
        return self.peak_flops[key]

    def attention_peak(self, dtype: str) -> float:
        """The attention core's FLOP/s in `dtype` (the GEMM peak unless measured)."""
        key = {"fp64": "fp32"}.get(dtype, dtype)
        return self.attention_flops.get(key) or self.peak(dtype)


@dataclass(frozen=True)
class Tier:
    """One network level: `size` GPUs per domain (None: the whole cluster), per-GPU bytes/s each way."""

    name: str
    size: int | None
    bandwidth: float
    latency: float = 5e-6
    oversubscription: float = 1.0
    ops: tuple = ()          # per-op (op, latency, bandwidth) fits that replace the two above (calibrate)
    overlap: float = 1.0     # share of an asynchronous collective that really hides behind compute
    loss: float = 0.0        # share of frames a path across this tier loses (each way; a lossy link)
    loss_recovery: float = 0.0   # seconds a lost frame holds up its transfer (0: TCP's estimate, 4 latencies)
    mtu: int = 1500          # frame bytes on this tier's links (what a lost frame carries)

    @property
    def recovery(self) -> float:
        """Seconds one lost frame costs: the measured `loss_recovery`, else TCP's: a lost frame is resent
        after about two round trips (fast retransmit waits one for the duplicate acknowledgements; a lost
        last frame waits for the tail-loss probe, two round trips: RFC 8985)."""
        return self.loss_recovery or 4 * self.latency

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth / self.oversubscription

    def fit(self, op: str) -> tuple[float, float]:
        """(latency per hop, bandwidth) of `op` on this tier: its own fit when measured, else the tier's."""
        for name, latency, bandwidth in self.ops:
            if name == op:
                return latency, bandwidth
        return self.latency, self.bandwidth


@dataclass(frozen=True)
class Topology:
    name: str
    accelerator: Accelerator
    tiers: tuple[Tier, ...]
    backend: str = "nccl"    # whose collective algorithms the ranks run (comm/volume.py ALGORITHMS): "nccl" on
                             # GPUs; "gloo" for CPU ranks (`fivefold calibrate` writes it; fivefold's
                             # reduce-scatter there is a pairwise exchange, and the fits count it so)

    @property
    def max_gpus(self) -> int | None:
        return self.tiers[-1].size

    def check(self, gpus: int) -> None:
        if self.max_gpus is not None and gpus > self.max_gpus:
            raise ConfigError(f"topology {self.name} has {self.max_gpus} GPUs; asked for {gpus}")

    def tier_index(self, block: int, world: int) -> int:
        """Innermost tier whose domains hold every aligned block of `block` consecutive ranks."""
        sizes = tuple(t.size for t in self.tiers)
        return _tier_index(block, world, sizes)

    def tier_of(self, block: int, world: int) -> Tier:
        return self.tiers[self.tier_index(block, world)]


@lru_cache(maxsize=65536)
def _tier_index(block: int, world: int, sizes: tuple) -> int:
    if block <= 1:
        return 0
    for i, size in enumerate(sizes):
        if size is None or world <= size:
            return i
        if block > size:
            continue
        if size % block == 0 or not any((k * block) // size != ((k + 1) * block - 1) // size
                                        for k in range(world // block)):
            return i
    return len(sizes) - 1


# -- presets ------------------------------------------------------------------------------------
# The host side of each accelerator is its share of the NVIDIA DGX node it ships in (8 GPUs):
# - PCIe: H100, H200 and B200 sit on PCIe Gen5 x16 (32 GT/s x 16 lanes, 128b/130b: 63 GB/s each way;
#   pinned host<->device copies reach about 55 GB/s), A100 on Gen4 x16 (31.5 GB/s; about 25 achievable).
# - Host memory: DGX H100, DGX H200, DGX B200 and DGX A100 (640 GB) have 2 TB of RAM (32 x 64 GB DIMMs):
#   256 GiB per GPU.
# - Host memory bandwidth: two CPUs of 8 DDR channels each, DDR5-4800 for DGX H100/H200 (Xeon 8480C: 614 GB/s
#   a node, 77 GB/s a GPU), DDR5-5600 for DGX B200 (Xeon 8570: 90 GB/s a GPU), DDR4-3200 for DGX A100 (EPYC
#   7742: 51 GB/s a GPU); the planner assumes ~78% of peak is reached (a STREAM-like figure): 60, 70, 40 GB/s.
# - NVMe: 8 U.2 data drives of 3.84 TB a node (DGX H100/H200/A100/B200), one per GPU; a PCIe Gen4 drive of
#   that class reads at ~7 GB/s and writes at ~3.5-4 GB/s: 3.5 GB/s, the slower direction, for both.
# - GEMM floor: 4 us a kernel (launch and tail; CUDA kernel launches cost a few microseconds each), an
#   assumption of the planner, not a measurement (docs/plan.md, "GEMM efficiency by shape").
# - Overlap: SM counts from the datasheets (H100/H200 SXM5 132, A100 108, B200 148). A collective beside
#   compute holds 20 SMs: DeepSeek-V3 (DeepSeek-AI 2024, §3.2.2) gives 20 of the H800's 132 SMs to its
#   all-to-alls ("only 20 SMs are sufficient to fully utilize the bandwidths of IB and NVLink"); NCCL runs
#   each channel of a collective as one thread block on its own SM (NCCL_MIN/MAX_NCHANNELS), of the same order.
# - FP8 GEMMs (`fp8_gemm_ratio`, Hopper): fitted to NVIDIA's published BF16 and FP8 step times of one recipe,
#   Nemotron-4 340B on 256 H100 (TP 8, PP 8, VP 12, GBS 64: 4.67 s and 3.21 s; NVIDIA/dgxc-benchmarking,
#   nemotron/README_340b.md, NeMo 24.11), with FP8's casts charged (time.fp8_cast_seconds) and tp's input
#   collectives hidden behind the column GEMMs (time.tp_hidden): 0.868, i.e. large FP8 GEMMs reach 0.868 of
#   the share of the FP8 peak that BF16 ones reach of theirs (0.88 before tp's overlap was planned). Held out:
#   the same recipe's other sizes and Llama 3.1 70B on 64 H100 (tests/unit/test_plan_fp8.py). B200: not
#   measured (1.0).
GEMM_KERNEL = 4e-6
COMM_SMS = 20
FP8_GEMM_RATIO_HOPPER = 0.868
# - CUDA context and kernels (`context_bytes`, plan/reserve.py): 1,343 MB measured with PyTorch (Hugging Face
#   Transformers docs, "Model training anatomy"), the same figure on every GPU until one of ours is measured.
CUDA_CONTEXT = 1343e6
ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 SXM5 datasheet: dense (no sparsity) tensor-core peaks.
    "h100": Accelerator("H100-SXM-80GB", {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 495e12,
                                          "fp32": 67e12}, 80 * GiB, 3.35e12,
                        pcie_bandwidth=55 * GB, host_memory=256 * GiB, host_bandwidth=60 * GB, nvme_bandwidth=3.5 * GB,
                        gemm_kernel=GEMM_KERNEL, sms=132, comm_sms=COMM_SMS, fp8_gemm_ratio=FP8_GEMM_RATIO_HOPPER,
                        context_bytes=CUDA_CONTEXT),
    "h200": Accelerator("H200-SXM-141GB", {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 495e12,
                                           "fp32": 67e12}, 141 * GB, 4.8e12,
                        pcie_bandwidth=55 * GB, host_memory=256 * GiB, host_bandwidth=60 * GB, nvme_bandwidth=3.5 * GB,
                        gemm_kernel=GEMM_KERNEL, sms=132, comm_sms=COMM_SMS, fp8_gemm_ratio=FP8_GEMM_RATIO_HOPPER,
                        context_bytes=CUDA_CONTEXT),
    "a100": Accelerator("A100-SXM-80GB", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
                        80 * GiB, 2.04e12,
                        pcie_bandwidth=25 * GB, host_memory=256 * GiB, host_bandwidth=40 * GB, nvme_bandwidth=3.5 * GB,
                        gemm_kernel=GEMM_KERNEL, sms=108, comm_sms=COMM_SMS, context_bytes=CUDA_CONTEXT),
    "b200": Accelerator("B200-180GB", {"bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12, "tf32": 1100e12,
                                       "fp32": 75e12}, 180 * GB, 8e12,
                        pcie_bandwidth=55 * GB, host_memory=256 * GiB, host_bandwidth=70 * GB, nvme_bandwidth=3.5 * GB,
                        gemm_kernel=GEMM_KERNEL, sms=148, comm_sms=COMM_SMS, context_bytes=CUDA_CONTEXT),
}

NVLINK4 = 450 * GB        # per GPU, each direction
NIC_400G = 50 * GB        # 400 Gb/s per GPU

TOPOLOGIES: dict[str, Topology] = {
    "dgx-h100": Topology("dgx-h100", ACCELERATORS["h100"], (
        Tier("nvlink", 8, NVLINK4, 2e-6),
        Tier("leaf", 256, NIC_400G, 5e-6),
        Tier("spine", None, NIC_400G, 8e-6),
    )),
    "llama3": Topology("llama3", ACCELERATORS["h100"], (
        Tier("nvlink", 8, NVLINK4, 2e-6),
        Tier("rack", 16, NIC_400G, 4e-6),
        Tier("pod", 3072, NIC_400G, 8e-6),
        Tier("cluster", 24576, NIC_400G, 12e-6, oversubscription=7.0),
    )),
}


def node_topology(ranks_per_node: int, accelerator: str = "h100") -> Topology:
    """Nodes of `ranks_per_node` GPUs, its tiers named as the runtime's ledger names them (comm/ledger.py):
    "intra" (inside a node, NVLink 4) and "inter" (between nodes, a 400 Gb/s NIC per GPU); one tier,
    "intra", when ranks_per_node is 0 (one node). `tiers.by_tier` of flows placed on it predicts a run's
    comm.json "by_tier" under the same `parallel.ranks_per_node` (tests/ranks/test_tiers.py)."""
    accel = ACCELERATORS[accelerator]
    if ranks_per_node <= 0:
        return Topology("one-node", accel, (Tier("intra", None, NVLINK4, 2e-6),))
    return Topology(f"nodes-of-{ranks_per_node}", accel, (Tier("intra", ranks_per_node, NVLINK4, 2e-6),
                                                          Tier("inter", None, NIC_400G, 5e-6)))


def _fp8_ratio(value) -> float:
    """[accelerator] fp8_gemm_ratio: a number in (0, 2]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 2:
        raise ConfigError(f"[accelerator] fp8_gemm_ratio must be a number in (0, 2] (the share of the FP8 peak FP8 "
                          f"GEMMs reach over BF16's share of its own; 1: the same), got {value!r}")
    return float(value)


def topology_from_dict(d: dict, name: str = "custom") -> Topology:
    """Build a topology from a TOML/dict form::

        name = "my-cluster"
        backend = "nccl"         # or "gloo": whose collective algorithms count the bytes (comm/volume.py)
        [accelerator]            # or: accelerator = "h100"
        name = "H100"
        memory_gib = 80          # or memory_gb (10^9 bytes)
        hbm_gbps = 3350
        peak_tflops = { bf16 = 989, fp8 = 1979 }
        [[tier]]                 # innermost first; the last may omit size (whole cluster)
        name = "nvlink"
        size = 8
        bandwidth_gbps = 450     # GB/s per GPU, each direction
        latency_us = 2
        oversubscription = 1
        # measured by `fivefold calibrate` (optional): per-op fits, the hidden share of async collectives
        ops = { all_reduce = { latency_us = 900, bandwidth_gbps = 2.1 } }
        overlap = 0.5
        # a lossy tier (optional): share of frames lost on a path across it, each way, what one lost frame
        # costs (absent: 4 latencies, TCP's estimate; benchmarks/network.py --loss-probe fits it), frame bytes
        loss = 0.01
        loss_recovery_us = 12000
        mtu = 9000

    and, in [accelerator], `attention_tflops = { fp32 = 0.03 }`, `layer_overhead_us`, `elementwise`,
    `action_overhead_us`, `ranks_per_core`, `fresh_gbps`, `fp8_gemm_ratio`, `context_mb` (see `Accelerator`; a GPU's default 1,343, a host-is-device one's 0), and the host side of one GPU for offload: `pcie_gbps`
    (GB/s each way), `host_memory_gib` (or `host_memory_gb`), `host_gbps` (host memory bandwidth),
    `nvme_gbps`; for GEMMs by shape `gemm_kernel_us` (the per-kernel floor; absent: flat efficiency) and
    for overlap's cost `sms` and `comm_sms` (absent: overlap is free). A custom accelerator without them is taken to be its own host (a CPU-only machine, as
    `fivefold calibrate` measures: host = device): pcie_gbps and host_gbps = hbm_gbps, host memory = memory,
    nvme_gbps = 3.5. Give them for a GPU.
    """
    acc = d.get("accelerator", "h100")
    if isinstance(acc, str):
        if acc.lower() not in ACCELERATORS:
            raise ConfigError(f"unknown accelerator {acc!r}; known: {', '.join(ACCELERATORS)}")
        accel = ACCELERATORS[acc.lower()]
    else:
        try:
            mem = acc["memory_gib"] * GiB if "memory_gib" in acc else acc["memory_gb"] * GB
            hbm = acc.get("hbm_gbps", 3350)
            host = (_times(acc["host_memory_gib"], GiB) if "host_memory_gib" in acc else
                    _times(acc["host_memory_gb"], GB) if "host_memory_gb" in acc else mem)
            accel = Accelerator(acc.get("name", "custom"), {k: v * 1e12 for k, v in acc["peak_tflops"].items()},
                                mem, hbm * GB,
                                {k: v * 1e12 for k, v in acc.get("attention_tflops", {}).items()},
                                acc.get("layer_overhead_us", 0.0) * 1e-6, acc.get("elementwise", 0.0),
                                acc.get("action_overhead_us", 0.0) * 1e-6,
                                pcie_bandwidth=_times(acc.get("pcie_gbps", hbm), GB), host_memory=host,
                                host_bandwidth=_times(acc.get("host_gbps", hbm), GB),
                                nvme_bandwidth=_times(acc.get("nvme_gbps", 3.5), GB),
                                host_is_device="pcie_gbps" not in acc,
                                gemm_kernel=_times(acc["gemm_kernel_us"], 1e-6) if "gemm_kernel_us" in acc else None,
                                sms=acc.get("sms", 0), comm_sms=acc.get("comm_sms", 0),
                                ranks_per_core=acc.get("ranks_per_core", 1.0),
                                fresh_bandwidth=_times(acc.get("fresh_gbps", 0.0), GB),
                                fp8_gemm_ratio=_fp8_ratio(acc.get("fp8_gemm_ratio", 1.0)),
                                context_bytes=_times(acc.get("context_mb", 0.0 if "pcie_gbps" not in acc
                                                             else CUDA_CONTEXT / 1e6), 1e6))
        except KeyError as e:
            raise ConfigError(f"[accelerator] needs {e.args[0]!r} (peak_tflops, memory_gb or memory_gib)") from None
    raw = d.get("tier") or d.get("tiers")
    if not raw:
        raise ConfigError("a topology needs at least one [[tier]] (name, size, bandwidth_gbps)")
    tiers = []
    for i, t in enumerate(raw):
        try:
            ops = tuple((op, f["latency_us"] * 1e-6, f["bandwidth_gbps"] * GB) for op, f in t.get("ops", {}).items())
            tiers.append(Tier(t["name"], t.get("size"), t["bandwidth_gbps"] * GB, t.get("latency_us", 5) * 1e-6,
                              t.get("oversubscription", 1.0), ops, t.get("overlap", 1.0), t.get("loss", 0.0),
                              _times(t.get("loss_recovery_us", 0.0), 1e-6), t.get("mtu", 1500)))
        except KeyError as e:
            raise ConfigError(f"tier {i} needs {e.args[0]!r} (name, size, bandwidth_gbps)") from None
    sizes = [t.size for t in tiers]
    for i in range(1, len(sizes)):
        inner, outer = sizes[i - 1], sizes[i]
        if inner is None or (outer is not None and (outer < inner or outer % inner)):
            raise ConfigError(f"tier sizes must grow innermost first and nest (each a multiple of the one "
                              f"inside it); got {sizes}")
    backend = d.get("backend", "nccl")
    if backend not in BACKENDS:
        raise ConfigError(f"topology backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return Topology(d.get("name", name), accel, tuple(tiers), backend)


def _times(value, unit: float):
    """value · unit for a number; anything else as it is, for tools/plan.py's check_topology to name."""
    return value * unit if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def load_topology(spec: str | Topology) -> Topology:
    """A preset name, "nodes:K" (`node_topology(K)`: the ledger's "intra" and "inter" tiers) or a TOML
    file (see `topology_from_dict`)."""
    if isinstance(spec, Topology):
        return spec
    if spec.lower() in TOPOLOGIES:
        return TOPOLOGIES[spec.lower()]
    kind, _, k = spec.partition(":")
    if kind == "nodes" and k.isdigit() and int(k) > 0:
        return node_topology(int(k))
    path = Path(spec)
    if path.suffix == ".toml" and path.is_file():
        with open(path, "rb") as f:
            return topology_from_dict(tomllib.load(f), name=path.stem)
    if path.suffix == ".toml" or len(path.parts) > 1:
        what = "a folder" if path.is_dir() else "no such file"
        raise ConfigError(f"topology {spec}: {what}; give a preset ({', '.join(TOPOLOGIES)}), nodes:K or a .toml file")
    raise ConfigError(f"unknown topology {spec!r}; known topologies: {', '.join(TOPOLOGIES)} (or nodes:K, or a .toml file)")


def collective_latency(op: str, n: int, latency: float, backend: str = "nccl") -> float:
    """Latency term (alpha) of one call: `latency` times the hops the backend's algorithm waits for
    (comm/volume.py `latency_hops`)."""
    return volume.latency_hops(op, n, backend) * latency


TCP_IP_HEADER = 52        # IPv4 20 + TCP 20 + the timestamp option 12: the frame bytes that are not payload


def collective_loss(op: str, n: int, bytes_sent: float, calls: float, tier: Tier, backend: str = "nccl") -> float:
    """Loss term of a collective on a lossy tier: the frames one rank sends (its payload in `tier.mtu`
    frames, and one frame per latency hop for each call: gloo's ready-to-receive notes, NCCL's flags) times
    the tier's `loss` times what one lost frame costs (`Tier.recovery`). Lost frames are taken one after
    another, each stalling its transfer (a step waits for its slowest rank's retransmissions)."""
    if tier.loss <= 0:
        return 0.0
    frames = bytes_sent / max(1, tier.mtu - TCP_IP_HEADER) + calls * volume.latency_hops(op, n, backend)
    return frames * tier.loss * tier.recovery


def group_bandwidth(topo: "Topology", tier_index: int, op: str, n: int, block: int, stages: int = 1,
                    duty: float = 1.0) -> float:
    """Per-rank bandwidth of a collective on a group of n ranks spanning `block` consecutive ranks whose
    slowest tier is `tier_index`. Oversubscription of that tier bites in proportion to the traffic that
    leaves a domain below it: an all-to-all sends (1-1/k) of its bytes out of each of the k domains it
    spans, every rank at once; a ring (all-reduce, all-gather, reduce-scatter) or a pipeline crosses
    each domain boundary once, so a domain of D ranks carries only D·k/n crossing flows on uplinks
    worth D·bandwidth/oversubscription.

    `stages`: the pipeline stages among one domain's ranks, for a group inside one stage
    (`tiers.domain_stages`); `duty`: the share of the step the other stages' ranks spend crossing the
    tier themselves. A stage's own ranks cross together (they run the same collective); the other
    stages' run other actions of the schedule (a forward beside a backward) and meet them only for
    their duty, so the uplinks carry (1 + (stages − 1)·duty)/stages of the domain's crossers: all of
    them at duty 1 (lockstep, every rank at once), one stage's at 0. The estimate finds the duty from
    its own step (`estimate.timed_stages`)."""
    tier = topo.tiers[tier_index]
    if tier.oversubscription <= 1 or tier_index == 0:
        return tier.bandwidth
    inner = topo.tiers[tier_index - 1].size or block
    k = max(1, math.ceil(block / inner))
    crossing = (1.0 + (stages - 1) * min(1.0, max(0.0, duty))) / max(1, stages)
    if op == "all_to_all":
        return tier.bandwidth * min(1.0, 1.0 / (tier.oversubscription * crossing))
    return tier.bandwidth * min(1.0, n / (k * tier.oversubscription * crossing))

