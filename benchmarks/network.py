"""Benchmark: traffic orchestration on an emulated cluster, in seconds and bytes, and the network's faults.

Needs root (network namespaces: `fivefold cluster`, tools/fabric.py). Each case trains plan_vs_run.py's
model (hidden 256, 4 layers, seq 128, global batch 16, fp32) on a fabric from examples/fabrics/ for
`--steps` steps, one torchrun agent per node, and reads:
- measured: the median step seconds of the steps after the first (metrics.jsonl), the bytes each tier's
  links carried per step (links.json, rank 0's reads at step ends) and the ledger's bytes per dimension
  and tier (comm.json);
- planned: `plan.estimate` at efficiency 1.0 on the fabric's topology whose accelerator and node tier are
  `fivefold calibrate`'s for as many ranks as the fabric has (they share this machine's cores as the
  fabric's ranks do), calibrated in the minute before each case's run (this machine's speed drifts by a
  third within minutes; `--reuse-calibration` plans with OUT/local-cpu-N.toml instead), and
  `plan.tiers.link_bytes`.
Each case's orders run `--time-rounds` times interleaved (A B, then B A), each run against its own fresh
calibration; a row is the mean of its rounds (each round's pair printed beside it), so orders that differ
by less than the machine's drift are ranked by their means, not by which ran in a faster minute.
Printed: the time table (predicted / measured, goal 0.8-1.25), each layout's orders ranked by measured
and by planned step time and the planner's recommended order, and a traffic table in the manner of
UB-Mesh's: bytes per dimension per tier from the ledger, beside what the links counted.

Faults, on two nodes, dp = 4: a cut link (seconds from the cut until every rank has stopped with its
line), node 1's link at half rate (the slowdown measured against the planner's with that tier at half
bandwidth), node 1's CPU throttled (the share of steps whose straggler is on node 1), node 1 frozen
(seconds until node 0's ranks stop), node 1 killed whole (agent and ranks) and replaced by a fresh agent
as a scheduler would, under `--max-restarts 1 --resume auto` (node 0's agent restarts its workers, the two
re-form the job, it resumes from its checkpoint and ends with the uninterrupted run's losses).

    sudo OMP_NUM_THREADS=1 .venv/bin/python benchmarks/network.py [--steps 6] [--quick-calibration]
        [--time-rounds 2] [--only tp2-dp2] [--no-faults] [--out runs/network]

`--replan` runs nothing and needs no root: it plans OUT's finished runs again with this checkout's
planner, each against the calibration taken before it, so a planner change is read on the runs as
measured (the measured steps and link bytes are the files', not new).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import common  # puts src/ on the path

from plan_vs_run import GLOBAL_BATCH, MODEL, SEQ, calibrated, predict

ROOT = Path(__file__).resolve().parents[1]
FABRICS = ROOT / "examples" / "fabrics"
FLAGS = ["--set", f"model.vocab={MODEL['vocab']}", "--set", f"model.hidden={MODEL['hidden']}",
         "--set", f"model.layers={MODEL['layers']}", "--set", f"model.heads={MODEL['heads']}",
         "--set", f"model.kv_heads={MODEL['kv_heads']}", "--set", f"model.ffn={MODEL['ffn']}",
         "--set", f"model.max_seq={MODEL['max_seq']}", "--seq-len", str(SEQ), "--global-batch", str(GLOBAL_BATCH),
         "--set", "train.checkpoint=false", "--set", "train.warmup=1"]
MOE = ["--set", "model.experts=4", "--set", "model.top_k=2", "--set", "model.capacity_factor=1.5"]

# name -> (fabric, nodes, layout flags, orders to compare)
CASES = {
    "tp2-dp2": ("two-nodes", 2, ["--tp", "2", "--dp", "2"], ["tp-cp-ep-dp-pp", "dp-tp-cp-ep-pp"]),
    "pp2-dp2": ("two-nodes", 2, ["--pp", "2", "--dp", "2", "--microbatches", "4"], ["tp-cp-ep-pp-dp", "tp-cp-ep-dp-pp"]),
    "moe-tp2-pp2-dp2-ep2": ("two-leaves", 4, ["--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--microbatches", "2",
                                              *MOE], ["tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp"]),
    # no pipeline: every rank runs the same collective at the same moment (the lockstep the planner's
    # oversubscription assumes), and the orders differ only in where ep's all-to-all runs: inside a leaf,
    # or across the spine (expert grads' edp reduction the other way round)
    "moe-tp2-dp4-ep2": ("two-leaves", 4, ["--tp", "2", "--dp", "4", "--ep", "2", *MOE],
                        ["tp-cp-ep-dp-pp", "tp-cp-dp-ep-pp"]),
    # MoE parallel folding across two nodes (issue 53): tp inside each node; ep4 over all four ranks (its
    # all-to-all crosses the nodes, no expert gradient reduction) against ep2 folded onto each node's tp pair
    # (the all-to-all stays inside the node, the experts' gradients are reduced over edp across the nodes).
    # An entry "ORDER|FLAGS" runs the order with those flags added: here the two layouts, not two orders.
    "moe-tp2-dp2-folded": ("two-nodes", 2, ["--tp", "2", "--dp", "2", *MOE],
                           ["tp-cp-ep-dp-pp|--ep 4", "tp-cp-ep-dp-pp|--ep 2"]),
}


def fabric(name: str):
    from fivefold.plan.topology import load_topology
    return load_topology(str(FABRICS / f"{name}.toml"))


def planned_topology(fab, cal):
    """The fabric's tiers with the calibration's accelerator, and its loopback tier as the node tier."""
    from fivefold.plan.topology import Topology

    node = dataclasses.replace(cal.tiers[0], name=fab.tiers[0].name, size=fab.tiers[0].size)
    return Topology(f"{fab.name}+{cal.name}", cal.accelerator, (node, *fab.tiers[1:]), backend="gloo")


def run_case(fab_name: str, nodes: int, argv: list[str], out: Path, steps: int, during=None, extra=(),
             max_restarts: int = 0, timeout_s: float = 900, impair=None, replace_nodes: int = 0) -> dict:
    from fivefold.tools.cluster import run_on_fabric

    fresh = [] if "--resume" in extra else ["--overwrite"]     # a restarted worker must not wipe its checkpoints
    train = ["train", *FLAGS, *argv, "--steps", str(steps), "--out", str(out), *fresh, *extra]
    t0 = time.monotonic()
    res = run_on_fabric(str(FABRICS / f"{fab_name}.toml"), nodes, train, overhead_bytes=4 << 20, during=during,
                        max_restarts=max_restarts, timeout_s=timeout_s, grace_s=10, impair=impair,
                        replace_nodes=replace_nodes)
    res["wall_s"] = time.monotonic() - t0
    from fivefold.tools.cluster import write_links
    if (out / "metrics.jsonl").is_file():
        res["links"] = write_links(out / "links.json", res, out / "metrics.jsonl")
    return res


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def measured(out: Path, res: dict) -> dict:
    m = metrics(out)
    comm = json.loads((out / "comm.json").read_text())
    steps = len(m)
    per_tier_dim: dict[tuple[str, str], float] = {}
    for r in comm["tiers"]:
        per_tier_dim[(r["dim"], r["tier"])] = per_tier_dim.get((r["dim"], r["tier"]), 0.0) + r["bytes_sent"] / steps
    links = {}
    for s in res["links"]["steps"]:
        for tier, d in s.get("payload", s["by_tier"]).items():
            links.setdefault(tier, []).append(d["tx"])
    return {"step_s": statistics.median(x["seconds"] for x in m[1:]), "steps": steps, "dim_tier": per_tier_dim,
            "links": {t: statistics.median(v) for t, v in links.items()},
            "config": json.loads((out / "run.json").read_text())["config"]}


def plan(cfg_dict: dict, topo) -> dict:
    from fivefold.config import Config
    from fivefold.plan.run import plan_of
    from fivefold.plan.estimate import fastest_order
    from fivefold.plan.traffic import stage_flows
    from fivefold.plan.tiers import link_bytes, recommend_order

    cfg = Config.from_dict(cfg_dict)
    p = predict(cfg, topo)
    run = plan_of(cfg)
    model, layout, work = run.model, run.layout, dataclasses.replace(run.work, efficiency=1.0)
    p["links"] = link_bytes(model, layout, work, topo, cfg.parallel.order)
    p["by_bytes"] = recommend_order(stage_flows(model, layout, work, 0))
    p["recommended"] = fastest_order(model, layout, work, topo)[0]
    return p


def _replanned(run_out: Path, world: int, fab) -> dict | None:
    """A finished run planned again (`--replan`): its measured step and link bytes as recorded, the plan
    from this checkout against the calibration taken in the minute before it."""
    from fivefold.plan.topology import load_topology

    cal = run_out.parent / f"{run_out.name}.local-cpu-{world}.toml"
    if not (run_out / "links.json").is_file() or not cal.is_file():
        return None
    m = measured(run_out, {"links": json.loads((run_out / "links.json").read_text())})
    topo = planned_topology(fab, load_topology(str(cal)))
    return {"measured": m, "plan": plan(m["config"], topo),
            "calibrated_fp32_tflops": topo.accelerator.peak_flops.get("fp32", 0.0) / 1e12}


def mean_of_rounds(runs: list[dict]) -> dict:
    """One (case, order) row from its rounds: planned and measured step seconds and the calibrated rate
    averaged, each round's pair kept (`rounds`); bytes and recommendations from the first round (they do
    not depend on the machine's speed)."""
    row = {**runs[0], "rounds": [(r["plan"]["step_s"], r["measured"]["step_s"]) for r in runs]}
    row["plan"] = {**runs[0]["plan"], "step_s": statistics.fmean(r["plan"]["step_s"] for r in runs)}
    row["measured"] = {**runs[0]["measured"], "step_s": statistics.fmean(r["measured"]["step_s"] for r in runs)}
    row["calibrated_fp32_tflops"] = statistics.fmean(r["calibrated_fp32_tflops"] for r in runs)
    return row


def time_table(rows: list[dict]) -> str:
    lines = ["| case | order | fabric | calibrated fp32 GFLOP/s a rank | planned step | measured step | planned / measured | "
             "rounds, planned / measured | link bytes / step, measured / planned |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        links = ", ".join(f"{t} {r['measured']['links'][t] / 1e6:.2f} MB ({r['measured']['links'][t] / r['plan']['links'][t]:.3f})"
                          for t in r["measured"]["links"] if r["plan"]["links"].get(t))
        lines.append(f"| {r['case']} | {r['order']} | {r['fabric']} | {1e3 * r.get('calibrated_fp32_tflops', 0.0):.1f} | "
                     f"{r['plan']['step_s']:.3f} s | "
                     f"{r['measured']['step_s']:.3f} s | {r['plan']['step_s'] / r['measured']['step_s']:.2f} | "
                     f"{', '.join(f'{p:.2f}/{m:.2f}' for p, m in r.get('rounds', []))} | {links} |")
    return "\n".join(lines)


def orders_table(rows: list[dict]) -> str:
    lines = ["| case | measured fastest first | planned fastest first | planner recommends (by step time; by bytes) |",
             "|---|---|---|---|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        by_m = " < ".join(r["order"] for r in sorted(mine, key=lambda r: r["measured"]["step_s"]))
        by_p = " < ".join(r["order"] for r in sorted(mine, key=lambda r: r["plan"]["step_s"]))
        lines.append(f"| {case} | {by_m} | {by_p} | {mine[0]['plan']['recommended']}; {mine[0]['plan']['by_bytes']} |")
    return "\n".join(lines)


def traffic_table(rows: list[dict]) -> str:
    """Bytes per step per dimension and tier (the ledger's, every rank), as UB-Mesh tabulates traffic."""
    lines = ["| case | order | dim | intra-node MB | inter-node MB |", "|---|---|---|---|---|"]
    for r in rows:
        dims = sorted({d for d, _ in r["measured"]["dim_tier"]})
        for d in dims:
            intra = r["measured"]["dim_tier"].get((d, "intra"), 0.0) / 1e6
            inter = r["measured"]["dim_tier"].get((d, "inter"), 0.0) / 1e6
            if intra + inter >= 0.01:
                lines.append(f"| {r['case']} | {r['order']} | {d} | {intra:.2f} | {inter:.2f} |")
    return "\n".join(lines)


# -- faults --------------------------------------------------------------------------------------------------
def wait_step(out: Path, step: int, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if (out / "metrics.jsonl").is_file() and any(m.get("step") == step for m in metrics(out)):
            return
        time.sleep(0.1)
    raise RuntimeError(f"step {step} not reached in {out}")


FAULTS = ("cut", "half_rate", "lossy", "throttled", "frozen", "killed")
LOSS, EXTRA_LATENCY_S = 0.01, 0.005          # node to node: through two impaired node links, half each


def faults(out: Path, steps: int, cal4, only=FAULTS, rounds: int = 1) -> dict:
    tp_across = ["--tp", "2", "--dp", "2", "--order", "dp-tp-cp-ep-pp"]
    res: dict = {}
    fab = fabric("two-nodes")
    topo = planned_topology(fab, cal4)
    if "half_rate" in only:
        res["half_rate"] = _half_rate(out, steps, topo, tp_across)
    if "lossy" in only:
        res["lossy"] = _lossy(out, steps, topo, tp_across, rounds)
    if "cut" in only:
        res["cut"] = _cut(out, steps)
    for name, fn in (("throttled", _throttled), ("frozen", _frozen), ("killed", _killed)):
        if name in only:
            res[name] = fn(out, steps)
    return res


def _lossy(out: Path, steps: int, topo, argv: list[str], rounds: int = 1) -> dict:
    """Every node-to-node path 5 ms longer and losing 1% of its frames (`Fabric.impair_paths`), then 5 ms
    alone, against relays that add nothing (what the relays cost is the emulator's, measured apart), in
    `rounds` interleaved rounds: the median of each round's slowdowns against the planner's with the leaf
    tier's latency raised by the same 5 ms, and for the lossy runs its loss at 1% with what a lost frame
    costs as `loss_probe` fits it."""
    from fivefold.plan.topology import Topology
    from fivefold.tools.fabric import JUMBO

    runs = {"relay": (0.0, 0.0), "latency": (EXTRA_LATENCY_S, 0.0), "lossy": (EXTRA_LATENCY_S, LOSS)}
    res, m, steps_s, losses = {}, {}, {name: [] for name in runs}, {}
    for i in range(rounds):
        for name, impair in runs.items():
            r = run_case("two-nodes", 2, argv, out / name, steps, impair=impair)
            m[name] = measured(out / name, r)
            steps_s[name].append(m[name]["step_s"])
            losses.setdefault(name, [x["loss"] for x in metrics(out / name)])
            wires = r["wires"].values()
            res[f"{name}_wires"] = {k: sum(sum(w[k]) for w in wires) for k in ("relayed", "dropped", "send_errors",
                                                                                "socket_drops")}
    fit = loss_probe()
    leaf = dataclasses.replace(topo.tiers[1], mtu=JUMBO)
    long_leaf = dataclasses.replace(leaf, latency=leaf.latency + EXTRA_LATENCY_S)
    lossy_leaf = dataclasses.replace(long_leaf, loss=LOSS, loss_recovery=fit["recovery_s"])
    base = plan(m["relay"]["config"], Topology(topo.name, topo.accelerator, (topo.tiers[0], leaf), backend="gloo"))
    planned = {name: plan(m[name]["config"], Topology(topo.name, topo.accelerator, (topo.tiers[0], t),
                                                      backend="gloo"))["step_s"] - base["step_s"]
               for name, t in (("latency", long_leaf), ("lossy", lossy_leaf))}
    res.update({name: steps_s[name] for name in runs})
    res.update({"rounds": rounds, "loss_recovery_s": fit["recovery_s"], "loss_probe": fit["ops"],
                "latency_planned_slowdown_s": planned["latency"], "lossy_planned_slowdown_s": planned["lossy"],
                "losses_equal": losses["lossy"] == losses["relay"] == losses["latency"]})
    for name in ("latency", "lossy"):
        slow = statistics.median(a - b for a, b in zip(steps_s[name], steps_s["relay"]))
        res[f"{name}_measured_slowdown_s"] = slow
        res[f"{name}_planned_over_measured"] = planned[name] / slow
    w = res["lossy_wires"]
    res["drop_rate_per_link"] = w["dropped"] / max(1, w["relayed"] + w["dropped"])
    return res


def _half_rate(out: Path, steps: int, topo, argv: list[str]) -> dict:
    """Node 1's link at half rate: the measured slowdown against the planner's with that tier at half bandwidth."""
    from fivefold.plan.topology import Topology

    clean = run_case("two-nodes", 2, argv, out / "clean", steps)
    m_clean = measured(out / "clean", clean)
    p_clean = plan(m_clean["config"], topo)

    def slow(fab, agents):
        fab.shape(fab.link("node1"), rate_scale=0.5)

    half = run_case("two-nodes", 2, argv, out / "half", steps, during=slow)
    slow_topo = Topology(topo.name, topo.accelerator, (topo.tiers[0], dataclasses.replace(
        topo.tiers[1], bandwidth=topo.tiers[1].bandwidth / 2)), backend="gloo")
    m_half = measured(out / "half", half)
    p_half = plan(m_half["config"], slow_topo)
    return {"measured_slowdown": m_half["step_s"] / m_clean["step_s"],
            "planned_slowdown": p_half["step_s"] / p_clean["step_s"],
            "measured_s": [m_clean["step_s"], m_half["step_s"]], "planned_s": [p_clean["step_s"], p_half["step_s"]]}


def _cut(out: Path, steps: int) -> dict:
    dp4 = ["--dp", "4"]
    cut_at = []

    def cut(fab, agents):
        wait_step(out / "cut", 2)
        fab.set_up(fab.link("node1"), False)
        cut_at.append(time.monotonic())

    r = run_case("two-nodes", 2, dp4, out / "cut", steps + 20, during=cut,
                 extra=["--timeout", "15", "--set", "train.checkpoint=true", "--set", "train.checkpoint_every=2"])
    stops = [t for t, _, line in r["lines"] if "made no progress" in line]
    return {"watchdog_s": 15, "ranks_stopped": len(stops), "last_stop_after_cut_s": max(stops) - cut_at[0],
            "job_ended_after_cut_s": r["wall_s"] - (cut_at[0] - (time.monotonic() - r["wall_s"])),
            "line": next((line for _, _, line in r["lines"] if "made no progress" in line), "")}


def _throttled(out: Path, steps: int) -> dict:
    """Node 1's CPU throttled to a fifth of a core: the straggler named."""
    dp4 = ["--dp", "4"]
    throttled = run_case("two-nodes", 2, dp4, out / "throttled", steps, during=lambda fab, agents: fab.throttle(1, 0.2))
    named = [m.get("slowest_node") for m in metrics(out / "throttled")[1:]]
    return {"steps": len(named), "named_node_1": sum(n == 1 for n in named),
            "wall_s": throttled["wall_s"]}


def _frozen(out: Path, steps: int) -> dict:
    dp4 = ["--dp", "4"]
    frozen_at = []

    def freeze(fab, agents):
        wait_step(out / "frozen", 2)
        fab.freeze(1)
        frozen_at.append(time.monotonic())

    fr = run_case("two-nodes", 2, dp4, out / "frozen", steps + 20, during=freeze, extra=["--timeout", "15"])
    stops = [(t, line) for t, node, line in fr["lines"] if "made no progress" in line and node == 0]
    return {"node0_ranks_stopped": len(stops), "last_stop_after_freeze_s": max(t for t, _ in stops) - frozen_at[0]
            if stops else None, "line": stops[0][1] if stops else ""}


def _killed(out: Path, steps: int) -> dict:
    """Node 1 killed whole after step 3 (its agent and its ranks at once, `Fabric.kill_node`); the tool starts a
    fresh agent there as a scheduler replaces a failed node (`replace_nodes=1`), node 0's agent restarts its
    workers (`--max-restarts 1`), the two re-form the job and it resumes from its last checkpoint."""
    from fivefold.train.rundir import clear, holds_run

    killed_at = []
    if holds_run(out / "killed"):    # an earlier run's steps would trigger the kill at once (and --resume it)
        clear(out / "killed")

    def kill(fab, agents):
        wait_step(out / "killed", 3)
        killed_at.append((time.monotonic(), len(fab.kill_node(1))))

    dp4 = ["--dp", "4"]
    killed = run_case("two-nodes", 2, dp4, out / "killed", steps, during=kill, max_restarts=1, replace_nodes=1,
                      extra=["--set", "train.checkpoint=true", "--set", "train.checkpoint_every=2", "--resume", "auto",
                             "--timeout", "30"])
    ref = run_case("two-nodes", 2, dp4, out / "uninterrupted", steps)
    lk = {m["step"]: m["loss"] for m in metrics(out / "killed")}
    lr = {m["step"]: m["loss"] for m in metrics(out / "uninterrupted")}
    after = [(t, line) for t, node, line in killed["lines"] if t > killed_at[0][0]]
    resumed = [t for t, line in after if "resuming from" in line]
    stepped = [t for t, line in after if resumed and t > resumed[0] and line.lstrip().startswith("step ")]
    return {"returncode": killed["returncode"], "steps": max(lk) if lk else 0, "processes_killed": killed_at[0][1],
            "replaced": [node for _, node in killed["replaced"]],
            "resumed_after_kill_s": resumed[0] - killed_at[0][0] if resumed else None,
            "first_step_after_kill_s": stepped[0] - killed_at[0][0] if stepped else None,
            "losses_equal_uninterrupted": lk == lr, "wall_s": killed["wall_s"], "uninterrupted_wall_s": ref["wall_s"]}


def _probe(added_s: float, loss: float, *argv: str) -> dict:
    """benchmarks/ranks/latency_probe.py on two nodes of two ranks, `added_s` and `loss` on every
    node-to-node path: {"group/op/bytes": seconds}."""
    import re

    from fivefold.tools.cluster import run_on_fabric

    probe = Path(__file__).parent / "ranks" / "latency_probe.py"
    r = run_on_fabric(str(FABRICS / "two-nodes.toml"), 2, [sys.executable, str(probe), *argv], fivefold=False,
                      overhead_bytes=0, impair=(added_s, loss), timeout_s=600)
    m = re.search(r"PROBE (\{.*\})", "".join(r["outputs"]))
    if not m:
        raise RuntimeError("latency probe failed: " + "".join(r["outputs"])[-2000:])
    return json.loads(m.group(1))


def latency_hops(added_s: float = 0.010) -> dict:
    """Each collective's one-way latencies: its median seconds with `added_s` on every node-to-node path
    less without, over `added_s` (benchmarks/ranks/latency_probe.py on two nodes of two ranks), beside what
    comm/volume.py's `latency_hops` counts for gloo."""
    from fivefold.comm.volume import latency_hops as counted

    seconds = {added: _probe(added, 0.0) for added in (0.0, added_s)}
    rows = {}
    for key, base in seconds[0.0].items():
        group, op, nbytes = key.split("/")
        n = 2 if group == "pair" else 4
        rows[key] = {"hops": (seconds[added_s][key] - base) / added_s, "counted": counted(op, n, "gloo"),
                     "clean_s": base, "added_s": seconds[added_s][key]}
    return rows


def loss_probe(latency_s: float = EXTRA_LATENCY_S, loss: float = LOSS, calls: int = 60) -> dict:
    """What one lost frame costs on the fabric's node-to-node paths (a tier's `loss_recovery_us`): the mean
    seconds of each 1 MiB collective between one rank on each of two nodes, `latency_s` added to the path,
    with `loss` against without, fitted as the planner charges it (plan/topology.py `collective_loss`):
    the extra seconds over all ops / (loss x the frames they send: payload in MTU frames plus one frame a
    latency hop)."""
    from fivefold.comm.volume import bytes_sent, latency_hops as hops
    from fivefold.plan.topology import TCP_IP_HEADER
    from fivefold.tools.fabric import JUMBO

    argv = ("--mean", str(calls), str(1 << 20))
    clean, lossy = _probe(latency_s, 0.0, *argv), _probe(latency_s, loss, *argv)
    rows, extra, frames = {}, 0.0, 0.0
    for key, base in clean.items():
        group, op, nbytes = key.split("/")
        if group != "pair":                     # every byte of the pair crosses the lossy path
            continue
        f = bytes_sent(op, float(nbytes), 2, "gloo") / (JUMBO - TCP_IP_HEADER) + hops(op, 2, "gloo")
        rows[key] = {"clean_s": base, "lossy_s": lossy[key], "frames": f}
        extra += lossy[key] - base
        frames += f
    recovery = extra / (loss * frames)
    return {"ops": rows, "latency_s": latency_s, "loss": loss, "recovery_s": recovery,
            "recovery_over_latency": recovery / (latency_s + fabric("two-nodes").tiers[1].latency)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--latency-hops", action="store_true", help="only measure each gloo collective's latency "
                    "hops (10 ms added to the path between two nodes) against comm/volume.py's counts")
    ap.add_argument("--loss-probe", action="store_true", help="only fit what one lost frame costs (1%% loss, "
                    "+5 ms between two nodes; a tier's loss_recovery_us)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the lossy fault's three runs")
    ap.add_argument("--time-rounds", type=int, default=2, help="rounds of each case's orders, interleaved (A B, "
                    "then B A, ...), each run planned against its own fresh calibration; a row is their mean")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--quick-calibration", action="store_true")
    ap.add_argument("--reuse-calibration", action="store_true", help="plan with OUT/local-cpu-N.toml where present")
    ap.add_argument("--replan", action="store_true", help="run nothing: plan OUT's finished runs again with this "
                    "checkout's planner, each against the calibration taken before it, and print the tables")
    ap.add_argument("--out", default="runs/network")
    a = common.parse_options(ap, steps=3, only="tp2-dp2", no_faults=True, quick_calibration=True)
    from fivefold.plan.topology import load_topology
    from fivefold.tools.fabric import check
    missing = None if a.replan else check()
    if missing:
        print(f"network.py: {missing}", file=sys.stderr)
        return 0 if a.smoke else 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.latency_hops:
        rows = latency_hops()
        print("| group | op | message | measured hops | counted (latency_hops) |\n|---|---|---|---|---|")
        for key, r in rows.items():
            group, op, nbytes = key.split("/")
            print(f"| {group} | {op} | {nbytes} B | {r['hops']:.2f} | {r['counted']} |")
        (out / "latency_hops.json").write_text(json.dumps(rows, indent=1))
        return 0
    if a.loss_probe:
        res = loss_probe()
        print(json.dumps(res, indent=1))
        (out / "loss_probe.json").write_text(json.dumps(res, indent=1))
        return 0
    cases = {k: v for k, v in CASES.items() if not a.only or k in a.only.split(",")}
    cals = {}
    rows = []
    for name, (fab_name, nodes, argv, orders) in cases.items():
        fab = fabric(fab_name)
        world = nodes * fab.tiers[0].size
        saved = out / f"local-cpu-{world}.toml"
        runs = []
        for rnd in range(1 if a.smoke else a.time_rounds):
            # the orders interleaved, A B then B A: two orders whose step times differ by less than this
            # machine drifts in minutes are ranked by their rounds' means, not by which ran first
            for order in (orders[:1] if a.smoke else orders if rnd % 2 == 0 else orders[::-1]):
                run_out = out / (f"{name}-{order.replace('|', '').replace(' ', '')}" + (f"-round{rnd + 1}" if rnd else ""))
                # calibrated in the minute before each run: this machine's speed drifts by a third within
                # minutes (benchmarks/README.md), so a calibration an hour old misplans by as much.
                # --smoke: the fabric file's own accelerator (its figures mean nothing)
                if a.replan:
                    replanned = _replanned(run_out, world, fab)
                    if replanned:
                        runs.append({"case": name, "order": order, "fabric": fab_name, "round": rnd + 1, **replanned})
                    continue
                if a.smoke:
                    cals[world] = fab
                elif a.reuse_calibration and saved.is_file():
                    cals[world] = cals.get(world) or load_topology(str(saved))
                else:
                    fresh = out / f"{run_out.name}.local-cpu-{world}.toml"
                    cals[world] = calibrated(world, a.quick_calibration, fresh, max_load=1.0)
                    shutil.copyfile(fresh, saved)     # the newest, for a later --reuse-calibration
                topo = planned_topology(fab, cals[world])
                order_only, _, more = order.partition("|")
                res = run_case(fab_name, nodes, [*argv, *more.split(), "--order", order_only], run_out, a.steps)
                if res["returncode"]:
                    print("".join(res["outputs"])[-3000:], file=sys.stderr)
                    return 1
                m = measured(run_out, res)
                runs.append({"case": name, "order": order, "fabric": fab_name, "round": rnd + 1, "measured": m,
                             "plan": plan(m["config"], topo),
                             "calibrated_fp32_tflops": topo.accelerator.peak_flops.get("fp32", 0.0) / 1e12})
                r = runs[-1]
                print(f"{name} {order} round {rnd + 1}: planned {r['plan']['step_s']:.3f} s, measured "
                      f"{m['step_s']:.3f} s", flush=True)
        rows += [mean_of_rounds([r for r in runs if r["order"] == order]) for order in dict.fromkeys(r["order"] for r in runs)]
    if a.replan:
        print(time_table(rows) + "\n\n" + orders_table(rows))
        return 0
    print("\n" + time_table(rows) + "\n\n" + orders_table(rows) + "\n\n" + traffic_table(rows))
    result = {"rows": [{**r, "measured": {**r["measured"], "dim_tier": {f"{d}/{t}": v for (d, t), v in
                                                                         r["measured"]["dim_tier"].items()}}}
                       for r in rows]}
    if not a.no_faults:
        four = out / "local-cpu-4.toml"
        result["faults"] = faults(out / "faults", a.steps, cals.get(4) or (
            load_topology(str(four)) if a.reuse_calibration and four.is_file() else
            calibrated(4, a.quick_calibration, four, 1.0)), only=a.faults.split(","), rounds=a.rounds)
        print(json.dumps(result["faults"], indent=1))
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
