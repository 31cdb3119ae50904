"""A wire with latency and packet loss, in user space: netem's job, for kernels built without sch_netem.

The emulated cluster (tools/fabric.py) shapes each link's rate with tbf; latency and loss are netem's, a
qdisc many kernels (this project's machines among them) do not ship. This relay does the same in a
process: it joins two network devices of one namespace (the link's switch end, taken off its bridge, and
one end of a fresh veth pair whose other end takes its place on the bridge), reads every frame arriving
on either with a packet socket (AF_PACKET, ETH_P_ALL), drops each with probability `loss` (seeded), and
sends the rest out of the other device `delay_s` later, in order. The link's tbf still shapes both ends,
so a frame pays the rate, then the wire.

Frames are taken whole, one Ethernet frame per packet: the devices on the path must hand the relay
finished frames, not offloaded ones (a veth with tx checksumming on passes frames whose TCP checksum is
left to "hardware" and TCP super-frames of up to 64 KiB; re-sent by a packet socket they arrive with bad
checksums). `tx_checksum_off(dev)` turns tx checksumming off (which turns TSO off with it) through the
SIOCETHTOOL ioctl, as `ethtool -K DEV tx off` does; the fabric calls it on every node's link before a
relay starts, so loss is per MTU-sized frame, as on a real link.

Run by the fabric inside the switch namespace, one process per impaired link:

    python wire.py DEV_A DEV_B --delay-s 0.0025 --loss 0.005 --seed 0

It prints `ready` once both sockets are bound, and on SIGTERM a JSON line with its counts: frames relayed
and dropped each way, and drops it did not choose (socket buffer overruns, a full qdisc downstream).
Stdlib only: it starts in a few milliseconds and imports nothing of fivefold.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import threading
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_STATISTICS = 6
PACKET_IGNORE_OUTGOING = 23        # Linux >= 4.20: our own sends are not read back
SIOCETHTOOL = 0x8946
ETHTOOL_GTXCSUM = 0x16
ETHTOOL_STXCSUM = 0x17
CLONE_NEWNET = 0x40000000
BATCH = 256                        # frames read per readable socket before the due ones are sent
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
BUFFER = 8 << 20                   # socket buffers: a burst of frames waits here, not dropped


def _ethtool_value(dev: str, cmd: int, value: int = 0) -> int:
    """One `struct ethtool_value` ioctl on `dev` in the calling thread's network namespace."""
    data = ctypes.create_string_buffer(struct.pack("II", cmd, value))
    ifreq = struct.pack("16sP", dev.encode(), ctypes.addressof(data))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)
    return struct.unpack("II", data.raw[:8])[1]


def tx_checksum_off(dev: str, netns: str | None = None) -> None:
    """`ethtool -K dev tx off`: frames leave `dev` whole and checksummed (TSO goes off with it). With
    `netns` (a name under /var/run/netns), in that namespace: a thread enters it (setns moves the calling
    thread only), so the caller's own namespace is untouched."""
    if netns is None:
        _ethtool_value(dev, ETHTOOL_STXCSUM, 0)
        if _ethtool_value(dev, ETHTOOL_GTXCSUM):
            raise OSError(f"{dev}: tx checksumming is still on")
        return
    err: list[BaseException] = []

    def inside() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET):
                    raise OSError(ctypes.get_errno(), f"setns into {netns}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
            tx_checksum_off(dev)
        except BaseException as e:      # handed to the caller's thread
            err.append(e)

    t = threading.Thread(target=inside)
    t.start()
    t.join()
    if err:
        raise err[0]


def packet_socket(dev: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    for force, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:                 # past net.core.[rw]mem_max: needs CAP_NET_ADMIN, which the fabric has
            s.setsockopt(socket.SOL_SOCKET, force, BUFFER)
        except PermissionError:
            s.setsockopt(socket.SOL_SOCKET, plain, BUFFER)
    s.bind((dev, ETH_P_ALL))
    s.setblocking(False)
    return s


class Relay:
    """Frames between two packet sockets, each direction a FIFO of (due time, frame)."""

    def __init__(self, socks: list[socket.socket], delay_s: float, loss: float, seed: int):
        if not (0.0 <= loss < 1.0 and delay_s >= 0.0):
            raise ValueError(f"loss must be in [0, 1) and delay_s >= 0, got {loss}, {delay_s}")
        self.delay_s, self.loss, self.rng = delay_s, loss, random.Random(seed)
        self.socks = socks                                              # non-blocking, one frame a message
        self.queues = [collections.deque(), collections.deque()]       # queue i: read on i, sent on 1 - i
        self.counts = {"relayed": [0, 0], "dropped": [0, 0], "send_errors": [0, 0]}
        self.stopped = False

    def read(self, i: int) -> None:
        s, q = self.socks[i], self.queues[i]
        for _ in range(BATCH):
            try:
                frame = s.recv(65536)
            except BlockingIOError:
                return
            if self.loss and self.rng.random() < self.loss:
                self.counts["dropped"][i] += 1
                continue
            q.append((time.monotonic() + self.delay_s, frame))

    def send_due(self) -> tuple[float | None, list[socket.socket]]:
        """Send every frame whose time has come. Returns the seconds until the next one is due (None: nothing
        queued) and the sockets that must drain before they take more (their send buffer is full: the
        downstream qdisc holds that many bytes; the frame waits, as it would in a switch's buffer)."""
        now = time.monotonic()
        wait, blocked = None, []
        for i, q in enumerate(self.queues):
            out = self.socks[1 - i]
            while q and q[0][0] <= now:
                try:
                    out.send(q[0][1])
                except BlockingIOError:
                    blocked.append(out)
                    break
                except OSError:          # ENOBUFS: the downstream qdisc dropped it (its queue is full)
                    self.counts["send_errors"][i] += 1
                else:
                    self.counts["relayed"][i] += 1
                q.popleft()
            if q and out not in blocked:
                wait = q[0][0] - now if wait is None else min(wait, q[0][0] - now)
        return wait, blocked

    def run(self) -> None:
        while not self.stopped:
            wait, blocked = self.send_due()
            timeout = 0.2 if wait is None else max(0.0, wait)
            try:
                ready, _, _ = select.select(self.socks, blocked, [], timeout)
            except InterruptedError:
                continue
            for s in ready:
                self.read(self.socks.index(s))

    def report(self) -> dict:
        kernel = []
        for s in self.socks:       # tp_packets, tp_drops since the last read: drops at our socket's buffer
            kernel.append(struct.unpack("II", s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))[1]
                          if s.family == socket.AF_PACKET else 0)
        return {**self.counts, "socket_drops": kernel, "delay_s": self.delay_s, "loss": self.loss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--delay-s", type=float, default=0.0, help="one-way delay added to every frame, each way")
    ap.add_argument("--loss", type=float, default=0.0, help="probability of dropping a frame, each way")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    relay = Relay([packet_socket(args.a), packet_socket(args.b)], args.delay_s, args.loss, args.seed)

    def stop(*_):
        relay.stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    relay.run()
    print(json.dumps(relay.report()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
