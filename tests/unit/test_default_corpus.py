"""The default corpus (train/corpus.py): the standard library of the Python that runs, recorded in what a
run writes; FIVEFOLD_DEFAULT_CORPUS reads another folder instead (the suite's generated corpus,
tests/conftest.py). The only test file that reads the machine's standard library."""
import platform
import sysconfig
from pathlib import Path

from fivefold.config import TrainConfig
from fivefold.train import rundir
from fivefold.train.corpus import DEFAULT_CORPUS_ENV, data_identity, default_corpus, read_tokens, stdlib_files

from tests.support.corpus import unpack_suite_corpus


def test_without_the_variable_the_default_corpus_is_this_pythons_library_and_says_so(monkeypatch):
    monkeypatch.delenv(DEFAULT_CORPUS_ENV, raising=False)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert default_corpus() == {"folder": str(stdlib), "python": platform.python_version()}
    first = [f for _, f in zip(range(20), stdlib_files())]
    assert first and all(f.suffix == ".py" and stdlib in f.parents for f in first)
    assert first == sorted(first)
    assert data_identity(TrainConfig())["default"] == default_corpus()   # run.json's and a checkpoint's "data"
    assert "default" not in data_identity(TrainConfig(data=[str(first[0])]))   # the user's files name themselves


def test_the_variable_reads_its_folder_and_a_resume_on_another_default_corpus_is_warned(tmp_path, monkeypatch):
    (tmp_path / "b.py").write_text("bb")
    (tmp_path / "a.py").write_text("aa")
    (tmp_path / "notes.txt").write_text("not python")
    monkeypatch.setenv(DEFAULT_CORPUS_ENV, str(tmp_path))
    assert list(stdlib_files()) == [tmp_path / "a.py", tmp_path / "b.py"]
    assert bytes(read_tokens(None, 1.0)) == b"aabb"
    here = data_identity(TrainConfig())
    assert here["default"] == {"folder": str(tmp_path.resolve())}
    other = {**here, "default": {"folder": "/usr/lib/python3.13", "python": "3.13.1"}}
    errors, warnings = rundir.compare_data(other, here)
    assert not errors and len(warnings) == 1 and "default corpus" in warnings[0]
    assert rundir.compare_data(here, here) == ([], [])


def test_the_suites_corpus_is_the_archive_the_repository_holds(tmp_path, monkeypatch):
    """What every other test trains on: the frozen archive's files, checked against its digest, read in
    the same order by the same walk as the standard library."""
    files = unpack_suite_corpus(tmp_path)
    assert len(files) == 115 and sum(f.stat().st_size for f in files) == 1_599_883
    monkeypatch.setenv(DEFAULT_CORPUS_ENV, str(tmp_path))
    assert list(stdlib_files()) == files
    assert len(read_tokens(None, 0.0)) == 1_599_883
