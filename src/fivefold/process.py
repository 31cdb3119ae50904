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


def host_cpu() -> str:
    """The host CPU's model name (/proc/cpuinfo's), else its architecture. Never `platform.processor()`,
    which starts `uname -p` in a subprocess on Linux the first time it is asked (inside a rank, a test or a
    fork-sensitive loader that is a process nobody expects)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


def host_platform() -> str:
    """System, release and architecture (`platform.platform()` reads the processor too: see `host_cpu`)."""
    import platform

    return "-".join(x for x in (platform.system(), platform.release(), platform.machine()) if x)
