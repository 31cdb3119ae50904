"""`fivefold plan`: estimate one layout, or search the layouts for a GPU count.

With every structural degree given (tp, pp, cp, dp — one of them may be left for --gpus to fix — and
ep for a MoE model) it estimates that layout; with some left out it searches over them, and over ZeRO
stage, micro-batch size, virtual stages and recompute where those are not given either.

    fivefold plan --model llama3-405b --gpus 16384 --topology llama3 --tp 8 --pp 16 --zero 2 \\
        --seq 8192 --global-batch 2048 --vpp 4 --partition llama3
    fivefold plan --model mixtral-8x7b --gpus 256 --topology dgx-h100 --json
    fivefold plan --config run.toml --topology dgx-h100        # the model and layout of a training config
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from math import isfinite
from pathlib import Path

from ..config import field_doc, load_config
from ..flags import MICRO_BATCH_SIZE_HELP, add_renamed
from .. import rules
from ..grid import DEFAULT_ORDER
from ..rules import (INTERLEAVED, ConfigError, CpMode, Dtype, Offload, PartitionKind, Recompute,
                     PlannedScheduleKind, SpMode, LORA_TARGETS, check_count, check_lora_targets, check_real, choices)
from ..plan.estimate import estimate, fastest_order
from ..plan.units import layer_names
from ..plan.layout import GradDtype, Layout, ReduceDtype, Workload, check_route_nodes, mlp_widths
from ..plan.models import PRESETS, PlanModel, load_model
from ..plan.run import plan_of
from ..plan.reserve import FRAMEWORKS
from ..plan.report import estimate_text, plot, search_dict, search_text, to_json
from ..plan.search import MAX_GPUS, TIE, search
from ..plan.topology import ACCELERATORS, GB, TOPOLOGIES, GiB, Topology, load_topology
from ..plan.tiers import COPY_TIERS, placement


def about(key: str, default: str) -> str:
    """A plan flag's help: what its config key means (config.field_doc, written once), the key, and what the
    planner takes when the flag is left out."""
    return f"{field_doc(key)} ({key}; default: {default})"


def add_plan_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help=f"preset ({', '.join(PRESETS)}), a Hugging Face config.json (or its checkpoint "
                                    f"folder), or a fivefold .toml (default llama3-8b)")
    ap.add_argument("--config", help="a fivefold training TOML: its model, layout and batch are the defaults")
    ap.add_argument("--gpus", type=int, help="GPU count (default: the product of the given degrees)")
    ap.add_argument("--topology", default="dgx-h100",
                    help=f"preset ({', '.join(TOPOLOGIES)}), nodes:K (nodes of K GPUs, tiers intra and inter as "
                         f"comm.json names them) or a .toml file (default dgx-h100)")
    ap.add_argument("--accelerator", choices=list(ACCELERATORS), help="replace the topology's accelerator")
    searched = {"dp": "the GPUs left by the others; searched when two degrees are missing",
                "etp": "searched: 1 and tp", "ep": "searched (1 for a dense model)"}
    for name in ("tp", "pp", "dp", "cp", "ep", "etp", "zero", "vpp"):
        ap.add_argument(f"--{name}", type=int, help=about(f"parallel.{name}", searched.get(
            name, "searched unless every degree is given")))
    ap.add_argument("--sp-mode", dest="sp_mode", choices=choices(SpMode),
                    help=about("parallel.sp_mode", "megatron when tp > 1"))
    ap.add_argument("--cp-mode", dest="cp_mode", choices=choices(CpMode), help=about("parallel.cp_mode", "searched"))
    ap.add_argument("--ulysses", type=int, help=about("parallel.ulysses", "the largest"))
    ap.add_argument("--seq", type=int, help=about("train.seq_len", "min(max_seq, 4096); a config.json's max_seq is "
                                                                   "its max_position_embeddings"))
    ap.add_argument("--global-batch", dest="global_batch", type=int, help=about("train.global_batch", "1024"))
    ap.add_argument("--micro-batch-size", dest="micro_batch", type=int, help=MICRO_BATCH_SIZE_HELP.split(" (")[0]
                    + " (default: searched, or 1 for one layout)")
    add_renamed(ap)   # --micro-batch: one line naming --micro-batch-size
    ap.add_argument("--recompute", choices=choices(Recompute),
                    help=about("train.recompute", "searched; none for one layout"))
    ap.add_argument("--schedule", choices=choices(PlannedScheduleKind), default=None,
                    help=about("parallel.schedule", "1f1b, interleaved with --vpp > 1; searched when searching")
                    + "; dualpipe: DeepSeek-V3's bidirectional schedule, planned only (fivefold train does not run it)")
    ap.add_argument("--order", help=about("parallel.order", DEFAULT_ORDER))
    ap.add_argument("--partition", help=about("parallel.partition", "even"))
    ap.add_argument("--uneven", action="store_true", help="the same as --partition llama3")
    ap.add_argument("--dtype", choices=choices(Dtype), default=None, help="weights and activations (bf16)")
    ap.add_argument("--optimizer-dtype", dest="optimizer_dtype", choices=("fp32", "bf16"), default="fp32",
                    help="Adam's moments: fp32 with an fp32 master copy (default), or bf16 with none (NeMo's "
                         "distributed_fused_adam with dtype bf16, as NVIDIA's Nemotron-4 340B benchmark; needs "
                         "--dtype bf16)")
    ap.add_argument("--grad-dtype", dest="grad_dtype", choices=choices(GradDtype), default="fp32",
                    help="gradient accumulation: fp32 main grads, or the weights' dtype")
    ap.add_argument("--no-flash", dest="flash", action="store_false", help="store the s^2 attention scores")
    ap.add_argument("--fp8-dispatch", dest="fp8_dispatch", action="store_true", help=about("parallel.fp8_dispatch", "off"))
    ap.add_argument("--capacity-factor", dest="capacity_factor", type=float, default=1.0,
                    help=about("model.capacity_factor", "1.0"))
    ap.add_argument("--efficiency", type=float, default=0.6,
                    help="fraction of peak FLOP/s kernels reach (with --gemm shape: what large GEMMs reach)")
    ap.add_argument("--gemm", choices=("shape", "flat"), default="shape",
                    help="GEMM time by shape: roofline of arithmetic intensity plus a per-kernel floor (default), "
                         "or flat: every GEMM at --efficiency of peak")
    ap.add_argument("--document-length", dest="document_length", type=float, default=0.0,
                    help="train.document_mask: attention stays inside packed documents of this token-weighted "
                         "mean length, sum(len^2)/sum(len) (docs/data.md, Document masking; default 0: no mask)")
    ap.add_argument("--lora-rank", dest="lora_rank", type=int, default=None,
                    help=about("train.lora_rank", "the --config's, else 0"))
    ap.add_argument("--lora-targets", dest="lora_targets", nargs="+", default=None,
                    help=about("train.lora_targets", "wq wk wv wo gate up down"))
    ap.add_argument("--freeze", nargs="+", default=None, metavar="PATTERN",
                    help=about("train.freeze", "the --config's"))
    mech = ap.add_argument_group("mechanisms (docs/plan.md, Mechanisms)")
    mech.add_argument("--reduce-dtype", dest="reduce_dtype", choices=choices(ReduceDtype),
                      help="dtype of the data-parallel gradient reduction (default fp32; the weights' dtype "
                           "with --grad-dtype param)")
    mech.add_argument("--bucket-mb", dest="bucket_mb", type=float, help=about("parallel.bucket_mb", "25"))
    mech.add_argument("--overlap-grad-reduce", dest="overlap_grad_reduce", action=argparse.BooleanOptionalAction,
                      help=about("parallel.overlap_grad_reduce", "on; a --config plans what the runtime does"))
    mech.add_argument("--overlap-param-gather", dest="overlap_param_gather", action=argparse.BooleanOptionalAction,
                      help="ZeRO-1/2: gather updated parameters behind the next step's first forwards")
    mech.add_argument("--reduce-each-microbatch", dest="reduce_each_microbatch", action="store_true",
                      help=about("parallel.reduce_each_microbatch", "off"))
    mech.add_argument("--ep-overlap", dest="ep_overlap", action=argparse.BooleanOptionalAction,
                      help="MoE all-to-alls overlap another micro-batch's compute (DualPipe-style; one layout: off "
                           "unless given; a search: on for ep > 1 unless --no-ep-overlap)")
    mech.add_argument("--zero-prefetch", dest="zero_prefetch", type=int, help=about("parallel.zero_prefetch", "1"))
    mech.add_argument("--tp-overlap", dest="tp_overlap", action=argparse.BooleanOptionalAction,
                      help=about("parallel.tp_overlap", "on"))
    mech.add_argument("--head-first", dest="head_first", action=argparse.BooleanOptionalAction,
                      help="the final norm, head and MTP modules on the first stage with the embedding (DualPipe's "
                           "placement; pp > 1, vpp 1; one layout: off unless given; a search tries both for a model "
                           "with MTP modules unless given)")
    mech.add_argument("--moe-route-nodes", dest="moe_route_nodes", type=int,
                      help="node-limited routing: each token's experts on at most M nodes (DeepSeek-V3: 4)")
    mech.add_argument("--fp8-gemm", dest="fp8_gemm", action="store_true", help="linear-layer GEMMs at the FP8 peak")
    mech.add_argument("--fp8-act-cache", dest="fp8_act_cache", action="store_true",
                      help="cache the linear layers' inputs in FP8 for the backward")
    mech.add_argument("--microbatch-group", dest="microbatch_group", type=int,
                      help=about("parallel.microbatch_group", "pp"))
    mech.add_argument("--recompute-norm-mla", dest="recompute_norm_mla", action=argparse.BooleanOptionalAction,
                      help="recompute norms and MLA up-projections in the backward (DeepSeek-V3; one layout: off "
                           "unless given; a search tries both for an MLA model unless given)")
    mech.add_argument("--offload", choices=choices(Offload),
                      help=about("parallel.offload", "a --config's; a search tries cpu, then nvme, only when nothing "
                                                     "fits the device; none: never"))
    ap.add_argument("--framework", choices=FRAMEWORKS, default="fivefold",
                    help="whose training process the plan is for: its device reserve (CUDA context; DeepSpeed's "
                         "overlap_comm buckets; plan/reserve.py) (default fivefold)")
    ap.add_argument("--ds-bucket", dest="ds_bucket", type=float,
                    help="with --framework deepspeed: allgather_bucket_size = reduce_bucket_size, in elements "
                         "(default DeepSpeed's 5e8)")
    ap.add_argument("--search", action="store_true", help="search even when every degree is given")
    ap.add_argument("--top", type=int, default=10, help="layouts to show when searching")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--verbose", action="store_true",
                    help="searching: also what the branch and bound skipped and why (bound: ...), and rejection examples")
    ap.add_argument("--plot", help="write a plot of memory per component and bytes per tier, both in GiB; the suffix "
                                   "is the file type (.png, .svg, .pdf, ...)")


DEGREES = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "ulysses")   # each at most MAX_GPUS
SIZES = ("seq", "global_batch", "micro_batch")                # tokens, sequences: each at most MAX_SIZE
MAX_SIZE = 2**30    # about a billion tokens in a sequence or sequences in a batch: far past any run


def _flag(name: str) -> str:
    return "--micro-batch-size" if name == "micro_batch" else "--" + name.replace("_", "-")


def check_args(args: argparse.Namespace) -> None:
    """Every numeric option, before any work: one ConfigError naming the rule and the valid values.
    Counts are >= 1 and bounded (--gpus, each degree and the product tp*pp*dp*cp at most MAX_GPUS; sequence
    length and batch sizes at most MAX_SIZE), --zero 0..3, --efficiency in (0, 1], --capacity-factor >= 0
    (0: dropless); no NaN or infinity."""
    for name in ("gpus",) + DEGREES + SIZES:
        value = getattr(args, name, None)
        if value is not None:
            check_count(_flag(name), value, 1, MAX_SIZE if name in SIZES else MAX_GPUS)
    check_count("--top", args.top, 1)
    for name in ("moe_route_nodes", "microbatch_group"):
        if getattr(args, name) is not None:
            check_count(_flag(name), getattr(args, name), 0, MAX_GPUS if name == "moe_route_nodes" else MAX_SIZE)
    if args.zero_prefetch is not None:
        check_count("--zero-prefetch", args.zero_prefetch, 0, rules.MAX_PREFETCH)
    if args.bucket_mb is not None:
        check_real("--bucket-mb", args.bucket_mb, 0, meaning=" (MiB of gradients per reduction bucket)")
    if args.zero is not None:
        check_count("--zero", args.zero, 0, 3)
    if args.ds_bucket is not None:
        if args.framework != "deepspeed":
            raise ConfigError(f"--ds-bucket sizes DeepSpeed's buckets; it needs --framework deepspeed (got "
                              f"--framework {args.framework}); valid: --framework deepspeed --ds-bucket 2e8")
        check_real("--ds-bucket", args.ds_bucket, 0, 1e12, meaning=" (elements in each of DeepSpeed's allgather "
                                                                   "and reduce buckets; its default 5e8)")
    check_real("--efficiency", args.efficiency, 0, 1, meaning=" (the fraction of peak FLOP/s kernels reach)")
    check_real("--capacity-factor", args.capacity_factor, 0, low_open=False,
               meaning=" (MoE tokens per expert relative to perfect balance; 0: dropless)")
    check_real("--document-length", args.document_length, 0, low_open=False,
               meaning=" (tokens a document holds, sum(len^2)/sum(len); 0: no document mask)")
    product = _product(args)
    if product > MAX_GPUS:
        raise ConfigError(f"the given degrees need tp*pp*dp*cp = {product} GPUs, more than the planner's limit of "
                          f"{MAX_GPUS}; valid: a product of 1..{MAX_GPUS}")


def _product(args: argparse.Namespace) -> int:
    """tp*pp*dp*cp of the given degrees (the GPU count when --gpus is not given)."""
    product = 1
    for name in ("tp", "pp", "dp", "cp"):
        product *= getattr(args, name) or 1
    return product


def check_topology(topo: Topology) -> None:
    """The loaded topology's numbers, in its TOML units: tier sizes >= 1 (the outermost may be absent: the whole
    cluster), bandwidth > 0, latency >= 0, oversubscription >= 1, accelerator peaks, memory and HBM > 0, the
    host side (pcie_gbps, host_memory_gib, host_gbps, nvme_gbps) > 0; no tier named pcie or nvme."""
    where = f"topology {topo.name}"
    acc = topo.accelerator
    if not acc.peak_flops:
        raise ConfigError(f"{where}: accelerator {acc.name} has no peak_tflops; give at least one, e.g. bf16 = 989")
    for dtype, peak in acc.peak_flops.items():
        check_real(f"{where}: accelerator peak_tflops.{dtype}", _scaled(peak, 1e12), 0)
    check_real(f"{where}: accelerator memory_gib", _scaled(acc.memory, GiB), 0)
    check_real(f"{where}: accelerator hbm_gbps", _scaled(acc.hbm_bandwidth, GB), 0)
    check_real(f"{where}: accelerator context_mb", _scaled(acc.context_bytes, 1e6), 0, low_open=False,
               meaning=" (device MB the CUDA context and kernels hold; 0 on a CPU)")
    if not topo.tiers:
        raise ConfigError(f"{where} needs at least one [[tier]] (name, size, bandwidth_gbps)")
    for i, t in enumerate(topo.tiers):
        name = f"{where}: tier {i} ({t.name})"
        if t.size is not None or i < len(topo.tiers) - 1:
            check_count(f"{name} size", t.size, 1, None)
        check_real(f"{name} bandwidth_gbps", _scaled(t.bandwidth, GB), 0)
        check_real(f"{name} latency_us", _scaled(t.latency, 1e-6), 0, low_open=False)
        check_real(f"{name} oversubscription", t.oversubscription, 1, low_open=False, meaning=" (1: non-blocking)")
        check_real(f"{name} overlap", t.overlap, 0, 1, low_open=False, meaning=" (share of a collective hidden)")
        check_real(f"{name} loss", t.loss, 0, 0.5, low_open=False, meaning=" (share of frames lost each way)")
        check_real(f"{name} loss_recovery_us", _scaled(t.loss_recovery, 1e-6), 0, low_open=False)
        check_count(f"{name} mtu", t.mtu, 576, 65536)
        for op, latency, bandwidth in t.ops:
            check_real(f"{name} ops.{op}.bandwidth_gbps", _scaled(bandwidth, GB), 0)
            check_real(f"{name} ops.{op}.latency_us", _scaled(latency, 1e-6), 0, low_open=False)
    for dtype, rate in acc.attention_flops.items():
        check_real(f"{where}: accelerator attention_tflops.{dtype}", _scaled(rate, 1e12), 0)
    # the host side of one GPU (offload)
    check_real(f"{where}: accelerator pcie_gbps", _scaled(acc.pcie_bandwidth, GB), 0,
               meaning=" (GPU <-> host bytes/s each way)")
    check_real(f"{where}: accelerator host_memory_gib", _scaled(acc.host_memory, GiB), 0,
               meaning=" (host RAM per GPU)")
    check_real(f"{where}: accelerator host_gbps", _scaled(acc.host_bandwidth, GB), 0,
               meaning=" (host memory bandwidth per GPU)")
    check_real(f"{where}: accelerator nvme_gbps", _scaled(acc.nvme_bandwidth, GB), 0,
               meaning=" (local NVMe bandwidth per GPU)")
    for i, t in enumerate(topo.tiers):
        if t.name in COPY_TIERS:
            raise ConfigError(f"{where}: tier {i} is named {t.name!r}, the name of the accelerator's own link that "
                              f"offload copies use; rename the tier (reserved: {', '.join(COPY_TIERS)})")
    check_real(f"{where}: accelerator layer_overhead_us", _scaled(acc.layer_overhead, 1e-6), 0, low_open=False)
    check_real(f"{where}: accelerator action_overhead_us", _scaled(acc.action_overhead, 1e-6), 0, low_open=False)
    check_real(f"{where}: accelerator ranks_per_core", acc.ranks_per_core, 1, low_open=False,
               meaning=" (local ranks sharing one core; 1: a core or device each)")
    check_real(f"{where}: accelerator fresh_gbps", _scaled(acc.fresh_bandwidth, GB), 0, low_open=False,
               meaning=" (first-touch bandwidth of fresh host pages; 0: not charged)")
    check_real(f"{where}: accelerator elementwise", acc.elementwise, 0, 1, low_open=False,
               meaning=" (share of element-wise traffic paid; 1: eager, unfused)")


def _scaled(value, unit: float):
    """value / unit for a number (the TOML's unit), anything else as it is (for the type error)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return value / unit if ok and isfinite(value) else value


def _topology(args: argparse.Namespace) -> Topology:
    """--topology (and --accelerator), checked; a malformed TOML is a ConfigError too."""
    try:
        topo = load_topology(args.topology)
    except ConfigError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError) as e:   # TOML syntax, a value of the wrong type
        raise ConfigError(f"topology {args.topology}: cannot read it ({type(e).__name__}: {e}); see "
                          f"docs/plan.md for the form") from None
    if args.accelerator:
        topo = replace(topo, accelerator=ACCELERATORS[args.accelerator])
    check_topology(topo)
    gpus = args.gpus or _product(args)
    if topo.max_gpus is not None and gpus > topo.max_gpus:
        what = "--gpus" if args.gpus else "tp*pp*dp*cp"
        raise ConfigError(f"{what} must be at most the {topo.max_gpus} GPUs of topology {topo.name}, got {gpus}; "
                          f"valid: 1..{topo.max_gpus}")
    return topo


def _base(args) -> tuple[PlanModel, Layout, Workload, dict]:
    """Model, default layout and workload, and the degrees the user fixed (from --config, then flags)."""
    fixed = {k: getattr(args, k, None) for k in ("tp", "pp", "dp", "cp", "ep", "etp", "zero", "vpp", "micro_batch",
                                                  "recompute", "offload")}
    if args.config:
        cfg = training_config(args.config)
        cfg.validate()   # a config the runtime would refuse plans nothing (rules.py; any world size)
        run = plan_of(cfg, name=Path(args.config).stem)
        model, layout, work = run.model, run.layout, run.work
        for k in fixed:
            if fixed[k] is None and (k != "offload" or layout.offload != "none"):   # a search may still offload
                fixed[k] = getattr(layout, k)
        work = replace(work, flash=args.flash)
    else:
        model = load_model(args.model or "llama3-8b")
        layout, work = Layout(), Workload(seq=min(model.max_seq, 4096), global_batch=1024)
    if args.model and args.config:
        model = load_model(args.model)
    model = with_lora(model, args)
    dtype = args.dtype or (work.dtype if args.config else "bf16")
    reduce_dtype = args.reduce_dtype or ("fp32" if args.grad_dtype == "fp32" or dtype == "fp32" else dtype)
    work = replace(work, seq=args.seq or work.seq, global_batch=args.global_batch or work.global_batch,
                   dtype=dtype, grad_dtype=args.grad_dtype, reduce_dtype=reduce_dtype,
                   flash=args.flash and work.flash, fp8_dispatch=args.fp8_dispatch,
                   capacity_factor=args.capacity_factor, efficiency=args.efficiency, gemm=args.gemm,
                   document_length=args.document_length,
                   moe_route_nodes=args.moe_route_nodes or work.moe_route_nodes,
                   fp8_gemm=args.fp8_gemm or work.fp8_gemm, fp8_act_cache=args.fp8_act_cache or work.fp8_act_cache,
                   framework=args.framework, ds_bucket=args.ds_bucket or 0.0,
                   optimizer_dtype=args.optimizer_dtype)
    if work.optimizer_dtype == "bf16":
        if work.dtype != "bf16":
            raise ConfigError(f"--optimizer-dtype bf16 keeps no master copy, so the weights must be bf16 too (got "
                              f"--dtype {work.dtype}); valid: --dtype bf16 --optimizer-dtype bf16, or --optimizer-dtype fp32")
        if fixed.get("offload") not in (None, "none"):
            raise ConfigError(f"--optimizer-dtype bf16 is planned on the device only (offload plans fp32 state); "
                              f"valid: --offload none, or --optimizer-dtype fp32 --offload {fixed['offload']}")
        fixed["offload"] = "none"
    return model, layout, work, fixed


def with_lora(model: PlanModel, args) -> PlanModel:
    """`model` with --lora-rank / --lora-targets / --freeze applied (unset: as it came, a --config's
    included)."""
    if getattr(args, "freeze", None):
        model = replace(model, frozen=tuple(args.freeze))
        try:
            layer_names(model, 0)
        except ValueError as e:
            raise ConfigError(f"--freeze: {e}") from None
    if getattr(args, "lora_rank", None) is None and getattr(args, "lora_targets", None) is None:
        return model
    rank = model.lora_rank if args.lora_rank is None else args.lora_rank
    check_count("--lora-rank", rank, 0)
    targets = args.lora_targets or model.lora_targets or LORA_TARGETS
    if not rank:
        return replace(model, lora_rank=0, lora_targets=())
    return replace(model, lora_rank=rank, lora_targets=check_lora_targets(targets))


def training_config(path: str):
    """--config: a fivefold training TOML, read and checked (a Hugging Face config.json belongs to --model)."""
    if Path(path).suffix.lower() == ".json":
        raise ConfigError(f"--config takes a fivefold training TOML, got the JSON file {path}; a Hugging Face "
                          f"config.json goes to --model")
    cfg = load_config(path)
    cfg.model.validate()
    return cfg


def check_seq(work: Workload, model: PlanModel, source: str) -> None:
    """The sequence fits the model's positions (rules.check_seq_len, as Config.validate checks a run's):
    nothing else bounded the planner, which planned a billion tokens at 120% MFU. `source` names where the
    length came from (--seq, a --config's train.seq_len)."""
    rules.check_seq_len(work.seq, model.max_seq, source, f"model {model.name}", "max_seq")


def check_plot(path: str | None) -> None:
    """--plot names a file, in a folder that exists, of a format matplotlib writes, with matplotlib installed:
    checked before the search, not after it (a folder or a bare name was saved as NAME.png, an unknown
    suffix was a traceback)."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--plot {path} is a folder; give a file name in it, e.g. --plot {p / 'plan.png'}")
    if not p.resolve().parent.is_dir():
        raise ConfigError(f"--plot {path}: the folder {p.resolve().parent} does not exist; create it or "
                          f"give a path in an existing folder")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ConfigError(f"--plot needs matplotlib; {rules.install_hint('plot')}") from None
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if p.suffix.lower().lstrip(".") not in formats:
        raise ConfigError(f"--plot {path}: the file type is the suffix, one of {', '.join(formats)}; got "
                          f"{p.suffix or 'none'}")


def mechanism_options(args, layout: Layout) -> dict:
    """The Layout's mechanism fields: flags where given, else the base layout's (a --config's: what the
    runtime does; otherwise Layout's defaults, what production stacks do)."""
    pick = {k: getattr(args, k) for k in ("overlap_grad_reduce", "overlap_param_gather", "bucket_mb",
                                          "microbatch_group")}
    out = {k: getattr(layout, k) if v is None else v for k, v in pick.items()}
    out["ep_overlap"] = layout.ep_overlap if args.ep_overlap is None else args.ep_overlap
    out["recompute_norm_mla"] = layout.recompute_norm_mla if args.recompute_norm_mla is None else args.recompute_norm_mla
    out["head_first"] = layout.head_first if args.head_first is None else args.head_first
    out["tp_overlap"] = layout.tp_overlap if args.tp_overlap is None else args.tp_overlap
    out["zero_prefetch"] = layout.zero_prefetch if args.zero_prefetch is None else args.zero_prefetch
    out["reduce_each_microbatch"] = args.reduce_each_microbatch or layout.reduce_each_microbatch
    return out


def check_fixed(model: PlanModel, fixed: dict, gpus: int | None, work: Workload, sp_mode: str | None,
                partition: str) -> None:
    """The degrees the user fixed, each against the model's rules (rules.py, as every layout is checked), and
    their product against --gpus, before a search: a search in which every layout breaks one rule answered
    "no layout fits; rejected, by reason: rule 84", and --ep 2 on a dense model failed inside the search
    naming a dp*cp the user never gave."""
    tp, pp, vpp, ep = fixed["tp"], fixed["pp"], fixed["vpp"], fixed["ep"]
    if tp is not None:
        rules.check_tensor_parallel(tp, model.heads, None if model.mla else model.kv_heads, mlp_widths(model))
        rules.check_sequence_parallel(sp_mode or "none", tp, work.seq)
    if pp is not None or vpp is not None:
        rules.check_pipeline_layers(model.layers, pp or 1, vpp or 1)
    if ep is not None:
        rules.check_experts(ep, model.experts)
    if fixed["etp"] is not None:
        rules.check_expert_tensor_parallel(fixed["etp"], model.experts, model.moe_ffn)
    if pp is not None and vpp is not None:
        rules.check_virtual_stages(pp, vpp)
    if pp is not None and partition not in choices(PartitionKind):
        counts = len(rules.parse_counts(partition)) if any(c.isdigit() for c in partition) else pp
        rules.check_partition(model.layers, pp, vpp or max(1, counts // pp), partition)
    if fixed["micro_batch"] is not None:
        rules.check_global_batch(work.global_batch, fixed["dp"] or 1, fixed["micro_batch"], what="micro_batch")
    check_route_nodes(model, work)
    given = {d: fixed[d] for d in ("tp", "pp", "cp", "dp") if fixed[d] is not None}
    product = 1
    for v in given.values():
        product *= v
    if gpus and gpus % product:
        names = "*".join(given)
        near = [product * k for k in range(max(1, gpus // product - 1), gpus // product + 3)]
        raise ConfigError(f"--gpus {gpus} must divide by the given degrees {names} = {product}; valid --gpus: "
                          f"{rules.nearest(gpus, near)}")


def _complete(fixed: dict, gpus: int | None, model: PlanModel) -> bool:
    """Without --gpus, missing degrees are 1. With it, one missing degree of tp·pp·cp·dp is derived and
    two or more are searched. True when the layout is fully given (ep too, for a MoE model)."""
    deg = ("tp", "pp", "cp", "dp")
    missing = [d for d in deg if fixed[d] is None]
    if not gpus:
        for d in missing + ["ep", "etp"]:
            fixed[d] = fixed[d] or 1
        return True
    if len(missing) == 1:
        rest = 1
        for d in deg:
            if d != missing[0]:
                rest *= fixed[d]
        if gpus % rest:
            raise ConfigError(f"--gpus {gpus} must divide by the product of the given degrees ({rest}); "
                              f"leave out one of --tp --pp --cp --dp to derive it")
        fixed[missing[0]] = gpus // rest
    if all(fixed[d] is not None for d in deg) and fixed["ep"] is not None and fixed["etp"] is None:
        fixed["etp"] = 1   # ep given without etp: whole experts (etp is searched only beside a searched ep)
    return all(fixed[d] is not None for d in deg) and (fixed["ep"] is not None or not model.moe)


def cmd_plan(args: argparse.Namespace) -> int:
    """Run `fivefold plan`; ConfigError propagates (the caller prints it)."""
    check_args(args)
    check_plot(args.plot)
    topo = _topology(args)
    model, layout, work, fixed = _base(args)
    # the collectives' algorithms: the topology's (NCCL's on GPUs, gloo's on a CPU calibration; comm/volume.py)
    work = replace(work, backend=topo.backend)
    check_seq(work, model, "--seq" if args.seq else f"train.seq_len of --config {args.config}" if args.config
              else "the sequence length")
    if model.moe:   # beyond experts/top_k every expert already takes every token of a sequence
        check_real("--capacity-factor", args.capacity_factor, 0, model.experts / model.top_k, low_open=False,
                   meaning=f" (the top is experts/top_k = {model.experts}/{model.top_k}: every expert takes every "
                           f"token; 0: dropless)")
    order = args.order or layout.order
    partition = args.partition or ("llama3" if args.uneven else layout.partition)
    check_fixed(model, fixed, args.gpus, work, args.sp_mode, partition)
    if args.schedule is not None and fixed["vpp"] is not None:   # the rule single-layout mode applies, in both
        rules.check_vpp_schedule(args.schedule, fixed["vpp"])
    full = _complete(fixed, args.gpus, model) and not args.search
    if full:
        sp_mode = args.sp_mode or ("megatron" if fixed["tp"] > 1 and not args.config else layout.sp_mode)
        lay = Layout(tp=fixed["tp"], pp=fixed["pp"], dp=fixed["dp"], cp=fixed["cp"], ep=fixed["ep"] or 1,
                     etp=fixed["etp"] or 1, zero=fixed["zero"] or 0, vpp=fixed["vpp"] or 1, micro_batch=fixed["micro_batch"] or 1,
                     recompute=fixed["recompute"] or "none", offload=fixed["offload"] or "none", order=order,
                     partition=partition, sp_mode=sp_mode,
                     cp_mode=args.cp_mode or layout.cp_mode, ulysses=args.ulysses or layout.ulysses,
                     reshard_after_forward=layout.reshard_after_forward, **mechanism_options(args, layout),
                     schedule=args.schedule or (INTERLEAVED if (fixed["vpp"] or 1) > 1 else layout.schedule))
        est = estimate(model, lay, work, topo, args.gpus)
        faster = faster_order(est, model, work, topo, args)
        if args.json:
            print(to_json(with_faster(est.to_dict(), faster)))
        else:
            print(estimate_text(est, faster=faster))
        write_plot(est, args.plot)
        return 0
    gpus = args.gpus
    if not gpus:
        raise ConfigError("searching needs --gpus (or give every degree: --tp --pp --cp --dp)")
    check_searchable(args)
    fixed.update(sp_mode=args.sp_mode, cp_mode=args.cp_mode, ep_overlap=args.ep_overlap,
                 recompute_norm_mla=args.recompute_norm_mla, head_first=args.head_first)
    res = search(model, work, topo, gpus, fixed, top=args.top, order=order, partition=partition,
                 schedule=args.schedule)
    for e in res.best:
        own_order(e, args)
    faster = faster_order(res.best[0], model, work, topo, args) if res.best else None
    if args.json:
        print(to_json(with_faster(search_dict(res), faster)))
    else:
        print(search_text(res, args.top, verbose=args.verbose, faster=faster))
    if res.best:
        write_plot(res.best[0], args.plot)
    return 0 if res.best else 1


ONE_LAYOUT = ("ulysses", "bucket_mb", "overlap_grad_reduce", "overlap_param_gather", "microbatch_group",
              "reduce_each_microbatch", "zero_prefetch", "tp_overlap")   # Layout fields a search holds at their defaults


def check_searchable(args: argparse.Namespace) -> None:
    """A search builds its layouts with Layout's defaults for the mechanism flags of ONE_LAYOUT (it tries both
    gradient reductions itself; ep_overlap and recompute_norm_mla are search dimensions, held where given),
    so those flags apply only to one layout: given to a search they were silently ignored, the plan the
    same with or without them. Refused, naming the flag."""
    for name in ONE_LAYOUT:
        value = getattr(args, name)   # store_true flags are False when not given; --[no-]overlap-* are None
        if value is not None and (value is not False or name.startswith("overlap_") or name == "tp_overlap"):
            flag = ("--no-" if value is False else "--") + name.replace("_", "-")
            raise ConfigError(f"{flag} sets a mechanism of one layout, which a search does not vary (it keeps "
                              f"Layout's defaults); give every degree (--tp --pp --cp --dp, and --ep for a MoE "
                              f"model) to estimate that layout with it, or leave {flag} out to search")


def planners_order(args: argparse.Namespace) -> bool:
    """The rank order is the planner's own default: neither --order nor a --config (whose order, given or
    not, is the one the runtime will run) chose it."""
    return not args.order and not args.config


def own_order(est, args: argparse.Namespace) -> None:
    """No warning about an order nobody chose: the planner's default is not the user's mistake (where another
    order is faster, `faster_order` says so, with its step time)."""
    if planners_order(args):
        est.warnings = [w for w in est.warnings if not w.startswith("order ")]


def faster_order(est, model: PlanModel, work: Workload, topo: Topology, args: argparse.Namespace):
    """With the planner's default order: the same layout in the fastest order by estimate (`estimate.
    fastest_order`: every distinct placement of the groups on the tiers, the byte-ranked recommendation
    first) where that puts some group on another tier and is faster by more than the search's tie
    (search.TIE); else None."""
    own_order(est, args)
    if not planners_order(args):
        return None
    order, alt = fastest_order(model, est.layout, work, topo, args.gpus, first=est.recommended_order)
    if order == est.layout.order or placement(est.layout, topo, order) == est.placement:
        return None
    return alt if alt.time.step_time_s * (1 + TIE) < est.time.step_time_s else None


def with_faster(d: dict, faster) -> dict:
    """The JSON's "faster_order": the recommended order's step time and MFU where it beats the default's."""
    if faster is not None:
        d["faster_order"] = {"order": faster.layout.order, "step_time_s": faster.time.step_time_s,
                             "mfu": faster.time.mfu, "placement": faster.placement}
    return d


def write_plot(est, path: str | None) -> None:
    """--plot: the file (its folder and type were checked before any work), its path on stderr."""
    if not path:
        return
    try:
        print(f"plot: {plot(est, path)}", file=sys.stderr)
    except OSError as e:
        raise ConfigError(f"--plot {path}: cannot write it ({e.strerror or e}); give a path you may write") from None
