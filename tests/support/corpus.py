"""A small corpus of sentences (DOCS), a tiny model's flags for it, and the one-line error check of the
tokenizer commands."""


WORDS = ("the quick brown fox jumps over the lazy dog while seven zebras quietly hum old songs; "
         "naïve café owners count 12 345 coins — déjà vu").split()


DOCS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + i % 13)) + "." for i in range(240)]


TINY = ["--set", "model.hidden=32", "--set", "model.layers=2", "--set", "model.ffn=64", "--set", "model.heads=2",
        "--set", "model.kv_heads=2", "--set", "model.max_seq=32", "--seq-len", "16", "--global-batch", "8",
        "--set", "train.warmup=1"]


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]



# -- the suite's default corpus ---------------------------------------------------------------------------
# The default corpus is the machine's own Python standard library, which differs between Pythons: a test
# trained on it passes on one machine and fails on another (tests/ranks/test_keep_best.py did). The suite
# reads a frozen corpus the repository holds instead: fivefold's own Python sources as they were at commit
# 7fc86c8 (115 files, 1.6 MB, 0.48 MB packed), real source text as the standard library is (a generated Python-like
# corpus was tried: its more repetitive text left 4x as many fp32 elements outside the layout tests'
# rounding tolerance, tests/support/tiny.py FP32). tests/conftest.py unpacks it for the session and points
# FIVEFOLD_DEFAULT_CORPUS (train/corpus.py) at it for every process. No test reads the standard library:
# tests/unit/test_default_corpus.py walks a stand-in it makes.

from pathlib import Path

SUITE_CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "fivefold-src-7fc86c8.tar.gz"
SUITE_CORPUS_SHA256 = "707e836eb3c6fbfbe4096c8dcb42623bd5c892fa0d8980e3544860e638c4d7e5"


def unpack_suite_corpus(folder) -> list[Path]:
    """The suite's corpus as .py files in `folder` (regular members only, by their base names); the
    archive is checked against its digest first. Returns the files written, sorted."""
    import hashlib
    import tarfile

    data = SUITE_CORPUS.read_bytes()
    if hashlib.sha256(data).hexdigest() != SUITE_CORPUS_SHA256:
        raise RuntimeError(f"{SUITE_CORPUS} is not the suite's corpus (its SHA-256 differs)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(SUITE_CORPUS, "r:gz") as archive:
        for member in archive.getmembers():
            name = Path(member.name).name
            if member.isfile() and name.endswith(".py"):
                (folder / name).write_bytes(archive.extractfile(member).read())
                written.append(folder / name)
    return sorted(written)
