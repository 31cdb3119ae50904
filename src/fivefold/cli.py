"""Command line: `fivefold train | plan | schedule`.

    fivefold train [--config F.toml] [--nproc N] [--dp --tp --pp --cp --cp-mode --ep --zero ...] [--steps K] [--out DIR]
    fivefold plan --model llama3-8b --gpus 64 --topology dgx-h100 [--tp --pp --dp ...] [--json]
    fivefold schedule --pp 4 --microbatches 8 --schedule 1f1b [--vpp V] [--out F.svg]
"""
from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Literal

from .config import ConfigError, field_type, load_config
from .rules import PartitionKind, choices

# flag -> dotted config key; each flag's type and choices come from the field's declared type
TRAIN_FLAGS = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep",
    "zero": "parallel.zero", "sp_mode": "parallel.sp_mode", "cp_mode": "parallel.cp_mode",
    "order": "parallel.order", "microbatches": "parallel.microbatches", "schedule": "parallel.schedule",
    "vpp": "parallel.vpp", "bucket_mb": "parallel.bucket_mb", "partition": "parallel.partition",
    "recompute": "train.recompute", "steps": "train.steps", "global_batch": "train.global_batch",
    "seq_len": "train.seq_len", "lr": "train.lr", "dtype": "train.dtype", "device": "train.device",
    "seed": "train.seed", "out": "train.out", "data": "train.data",
}
HELP = {
    "sp_mode": "Megatron sequence parallelism inside tp",
    "cp_mode": "context parallelism: Ulysses all-to-all, ring attention, or both (hybrid)",
    "order": "rank order, innermost first (default tp-cp-ep-dp-pp)",
    "partition": f"layers to pipeline stages: {' | '.join(choices(PartitionKind))} | counts like 3,5,5,3",
    "recompute": "activation checkpointing (pp)",
    "out": "output folder (metrics.jsonl, comm.json, run.json, checkpoint.pt)",
    "data": "text files, or token files (.u16/.bin, .u32, .npy)",
}


def flag_kwargs(kind) -> dict:
    """argparse keywords for a config field's type: Literal -> choices, list -> nargs."""
    if typing.get_origin(kind) is Literal:
        values = choices(kind)
        return {"type": type(values[0]), "choices": values}
    if typing.get_origin(kind) is list:
        return {"nargs": "+"}
    return {"type": kind}


def add_train_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="TOML file with [model], [parallel], [train] tables")
    ap.add_argument("--nproc", type=int, help="local gloo ranks to spawn (default: the layout's world size)")
    for flag, key in TRAIN_FLAGS.items():
        ap.add_argument(f"--{flag.replace('_', '-')}", dest=flag, help=HELP.get(flag),
                        **flag_kwargs(field_type(key)))
    ap.add_argument("--resume", help="checkpoint file or run folder to continue from")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any config key, e.g. --set model.hidden=256 (repeatable)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before local ranks are killed")


def resolve_train_config(args: argparse.Namespace, world: int | None = None):
    """The config from file + flags; when dp is not given it fills the world left by tp*cp*pp."""
    overrides = {key: getattr(args, flag) for flag, key in TRAIN_FLAGS.items()}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value.strip()
    cfg = load_config(args.config, overrides)
    p = cfg.parallel
    world = world or args.nproc
    if world and args.dp is None and p.world_size != world:
        other = p.tp * p.cp * p.pp
        if world % other:
            raise ConfigError(f"{world} ranks must divide by tp*cp*pp = {other}")
        p.dp = world // other
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    from .comm import CommLedger
    from .train.launch import init_torchrun, leave_torchrun, run_ranks, torchrun_env
    from .train.launch import resolve_device
    from .train.trainer import supported, train_rank

    env = torchrun_env()
    cfg = resolve_train_config(args, env[1] if env else None)
    out = cfg.train.out
    if env is not None:  # one rank of a torchrun job
        cfg.validate(env[1])
        supported(cfg)
        rank, world = init_torchrun(device=cfg.train.device)
        train_rank(rank, world, cfg.to_dict(), out, args.resume)
        leave_torchrun(0)   # does not return; a failure above propagates with its traceback as usual
    world = args.nproc or cfg.parallel.world_size
    cfg.validate(world)
    supported(cfg)                                          # before any rank starts: what the runtime
    resolve_device(cfg.train.device, "gloo" if world > 1 else None)   # does not run, a device it cannot use
    print(f"fivefold train: {world} rank(s), dp={cfg.parallel.dp} tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
          f"cp={cfg.parallel.cp} ep={cfg.parallel.ep} zero={cfg.parallel.zero}, "
          f"{cfg.model.num_params():,} parameters, {cfg.train.steps} steps -> {out}", file=sys.stderr)
    results = run_ranks(train_rank, world, (cfg.to_dict(), out, args.resume), timeout_s=args.timeout)
    hist = results[0]["history"]
    if hist:
        first, last = hist[0], hist[-1]
        print(f"loss {first['loss']:.4f} -> {last['loss']:.4f} over {len(hist)} steps")
    print("\ncommunication (all ranks):")
    print(CommLedger.read(Path(out) / "comm.json").table())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fivefold", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_train_args(sub.add_parser("train", help="train a model (embedded default when no config)"))
    from .parallel.pipeline.cli_schedule import add_schedule_args, cmd_schedule
    add_schedule_args(sub.add_parser("schedule", help="simulate and draw a pipeline schedule"))
    from .plan.cli import add_plan_args, cmd_plan
    add_plan_args(sub.add_parser("plan", help="estimate memory, traffic and step time of a layout, or search"))
    args = ap.parse_args(argv)
    try:
        if args.cmd == "train":
            return cmd_train(args)
        if args.cmd == "schedule":
            return cmd_schedule(args)
        if args.cmd == "plan":
            return cmd_plan(args)
    except ConfigError as e:
        print(f"fivefold: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a failing rank: its traceback is in the message
        from .train.launch import RankError

        if isinstance(e, (RankError, TimeoutError)):
            print(f"fivefold: {e}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
