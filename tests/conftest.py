"""Fixtures shared by several test files: a spawn of ranks is started once per session and runs the
cases of every file that needs that world size (process start-up dominates the suite's time)."""
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CORPUS_MARK = ".fivefold-test-corpus"   # written last: a folder holding it is complete


def pytest_configure(config):
    """Every test, and every process a test starts, reads the suite's generated corpus where it would read
    the standard library (train/corpus.py's FIVEFOLD_DEFAULT_CORPUS; tests/support/corpus.py): no test
    depends on which Python the machine has. The first process unpacks it; xdist workers inherit it."""
    from fivefold.train.corpus import DEFAULT_CORPUS_ENV
    from tests.support.corpus import unpack_suite_corpus

    folder = os.environ.get(DEFAULT_CORPUS_ENV)
    if folder and (Path(folder) / CORPUS_MARK).is_file():
        return
    folder = Path(tempfile.mkdtemp(prefix="fivefold-corpus-"))
    unpack_suite_corpus(folder)
    (folder / CORPUS_MARK).write_text("")
    os.environ[DEFAULT_CORPUS_ENV] = str(folder)
    config.fivefold_corpus = folder


def pytest_unconfigure(config):
    folder = getattr(config, "fivefold_corpus", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (the Makefile's), our way: a worker takes a whole group at a time, and a test's
    group is its file, so a file's module fixtures and shared spawns run once per worker; a long file
    spreads over workers by ending some tests' ids with "@name", a group of their own within the file
    (test_benchmarks.py's smoke shards, test_dry_run.py's 405B cases). pytest-xdist's own loadgroup reads
    `xdist_group` marks but cannot tag the node ids it schedules by under pytest 9 (`Item._nodeid` is
    gone), so it would run every test alone."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return FileGroups(config, log)


def group_of(nodeid: str) -> str:
    """A test's xdist group: its file, or "file@name" when its parameter id ends with "@name"."""
    file = nodeid.split("::")[0]
    ident = nodeid[nodeid.rfind("[") + 1:-1] if nodeid.endswith("]") else ""
    return f"{file}@{ident.rsplit('@', 1)[1]}" if "@" in ident else file


@pytest.fixture(scope="session")
def docs_file(tmp_path_factory):
    """A token file of byte-level documents with their offsets (test_documents.py's data)."""
    from tests.support.documents import write_documents

    path = tmp_path_factory.mktemp("docs") / "docs.bin"
    write_documents(path)
    return path


@pytest.fixture(scope="session")
def context_four(docs_file):
    """test_context.py's 4-rank spawn, which also runs test_documents.py's 4-rank cases."""
    from tests.ranks.test_context import spawn
    from tests.ranks.test_documents import four_rank_jobs

    return spawn(4, four_rank_jobs(docs_file))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """tests/unit is what `make test-fast` runs: nothing there may start a process or a process group. Judged by
    what a test does, not by its mark: while a unit test is set up (its fixtures, module-wide ones included),
    runs and is torn down, starting a subprocess, a multiprocessing process or a torch process group fails
    it, naming where it belongs (tests/ranks, marked `ranks`)."""
    if Path(str(item.fspath)).parent.name != "unit":
        yield
        return

    def refuse(what):
        def started(*args, **kwargs):
            raise AssertionError(f"{item.nodeid} started {what}: tests/unit spawns nothing; move the test to "
                                 f"tests/ranks (pytestmark = pytest.mark.ranks)")
        return started

    patched = [(subprocess.Popen, "__init__", refuse("a subprocess")),
               (multiprocessing.process.BaseProcess, "start", refuse("a multiprocessing process"))]
    if "torch.distributed" in sys.modules:
        patched.append((sys.modules["torch.distributed"], "init_process_group", refuse("a process group")))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, fn in patched:
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
