"""The suite's own shape, as README.md's "Tests and benchmarks" describes it: tests/unit/ spawns nothing,
tests/ranks/ holds every file that does (marked `ranks`), a test file imports shared pieces from
tests/support/ and never from another test file, tests reach the command line only through `main`, and a
long file spreads over workers by xdist groups (tests/conftest.py), not by being split in numbered files."""
import ast
import re

from tests.support.paths import ROOT

TESTS = ROOT / "tests"


def _test_files(folder: str) -> list:
    return sorted((TESTS / folder).glob("test_*.py"))


def _imported(path) -> list[str]:
    """Every module a file imports (absolute names; a relative import keeps its dots), at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append("." * node.level + (node.module or ""))
    return out


RANKS_MARK = re.compile(r"^\s*(@pytest\.mark\.ranks\b|pytestmark\b.*\bmark\.ranks\b)", re.M)


def test_every_test_file_is_in_unit_or_ranks_by_what_it_spawns():
    assert not list(TESTS.glob("test_*.py")), "a test file outside tests/unit and tests/ranks"
    for path in _test_files("unit"):
        assert not RANKS_MARK.search(path.read_text()), f"{path.name} spawns: it belongs in tests/ranks/"
    for path in _test_files("ranks"):
        assert RANKS_MARK.search(path.read_text()), f"{path.name} spawns nothing: it belongs in tests/unit/"


def test_no_test_file_imports_another_and_the_cli_only_through_main():
    for path in _test_files("unit") + _test_files("ranks") + sorted((TESTS / "support").glob("*.py")):
        for module in _imported(path):
            assert not module.startswith("."), f"{path.name}: relative import {module}"
            assert not re.match(r"tests\.(unit|ranks)\b", module), f"{path.name} imports the test file {module}"
        text = path.read_text()
        # in-process and in the code a test hands to a fresh interpreter alike
        for names in re.findall(r"from fivefold\.cli import ([\w, ]+)", text):
            assert {n.strip().split(" as ")[0] for n in names.split(",")} == {"main"}, f"{path.name}: {names}"


def test_no_file_is_split_in_numbered_parts():
    for path in _test_files("unit") + _test_files("ranks"):
        assert not re.search(r"_(\d+|smoke_\d+)\.py$", path.name), f"{path.name}: use an xdist group instead"


def test_a_tests_xdist_group_is_its_file_unless_its_id_names_one():
    from tests.conftest import group_of

    assert group_of("tests/unit/test_x.py::test_a") == "tests/unit/test_x.py"
    assert group_of("tests/unit/test_x.py::test_a[2-fp32]") == "tests/unit/test_x.py"
    assert group_of("tests/ranks/test_benchmarks.py::test_benchmark_runs_one_step[ddp.py@smoke-1]") == \
        "tests/ranks/test_benchmarks.py@smoke-1"
    assert group_of("tests/ranks/test_x.py::TestA::test_b[a@b@c]") == "tests/ranks/test_x.py@c"


def test_a_unit_test_that_starts_a_process_fails_naming_tests_ranks():
    """The guard judges what a unit test does (tests/conftest.py pytest_runtest_protocol), not its mark: a
    subprocess or a multiprocessing process started here fails, naming tests/ranks."""
    import multiprocessing
    import subprocess
    import sys

    import pytest

    with pytest.raises(AssertionError, match="tests/unit spawns nothing; move the test to tests/ranks"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(AssertionError, match="started a multiprocessing process"):
        multiprocessing.get_context("spawn").Process(target=print).start()
