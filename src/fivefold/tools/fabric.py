"""An emulated cluster on one machine: the planner's topology built from Linux network namespaces.

A `Topology` (plan/topology.py) lists tiers innermost first; `Fabric.build` makes the same cluster:

- tier 0 (size K: ranks per node) is a **node**: a network namespace whose ranks talk over its loopback
  (the high-bandwidth domain);
- tier 1 is the **leaf**: each node has one link (a veth pair) to its leaf switch, a Linux bridge in a
  namespace of its own; a leaf holds tier 1's size / K nodes (size omitted: every node on one leaf);
- tier 2, when there is one, is the **spine**: each leaf has one link to a spine bridge.

A link is shaped at both ends with tbf, so each direction has the tier's rate. Rates: a tier's
`bandwidth` is per rank each way (the planner's convention), divided by its `oversubscription`; a node's
link carries its K ranks (K · bandwidth), a leaf's uplink the ranks of the leaf (ranks per leaf ·
bandwidth / oversubscription). Latency is what the veths and bridges give (tens of microseconds):
`impair(link, delay_s, loss)` adds delay and packet loss through a relay in user space (tools/wire.py:
netem's job; the kernels this project runs on do not ship sch_netem), and `impair_paths` does it for
every node-to-node path. Links run Ethernet's 1500-byte frames, or jumbo frames (`Fabric.build(...,
mtu=JUMBO)`: 9000, as data-centre fabrics run) for a fabric with relays, which then move 6x fewer frames;
IPv4 only.

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544) only: node i is 198.18.0.(i+1)/16
on its uplink `up0`, one flat L2 segment through the bridges, and no namespace has a route out (nothing
but the segment and loopback exist in them). Names carry the tool's marker, `ffc<pid>-`, with the pid of
the process that made them: `ffc<pid>-n<i>` (nodes), `-l<j>` (leaves), `-s` (spine).
`remove_leftovers()` deletes only namespaces with that marker whose pid is no longer alive (a killed run),
never anything else; `Fabric.remove()` deletes what this fabric made (namespaces take their veths and
qdiscs with them).

Counters: a small holder process sleeps in each namespace, so `counters()` reads every link's kernel
byte counters from `/proc/<holder>/net/dev` (the namespace's own view) without starting a process; the
node end of a node link gives the node's tx (bytes leaving the node) and rx, the leaf end of a spine link
the leaf's.

Faults: `set_up(link, False)` cuts a link, `shape(link, rate_scale=0.5)` slows it, `impair(link, delay_s,
loss)` makes it long and lossy, `throttle(node, cores)`
limits a node's processes to a CPU share (cgroup v1 `cpu`), `freeze(node)` stops them (cgroup v1
`freezer`), `kill_node(node)` kills them all at once (a node lost); the cgroups are named as the namespaces and removed with them.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip` / `tc` from iproute2; `check()` says in one line
what is missing.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError
from ..plan.topology import Topology
from ..train.link_counters import read_net_dev
from ..train.signals import alive
from . import wire

NET = ipaddress.ip_network("198.18.0.0/15")     # RFC 2544 benchmarking range: the only addresses used
PREFIX = 16                                     # nodes share 198.18.0.0/16
MARK = "ffc"                                    # the tool's marker: ffc<pid>-...
MARKED = re.compile(rf"^{MARK}(\d+)-")
UPLINK = "up0"                                  # a node's (or leaf's) link to the switch above it
MAX_NODES = 250
MTU, JUMBO = 1500, 9000                         # Ethernet's frames; jumbo ones for a fabric with relays
CGROUP = Path("/sys/fs/cgroup")                 # cgroup v1 controllers: cpu (a slow node), freezer (a frozen one)


class FabricError(RuntimeError):
    """A fabric command failed (the message names it and what the kernel said)."""


@dataclass(frozen=True)
class Link:
    """One shaped link: its tier, the namespace and device at its lower end (the node or leaf), and the
    switch end's namespace and device. Counters are read at the lower end: tx = bytes going up."""
    name: str                  # "node0", "leaf1"
    tier: str                  # the topology tier's name whose traffic it carries
    ns: str
    dev: str
    switch_ns: str
    switch_dev: str
    rate_bps: float            # bits/s each way
    delay_s: float             # the tier's one-way latency (the plan's; the emulated link adds none by itself)


@dataclass
class Fabric:
    topology: Topology
    nodes: int
    ranks_per_node: int
    tag: str
    node_ns: list[str] = field(default_factory=list)
    switch_ns: list[str] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    holders: dict[str, subprocess.Popen] = field(default_factory=dict)
    cgroups: list[Path] = field(default_factory=list)
    relays: dict[str, subprocess.Popen] = field(default_factory=dict)      # link name -> its wire (impair)
    relay_reports: dict[str, dict] = field(default_factory=dict)           # link name -> the wire's last counts
    whole_frames: bool = False         # every node's link sends checksummed, unsegmented frames (impair)
    mtu: int = MTU                     # every link's frame size

    # -- shape of the cluster ---------------------------------------------------------------------------
    @staticmethod
    def layout(topology: Topology, nodes: int) -> tuple[int, int, bool]:
        """(ranks per node, nodes per leaf, spine?) of `nodes` nodes on `topology`, or a ConfigError naming
        the rule."""
        tiers = topology.tiers
        if not 2 <= len(tiers) <= 3:
            raise ConfigError(f"an emulated cluster needs 2 or 3 tiers (node, leaf[, spine]); topology "
                              f"{topology.name} has {len(tiers)}")
        k = tiers[0].size
        if not k or k < 1:
            raise ConfigError(f"the first tier of {topology.name} must give the ranks per node (size >= 1)")
        if not 2 <= nodes <= MAX_NODES:
            raise ConfigError(f"--nodes must be 2..{MAX_NODES}, got {nodes}")
        leaf = tiers[1].size
        per_leaf = nodes if leaf is None or len(tiers) == 2 else leaf // k
        if len(tiers) == 3 and (per_leaf < 1 or nodes % per_leaf):
            raise ConfigError(f"tier {tiers[1].name} holds {leaf} ranks = {per_leaf} nodes of {k}; --nodes must "
                              f"be a multiple of {per_leaf}, got {nodes}")
        for t in tiers[1:]:
            if t.bandwidth * 8 / t.oversubscription > 10e9 * 8:
                raise ConfigError(f"tier {t.name}: {t.bandwidth / 1e9:g} GB/s per rank cannot be shaped here "
                                  f"(an emulated link runs at most a few GB/s); give bandwidth_gbps <= 10")
        spine = len(tiers) == 3 and nodes > per_leaf
        return k, per_leaf, spine

    @classmethod
    def build(cls, topology: Topology, nodes: int, tag: str | None = None, mtu: int = MTU) -> "Fabric":
        """Make every namespace, link and qdisc; on any failure remove what was made and raise."""
        k, per_leaf, spine = cls.layout(topology, nodes)
        fab = cls(topology, nodes, k, tag or f"{MARK}{os.getpid()}", mtu=mtu)
        try:
            fab._make(per_leaf, spine)
        except BaseException:
            fab.remove()
            raise
        return fab

    def _make(self, per_leaf: int, spine: bool) -> None:
        tiers, k = self.topology.tiers, self.ranks_per_node
        leaves = -(-self.nodes // per_leaf)
        self.node_ns = [f"{self.tag}-n{i}" for i in range(self.nodes)]
        leaf_ns = [f"{self.tag}-l{j}" for j in range(leaves)]
        spine_ns = [f"{self.tag}-s"] if spine else []
        self.switch_ns = leaf_ns + spine_ns
        for ns in self.node_ns + self.switch_ns:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                  "net.ipv6.conf.default.disable_ipv6=1"])      # IPv4 only: no neighbour discovery on the links
            self.holders[ns] = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "infinity"],
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        for ns in self.switch_ns:
            _ip("-n", ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", ns, "link", "set", "br0", "up")
        leaf_t = tiers[1]
        for i, ns in enumerate(self.node_ns):
            sw = leaf_ns[i // per_leaf]
            self._link(Link(f"node{i}", leaf_t.name, ns, UPLINK, sw, f"n{i}",
                            k * leaf_t.bandwidth * 8 / leaf_t.oversubscription, leaf_t.latency))
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/{PREFIX}", "dev", UPLINK)
        if spine:
            spine_t = tiers[2]
            for j, ns in enumerate(leaf_ns):
                ranks = min(per_leaf, self.nodes - j * per_leaf) * k
                self._link(Link(f"leaf{j}", spine_t.name, ns, UPLINK, spine_ns[0], f"l{j}",
                                ranks * spine_t.bandwidth * 8 / spine_t.oversubscription, spine_t.latency))
                _ip("-n", ns, "link", "set", UPLINK, "master", "br0")     # the leaf's bridge forwards up
        for ns in self.node_ns + self.switch_ns:
            self.wait_holder(ns)

    def _link(self, link: Link) -> None:
        _ip("link", "add", link.dev, "mtu", str(self.mtu), "netns", link.ns, "type", "veth", "peer", "name",
            link.switch_dev, "mtu", str(self.mtu), "netns", link.switch_ns)
        _ip("-n", link.switch_ns, "link", "set", link.switch_dev, "master", "br0")
        for ns, dev in ((link.ns, link.dev), (link.switch_ns, link.switch_dev)):
            _ip("-n", ns, "link", "set", dev, "up")
        self.links.append(link)
        self.shape(link)

    def wait_holder(self, ns: str, timeout_s: float = 10.0) -> None:
        """Wait until the namespace's holder process has entered it (its net/dev lists the namespace's links)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                with open(f"/proc/{self.holders[ns].pid}/net/dev") as f:
                    text = f.read()
            except OSError:
                text = ""
            if ("br0" in text or UPLINK in text) and self.holders[ns].poll() is None:
                return
            time.sleep(0.01)
        raise FabricError(f"the holder process of namespace {ns} did not start")

    # -- addresses and commands ---------------------------------------------------------------------------
    @staticmethod
    def address(node: int) -> str:
        addr = NET.network_address + node + 1
        assert addr in NET
        return str(addr)

    def exec_argv(self, node: int, argv: list[str]) -> list[str]:
        """`argv` run inside node `node`'s namespace."""
        return ["ip", "netns", "exec", self.node_ns[node], *argv]

    def link(self, name: str) -> Link:
        return next(lk for lk in self.links if lk.name == name)

    # -- shaping and faults ---------------------------------------------------------------------------------
    def shape(self, link: Link, rate_scale: float = 1.0) -> None:
        """(Re)shape both ends of `link` with tbf at its rate · rate_scale."""
        rate = max(8e3, link.rate_bps * rate_scale)
        burst = max(32 * 1024, int(rate / 8 / 250))          # at least 4 ms of traffic (HZ = 250)
        for ns, dev in ((link.ns, link.dev), (link.switch_ns, link.switch_dev)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{int(rate)}bit",
                "burst", str(burst), "latency", "400ms")

    def impair(self, link: Link, delay_s: float = 0.0, loss: float = 0.0, seed: int = 0, relay: bool = False) -> None:
        """Add `delay_s` of one-way latency and drop a fraction `loss` of the frames crossing `link`, each way
        (a frame from node to node through two impaired node links pays both). The link's switch end leaves
        its bridge for a relay (tools/wire.py) that forwards to a fresh veth pair whose other end takes its
        place; `impair(link)` with nothing to add puts the link back as it was (`relay=True`: a relay that adds
        nothing, whose own cost a benchmark measures apart). Before the first relay, every node's link stops
        offloading checksums and segmentation (the relay needs whole frames)."""
        self._unimpair(link)
        if delay_s == 0 and loss == 0 and not relay:
            return
        if not self.whole_frames:
            for i, ns in enumerate(self.node_ns):
                wire.tx_checksum_off(UPLINK, ns)
            self.whole_frames = True
        ns, dev = link.switch_ns, link.switch_dev
        relay_end, bridge_end = f"ra-{dev}", f"rb-{dev}"
        _ip("-n", ns, "link", "add", relay_end, "mtu", str(self.mtu), "type", "veth", "peer", "name", bridge_end,
            "mtu", str(self.mtu))
        _ip("-n", ns, "link", "set", dev, "nomaster")
        _ip("-n", ns, "link", "set", bridge_end, "master", "br0")
        for d in (relay_end, bridge_end):
            _ip("-n", ns, "link", "set", d, "up")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, wire.__file__, dev, relay_end,
                                 "--delay-s", repr(delay_s), "--loss", repr(loss), "--seed", str(seed)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.relays[link.name] = proc
        if proc.stdout.readline().strip() != "ready":
            err = proc.stderr.read() if proc.wait(timeout=5) is not None else ""
            raise FabricError(f"the relay of link {link.name} did not start: {err.strip()[-500:]}")

    def impair_paths(self, latency_s: float, loss: float, seed: int = 0) -> None:
        """Every node-to-node path `latency_s` longer and losing a fraction `loss` of its frames: each such
        path crosses exactly two node links (its ends), so each node link takes half the latency and the
        loss q with (1 - q)^2 = 1 - loss, each way. Leaf-to-spine links stay as they are. (0, 0): relays
        that add nothing (what the relays themselves cost)."""
        if not (0 <= loss < 1 and latency_s >= 0):
            raise ConfigError(f"loss must be in [0, 1) and extra latency >= 0, got {loss:g} and {latency_s:g} s")
        per_link = 1 - (1 - loss) ** 0.5
        for i, lk in enumerate(lk for lk in self.links if lk.name.startswith("node")):
            self.impair(lk, latency_s / 2, per_link, seed=seed + i, relay=True)

    def restore_all(self) -> dict[str, dict]:
        """Every impaired link back as built; returns each relay's counts (link name -> counts)."""
        for name in list(self.relays):
            self._unimpair(self.link(name))
        return dict(self.relay_reports)

    def _unimpair(self, link: Link) -> None:
        proc = self.relays.pop(link.name, None)
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=5)
            last = out.strip().splitlines()[-1:] if out else []
            if last:
                self.relay_reports[link.name] = json.loads(last[0])
        except (subprocess.TimeoutExpired, ValueError):
            _kill(proc)
        subprocess.run(["ip", "-n", link.switch_ns, "link", "del", f"ra-{link.switch_dev}"], capture_output=True)
        _ip("-n", link.switch_ns, "link", "set", link.switch_dev, "master", "br0")

    def set_up(self, link: Link, up: bool) -> None:
        """Cut (`up=False`) or restore a link: its switch end goes down, so nothing crosses either way."""
        _ip("-n", link.switch_ns, "link", "set", link.switch_dev, "up" if up else "down")

    # -- a node's processes: throttled or frozen (cgroup v1) ------------------------------------------------------
    def node_cgroup(self, node: int, controller: str) -> Path:
        """This fabric's cgroup for node `node` under `controller` ("cpu" or "freezer"), made on first use, with
        every process now in the node's namespace moved into it (the agent, its ranks, the holder); the
        children they start later inherit it."""
        root = CGROUP / controller
        if not root.is_dir():
            raise FabricError(f"cgroup v1 controller {controller!r} is not mounted at {root}")
        path = root / self.node_ns[node]
        path.mkdir(exist_ok=True)
        self.cgroups.append(path)
        for pid in _pids_in(self.node_ns[node]):
            try:
                (path / "cgroup.procs").write_text(str(pid))
            except OSError:        # gone meanwhile
                pass
        return path

    def throttle(self, node: int, cores: float | None) -> None:
        """Limit node `node`'s processes to `cores` CPUs (CFS quota; None: no limit): a slow node."""
        path = self.node_cgroup(node, "cpu")
        period = 100_000
        (path / "cpu.cfs_period_us").write_text(str(period))
        (path / "cpu.cfs_quota_us").write_text("-1" if cores is None else str(max(1000, int(cores * period))))

    def freeze(self, node: int, frozen: bool = True) -> None:
        """Stop (or resume) every process of node `node` at once (the freezer): a hung node whose network lives."""
        path = self.node_cgroup(node, "freezer")
        (path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")

    def kill_node(self, node: int) -> list[int]:
        """SIGKILL every process of node `node` (its torchrun agent and ranks) at once, as a node that loses power
        or is fenced: nothing of it runs on, its link stays. Its namespace holder is kept (it holds the namespace
        for a new agent). Returns the pids killed."""
        holder, killed = self.holders[self.node_ns[node]].pid, []
        for _ in range(20):                 # again, for a child started while the list was read
            pids = [pid for pid in _pids_in(self.node_ns[node]) if pid != holder and pid not in killed]
            if not pids:
                break
            _kill_pids(pids)
            killed += pids
        return killed

    def thaw_all(self) -> None:
        """Resume every frozen node (a frozen process cannot die of SIGKILL until it is thawed)."""
        for path in self.cgroups:
            if (path / "freezer.state").exists():
                try:
                    (path / "freezer.state").write_text("THAWED")
                except OSError:
                    pass

    # -- counters -----------------------------------------------------------------------------------------
    def counters(self) -> dict[str, dict[str, int]]:
        """link name -> {"rx": bytes, "tx": bytes, "rx_packets", "tx_packets"} at its lower end (tx: up)."""
        out = {}
        for lk in self.links:
            stats = read_net_dev(self.holders[lk.ns].pid)
            out[lk.name] = stats.get(lk.dev, {"rx": 0, "tx": 0, "rx_packets": 0, "tx_packets": 0})
        return out

    # -- removal --------------------------------------------------------------------------------------------
    def remove(self) -> None:
        """Delete every namespace this fabric made (with their links and qdiscs), stop its holders and any
        process still in a node, and remove its cgroups."""
        self.thaw_all()
        for proc in self.relays.values():
            _kill(proc)
        self.relays.clear()
        for proc in self.holders.values():
            _kill(proc)
        for ns in self.node_ns + self.switch_ns:
            _delete_namespace(ns)
        self.holders.clear()
        for path in self.cgroups:
            _rmdir_cgroup(path)
        self.cgroups.clear()

    def __enter__(self) -> "Fabric":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
        raise FabricError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _tc(ns: str, *args: str) -> None:
    _run(["tc", "-n", ns, *args])


def marked_namespaces() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip() and MARKED.match(line.split()[0])]


def remove_leftovers() -> list[str]:
    """Delete namespaces carrying the tool's marker whose maker (the pid in the name) is gone: what a killed
    run left. Returns their names. Nothing without the marker is touched."""
    gone = []
    for controller in ("cpu", "freezer"):
        root = CGROUP / controller
        for path in (root.iterdir() if root.is_dir() else ()):
            m = MARKED.match(path.name)
            if path.is_dir() and m and not (alive(int(m.group(1))) and int(m.group(1)) != os.getpid()):
                if (path / "freezer.state").exists():
                    (path / "freezer.state").write_text("THAWED")
                _kill_pids(map(int, (path / "cgroup.procs").read_text().split()))
                _rmdir_cgroup(path)
    for ns in marked_namespaces():
        pid = int(MARKED.match(ns).group(1))
        if pid != os.getpid() and alive(pid):
            continue
        _delete_namespace(ns)
        gone.append(ns)
    return gone


def _kill_pids(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete_namespace(ns: str) -> None:
    """SIGKILL every process still in namespace `ns` (one of ours), then delete it with its links and qdiscs."""
    _kill_pids(_pids_in(ns))
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _rmdir_cgroup(path: Path, timeout_s: float = 10.0) -> None:
    """Remove a cgroup once its processes are gone (they may take a moment to exit after SIGKILL)."""
    end = time.monotonic() + timeout_s
    while path.exists():
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() > end:
                return
            time.sleep(0.05)


def _pids_in(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def check() -> str | None:
    """None when fabrics can be built here; else one line saying what is missing."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs `{tool}` (iproute2): apt-get install iproute2"
    if os.geteuid() != 0:
        return ("the emulated cluster needs root (network namespaces, veth pairs, tc): run it as root, or "
                "under `unshare --user --net --mount --map-root-user` where the kernel allows user namespaces")
    probe = f"{MARK}{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"cannot make a network namespace here (ip netns add: {r.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None
