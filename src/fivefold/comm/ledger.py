"""CommLedger: what every collective sent, per (dimension, op).

Each wrapper in `fivefold.comm.ops` records one call: the message size, the bytes that left this rank
(from `comm/volume.py`) and the seconds spent issuing and waiting. A ledger is per rank; `gather`
collects all ranks' ledgers so rank 0 can write `comm.json`:

    {"world_size": 2,
     "rows": [{"dim": "dp", "op": "all_reduce", "calls": 8, "message_bytes": ..., "bytes_sent": ...,
               "seconds": ...}, ...],          # summed over ranks
     "per_rank": [{"rank": 0, "rows": [...]}, ...]}

Training, benchmarks and tests all read it through this class: `total(dim, op, field)`,
`rows()`, `table()`, `CommLedger.read(path)`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

FIELDS = ("calls", "message_bytes", "bytes_sent", "seconds")


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
        self._rows: dict[tuple[str, str], Row] = {}
        self._per_rank: list[dict[tuple[str, str], Row]] | None = None
        self.enabled = True

    # -- recording ---------------------------------------------------------------------------
    def record(self, dim: str, op: str, message_bytes: float, bytes_sent: float, seconds: float = 0.0,
               calls: int = 1) -> None:
        if not self.enabled:
            return
        self._rows.setdefault((dim, op), Row()).add(Row(calls, float(message_bytes), float(bytes_sent), seconds))

    def add_seconds(self, dim: str, op: str, seconds: float) -> None:
        if self.enabled:
            self._rows.setdefault((dim, op), Row()).seconds += seconds

    def reset(self) -> None:
        self._rows.clear()
        self._per_rank = None

    # -- reading -----------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """One dict per (dim, op), summed over ranks when the ledger was gathered."""
        return [{"dim": d, "op": o, **asdict(r)} for (d, o), r in sorted(self._rows.items())]

    def total(self, dim: str | None = None, op: str | None = None, field: str = "bytes_sent") -> float:
        """Sum of `field` over rows matching dim and op (None matches all)."""
        if field not in FIELDS:
            raise ValueError(f"field must be one of {FIELDS}")
        return sum(getattr(r, field) for (d, o), r in self._rows.items()
                   if (dim is None or d == dim) and (op is None or o == op))

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

    def snapshot(self) -> dict[tuple[str, str], Row]:
        return {k: Row(**asdict(v)) for k, v in self._rows.items()}

    def since(self, snap: dict[tuple[str, str], Row]) -> "CommLedger":
        """A ledger holding what was recorded after `snap` was taken."""
        led = CommLedger(self.rank, self.world_size)
        for k, r in self._rows.items():
            old = snap.get(k, Row())
            diff = Row(r.calls - old.calls, r.message_bytes - old.message_bytes,
                       r.bytes_sent - old.bytes_sent, r.seconds - old.seconds)
            if diff.calls:
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
        objs: list = [None] * dist.get_world_size()
        dist.all_gather_object(objs, self.rows())
        return CommLedger.merge([CommLedger.from_rows(rows, rank=i) for i, rows in enumerate(objs)])

    # -- files -------------------------------------------------------------------------------
    @staticmethod
    def from_rows(rows: list[dict], rank: int = 0) -> "CommLedger":
        led = CommLedger(rank)
        for r in rows:
            led._rows[(r["dim"], r["op"])] = Row(r["calls"], r["message_bytes"], r["bytes_sent"], r["seconds"])
        return led

    def to_dict(self) -> dict:
        return {"world_size": len(self.per_rank()), "rows": self.rows(),
                "per_rank": [{"rank": i, "rows": led.rows()} for i, led in enumerate(self.per_rank())]}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @staticmethod
    def read(path: str | Path) -> "CommLedger":
        d = json.loads(Path(path).read_text())
        return CommLedger.merge([CommLedger.from_rows(p["rows"], p["rank"]) for p in d["per_rank"]])

    def table(self) -> str:
        """A readable table: per dimension and op, calls, message bytes, bytes sent and seconds."""
        lines = [f"{'dim':<10}{'op':<16}{'calls':>8}{'message':>12}{'sent':>12}{'seconds':>10}"]
        for r in self.rows():
            lines.append(f"{r['dim']:<10}{r['op']:<16}{r['calls']:>8}{fmt_bytes(r['message_bytes']):>12}"
                         f"{fmt_bytes(r['bytes_sent']):>12}{r['seconds']:>10.3f}")
        if len(lines) == 1:
            lines.append("(no communication)")
        return "\n".join(lines)


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
