"""The default corpus (train/corpus.py): the standard library of the Python that runs, recorded in what a
run writes; FIVEFOLD_DEFAULT_CORPUS reads another folder instead (the suite's frozen corpus, tests/conftest.py).
No test reads the machine's standard library: its walk is tested on a stand-in made here."""
import platform
import sysconfig

from fivefold.config import TrainConfig
from fivefold.train import rundir
from fivefold.train.corpus import DEFAULT_CORPUS_ENV, data_identity, default_corpus, read_tokens, stdlib_files

from tests.support.corpus import unpack_suite_corpus


def test_without_the_variable_the_default_corpus_is_this_pythons_library_and_says_so(tmp_path, monkeypatch):
    """The default names this Python's library (a path, read from sysconfig: no file of it is read here, its
    text differs between Pythons) and walks it as the run would: a stand-in library made here, its sources
    in sorted path order, site-packages and linked folders left out."""
    import fivefold.train.corpus as corpus

    monkeypatch.delenv(DEFAULT_CORPUS_ENV, raising=False)
    assert default_corpus() == {"folder": sysconfig.get_paths()["stdlib"], "python": platform.python_version()}
    lib = tmp_path / "lib"
    for rel in ("os.py", "abc.py", "json/__init__.py", "json/decoder.py", "site-packages/numpy.py", "notes.txt"):
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(rel)
    (lib / "linked").symlink_to(lib / "json")
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    assert default_corpus() == {"folder": str(lib), "python": platform.python_version()}
    assert list(stdlib_files()) == [lib / "abc.py", lib / "json/__init__.py", lib / "json/decoder.py", lib / "os.py"]
    assert data_identity(TrainConfig())["default"] == default_corpus()   # run.json's and a checkpoint's "data"
    assert "default" not in data_identity(TrainConfig(data=[str(lib / "os.py")]))   # the user's files name themselves


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
