"""Imports flow one way (docs/architecture.md, "Floors"): planning needs neither torch nor processes. The layer contracts
themselves (and "nothing imports fivefold.cli") are checked by import-linter: tests/ranks/test_layers.py."""
import subprocess
import sys

import pytest


@pytest.mark.ranks
def test_planner_and_the_shared_facts_do_not_import_torch():
    code = ("import sys, fivefold.plan.search, fivefold.plan.estimate, fivefold.plan.report, fivefold.tools.plan, "
            "fivefold.config, fivefold.rules, fivefold.grid, fivefold.shapes, fivefold.comm.volume, "
            "fivefold.parallel.pipeline.partition, fivefold.parallel.pipeline.schedules; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
