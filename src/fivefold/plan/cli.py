"""`fivefold plan`: estimate one layout, or search the layouts for a GPU count.

With every structural degree given (tp, pp, cp, dp — one of them may be left for --gpus to fix — and
ep for a MoE model) it estimates that layout; with some left out it searches over them, and over ZeRO
stage, micro-batch size, virtual stages and recompute where those are not given either.

    fivefold plan --model llama3-405b --gpus 16384 --topology llama3 --tp 8 --pp 16 --zero 2 \\
        --seq 8192 --global-batch 2048 --vpp 4 --uneven
    fivefold plan --model mixtral-8x7b --gpus 256 --topology dgx-h100 --json
    fivefold plan --config run.toml --topology dgx-h100        # the model and layout of a training config
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ..config import ConfigError
from .estimate import estimate
from .layout import CP_MODES, RECOMPUTE, Layout, Workload, from_config
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
    ap.add_argument("--sp-mode", dest="sp_mode", choices=["none", "megatron"] + list(CP_MODES),
                    help="megatron (default when tp > 1), or ulysses/ring for cp")
    ap.add_argument("--seq", type=int, help="sequence length (default min(model max, 4096))")
    ap.add_argument("--global-batch", dest="global_batch", type=int, help="sequences per step (default 1024)")
    ap.add_argument("--micro-batch", dest="micro_batch", type=int, help="sequences per micro-batch")
    ap.add_argument("--recompute", choices=list(RECOMPUTE))
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb"], default=None)
    ap.add_argument("--order", help="rank order, innermost first (default tp-cp-ep-pp-dp)")
    ap.add_argument("--uneven", action="store_true", help="Llama-3 split: first and last stage one layer fewer")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="weights and activations (bf16)")
    ap.add_argument("--grad-dtype", dest="grad_dtype", choices=["fp32", "param"], default="fp32",
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
        from ..config import load_config
        cfg = load_config(args.config)
        model = from_model_config(cfg.model, name=Path(args.config).stem)
        layout, work = from_config(cfg)
        for k in ("tp", "pp", "dp", "cp", "ep", "zero", "vpp", "micro_batch"):
            if fixed[k] is None:
                fixed[k] = getattr(layout, k)
        work = replace(work, flash=args.flash)
    else:
        model = load_model(args.model or "llama3-8b")
        layout, work = Layout(order="tp-cp-ep-pp-dp"), Workload(seq=min(model.max_seq, 4096), global_batch=1024)
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
    sp_mode = args.sp_mode
    order = args.order or layout.order
    if full:
        lay = Layout(tp=fixed["tp"], pp=fixed["pp"], dp=fixed["dp"], cp=fixed["cp"], ep=fixed["ep"] or 1,
                     zero=fixed["zero"] or 0, vpp=fixed["vpp"] or 1, micro_batch=fixed["micro_batch"] or 1,
                     recompute=fixed["recompute"] or "none", order=order, uneven=args.uneven,
                     sp=(sp_mode == "megatron") if sp_mode else (fixed["tp"] > 1 and not args.config) or layout.sp,
                     cp_mode=sp_mode if sp_mode in CP_MODES else layout.cp_mode,
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
    if sp_mode in CP_MODES:
        fixed["cp_mode"] = sp_mode
    elif sp_mode is not None:
        fixed["sp"] = sp_mode == "megatron"
    res = search(model, work, topo, gpus, fixed, top=args.top, order=order, uneven=args.uneven,
                 schedule=args.schedule or "1f1b")
    if args.json:
        print(to_json(search_dict(res)))
    else:
        print(search_text(res, args.top))
    if args.plot and res.best:
        print(f"plot: {plot(res.best[0], args.plot)}", file=sys.stderr)
    return 0 if res.best else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m fivefold.plan.cli ...`), as `fivefold plan` will run it."""
    ap = argparse.ArgumentParser(prog="fivefold plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(ap)
    args = ap.parse_args(argv)
    try:
        return cmd_plan(args)
    except ConfigError as e:
        print(f"fivefold: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
