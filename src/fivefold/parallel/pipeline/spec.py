"""The pipeline schedule as one value: `Schedule(kind, vpp, microbatches, microbatch_group,
partition)`.

A run's (or a plan's) pipeline is built once, from the config (`Schedule.of(cfg)`) or from the planner's
layout (`plan.layout.schedule_of`), and every consumer takes that value instead of re-reading loose
fields: the runtime builds its action lists from it (`actions()`), the simulator times it
(`simulate()`), the timeline titles it (`title()`), and `pipeline.json` writes it (`to_dict()`, read back
by `from_dict`), so a run's measured timeline is compared with the schedule it ran, micro-batch group
included. Construction checks every rule (`rules.check_schedule`); the interleaved schedule's group is
stored resolved (N = pp when the config says 0), so two values of one schedule are equal.

Pure Python: the planner imports it (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...rules import INTERLEAVED, ScheduleKind, check_schedule
from .partition import Partition, partition_layers


def title(kind: str, pp: int, microbatches: int, vpp: int = 1, group: int = 0) -> str:
    """A timeline drawing's title: kind, pp, micro-batches, and vpp and N (0: pp) when interleaved."""
    extra = f" vpp={vpp} N={group or pp}" if kind == INTERLEAVED and vpp > 1 else ""
    return f"{kind} pp={pp} m={microbatches}{extra}"


@dataclass(frozen=True)
class Schedule:
    """What a pipeline runs in one step: schedule `kind`, `vpp` chunks per rank, `microbatches` per step,
    the interleaved schedule's micro-batches per group (`microbatch_group`, N, resolved; 0 for the other
    schedules; `parallel.microbatch_group` and pipeline.json name it so) and
    the layer `partition` (whose `pp` is the number of pipeline ranks)."""

    kind: ScheduleKind
    vpp: int
    microbatches: int
    microbatch_group: int
    partition: Partition

    def __post_init__(self):
        check_schedule(self.kind, self.pp, self.vpp, self.microbatches, self.microbatch_group)
        if self.partition.vpp != self.vpp:
            raise ValueError(f"a Schedule's partition has vpp {self.partition.vpp}, the schedule {self.vpp}")
        if self.interleaved:   # N = pp when the config says 0: one schedule, one value
            object.__setattr__(self, "microbatch_group", self.microbatch_group or self.pp)

    @staticmethod
    def of(cfg) -> "Schedule":
        """The schedule of a `Config` (parallel.schedule, vpp, microbatches, microbatch_group, partition
        of model.layers)."""
        p = cfg.parallel
        return Schedule.build(p.schedule, p.pp, p.vpp, p.microbatches, p.microbatch_group, cfg.model.layers,
                              p.partition)

    @staticmethod
    def build(kind: str, pp: int, vpp: int, microbatches: int, group: int, layers: int,
              partition: str = "even") -> "Schedule":
        """From loose fields: `layers` split over pp·vpp chunks by `partition` (even | llama3 | counts)."""
        return Schedule(kind, vpp, microbatches, group, partition_layers(layers, pp, vpp, partition))

    @property
    def pp(self) -> int:
        return self.partition.pp

    @property
    def interleaved(self) -> bool:
        """Chunks interleaved over the ranks (the interleaved schedule with vpp > 1)."""
        return self.kind == INTERLEAVED and self.vpp > 1

    @property
    def config_group(self) -> int:
        """The group as `parallel.microbatch_group` / `build_schedule` take it (0: the default, pp)."""
        return self.microbatch_group if self.interleaved else 0

    def actions(self, communication: bool = True) -> list:
        """Every pipeline rank's action list (`schedules.build_schedule`)."""
        from .schedules import build_schedule

        return build_schedule(self.kind, self.pp, self.microbatches, self.vpp, communication, self.config_group)

    def simulate(self, cost_f: float = 1.0, cost_b: float = 2.0, cost_i: float = 1.0, cost_w: float = 1.0,
                 comm: float = 0.0, blocking: bool = False):
        """`schedules.simulate_schedule` of this schedule (costs per stage)."""
        from .schedules import simulate_schedule

        return simulate_schedule(self.kind, self.pp, self.microbatches, self.vpp, cost_f, cost_b, cost_i, cost_w,
                                 comm, blocking, self.config_group)

    def title(self) -> str:
        """A timeline drawing's title (`title`)."""
        return title(self.kind, self.pp, self.microbatches, self.vpp, self.microbatch_group)

    def to_dict(self) -> dict:
        """The keys pipeline.json carries at its top level."""
        return {"schedule": self.kind, "pp": self.pp, "vpp": self.vpp, "microbatches": self.microbatches,
                "microbatch_group": self.microbatch_group, "partition": list(self.partition.counts)}

    @staticmethod
    def from_dict(d: dict) -> "Schedule":
        """The value `to_dict` wrote (pipeline.json)."""
        return Schedule(d["schedule"], d["vpp"], d["microbatches"], d["microbatch_group"],
                        Partition(tuple(d["partition"]), d["pp"], d["vpp"]))
