"""Benchmark: does `fivefold plan` predict a real `fivefold train` step on this machine?

Each layout below trains one small model (hidden 256, 8 heads / 4 KV heads, ffn 704, vocab 256, seq 128,
global batch 16, fp32) with the real `Trainer` on local gloo ranks (`run_ranks`, one intra-op thread
per rank, as `fivefold train --nproc N`), for a few warm-up steps and then `--steps` timed ones. The
same config goes to the planner (`plan.run.plan_of`: `plan.layout.from_config`, `plan.models.from_model_config`,
`plan.estimate.estimate`) with efficiency 1.0 and the topology `fivefold calibrate` measured for that
many ranks (calibrated at the start, or `--topology FILE`, repeatable, one per rank count, or with
`--calibrate-each` just before each layout runs: this machine's speed drifts by 10-25% within minutes, so
a calibration taken minutes before a run misjudges it).

Measured per step (slowest rank, then the median over steps and over `--rounds` fresh spawns):
- step: the trainer's own step seconds (forward/backward, gradient engine, norm, optimizer, stop vote);
- comm: seconds inside fivefold.comm calls per ledger dimension (issue + wait: what a rank did not
  compute), the counterpart of the planner's exposed layer / grad / step communication;
- opt: seconds of the gradient engine's optimizer step (the planner's optimizer term);
- bubble (pp): idle share of the pipeline runtime's compute timeline (F/B blocks, every pp rank), as
  OUT/pipeline.json reports it;
- after the timed steps, one step under torch.profiler: self CPU seconds of GEMMs, of the attention core
  and of every other aten op (the terms the planner's compute does and does not count).

The machine's own speed drifts between the calibration and the run (a calibration's GEMMs have read 64.8-82.6
GFLOP/s a rank within one hour), so every run also times one reference GEMM (`PROBE_SHAPE`, F.linear forward
+ backward, fp32, all ranks in one window as the calibration times its grid) inside the run, after its
warm-up and after its timed steps (the mean), and the calibration's memory probe (an in-place add of two
64 MiB tensors). speed = the calibrated topology's own time for that GEMM (its GEMM curve, plan/gemm.py,
fitted over the calibration's whole grid) over the run's (below 1: the run's machine was slower than
calibrated), memory speed = the run's add bandwidth over the topology's `hbm_gbps` (which read 11.4-24.4 GB/s
a rank in one campaign); "at run speed" plans the row again with every compute rate of the calibrated
accelerator times speed, its fixed per-op costs over it and its memory bandwidths times memory speed
(`at_speed`; the collective fits as calibrated). The plain ratio is the planner against the minute before; the ratio at run speed is the
planner's terms against the run, with the machine's drift taken out by a measurement, not a fit. (A probe
timed on fresh ranks right after the calibration read 13.8-28.6 ms for the same GEMM in one campaign: one
short window in a fresh process is noisier than the curve.)

Printed per layout: predicted and measured step, ratio predicted / measured (goal 0.8-1.25), the speed and
the ratio at run speed, predicted and measured bubble (goal within 10 points), then both breakdowns. The machine is shared: before every spawn
the script waits for a 1-minute load average below `--max-load`, and a spawn during which other processes
took CPU (`tools.calibrate.ForeignLoad`, from /proc/stat) is repeated, up to `--tries` times. Calibrated
topologies and results.json go to `--out`.

    OMP_NUM_THREADS=1 python benchmarks/plan_vs_run.py [--steps 8] [--rounds 2] [--topology local2.toml]
        [--calibrate-each] [--quick-calibration] [--only dp2,pp2-1f1b] [--out runs/plan_vs_run]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import common  # puts src/ on the path

from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig

MODEL = dict(vocab=256, hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, max_seq=128)
GLOBAL_BATCH, SEQ = 16, 128

# name -> (parallel config, model overrides)
LAYOUTS = {
    "dp2": (dict(dp=2, microbatches=2), {}),
    "zero3-dp2": (dict(dp=2, zero=3, microbatches=2), {}),
    "tp2": (dict(tp=2, microbatches=2), {}),
    "tp2-sp": (dict(tp=2, sp_mode="megatron", microbatches=2), {}),
    "pp2-1f1b": (dict(pp=2, microbatches=8), {}),
    "pp2-interleaved-v2": (dict(pp=2, vpp=2, schedule="interleaved", microbatches=8), {}),
    "pp4-1f1b": (dict(pp=4, microbatches=8), {}),
    "pp4-interleaved-v2": (dict(pp=4, vpp=2, schedule="interleaved", microbatches=8), dict(layers=8)),
}


def make_config(parallel: dict, model: dict, steps: int) -> Config:
    return Config(model=ModelConfig(**{**MODEL, **model}), parallel=ParallelConfig(**parallel),
                  train=TrainConfig(steps=steps, global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32",
                                    warmup=1, checkpoint=False, data_limit_mb=1.0))


# -- measured ---------------------------------------------------------------------------------------
def _comm_seconds(ledger) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in ledger.rows():
        out[row["dim"]] = out.get(row["dim"], 0.0) + row["seconds"]
    return out


def _timed_optimizer(engine, record: list) -> None:
    """Record the seconds of each engine.step (the optimizer update) in `record`."""
    step = engine.step

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        step(*args, **kwargs)
        record.append(time.perf_counter() - t0)
    engine.step = timed


def _bubble(trainer, pipe) -> float | None:
    """Idle share of the last step's compute timeline over the pp group of rank 0 (every rank calls)."""
    from fivefold.comm import gather_objects
    from fivefold.parallel.pipeline.schedules import timeline_stats

    rows = gather_objects([tuple(b) for b in pipe.runtime.timeline])
    return timeline_stats([rows[r] for r in trainer.mesh["pp"].ranks])["bubble"]


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null for the block (the profiler's C++ start/stop lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def profile_step(trainer, k: int) -> dict:
    """One more step under torch.profiler (after the timed ones): seconds of GEMMs, attention-core
    kernels and every other aten op (self CPU time); the rest of a step is Python, autograd bookkeeping and
    waiting. The profiled step's wall time is kept but means little (profiler start and stop)."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(k)
    wall = time.perf_counter() - t0
    out = {"gemm": 0.0, "attention": 0.0, "other_ops": 0.0}
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        kind = "gemm" if e.key in GEMM_OPS else ("attention" if "scaled_dot_product" in e.key else "other_ops")
        out[kind] += e.self_cpu_time_total / 1e6
    out["wall"] = wall
    return out


PROBE_SHAPE = (1024, 256, 704)   # tokens, k, n: the MLP's up projection at a micro-batch of 8 x 128 tokens
PROBE_BLOCKS = 20                 # the window: 20 blocks of 30 ms of a rank's share of the cores
PROBE_MIB = 64                    # the memory probe: an in-place add of two such fp32 tensors (the full
                                  # calibration's size; --quick calibrates with 32)


def speed_probe(world: int) -> tuple[float, float]:
    """(seconds of one F.linear forward + backward at PROBE_SHAPE, fp32; bytes/s of an in-place add of two
    PROBE_MIB tensors, 3 streams) on this rank, every rank through one shared window each
    (`calibrate._windowed`, as the calibration times its GEMM grid and `hbm_gbps`)."""
    import torch
    import torch.distributed as dist

    from fivefold.tools.calibrate import MiB, _linear_step, _windowed, usable_cores, window_s

    window = window_s(PROBE_BLOCKS, world, usable_cores())
    step, _ = _linear_step(*PROBE_SHAPE, torch.float32)
    gemm = _windowed(step, window, dist.barrier)
    a, b = torch.ones(PROBE_MIB * MiB // 4), torch.ones(PROBE_MIB * MiB // 4)
    return gemm, 3 * PROBE_MIB * MiB / _windowed(lambda: a.add_(b), window, dist.barrier)


def planned_probe_s(topo) -> float:
    """The calibrated topology's seconds for `speed_probe`'s GEMM: forward + backward, three GEMMs of the
    curve (plan/gemm.py, as `fivefold calibrate` fits it)."""
    from fivefold.plan.gemm import gemm_seconds

    a = topo.accelerator
    t, k, n = PROBE_SHAPE
    return 3 * gemm_seconds(t, n, k, a.peak_flops["fp32"], a.hbm_bandwidth, 4, a.gemm_kernel or 0.0)


def bench_rank(rank: int, world: int, cfg_dict: dict, warmup: int) -> dict:
    """Train warmup + timed steps; per timed step: seconds, comm seconds per dim, optimizer seconds, bubble.
    `speed_probe` after the warm-up and after the timed steps (their mean). Then one profiled step (not
    timed)."""
    from fivefold.train.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    cfg.train.steps += 1                       # the profiled step
    trainer = Trainer(cfg, rank, world, quiet=True)
    opt: list[float] = []
    _timed_optimizer(trainer.engine, opt)
    pipe = next((d for d in trainer.dims if hasattr(d, "runtime")), None)
    steps, probes = [], []
    for k in range(trainer.cfg.train.steps - 1):
        if k == warmup:
            probes.append(speed_probe(world))
        before = _comm_seconds(trainer.ledger)
        m = trainer.step(k)
        after = _comm_seconds(trainer.ledger)
        row = {"seconds": m["seconds"], "opt": opt[-1] if opt else 0.0,
               "comm": {d: after[d] - before.get(d, 0.0) for d in after if after[d] - before.get(d, 0.0) > 0}}
        if pipe is not None:
            row["bubble"] = _bubble(trainer, pipe)
        if k >= warmup:
            steps.append(row)
    probes.append(speed_probe(world))
    return {"steps": steps, "probe_s": statistics.mean(p[0] for p in probes),
            "probe_bw": statistics.mean(p[1] for p in probes), "profile": profile_step(trainer, trainer.cfg.train.steps - 1)}


def combine(per_rank: list[dict]) -> dict:
    """Per step the slowest rank (step, comm per dim, optimizer), then the median over steps."""
    n = len(per_rank[0]["steps"])
    steps = [[r["steps"][i] for r in per_rank] for i in range(n)]
    dims = sorted({d for ranks in steps for r in ranks for d in r["comm"]})
    out = {"step_s": statistics.median(max(r["seconds"] for r in ranks) for ranks in steps),
           "opt_s": statistics.median(max(r["opt"] for r in ranks) for ranks in steps),
           "comm_s": {d: statistics.median(max(r["comm"].get(d, 0.0) for r in ranks) for ranks in steps)
                      for d in dims}}
    if "bubble" in per_rank[0]["steps"][0]:
        out["bubble"] = statistics.median(s[0]["bubble"] for s in steps)
    out["profile"] = {k: max(r["profile"][k] for r in per_rank) for k in per_rank[0]["profile"]}
    out["probe_s"] = statistics.median(r["probe_s"] for r in per_rank)     # over ranks, as calibrate takes
    out["probe_bw"] = statistics.median(r["probe_bw"] for r in per_rank)   # its GEMM and add figures
    return out


def wait_quiet(max_load: float, limit_s: float = 900) -> float:
    """Poll the 1-minute load average until it is below max_load (or limit_s passed); return it."""
    t0 = time.monotonic()
    while True:
        load = float(Path("/proc/loadavg").read_text().split()[0])
        if load < max_load or time.monotonic() - t0 > limit_s:
            return load
        time.sleep(5)


def quiet_round(cfg: Config, world: int, warmup: int, max_load: float, tries: int) -> dict:
    """One fresh spawn, repeated (up to `tries` times) while other processes took CPU during it: the
    least disturbed is kept, with its foreign load in cores."""
    from fivefold.tools.calibrate import QUIET_CORES, ForeignLoad
    from fivefold.train.launch import run_ranks

    best = None
    for _ in range(tries):
        wait_quiet(max_load)
        with ForeignLoad() as load:
            run = combine(run_ranks(bench_rank, world, (cfg.to_dict(), warmup), timeout_s=600))
        run["foreign_cores"] = load.cores or 0.0
        if best is None or run["foreign_cores"] < best["foreign_cores"]:
            best = run
        if run["foreign_cores"] < QUIET_CORES:
            break
    return best


def measure(cfg: Config, world: int, warmup: int, rounds: int, max_load: float, tries: int) -> dict:
    """Median over `rounds` quiet fresh spawns of each measured figure."""
    runs = [quiet_round(cfg, world, warmup, max_load, tries) for _ in range(rounds)]
    dims = sorted({d for r in runs for d in r["comm_s"]})
    out = {"step_s": statistics.median(r["step_s"] for r in runs), "opt_s": statistics.median(r["opt_s"] for r in runs),
           "comm_s": {d: statistics.median(r["comm_s"].get(d, 0.0) for r in runs) for d in dims},
           "rounds_step_s": [r["step_s"] for r in runs], "foreign_cores": [r["foreign_cores"] for r in runs],
           "probe_s": statistics.median(r["probe_s"] for r in runs),
           "probe_bw": statistics.median(r["probe_bw"] for r in runs),
           "profile": {k: statistics.median(r["profile"][k] for r in runs) for k in runs[0]["profile"]}}
    if "bubble" in runs[0]:
        out["bubble"] = statistics.median(r["bubble"] for r in runs)
    return out


# -- predicted --------------------------------------------------------------------------------------
def predict(cfg: Config, topo) -> dict:
    """The planner's estimate of this config at efficiency 1.0 (achieved peaks)."""
    from fivefold.plan.estimate import estimate
    from fivefold.plan.run import plan_of

    run = plan_of(cfg)
    est = estimate(run.model, run.layout, dataclasses.replace(run.work, efficiency=1.0), topo)
    t = est.time
    comm = {}
    for fl in est.flows:
        comm[fl.dim] = comm.get(fl.dim, 0.0) + fl.seconds
    return {"step_s": t.step_time_s, "bubble": t.bubble if run.layout.pp > 1 else None, "bubble_source": t.bubble_source,
            "compute_s": t.compute_s, "layer_comm_s": t.layer_comm_s, "pipeline_s": t.pipeline_s,
            "grad_comm_s": t.grad_comm_s, "step_comm_s": t.step_comm_s, "optimizer_s": t.optimizer_s,
            "flow_s": comm}


def at_speed(topo, speed: float, memory: float):
    """The calibrated topology with its accelerator as fast as the run's machine: every compute rate times
    `speed` and every fixed host cost (per GEMM kernel, per layer, per pipeline action) over it, every
    memory bandwidth times `memory`. The tiers (collective fits, overlap) stay as calibrated."""
    a = topo.accelerator
    acc = dataclasses.replace(
        a, peak_flops={d: r * speed for d, r in a.peak_flops.items()},
        attention_flops={d: r * speed for d, r in a.attention_flops.items()},
        hbm_bandwidth=a.hbm_bandwidth * memory, host_bandwidth=a.host_bandwidth * memory,
        fresh_bandwidth=a.fresh_bandwidth * memory, layer_overhead=a.layer_overhead / speed,
        action_overhead=a.action_overhead / speed,
        gemm_kernel=None if a.gemm_kernel is None else a.gemm_kernel / speed)
    return dataclasses.replace(topo, accelerator=acc)


# -- topology ---------------------------------------------------------------------------------------
def calibrated(n: int, quick: bool, path: Path, max_load: float):
    """A topology of n local ranks calibrated now, written to `path`."""
    from fivefold.tools.calibrate import calibrate, summary_line, to_toml
    from fivefold.plan.topology import load_topology

    wait_quiet(max_load)
    cal = calibrate(n, quick)
    path.write_text(to_toml(cal))
    print(f"calibrated {summary_line(cal)} -> {path}", flush=True)
    return load_topology(str(path))


def topologies(files: list[str], worlds: set[int], quick: bool, out: Path, max_load: float) -> dict:
    """world size -> Topology: from --topology files (their loopback tier's size), else calibrated now."""
    from fivefold.plan.topology import load_topology

    topos = {}
    for f in files:
        topo = load_topology(f)
        topos[topo.tiers[0].size] = topo
    for n in sorted(worlds - topos.keys()):
        topos[n] = calibrated(n, quick, out / f"local-cpu-{n}.toml", max_load)
    return topos


# -- report -----------------------------------------------------------------------------------------
def _pct(x) -> str:
    return "   -  " if x is None else f"{100 * x:5.1f}%"


def _ok(pred: dict, meas: dict) -> str:
    """Inside the goals: step ratio 0.8-1.25 and (pipelines) the bubble within 10 points."""
    ratio = pred["step_s"] / meas["step_s"]
    bub_ok = pred["bubble"] is None or abs(pred["bubble"] - meas.get("bubble", 0.0)) <= 0.10
    return "yes" if 0.8 <= ratio <= 1.25 and bub_ok else "no"


def table(rows: list[dict]) -> str:
    head = (f"{'layout':<20}{'ranks':>5}{'pred step':>11}{'meas step':>11}{'ratio':>7}{'ok':>4}{'speed':>7}"
            f"{'pred@run':>11}{'ratio':>7}{'ok':>4}{'pred bub':>9}{'meas bub':>9}")
    lines = [head]
    for r in rows:
        p, m = r["pred"], r["meas"]
        line = (f"{r['name']:<20}{r['world']:>5}{p['step_s'] * 1e3:>8.1f} ms{m['step_s'] * 1e3:>8.1f} ms"
                f"{p['step_s'] / m['step_s']:>7.2f}{_ok(p, m):>4}")
        q = r["pred_at_speed"]
        line += f"{r['speed']:>7.3f}{q['step_s'] * 1e3:>8.1f} ms{q['step_s'] / m['step_s']:>7.2f}{_ok(q, m):>4}"
        lines.append(line + f"{_pct(p['bubble']):>9}{_pct(m.get('bubble')):>9}")
    return "\n".join(lines)


def breakdown(rows: list[dict]) -> str:
    lines = ["per layout, ms per step: planner terms | measured (comm: inside fivefold.comm, per ledger dim)"]
    for r in rows:
        p, m = r["pred"], r["meas"]
        pc = " ".join(f"{d} {s * 1e3:.1f}" for d, s in sorted(p["flow_s"].items()))
        mc = " ".join(f"{d} {s * 1e3:.1f}" for d, s in m["comm_s"].items())
        lines.append(f"{r['name']:<20} plan: compute {p['compute_s'] * 1e3:.1f}, layer comm "
                     f"{p['layer_comm_s'] * 1e3:.1f}, pipeline {p['pipeline_s'] * 1e3:.1f}, grad comm "
                     f"{p['grad_comm_s'] * 1e3:.1f}, step comm {p['step_comm_s'] * 1e3:.1f}, optimizer "
                     f"{p['optimizer_s'] * 1e3:.1f} (flows: {pc})")
        pr = m["profile"]
        lines.append(f"{'':<20} speed: reference GEMM {m['probe_s'] * 1e3:.2f} ms in the run against "
                     f"{m['probe_s'] * r['speed'] * 1e3:.2f} ms on the calibrated curve ({r['speed']:.3f}); "
                     f"memory {m['probe_bw'] / 1e9:.2f} against {m['probe_bw'] / r['memory_speed'] / 1e9:.2f} GB/s "
                     f"({r['memory_speed']:.3f}); planned at run speed: compute "
                     f"{r['pred_at_speed']['compute_s'] * 1e3:.1f}")
        lines.append(f"{'':<20} run:  step {m['step_s'] * 1e3:.1f} (rounds "
                     f"{', '.join(f'{s * 1e3:.0f}' for s in m['rounds_step_s'])}; foreign load "
                     f"{', '.join(f'{c:.2f}' for c in m['foreign_cores'])} cores), optimizer {m['opt_s'] * 1e3:.1f}, "
                     f"comm: {mc}")
        lines.append(f"{'':<20} profiled step: GEMM {pr['gemm'] * 1e3:.1f}, attention {pr['attention'] * 1e3:.1f}, "
                     f"other aten ops {pr['other_ops'] * 1e3:.1f} (self CPU; slowest rank)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=2, help="fresh spawns per layout (median)")
    ap.add_argument("--topology", action="append", default=[], help="calibrated TOML (one per rank count)")
    ap.add_argument("--quick-calibration", action="store_true", help="calibrate with --quick")
    ap.add_argument("--calibrate-each", action="store_true",
                    help="calibrate just before each layout and plan it with that (the machine's speed drifts "
                         "by 10-25%% within minutes); --topology is then ignored")
    ap.add_argument("--only", help="comma-separated layout names: " + ", ".join(LAYOUTS))
    ap.add_argument("--max-load", type=float, default=1.5, help="wait for a 1-minute load below this")
    ap.add_argument("--tries", type=int, default=4, help="spawns per round until one is undisturbed")
    ap.add_argument("--out", default="runs/plan_vs_run", help="folder for calibrated topologies and results.json")
    args = common.parse_options(ap, steps=1, warmup=1, rounds=1, quick_calibration=True, max_load=float("inf"),
                                tries=1, only="dp2,pp2-interleaved-v2")
    names = args.only.split(",") if args.only else list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = {n: make_config(*LAYOUTS[n], steps=args.warmup + args.steps) for n in names}
    worlds = {c.parallel.world_size for c in configs.values()}
    topos = {} if args.calibrate_each else topologies(args.topology, worlds, args.quick_calibration, out,
                                                      args.max_load)
    rows = []
    for name, cfg in configs.items():
        world = cfg.parallel.world_size
        topo = calibrated(world, args.quick_calibration, out / f"local-cpu-{world}-{name}.toml", args.max_load) \
            if args.calibrate_each else topos[world]
        meas = measure(cfg, world, args.warmup, args.rounds, args.max_load, args.tries)
        speed, memory = planned_probe_s(topo) / meas["probe_s"], meas["probe_bw"] / topo.accelerator.hbm_bandwidth
        rows.append({"name": name, "world": world, "pred": predict(cfg, topo), "meas": meas, "speed": speed,
                     "memory_speed": memory, "pred_at_speed": predict(cfg, at_speed(topo, speed, memory))})
        print(table(rows[-1:]).splitlines()[1], flush=True)
    print()
    print(table(rows))
    print()
    print(breakdown(rows))
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
