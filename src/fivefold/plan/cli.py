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
from pathlib import Path

from ..config import load_config
from ..grid import DEFAULT_ORDER
from ..rules import ConfigError, CpMode, Dtype, PartitionKind, Recompute, Schedule, SpMode, choices
from .estimate import estimate
from .layout import GradDtype, Layout, Workload, from_config
from .models import PRESETS, PlanModel, from_model_config, load_model
from .report import estimate_text, plot, search_dict, search_text, to_json
from .search import search
from .topology import ACCELERATORS, TOPOLOGIES, load_topology


def add_plan_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help=f"preset ({', '.join(PRESETS)}), a Hugging Face config.json, or a fivefold "
                                    f".toml (default llama3-8b)")
    ap.add_argument("--config", help="a fivefold training TOML: its model, layout and batch are the defaults")
    ap.add_argument("--gpus", type=int, help="GPU count (default: the product of the given degrees)")
    ap.add_argument("--topology", default="dgx-h100",
                    help=f"preset ({', '.join(TOPOLOGIES)}) or a .toml file (default dgx-h100)")
    ap.add_argument("--accelerator", choices=list(ACCELERATORS), help="replace the topology's accelerator")
    for name in ("tp", "pp", "dp", "cp", "ep", "zero", "vpp"):
        ap.add_argument(f"--{name}", type=int)
    ap.add_argument("--sp-mode", dest="sp_mode", choices=choices(SpMode),
                    help="Megatron sequence parallelism (default megatron when tp > 1)")
    ap.add_argument("--cp-mode", dest="cp_mode", choices=choices(CpMode),
                    help="context parallelism: Ulysses all-to-all, ring attention, or both (default: search them)")
    ap.add_argument("--ulysses", type=int, help="hybrid cp: Ulysses degree of the inner ranks (default the largest)")
    ap.add_argument("--seq", type=int, help="sequence length (default min(model max, 4096))")
    ap.add_argument("--global-batch", dest="global_batch", type=int, help="sequences per step (default 1024)")
    ap.add_argument("--micro-batch", dest="micro_batch", type=int, help="sequences per micro-batch")
    ap.add_argument("--recompute", choices=choices(Recompute))
    ap.add_argument("--schedule", choices=choices(Schedule), default=None)
    ap.add_argument("--order", help=f"rank order, innermost first (default {DEFAULT_ORDER})")
    ap.add_argument("--partition", help=f"layers to pipeline stages: {' | '.join(choices(PartitionKind))} | "
                                        f"counts like 3,5,5,3 (default even)")
    ap.add_argument("--uneven", action="store_true", help="the same as --partition llama3")
    ap.add_argument("--dtype", choices=choices(Dtype), default=None, help="weights and activations (bf16)")
    ap.add_argument("--grad-dtype", dest="grad_dtype", choices=choices(GradDtype), default="fp32",
                    help="gradient accumulation: fp32 main grads, or the weights' dtype")
    ap.add_argument("--no-flash", dest="flash", action="store_false", help="store the s^2 attention scores")
    ap.add_argument("--fp8-dispatch", dest="fp8_dispatch", action="store_true", help="MoE dispatch in FP8")
    ap.add_argument("--capacity-factor", dest="capacity_factor", type=float, default=1.0)
    ap.add_argument("--efficiency", type=float, default=0.6, help="fraction of peak FLOP/s kernels reach")
    ap.add_argument("--search", action="store_true", help="search even when every degree is given")
    ap.add_argument("--top", type=int, default=10, help="layouts to show when searching")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--plot", help="write a PNG of memory per component and bytes per tier")


def _base(args) -> tuple[PlanModel, Layout, Workload, dict]:
    """Model, default layout and workload, and the degrees the user fixed (from --config, then flags)."""
    fixed = {k: getattr(args, k) for k in ("tp", "pp", "dp", "cp", "ep", "zero", "vpp", "micro_batch", "recompute")}
    if args.config:
        cfg = load_config(args.config)
        model = from_model_config(cfg.model, name=Path(args.config).stem)
        layout, work = from_config(cfg)
        for k in fixed:
            if fixed[k] is None:
                fixed[k] = getattr(layout, k)
        work = replace(work, flash=args.flash)
    else:
        model = load_model(args.model or "llama3-8b")
        layout, work = Layout(), Workload(seq=min(model.max_seq, 4096), global_batch=1024)
    if args.model and args.config:
        model = load_model(args.model)
    work = replace(work, seq=args.seq or work.seq, global_batch=args.global_batch or work.global_batch,
                   dtype=args.dtype or (work.dtype if args.config else "bf16"), grad_dtype=args.grad_dtype,
                   flash=args.flash and work.flash, fp8_dispatch=args.fp8_dispatch,
                   capacity_factor=args.capacity_factor, efficiency=args.efficiency)
    return model, layout, work, fixed


def _complete(fixed: dict, gpus: int | None, model: PlanModel) -> bool:
    """Without --gpus, missing degrees are 1. With it, one missing degree of tp·pp·cp·dp is derived and
    two or more are searched. True when the layout is fully given (ep too, for a MoE model)."""
    deg = ("tp", "pp", "cp", "dp")
    missing = [d for d in deg if fixed[d] is None]
    if not gpus:
        for d in missing + ["ep"]:
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
    return all(fixed[d] is not None for d in deg) and (fixed["ep"] is not None or not model.moe)


def cmd_plan(args: argparse.Namespace) -> int:
    """Run `fivefold plan`; ConfigError propagates (the caller prints it)."""
    model, layout, work, fixed = _base(args)
    topo = load_topology(args.topology)
    if args.accelerator:
        topo = replace(topo, accelerator=ACCELERATORS[args.accelerator])
    full = _complete(fixed, args.gpus, model) and not args.search
    order = args.order or layout.order
    partition = args.partition or ("llama3" if args.uneven else layout.partition)
    if full:
        sp_mode = args.sp_mode or ("megatron" if fixed["tp"] > 1 and not args.config else layout.sp_mode)
        lay = Layout(tp=fixed["tp"], pp=fixed["pp"], dp=fixed["dp"], cp=fixed["cp"], ep=fixed["ep"] or 1,
                     zero=fixed["zero"] or 0, vpp=fixed["vpp"] or 1, micro_batch=fixed["micro_batch"] or 1,
                     recompute=fixed["recompute"] or "none", order=order, partition=partition, sp_mode=sp_mode,
                     cp_mode=args.cp_mode or layout.cp_mode, ulysses=args.ulysses or layout.ulysses,
                     bucket_mb=layout.bucket_mb,
                     reshard_after_forward=layout.reshard_after_forward,
                     schedule=args.schedule or ("interleaved" if (fixed["vpp"] or 1) > 1 else layout.schedule))
        est = estimate(model, lay, work, topo, args.gpus)
        if args.json:
            print(to_json(est.to_dict()))
        else:
            print(estimate_text(est))
        if args.plot:
            print(f"plot: {plot(est, args.plot)}", file=sys.stderr)
        return 0
    gpus = args.gpus
    if not gpus:
        raise ConfigError("searching needs --gpus (or give every degree: --tp --pp --cp --dp)")
    fixed.update(sp_mode=args.sp_mode, cp_mode=args.cp_mode)
    res = search(model, work, topo, gpus, fixed, top=args.top, order=order, partition=partition,
                 schedule=args.schedule or "1f1b")
    if args.json:
        print(to_json(search_dict(res)))
    else:
        print(search_text(res, args.top))
    if args.plot and res.best:
        print(f"plot: {plot(res.best[0], args.plot)}", file=sys.stderr)
    return 0 if res.best else 1
