"""`fivefold schedule`: simulate a pipeline schedule, print its bubble and memory, draw its timeline.

    fivefold schedule --pp 4 --microbatches 8 --schedule interleaved --vpp 2 --out tl.svg

Wire-up (cli.py): `add_schedule_args(sub.add_parser("schedule", help=...))`, then
`return cmd_schedule(args)`; bad input raises `fivefold.config.ConfigError`, which `main` reports.
"""
from __future__ import annotations

import argparse
import json

from ..rules import GPIPE, INTERLEAVED, ONE_F_ONE_B, ZB
from ..parallel.pipeline.schedules import SCHEDULES, Simulation, closed_form_bubble, simulate_schedule
from ..parallel.pipeline.spec import title

FORMULAS = {GPIPE: "(p-1)/(m+p-1)", ONE_F_ONE_B: "(p-1)/(m+p-1)", INTERLEAVED: "(p-1)/(v*m+p-1)",
            ZB: "(p-1)(F+I-W)/(m(F+I+W)+(p-1)(F+I-W))"}


def add_schedule_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    ap.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    ap.add_argument("--schedule", choices=SCHEDULES, default=ONE_F_ONE_B)
    ap.add_argument("--vpp", type=int, default=1, help="virtual stages per rank (interleaved only)")
    ap.add_argument("--microbatch-group", dest="microbatch_group", type=int, default=0,
                    help="interleaved: micro-batches per group N, pp..microbatches (0: pp)")
    ap.add_argument("--cost-f", dest="cost_f", type=float, default=1.0, help="forward time of one stage (1)")
    ap.add_argument("--cost-b", dest="cost_b", type=float, default=2.0, help="backward time of one stage (2)")
    ap.add_argument("--cost-i", dest="cost_i", type=float, default=1.0, help="input-grad backward, zb (1)")
    ap.add_argument("--cost-w", dest="cost_w", type=float, default=1.0, help="weight-grad backward, zb (1)")
    ap.add_argument("--comm", type=float, default=0.0, help="time of one point-to-point transfer (0)")
    ap.add_argument("--blocking", action="store_true",
                    help="time a runtime that waits for every send/recv batch at once (default: overlap)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--out", help="write the timeline drawing: F.svg (no dependency) or F.png (matplotlib)")


def summary(args: argparse.Namespace, sim: Simulation) -> dict:
    closed = None
    if args.comm == 0:
        closed = closed_form_bubble(args.schedule, args.pp, args.microbatches, args.vpp, args.cost_f, args.cost_b,
                                    args.cost_i, args.cost_w)
    costs = ({"F": args.cost_f, "I": args.cost_i, "W": args.cost_w} if args.schedule == ZB
             else {"F": args.cost_f, "B": args.cost_b})
    return {"schedule": args.schedule, "pp": args.pp, "microbatches": args.microbatches, "vpp": args.vpp,
            "microbatch_group": args.microbatch_group,
            "costs": costs, "comm": args.comm, "blocking": args.blocking, "makespan": sim.makespan,
            "bubble": sim.bubble, "closed_form_bubble": closed, "formula": FORMULAS[args.schedule],
            "ranks": [{"rank": r, "busy": sim.busy[r], "idle": sim.makespan - sim.busy[r],
                       "peak_in_flight": sim.peak_in_flight[r]} for r in range(args.pp)],
            "timeline": [[list(b) for b in row] for row in sim.timeline]}


def print_table(info: dict) -> None:
    costs = " ".join(f"{k}={v:g}" for k, v in info["costs"].items())
    print(f"schedule {info['schedule']}  pp={info['pp']}  microbatches={info['microbatches']}  vpp={info['vpp']}  "
          f"costs per stage {costs}  comm={info['comm']:g}  {'blocking' if info['blocking'] else 'overlap'}")
    line = f"makespan {info['makespan']:.4g}   bubble {info['bubble']:.2%}"
    if info["closed_form_bubble"] is not None:
        line += f"   (closed form {info['formula']} = {info['closed_form_bubble']:.2%})"
    print(line)
    note = f"; each chunk holds 1/{info['vpp']} of a rank's layers" if info["vpp"] > 1 else ""
    print(f"peak in flight = (micro-batch, chunk) pairs forwarded and not yet backward-complete{note}")
    print(f"{'rank':>4} {'busy':>9} {'idle':>9} {'peak in flight':>15}")
    for row in info["ranks"]:
        print(f"{row['rank']:>4} {row['busy']:>9.4g} {row['idle']:>9.4g} {row['peak_in_flight']:>15}")


def cmd_schedule(args: argparse.Namespace) -> int:
    sim = simulate_schedule(args.schedule, args.pp, args.microbatches, args.vpp, args.cost_f, args.cost_b,
                            args.cost_i, args.cost_w, args.comm, args.blocking, args.microbatch_group)
    info = summary(args, sim)
    if args.out:
        from ..train.timeline import write_timeline
        heading = title(args.schedule, args.pp, args.microbatches, args.vpp, args.microbatch_group)
        info["out"] = str(write_timeline(args.out, sim.timeline, heading, "cost units"))
    if args.json:
        print(json.dumps(info))
    else:
        print_table(info)
        if args.out:
            print(f"timeline written to {info['out']}")
    return 0
