"""The hang watchdog of a torchrun rank: no step for `timeout_s` seconds, and the rank says why and leaves.

Local ranks have the launcher's watchdog (train/launch.py `run_ranks`). A rank of a torchrun job has no
launcher of its own that knows its steps, and gloo's own timeout is the job's collective timeout (30
minutes), so a cut link, a frozen or a dead node would hold every other rank for that long. This thread
does for one rank what the launcher does for local ones: `beat(step)` after each step (the trainer's
`launch.heartbeat`) restarts its clock; when `timeout_s` pass without one, it prints one line and ends the
process with EXIT_CODE, so torchrun's agent sees a failed worker and stops (or restarts) the job:

    fivefold: rank 2 (node 1) made no progress for 30 s after step 5, blocked in a collective; cannot reach node 0 (198.18.0.1)

Which nodes it cannot reach: at start every rank publishes its node's address in the job's store
(`publish_nodes`: the address its traffic leaves from, one per node), and on expiry the watchdog tries
a TCP connection to each other node's address on the discard port: an answer of any kind (a refusal
included) means the node's network is there; no answer within PROBE_S means it is not. When every node
answers, the line says so: a rank stalled (a frozen or busy process), not the network.
"""
from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import time

EXIT_CODE = 3
PROBE_S = 3.0
PROBE_PORT = 9          # discard: nothing listens there; a refusal is an answer


def own_address(peer: str) -> str:
    """The local address this host's traffic to `peer` leaves from (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 1))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def publish_nodes(store, node: int, nodes: int, local_rank: int, master: str) -> dict[int, str]:
    """Every node's address, from the job's store: local rank 0 of each node writes its own."""
    if local_rank == 0:
        store.set(f"fivefold/node_addr/{node}", own_address(master))
    return {i: store.get(f"fivefold/node_addr/{i}").decode() for i in range(nodes)}


def reachable(address: str, timeout_s: float = PROBE_S) -> bool:
    """Whether `address` answers a TCP connection attempt (accepted or refused) within timeout_s."""
    try:
        with socket.create_connection((address, PROBE_PORT), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError as e:
        return e.errno == errno.ECONNREFUSED


class Watchdog:
    """A daemon thread that ends this rank after `timeout_s` without a `beat` (see the module docstring)."""

    def __init__(self, timeout_s: float, rank: int, node: int, addresses: dict[int, str], blocked=lambda: False,
                 exit=os._exit):
        self.timeout_s, self.rank, self.node, self.addresses = timeout_s, rank, node, addresses
        self.blocked, self.exit = blocked, exit
        self.steps_done: int | None = None
        self.last = time.monotonic()
        self.fired: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fivefold-watchdog")

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def beat(self, steps_done: int | None = None) -> None:
        """Progress: `steps_done` steps have finished (1-based, as `launch.heartbeat` gives it)."""
        self.steps_done, self.last = steps_done, time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            if time.monotonic() - self.last >= self.timeout_s:
                self.fired = self.report()
                print(self.fired, file=sys.stderr, flush=True)
                sys.stdout.flush()
                self.exit(EXIT_CODE)
                return

    def report(self) -> str:
        """The one line: this rank, its node, how long and after which step, what it waits in, which nodes
        do not answer (probed at once, in parallel)."""
        others = {i: a for i, a in self.addresses.items() if i != self.node}
        answers: dict[int, bool] = {}
        threads = [threading.Thread(target=lambda i=i, a=a: answers.__setitem__(i, reachable(a)), daemon=True)
                   for i, a in others.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PROBE_S + 1)
        lost = [f"node {i} ({others[i]})" for i in sorted(others) if not answers.get(i, False)]
        after = f"after step {self.steps_done}" if self.steps_done else "before its first step"
        where = "blocked in a collective" if self.blocked() else "not in a collective"
        why = (f"cannot reach {', '.join(lost)}" if lost else
               "every node answers: a rank stalled (a frozen or busy process), not the network")
        return (f"fivefold: rank {self.rank} (node {self.node}) made no progress for {self.timeout_s:g} s {after}, "
                f"{where}; {why}")
