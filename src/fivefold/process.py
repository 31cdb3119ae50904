"""What every command does around its own work, torch-free (cli.py's `main` calls both): third-party
progress bars off before any of them is imported, and which errors are a failed rank (one line, exit 1)
rather than a bug (a traceback)."""
from __future__ import annotations

import os
import sys

QUIET_THIRD_PARTY = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def quiet_third_party_bars() -> None:
    """Third-party progress bars off for this process and the ranks it spawns (QUIET_THIRD_PARTY)."""
    for name, value in QUIET_THIRD_PARTY.items():
        os.environ.setdefault(name, value)


def is_rank_failure(e: BaseException) -> bool:
    """A failed rank (`train.launch.RankError`) or the hang watchdog (TimeoutError). Decided without importing
    train.launch, which needs torch: a RankError exists only once that module has been imported, so when it
    is not in sys.modules the error is not one (`fivefold plan` and `schedule` run without torch)."""
    if isinstance(e, TimeoutError):
        return True
    launch = sys.modules.get("fivefold.train.launch")
    return launch is not None and isinstance(e, launch.RankError)
