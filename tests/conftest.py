"""Fixtures shared by several test files: a spawn of ranks is started once per session and runs the
cases of every file that needs that world size (process start-up dominates the suite's time)."""
import pytest


@pytest.fixture(scope="session")
def docs_file(tmp_path_factory):
    """A token file of byte-level documents with their offsets (test_documents.py's data)."""
    from .test_documents import write_documents

    path = tmp_path_factory.mktemp("docs") / "docs.bin"
    write_documents(path)
    return path


@pytest.fixture(scope="session")
def context_four(docs_file):
    """test_context.py's 4-rank spawn, which also runs test_documents.py's 4-rank cases."""
    from .test_context import spawn
    from .test_documents import four_rank_jobs

    return spawn(4, four_rank_jobs(docs_file))
