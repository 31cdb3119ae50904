"""Fixtures shared by several test files: a spawn of ranks is started once per session and runs the
cases of every file that needs that world size (process start-up dominates the suite's time)."""
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """pytest-xdist's `--dist loadgroup` (the Makefile's) runs an xdist group on one worker: every test
    without a group of its own joins its file's, so a file's module fixtures and shared spawns run once
    per worker, and a long file spreads over workers by naming groups for some of its tests
    (test_benchmarks.py's smoke shards, test_dry_run.py's 405B cases). Runs before xdist reads the marks."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


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
