"""The import floors of docs/architecture.md hold: `lint-imports` checks the contracts in pyproject.toml
([tool.importlinter]: the floors cli -> tools -> train | plan -> parallel -> ..., a torch-free planner, nothing
below imports tools/ or the CLI, parallel/ draws nothing and parses no arguments, moe.py never imports transformer.py)."""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT



@pytest.mark.ranks
def test_import_contracts_hold():
    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.exists(), "lint-imports is missing: install the test extra (pip install -e '.[test]')"
    r = subprocess.run([str(exe), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout
