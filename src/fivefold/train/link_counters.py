"""The emulated cluster's link counters, read at each step's end (tools/cluster.py sets them up).
Torch-free: `fivefold cluster` reads the same counters.

`fivefold cluster` runs every node's ranks inside a network namespace and keeps a holder process in each
namespace; it names each link's holder pid and device in `FIVEFOLD_LINKS` (JSON: {"node0": [pid, "up0"],
...}). The ranks share the machine's process table, so global rank 0 reads every link's kernel counters
from `/proc/<pid>/net/dev` (that namespace's own view) at each step's end, and the trainer writes them
into the step's metrics line ("links": {name: {"tx", "rx": bytes, "tx_packets", "rx_packets": the
kernel's packets, each one header}}, cumulative, and "retrans": the namespaces' retransmitted TCP
segments, cumulative): the bytes of one step are the difference of two lines, taken at the step boundary
rather than between two samples of a poller.

The boundary is exact because the read sits between two world collectives: the trainer's
own stop/peak all-reduce, which no rank leaves before every rank has received all of its step's
messages, and a gate (an 8-byte all-reduce over the world, ledger dim "links", the instrument's own
traffic, reported apart from what the planner predicts), which no rank leaves before rank 0 has read, so
no rank's next step has sent a byte. Without the gate, rank 0 read after the stop all-reduce while a tp
pair it does not belong to could already be in the next step: under load a step read +289 KB (four SP
messages, 5.5%) and the next as many bytes short. Without the variable (any other run) it reads
nothing, sends nothing and costs nothing.
"""
from __future__ import annotations

import json
import os

ENV = "FIVEFOLD_LINKS"


class LinkCounters:
    def __init__(self, rank: int, spec: str | None = None):
        spec = os.environ.get(ENV) if spec is None else spec
        self.links: dict[str, tuple[int, str]] = {}
        self.gated = bool(spec)          # every rank of an emulated cluster's run takes part in the gate
        if rank == 0 and spec:
            self.links = {name: (int(pid), str(dev)) for name, (pid, dev) in json.loads(spec).items()}

    def read(self) -> dict:
        """{"links": {name: {"tx", "rx", "tx_packets", "rx_packets"}}, "retrans": segments} now, or {} when there is nothing to read (or
        a holder is gone). "retrans": the TCP segments every link namespace has sent again (a node's: its
        ranks' retransmissions, which its links carry twice; a switch's: none), the links' bytes beyond
        the messages' own."""
        if not self.links:
            return {}
        out, retrans = {}, {}
        for name, (pid, dev) in self.links.items():
            try:
                stats = read_net_dev(pid)[dev]
                if pid not in retrans:   # one count per namespace, however many links it holds
                    retrans[pid] = read_tcp_retrans(pid)
            except (OSError, KeyError, ValueError, IndexError):
                return {}
            out[name] = stats
        return {"links": out, "retrans": sum(retrans.values())}

    def read_at_step_end(self, world, device) -> dict:
        """The counters at a step's end, read by rank 0 right after the step guard's world all-reduce
        (train/step_guard.py), then the gate: an 8-byte all-reduce over `world` (ledger dim "links") that
        holds every rank's next step until the read is done, outside the step's seconds. {} and no gate in
        any other run."""
        if not self.gated:
            return {}
        import torch

        from .. import comm

        reads = self.read()
        comm.all_reduce(torch.zeros(1, dtype=torch.int64, device=device), world, dim="links")
        return reads


def read_net_dev(pid: int) -> dict[str, dict[str, int]]:
    """A process's network namespace's interfaces -> byte and packet counters (/proc/PID/net/dev)."""
    out = {}
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            v = rest.split()
            out[name.strip()] = {"rx": int(v[0]), "rx_packets": int(v[1]), "tx": int(v[8]), "tx_packets": int(v[9])}
    return out


def read_tcp_retrans(pid: int) -> int:
    """The TCP segments a process's network namespace has retransmitted (/proc/PID/net/snmp, Tcp
    RetransSegs: counted in segments of at most one MSS each)."""
    with open(f"/proc/{pid}/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    head, values = rows[0], rows[1]
    return int(values[head.index("RetransSegs")])
