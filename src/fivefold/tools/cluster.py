"""`fivefold cluster`: run a command on an emulated multi-node cluster and measure the bytes on its links.

    fivefold cluster --topology fabric.toml --nodes 2 -- train --tp 2 --dp 2 --steps 4 --out runs/x

The topology file is the planner's (plan/topology.py; `fivefold plan --topology` reads the same file), so
the cluster that runs is the one that was planned: tools/fabric.py builds it from network namespaces and
shaped links. One torchrun agent per node runs the command after `--` (a fivefold command, or with
`--exec` any program torchrun can start), exactly as on a real cluster: `--nnodes N --nproc-per-node K`,
c10d rendezvous on node 0's address, gloo on each node's uplink (`GLOO_SOCKET_IFNAME`).

While it runs, every link's kernel counters are sampled (`--sample-ms`, default 50), and at the end
`links.json` is written beside the run's other outputs (the command's `--out`, else `--links`):

    {"fabric": {"topology": ..., "nodes": 2, "ranks_per_node": 2, "links": [{"name": "node0", "tier": ...,
                "rate_bps": ..., "delay_s": ...}, ...]},
     "overhead": {"payload": 8388608, "sent": ..., "acks": ..., "ratio": ...,  # a known transfer: TCP/IP cost
                  "packets": ..., "frame_header": 66.0},              # bytes per counted packet beside payload
     "samples": [{"t": unix seconds, "links": {"node0": {"rx": ..., "tx": ...}, ...}}, ...],
     "totals": {"node0": {"rx": ..., "tx": ...}, ...},        # over the whole command
     "by_tier": {"leaf": {"tx": ..., "rx": ...}, ...},        # totals summed over a tier's links
     "steps": [{"step": 2, "by_tier": {"leaf": {"tx": ...}}, "payload": {"leaf": {"tx": ...}}}, ...]}
                     # per training step: the counters the trainer read at each step's end (metrics.jsonl
                     # "links", train/link_counters.py), and the payload they carried

The overhead is measured before the command: `--overhead-mb` MiB sent over TCP from node 0 to node 1, the
bytes and packets the two node links counted against the payload ("ratio": link bytes per payload byte,
both directions' headers and ACKs included; "frame_header": bytes per packet beside its payload). A
step's "payload" is its bytes less one frame header per packet: what `plan.tiers.link_bytes` predicts.
Its header count holds however the ranks' messages are cut into segments and however often they are
acknowledged (a loaded machine sends smaller segments and more ACKs, which a fixed ratio charges at the
probe's rate); what stays in it beyond the plan is gloo's own framing, a preamble per message.

`--replace-nodes N` starts a fresh agent on a node whose agent died (`Fabric.kill_node` kills a node
whole), up to N times, as a scheduler replaces a failed node; with `--max-restarts` >= 1 the other agents
re-form the job with it (docs/multi-node.md).

Everything the tool made (namespaces, links, qdiscs, holder processes) is removed when the command ends, on
Ctrl-C and on failure; namespaces a killed run left (the tool's marker, a dead pid) are removed at the next
start. Exit status: the command's (the first failing agent's), 2 for bad input or a machine that cannot
build fabrics (one line saying what is missing).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..config import ConfigError
from ..plan.topology import Topology, load_topology
from .fabric import JUMBO, MTU, Fabric, FabricError, check, remove_leftovers

RDZV_PORT = 29400
GRACE_S = 20.0      # after one agent failed, the others' time to end before SIGTERM


def add_cluster_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--topology", required=True, help="the planner's topology TOML (or nodes:K): tier 0 = ranks per "
                    "node, tier 1 = each node's link to its leaf, tier 2 (optional) = the leaves' links to the spine")
    ap.add_argument("--nodes", type=int, required=True, help="nodes to emulate (one torchrun agent each)")
    ap.add_argument("--links", help="where to write links.json (default: the command's --out folder)")
    ap.add_argument("--sample-ms", type=float, default=50.0, help="link counter sampling period (default 50 ms)")
    ap.add_argument("--overhead-mb", type=float, default=8.0,
                    help="MiB of a known TCP transfer that measures header overhead first (0: skip)")
    ap.add_argument("--extra-latency-ms", type=float, default=0.0,
                    help="milliseconds added to every node-to-node path, each way (a relay on each node link: "
                         "tools/wire.py)")
    ap.add_argument("--loss", type=float, default=0.0,
                    help="fraction of frames lost on every node-to-node path, each way (e.g. 0.01)")
    ap.add_argument("--max-restarts", type=int, default=0, help="torchrun --max-restarts for each agent")
    ap.add_argument("--replace-nodes", type=int, default=0,
                    help="start a fresh agent on a node whose agent died, up to N times in all, as a scheduler "
                         "replaces a failed node (the other agents re-form the job with it: give --max-restarts >= 1 "
                         "and the command --resume auto)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before the whole command is stopped")
    ap.add_argument("--exec", action="store_true", help="run the command after -- as a program, not a fivefold "
                    "command")
    ap.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command each node runs")


def cmd_cluster(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ConfigError("fivefold cluster needs a command after --, e.g. -- train --tp 2 --dp 2 --out runs/x")
    topo = load_topology(args.topology)
    Fabric.layout(topo, args.nodes)
    if args.replace_nodes < 0 or args.max_restarts < 0:
        raise ConfigError(f"--replace-nodes and --max-restarts are counts >= 0, got {args.replace_nodes} and "
                          f"{args.max_restarts}")
    if args.sample_ms <= 0:
        raise ConfigError(f"--sample-ms must be > 0, got {args.sample_ms:g}")
    if not 0 <= args.loss < 0.5:
        raise ConfigError(f"--loss is a fraction of frames in [0, 0.5), got {args.loss:g}")
    if not 0 <= args.extra_latency_ms <= 10_000:
        raise ConfigError(f"--extra-latency-ms must be in [0, 10000], got {args.extra_latency_ms:g}")
    out = Path(args.links) if args.links else _out_folder(argv)
    if out is None:
        raise ConfigError("fivefold cluster writes links.json into the command's --out folder; give the command "
                          "--out DIR, or --links FILE")
    missing = check()
    if missing:
        raise ConfigError(missing)
    for ns in remove_leftovers():
        print(f"removed namespace {ns}, left by a run that was killed", file=sys.stderr)
    result = run_on_fabric(topo, args.nodes, argv, fivefold=not args.exec, sample_s=args.sample_ms / 1e3,
                           overhead_bytes=int(args.overhead_mb * 2**20), max_restarts=args.max_restarts,
                           timeout_s=args.timeout, replace_nodes=args.replace_nodes,
                           impair=(args.extra_latency_ms / 1e3, args.loss) if args.extra_latency_ms or args.loss else None)
    path = out / "links.json" if out.suffix != ".json" else out
    path.parent.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl" if out.suffix != ".json" else None
    write_links(path, result, metrics)
    print(f"links: {path}")
    for tier, d in links_by_tier(result).items():
        print(f"  {tier:<10} tx {d['tx'] / 1e6:10.2f} MB  rx {d['rx'] / 1e6:10.2f} MB")
    return result["returncode"]


def _out_folder(argv: list[str]) -> Path | None:
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if a.startswith("--out="):
            return Path(a.split("=", 1)[1])
    return None


def agent_argv(fab: Fabric, node: int, argv: list[str], fivefold: bool = True, max_restarts: int = 0,
               run_id: str = "fivefold-cluster") -> list[str]:
    """The torchrun agent of node `node`, inside its namespace: rendezvous on node 0."""
    host = fab.address(0)
    conf = f"is_host={1 if node == 0 else 0},join_timeout=120"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(fab.nodes),
           "--nproc-per-node", str(fab.ranks_per_node), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"{host}:{RDZV_PORT}", "--rdzv-id", run_id, "--rdzv-conf", conf,
           "--local-addr", fab.address(node), "--node-rank", str(node), "--max-restarts", str(max_restarts)]
    cmd += ["-m", "fivefold.cli", *argv] if fivefold else ["--no-python", *argv]
    return fab.exec_argv(node, cmd)


def agent_env(fab: Fabric) -> dict[str, str]:
    """The agents' environment: gloo on the node's uplink, one thread per rank, no proxy, every link's holder
    pid and device for the trainer to read at step ends (train/link_counters.py), and the ranks' store made
    afresh each rendezvous round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). With torch's shared store (the
    default since 2.4) a node that joins a later round as another than rank 0, a replaced node, waits for a
    master address the unchanged rank 0 never writes again, and both agents hang until the store's timeout
    (seen here with torch 2.13; pytorch/pytorch#135712 is the same class)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    links = {lk.name: [fab.holders[lk.ns].pid, lk.dev] for lk in fab.links}
    env.update(GLOO_SOCKET_IFNAME="up0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FIVEFOLD_LINKS=json.dumps(links),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return env


class Sampler:
    """Reads every link's counters every `period_s` on a thread of its own (first and last reads included)."""

    def __init__(self, fab: Fabric, period_s: float):
        self.fab, self.period_s = fab, period_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        self.samples.append({"t": time.time(), "links": self.fab.counters()})

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except OSError:      # a holder gone while the fabric is removed
                return

    def __enter__(self) -> "Sampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def run_on_fabric(topo: Topology | str, nodes: int, argv: list[str], fivefold: bool = True, sample_s: float = 0.05,
                  overhead_bytes: int = 8 << 20, max_restarts: int = 0, timeout_s: float = 1800.0,
                  during=None, grace_s: float = GRACE_S, impair: tuple[float, float] | None = None,
                  replace_nodes: int = 0) -> dict:
    """Build the fabric, measure header overhead, run one agent per node, sample the links, remove the fabric.
    `impair`: (seconds, loss fraction) added to every node-to-node path once the overhead is measured
    (`Fabric.impair_paths`; (0, 0): relays that add nothing), on a fabric of jumbo frames. `during(fab, agents)`: called once the agents started (a fault to inject); its
    return value is kept as "during". Returns {"returncode", "fabric", "overhead", "samples", "outputs",
    "lines" ((monotonic time, node, line) of every output line), "during", "wires" (each relay's counts:
    frames relayed and dropped each way), "replaced" ((monotonic time, node) of each node given a fresh agent)}.
    `replace_nodes`: a node whose agent ends while others run gets a fresh agent, up to this many times in all,
    as a scheduler replaces a failed node (the others re-form the job with it if their --max-restarts allow)."""
    topo = load_topology(topo)
    fab = Fabric.build(topo, nodes, mtu=JUMBO if impair is not None else MTU)   # relays move fewer, bigger frames
    agents: list[subprocess.Popen] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stopping: list[int] = []

    def stop(signum, frame):
        stopping.append(signum)
        for a in agents:
            _signal(a, signal.SIGTERM)
        if len(stopping) > 1:
            for a in agents:
                _signal(a, signal.SIGKILL)

    try:
        if threading.current_thread() is threading.main_thread():
            for s in previous:
                signal.signal(s, stop)
        overhead = measure_overhead(fab, overhead_bytes) if overhead_bytes else None
        if impair is not None:
            fab.impair_paths(*impair)
        outputs, lines, readers, replaced = [""] * nodes, [], [], []

        def start(node: int) -> subprocess.Popen:
            agent = subprocess.Popen(agent_argv(fab, node, argv, fivefold, max_restarts), env=agent_env(fab),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
            readers.append(threading.Thread(target=_drain, args=(agent, outputs, node, lines), daemon=True))
            readers[-1].start()
            return agent

        def replace(node: int) -> subprocess.Popen | None:
            if len(replaced) >= replace_nodes:
                return None
            replaced.append((time.monotonic(), node))
            return start(node)

        with Sampler(fab, sample_s) as sampler:
            for node in range(nodes):
                agents.append(start(node))
            during_result = during(fab, agents) if during else None
            wait_agents(agents, timeout_s, stop, grace_s, replace)
            fab.thaw_all()              # a frozen node's processes die only once thawed
            for a in agents:
                _signal(a, signal.SIGKILL)
                a.wait()
            for r in readers:
                r.join(timeout=5)
        wires = fab.restore_all()
        codes = [a.returncode for a in agents]
        code = next((c for c in codes if c), 0)
        return {"returncode": code if code >= 0 else 128 - code, "returncodes": codes, "fabric": describe(fab),
                "overhead": overhead, "samples": sampler.samples, "outputs": outputs, "lines": lines,
                "during": during_result, "wires": wires, "replaced": replaced}
    finally:
        fab.thaw_all()
        for a in agents:
            _signal(a, signal.SIGKILL)
        if threading.current_thread() is threading.main_thread():
            for s, h in previous.items():
                signal.signal(s, h)
        fab.remove()


def wait_agents(agents: list[subprocess.Popen], timeout_s: float, stop, grace_s: float = GRACE_S,
                replace=None) -> None:
    """Wait for every agent, as a scheduler runs a job step: an agent that fails while another still runs is
    first offered to `replace(node)` (a fresh agent in its place, or None), as a scheduler replaces a failed
    node; once one has failed for good, the others get `grace_s` to end (their ranks' watchdogs stop them; an
    agent whose rendezvous store is out of reach would wait minutes for it), then SIGTERM, and SIGKILL
    `grace_s` later; the same after `timeout_s` in all."""
    end = time.monotonic() + timeout_s
    while [a.poll() for a in agents].count(None):          # every agent polled, each round
        for node, a in enumerate(agents):
            if a.returncode not in (None, 0) and replace is not None:
                fresh = replace(node)
                if fresh is not None:
                    agents[node] = fresh
        failed = any(a.returncode not in (None, 0) for a in agents)
        if failed:
            end = min(end, time.monotonic() + grace_s)
        if time.monotonic() >= end:
            stop(signal.SIGTERM, None)
            deadline = time.monotonic() + grace_s
            while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
                time.sleep(0.1)
            return
        time.sleep(0.1)


def _drain(proc: subprocess.Popen, outputs: list[str], i: int, lines: list) -> None:
    """Echo an agent's output on stderr with its node's name (a log: stdout keeps the tool's own report), and
    keep it (and each line's monotonic time)."""
    for line in proc.stdout:
        outputs[i] += line
        lines.append((time.monotonic(), i, line.rstrip("\n")))
        sys.stderr.write(f"[node{i}] {line}")
    sys.stderr.flush()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def describe(fab: Fabric) -> dict:
    return {"topology": fab.topology.name, "nodes": fab.nodes, "ranks_per_node": fab.ranks_per_node,
            "tiers": [t.name for t in fab.topology.tiers],
            "links": [{"name": lk.name, "tier": lk.tier, "rate_bps": lk.rate_bps, "delay_s": lk.delay_s}
                      for lk in fab.links]}


_SINK = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print(n, flush=True)
"""
_SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
left = int(sys.argv[3]); chunk = b"\0" * (1 << 20)
while left > 0:
    c.sendall(chunk[:min(left, len(chunk))]); left -= min(left, len(chunk))
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


def measure_overhead(fab: Fabric, payload: int, port: int = 29399) -> dict:
    """Send `payload` bytes over TCP from node 0 to node 1 and read both node links: link bytes per payload
    byte (the data's headers on the way out, the ACKs on the way back), and the bytes each packet the
    kernel counted adds beside its payload ("frame_header": Ethernet, IP and TCP with its timestamp
    option, 66 on Linux; a segmentation-offloaded packet counts once with one header). The ratio holds
    for messages like the probe's; the per-packet header holds for any: a run whose ranks write small
    messages, or that an ACK answers more often, moves more packets per payload byte."""
    before = fab.counters()
    sink = subprocess.Popen(fab.exec_argv(1, [sys.executable, "-c", _SINK, fab.address(1), str(port)]),
                            stdout=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "ready":
            raise FabricError("the overhead probe's receiver did not start")
        subprocess.run(fab.exec_argv(0, [sys.executable, "-c", _SOURCE, fab.address(1), str(port), str(payload)]),
                       check=True, timeout=300)
        got = int(sink.stdout.readline())
    finally:
        sink.kill()
        sink.wait()
    time.sleep(0.2)
    after = fab.counters()
    sent = after["node0"]["tx"] - before["node0"]["tx"]
    acks = after["node1"]["tx"] - before["node1"]["tx"]
    packets = sum(after[n]["tx_packets"] - before[n]["tx_packets"] for n in ("node0", "node1"))
    if got != payload:
        raise FabricError(f"the overhead probe received {got} bytes of {payload}")
    return {"payload": payload, "sent": sent, "acks": acks, "ratio": (sent + acks) / payload,
            "packets": packets, "frame_header": (sent + acks - payload) / max(packets, 1)}


def tier_delta(links: list[dict], before: dict, after: dict, keys=("tx", "rx")) -> dict[str, dict[str, float]]:
    """Bytes (or, with `keys`, packets) per tier and direction between two reads of every link's counters
    ({name: {"tx", "rx", "tx_packets", "rx_packets"}})."""
    out: dict[str, dict[str, float]] = {}
    for lk in links:
        d = out.setdefault(lk["tier"], {k: 0 for k in keys})
        for k in keys:
            d[k] += after[lk["name"]][k] - before[lk["name"]][k]
    return out


def tier_payload(links: list[dict], before: dict, after: dict, frame_header: float) -> dict[str, dict[str, float]]:
    """Payload per tier and direction between two reads: the bytes less one `frame_header` per packet
    (`measure_overhead`); a retransmitted segment's payload still counts twice."""
    data = tier_delta(links, before, after)
    packets = tier_delta(links, before, after, ("tx_packets", "rx_packets"))
    return {tier: {way: d[way] - frame_header * packets[tier][f"{way}_packets"] for way in ("tx", "rx")}
            for tier, d in data.items()}


def links_by_tier(result: dict) -> dict[str, dict[str, float]]:
    """Bytes over the whole command per tier and direction (the sampler's last read less its first)."""
    return tier_delta(result["fabric"]["links"], result["samples"][0]["links"], result["samples"][-1]["links"])


def step_bytes(result: dict, step_ends: list[tuple[int, float, dict | None]]) -> list[dict]:
    """Per training step (from the previous step's end to its own), bytes per tier and direction on the
    links, from the counters the trainer read at the step ends (metrics.jsonl "links"; a 50 ms sampler
    read between two of its samples missed by up to 10% a step); the first step (no start) is left out.
    "payload": the same less each packet's header (where the overhead was measured and the reads hold
    packets). "retrans_segments": TCP segments sent again in the step (None where a read lacks them)."""
    links = result["fabric"]["links"]
    header = (result.get("overhead") or {}).get("frame_header")
    steps = []
    for (_, _, c0), (step, t1, c1) in zip(step_ends, step_ends[1:]):
        if not (c0 and c1):
            continue
        s = {"step": step, "t": t1, "by_tier": tier_delta(links, c0["links"], c1["links"]), "read": "step end",
             "retrans_segments": None if None in (c0["retrans"], c1["retrans"]) else c1["retrans"] - c0["retrans"]}
        if header is not None and all("tx_packets" in c["links"][lk["name"]] for c in (c0, c1) for lk in links):
            s["payload"] = tier_payload(links, c0["links"], c1["links"], header)
        steps.append(s)
    return steps


def read_step_ends(metrics: Path | None) -> list[tuple[int, float, dict | None]]:
    """(step, unix end time, {"links": counters, "retrans": segments} or None) of each line of a run's
    metrics.jsonl that has a time."""
    if metrics is None or not metrics.is_file():
        return []
    ends = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "time" in rec and "step" in rec and "loss" in rec:
            reads = {"links": rec["links"], "retrans": rec.get("retrans")} if rec.get("links") else None
            ends.append((int(rec["step"]), float(rec["time"]), reads))
    return ends


def write_links(path: Path, result: dict, metrics: Path | None = None) -> dict:
    first, last = result["samples"][0]["links"], result["samples"][-1]["links"]
    doc = {"fabric": result["fabric"], "overhead": result["overhead"], "samples": result["samples"],
           "totals": {name: {k: last[name][k] - first[name][k] for k in ("rx", "tx")} for name in last},
           "by_tier": links_by_tier(result), "steps": step_bytes(result, read_step_ends(metrics)),
           "wires": result.get("wires", {}), "returncode": result["returncode"]}
    path.write_text(json.dumps(doc, indent=1))
    return doc
