"""Imports flow one way (DESIGN.md): planning needs neither torch nor processes."""
import subprocess
import sys


def test_planner_does_not_import_torch():
    code = ("import sys, fivefold.plan.search, fivefold.plan.estimate, fivefold.plan.report, "
            "fivefold.parallel.pipeline.schedules; assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_nothing_imports_cli():
    import re
    from pathlib import Path
    src = Path(__file__).resolve().parents[1] / "src" / "fivefold"
    top_cli = re.compile(r"from \.\.+cli import|from fivefold\.cli import|import fivefold\.cli")
    for f in src.rglob("*.py"):
        assert not top_cli.search(f.read_text()), f"{f} imports fivefold.cli"
