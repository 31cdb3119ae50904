"""Pipeline parallelism: layer partitions, schedules as data and a simulator.

Pure Python (no torch): `Schedule` is a run's pipeline as one value (spec.py: kind, vpp, micro-batches,
group, partition; built once from the config), `partition_layers` splits layers into (virtual) stages,
`build_schedule` gives each rank its list of `Action`s, `simulate` runs the lists and reports bubble, in-flight micro-batches
and deadlocks. The process-level executor lives in `runtime.py` (torch; imported by the trainer, not
here, so planning needs no torch). Nothing here draws: timelines are drawn by train/timeline.py.
"""
from .partition import Partition, partition_layers
from .spec import Schedule
from .schedules import (B, COMM, COMPUTE, F, I, RECV_B, RECV_F, SCHEDULES, SEND_B, SEND_F, W, Action, Block,
                        DeadlockError, ScheduleError, Simulation, add_communication, build_schedule,
                        check_actions, closed_form_bubble, compute_only, gpipe, input_messages,
                        interleaved_1f1b, message_key, one_f_one_b, simulate, simulate_schedule, steps,
                        timeline_stats, zero_bubble_h1)

__all__ = [
    "Partition", "partition_layers", "Schedule",
    "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "COMPUTE", "COMM", "SCHEDULES",
    "Action", "Block", "Simulation", "DeadlockError", "ScheduleError",
    "build_schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "add_communication",
    "check_actions", "compute_only", "steps", "message_key", "input_messages",
    "simulate", "simulate_schedule", "timeline_stats", "closed_form_bubble",
]
