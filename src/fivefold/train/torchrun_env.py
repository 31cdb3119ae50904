"""Whether this process is a rank of a torchrun job, read from torchrun's environment (torch-free: the
CLI asks before it validates a config, and validation must not wait for torch's import)."""
from __future__ import annotations

import os


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world_size) when started by torchrun, else None. Read only by the launcher."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def torchrun_ranks_per_node() -> int | None:
    """Ranks on this node when started by torchrun (its LOCAL_WORLD_SIZE: --nproc-per-node), else None.
    Read only by the launcher, which passes it on as parallel.ranks_per_node."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if torchrun_env() is not None and value.isdigit() else None
