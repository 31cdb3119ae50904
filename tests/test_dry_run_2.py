"""The second half of the dry-run cases (tests/test_dry_run.py: the cases, what they check, why split)."""
import pytest

from .test_dry_run import SECOND, check_case

pytestmark = pytest.mark.ranks


@pytest.mark.parametrize("case", SECOND)
def test_model_state_and_ledger_equal_the_planner(tmp_path, case):
    check_case(tmp_path, case)
