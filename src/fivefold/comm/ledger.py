"""CommLedger: what every collective sent, per (dimension, op) and per network tier.

Each wrapper in `fivefold.comm.ops` records one call: the message size, the bytes that left this rank
(from `comm/volume.py`) and the seconds spent issuing and waiting, under (dim, op) and the tier its
group crosses (`Group.tier`, set by the mesh from `parallel.ranks_per_node`, see `fivefold.grid`):
"intra" when all the group's ranks share a node, "inter" when it spans nodes. Offload copies
(`comm/transfer.py`) land on the accelerator's own links, named as the planner names them: "pcie"
(d2h, h2d) and "nvme" (nvme_read, nvme_write). A ledger is per rank; `gather` collects all ranks'
ledgers so rank 0 can write `comm.json`:

    {"world_size": 2,
     "rows": [{"dim": "dp", "op": "all_reduce", "calls": 8, "message_bytes": ..., "bytes_sent": ...,
               "seconds": ...}, ...],          # per (dim, op), summed over tiers and ranks
     "tiers": [{"dim": "dp", "op": "all_reduce", "tier": "inter", "calls": 8, ...}, ...],
                                               # the same rows split by tier, summed over ranks
     "by_tier": {"inter": ..., "intra": ...},  # bytes sent per tier, all ranks
     "per_rank": [{"rank": 0, "rows": [...], "tiers": [...]}, ...]}

Sections: what is recorded inside `with ledger.section("eval"):` (evaluations: the trainer's forward-only
passes) is kept apart from the training rows, so the rows above stay those of training steps (what the
planner predicts per step); `part("eval")` returns that section as a ledger of its own, and the trainer
writes it into comm.json under "eval" (the same shape, plus "evaluations": how many ran).

The "rows" mean what they always meant (each is the sum of its "tiers" rows). A tier row holds the
bytes that crossed that tier's links (`record_split`: a ring's bytes go to the next rank, so a ring over
two nodes puts some ranks' bytes on "intra" and others' on "inter"), and the calls, message bytes and
seconds of the calls whose group spans it as its outermost tier; a row can hold bytes with 0 calls. A
(dim, op) may appear under two tiers when it runs over two groups (the loss is summed over dp and over pp). Training,
benchmarks and tests all read it through this class: `total(dim, op, field, tier=None)`, `rows()`,
`tier_rows()`, `by_tier()`, `table()`, `CommLedger.read(path)` (a comm.json without "tiers" reads
as tier "").
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

FIELDS = ("calls", "message_bytes", "bytes_sent", "seconds")
INTRA = "intra"          # the tier of a record that names none (a group of one node: see fivefold.grid)
# offload copies are not network traffic: the accelerator's link they cross (plan/traffic.py COPY_TIERS)
COPY_TIERS = {"d2h": "pcie", "h2d": "pcie", "nvme_read": "nvme", "nvme_write": "nvme"}


@dataclass
class Row:
    calls: int = 0
    message_bytes: float = 0.0
    bytes_sent: float = 0.0
    seconds: float = 0.0

    def add(self, other: "Row") -> None:
        self.calls += other.calls
        self.message_bytes += other.message_bytes
        self.bytes_sent += other.bytes_sent
        self.seconds += other.seconds


class CommLedger:
    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank = rank
        self.world_size = world_size
        self._rows: dict[tuple[str, str, str], Row] = {}        # (dim, op, tier) -> Row
        self._per_rank: list[dict[tuple[str, str, str], Row]] | None = None
        self._sections: dict[str, dict[tuple[str, str, str], Row]] = {}   # name -> rows recorded inside it
        self.enabled = True

    @contextmanager
    def section(self, name: str):
        """Record into section `name` instead of the main rows while inside (waits too)."""
        main = self._rows
        self._rows = self._sections.setdefault(name, {})
        try:
            yield self
        finally:
            self._rows = main

    def part(self, name: str) -> "CommLedger":
        """Section `name`'s rows as a ledger of their own (empty when nothing was recorded there)."""
        led = CommLedger(self.rank, self.world_size)
        led._rows = {k: Row(**asdict(v)) for k, v in self._sections.get(name, {}).items()}
        return led

    # -- recording ---------------------------------------------------------------------------
    def record(self, dim: str, op: str, message_bytes: float, bytes_sent: float, seconds: float = 0.0,
               calls: int = 1, tier: str | None = None) -> None:
        """One call under (dim, op) on `tier` (None: the copy's link for an offload copy, else "intra")."""
        if not self.enabled:
            return
        key = (dim, op, tier or COPY_TIERS.get(op, INTRA))
        self._rows.setdefault(key, Row()).add(Row(calls, float(message_bytes), float(bytes_sent), seconds))

    def record_split(self, dim: str, op: str, message_bytes: float, bytes_by_tier: dict[str, float],
                     seconds: float = 0.0, tier: str | None = None) -> None:
        """One call whose bytes went over several tiers (`bytes_by_tier`: the links each byte took): the
        call, its message and its seconds on `tier` (the group's: the outermost it spans), each tier's bytes
        on that tier (a tier that got bytes but not the call holds them with 0 calls)."""
        if not self.enabled:
            return
        tier = tier or COPY_TIERS.get(op, INTRA)
        self.record(dim, op, message_bytes, bytes_by_tier.get(tier, 0.0), seconds, tier=tier)
        for t, b in bytes_by_tier.items():
            if t != tier and b:
                self._rows.setdefault((dim, op, t), Row()).bytes_sent += b

    def add_seconds(self, dim: str, op: str, seconds: float, tier: str | None = None) -> None:
        if self.enabled:
            self._rows.setdefault((dim, op, tier or COPY_TIERS.get(op, INTRA)), Row()).seconds += seconds

    def reset(self) -> None:
        self._rows.clear()
        self._sections.clear()
        self._per_rank = None

    # -- reading -----------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """One dict per (dim, op), summed over tiers (and over ranks when the ledger was gathered)."""
        out: dict[tuple[str, str], Row] = {}
        for (d, o, _), r in self._rows.items():
            out.setdefault((d, o), Row()).add(r)
        return [{"dim": d, "op": o, **asdict(r)} for (d, o), r in sorted(out.items())]

    def tier_rows(self) -> list[dict]:
        """One dict per (dim, op, tier): the rows of `rows()` split by the tier their group crosses."""
        return [{"dim": d, "op": o, "tier": t, **asdict(r)} for (d, o, t), r in sorted(self._rows.items())]

    def by_tier(self, field: str = "bytes_sent") -> dict[str, float]:
        """Sum of `field` per tier (only tiers something was recorded on)."""
        out: dict[str, float] = {}
        for t in sorted({t for _, _, t in self._rows}):
            out[t] = self.total(field=field, tier=t)
        return out

    def total(self, dim: str | None = None, op: str | None = None, field: str = "bytes_sent",
              tier: str | None = None) -> float:
        """Sum of `field` over rows matching dim, op and tier (None matches all)."""
        if field not in FIELDS:
            raise ValueError(f"field must be one of {FIELDS}")
        return sum(getattr(r, field) for (d, o, t), r in self._rows.items()
                   if (dim is None or d == dim) and (op is None or o == op) and (tier is None or t == tier))

    def per_rank(self) -> list["CommLedger"]:
        """Each rank's own ledger (only after `gather` or `read`)."""
        if self._per_rank is None:
            return [self]
        out = []
        for rank, rows in enumerate(self._per_rank):
            led = CommLedger(rank, self.world_size)
            led._rows = {k: Row(**asdict(v)) for k, v in rows.items()}
            out.append(led)
        return out

    def snapshot(self) -> dict[tuple[str, str, str], Row]:
        return {k: Row(**asdict(v)) for k, v in self._rows.items()}

    def since(self, snap: dict[tuple[str, str, str], Row]) -> "CommLedger":
        """A ledger holding what was recorded after `snap` was taken."""
        led = CommLedger(self.rank, self.world_size)
        for k, r in self._rows.items():
            old = snap.get(k, Row())
            diff = Row(r.calls - old.calls, r.message_bytes - old.message_bytes,
                       r.bytes_sent - old.bytes_sent, r.seconds - old.seconds)
            if diff.calls or diff.bytes_sent:
                led._rows[k] = diff
        return led

    # -- across ranks ------------------------------------------------------------------------
    @staticmethod
    def merge(ledgers: list["CommLedger"]) -> "CommLedger":
        total = CommLedger(0, len(ledgers))
        total._per_rank = []
        for led in ledgers:
            total._per_rank.append(led.snapshot())
            for k, r in led._rows.items():
                total._rows.setdefault(k, Row()).add(r)
        return total

    def gather(self) -> "CommLedger":
        """Collect every rank's ledger (a bookkeeping exchange, not recorded). Call on all ranks."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return CommLedger.merge([self])
        from .waits import waiting

        objs: list = [None] * dist.get_world_size()
        with waiting():
            dist.all_gather_object(objs, self.tier_rows())
        return CommLedger.merge([CommLedger.from_rows(rows, rank=i) for i, rows in enumerate(objs)])

    # -- files -------------------------------------------------------------------------------
    @staticmethod
    def from_rows(rows: list[dict], rank: int = 0) -> "CommLedger":
        """A ledger from `tier_rows()` (or from `rows()`, whose rows then read as tier "")."""
        led = CommLedger(rank)
        for r in rows:
            led._rows.setdefault((r["dim"], r["op"], r.get("tier", "")), Row()).add(
                Row(r["calls"], r["message_bytes"], r["bytes_sent"], r["seconds"]))
        return led

    def to_dict(self) -> dict:
        return {"world_size": len(self.per_rank()), "rows": self.rows(), "tiers": self.tier_rows(),
                "by_tier": self.by_tier(),
                "per_rank": [{"rank": i, "rows": led.rows(), "tiers": led.tier_rows()}
                             for i, led in enumerate(self.per_rank())]}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @staticmethod
    def read(path: str | Path) -> "CommLedger":
        d = json.loads(Path(path).read_text())
        return CommLedger.merge([CommLedger.from_rows(p.get("tiers", p["rows"]), p["rank"]) for p in d["per_rank"]])

    def table(self, host_is_device: bool = False) -> str:
        """A readable table: per dimension and op, calls, message bytes, bytes sent and seconds; then the
        bytes sent per tier when anything left a node (or went over an offload link). `host_is_device`
        (a run on the CPU): the "pcie" tier's bytes are named copies within host memory, which they are."""
        lines = [f"{'dim':<10}{'op':<16}{'calls':>8}{'message':>12}{'sent':>12}{'seconds':>10}"]
        for r in self.rows():
            lines.append(f"{r['dim']:<10}{r['op']:<16}{r['calls']:>8}{fmt_bytes(r['message_bytes']):>12}"
                         f"{fmt_bytes(r['bytes_sent']):>12}{r['seconds']:>10.3f}")
        if len(lines) == 1:
            lines.append("(no communication)")
        tiers = self.by_tier()
        if set(tiers) - {INTRA, ""}:   # anything beyond one node (or an offload link)
            lines.append("sent per tier: " + ", ".join(f"{tier_label(t, host_is_device)} {fmt_bytes(b)}"
                                                       for t, b in tiers.items()))
        return "\n".join(lines)


def tier_label(tier: str, host_is_device: bool = False) -> str:
    """A tier's name for people: on a CPU device the offload copies' "pcie" crossed no bus."""
    if host_is_device and tier == "pcie":
        return "pcie (none crossed: the device is the CPU, host and device are the same memory; copies within it)"
    return tier or "?"


def fmt_bytes(n: float, binary: bool = True) -> str:
    """Bytes with an honest unit: binary KiB/MiB/GiB/TiB/PiB (powers of 1024, the default, as memory is
    counted) or decimal kB/MB/GB/TB/PB (powers of 1000, as link bandwidths are quoted)."""
    base, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB")) if binary else (1000, ("B", "kB", "MB", "GB", "TB", "PB"))
    for unit in units[:-1]:
        if abs(n) < base:
            break
        n /= base
    else:
        unit = units[-1]
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
