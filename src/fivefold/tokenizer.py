"""Tokenizers, torch-free: text <-> token ids for training data, `fivefold tokenize` and `generate`.

Three kinds, told apart by the file's content (never its name):
- `ByteTokenizer` (no file): the UTF-8 bytes of the text, vocabulary 256, no end-of-text token. The
  zero-download default, and exactly what training reads from a text file without `--tokenizer`.
- a Hugging Face `tokenizer.json` (a JSON object with a "model"), read with the `tokenizers` library.
  Text is encoded without the post-processor's special tokens (no BOS); the end-of-text id is the first
  of `EOS_NAMES` the vocabulary holds, else None.
- a tiktoken BPE ranks file (a line "BASE64TOKEN RANK" per token, `tiktoken.load.load_tiktoken_bpe`'s
  format), read by `tiktoken` with the GPT-4 (cl100k) split pattern and `<|endoftext|>` appended as the
  last id, which is the end-of-text id. The file is parsed here rather than by `load_tiktoken_bpe`,
  which copies every file it reads into a cache keyed by its path (a changed file would be read stale).

`Tokenizer.digest` (a hash of the file's bytes; "bytes" for the default) says which tokenizer made a
token file, so a run refuses data made by another one. `save_to_run(path, out)` copies the file into a
run folder under `RUN_FILES[kind]`; `run_tokenizer(run)` loads it back (ByteTokenizer when the run had
none). The model's vocabulary is `vocab_size`; tensor parallelism pads it to a multiple of tp
itself (`shapes.padded_vocab`), so nothing here rounds it.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Protocol, runtime_checkable

from .rules import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "TiktokenTokenizer", "Tokenizer", "detect_kind", "file_digest",
           "load_tokenizer", "run_tokenizer", "run_tokenizer_file", "save_to_run"]

# GPT-4's (cl100k) pre-tokenizer split: contractions, letter runs, 1-3 digit groups, punctuation, spaces
GPT_SPLIT = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
             r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
ENDOFTEXT = "<|endoftext|>"
# end-of-text tokens looked up, in this order, in a Hugging Face vocabulary
EOS_NAMES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
# the fixed name a run folder keeps its tokenizer under, by kind
RUN_FILES = {"hf": "tokenizer.json", "tiktoken": "tokenizer.tiktoken"}
TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*\s+\d+$")
KINDS = ('a Hugging Face tokenizer.json (a JSON object with a "model")',
         'a tiktoken BPE ranks file (lines "BASE64TOKEN RANK")')


@runtime_checkable
class Tokenizer(Protocol):
    """What training, `tokenize` and `generate` need of a tokenizer."""

    name: str            # kind and file name, e.g. "hf:tokenizer.json"; "bytes" for the default
    vocab_size: int      # ids are in [0, vocab_size)
    eos_id: int | None   # appended after each document by `fivefold tokenize`; None: nothing is
    digest: str          # hash of the tokenizer file's bytes ("bytes" for the default)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids (vocabulary 256, no end-of-text token): what a text file trains on by default."""

    name = "bytes"
    vocab_size = 256
    eos_id = None
    digest = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; an id outside [0, 256) (a padded row) decodes as U+FFFD, like a broken byte."""
        return bytes(i if 0 <= i < 256 else 0xFF for i in ids).decode("utf-8", errors="replace")


def _require(module: str, path, what: str):
    """Import the optional package that reads `what`, or a one-line error naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"tokenizer {path}: reading {what} needs the {module} package "
                          f"(pip install 'fivefold[data]')") from None


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` library)."""

    def __init__(self, path: str | Path):
        backend = _require("tokenizers", path, "a tokenizer.json")
        try:
            self.backend = backend.Tokenizer.from_file(str(path))
        except Exception as e:   # the library raises its own Exception type for malformed files
            raise ConfigError(f"tokenizer {path}: not a valid Hugging Face tokenizer.json ({_first_line(e)})") from None
        self.name, self.digest = f"hf:{Path(path).name}", file_digest(path)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for t in EOS_NAMES if (i := self.backend.token_to_id(t)) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


class TiktokenTokenizer:
    """A tiktoken BPE ranks file with the GPT-4 split pattern and `<|endoftext|>` appended."""

    def __init__(self, path: str | Path):
        tiktoken = _require("tiktoken", path, "a tiktoken BPE file")
        ranks = read_bpe_ranks(path)
        self.eos_id = max(ranks.values()) + 1
        self.vocab_size = self.eos_id + 1
        self.name, self.digest = f"tiktoken:{Path(path).name}", file_digest(path)
        try:
            self.backend = tiktoken.Encoding(self.name, pat_str=GPT_SPLIT, mergeable_ranks=ranks,
                                             special_tokens={ENDOFTEXT: self.eos_id})
        except ValueError as e:
            raise ConfigError(f"tokenizer {path}: not a usable tiktoken BPE file ({_first_line(e)})") from None

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; "<|endoftext|>" inside the text is ordinary text, not the special token."""
        return self.backend.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), errors="replace")


def read_bpe_ranks(path: str | Path) -> dict[bytes, int]:
    """{token bytes: rank} of a tiktoken ranks file (one "BASE64TOKEN RANK" per line; blank lines skipped)."""
    ranks = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ConfigError(f"tokenizer {path}: line {n} is not 'BASE64TOKEN RANK' (tiktoken BPE format)") from None
    if not ranks:
        raise ConfigError(f"tokenizer {path}: the tiktoken BPE file holds no tokens")
    return ranks


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def file_digest(path: str | Path) -> str:
    """The first 16 hex digits of the SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def detect_kind(path: str | Path) -> str:
    """"hf" or "tiktoken" by the file's content; ConfigError naming both rules otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tokenizer {path}: no such file; give {KINDS[0]} or {KINDS[1]}")
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.lstrip().startswith(b"{"):
        try:
            if "model" in json.loads(path.read_text(encoding="utf-8")):
                return "hf"
        except (ValueError, UnicodeDecodeError, TypeError):
            pass
    else:
        first = next((line for line in head.splitlines() if line.strip()), b"")
        if TIKTOKEN_LINE.match(first.strip()):
            return "tiktoken"
    raise ConfigError(f"tokenizer {path}: not a known tokenizer file; give {KINDS[0]} or {KINDS[1]}")


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer in file `path` (kind told by content), or the byte-level one for None / ""."""
    if path is None or str(path) == "":
        return ByteTokenizer()
    return {"hf": HFTokenizer, "tiktoken": TiktokenTokenizer}[detect_kind(path)](path)


def save_to_run(tokenizer_path: str | Path | None, out_dir: str | Path) -> Path | None:
    """Copy the tokenizer file into run folder `out_dir` as RUN_FILES[kind] (a temporary copy renamed
    into place) and remove any other tokenizer copy there, so the folder names exactly the run's
    tokenizer; None for the byte-level default (then no copy is left)."""
    out_dir = Path(out_dir)
    dest = None
    if tokenizer_path is not None and str(tokenizer_path) != "":
        out_dir.mkdir(parents=True, exist_ok=True)
        dest = out_dir / RUN_FILES[detect_kind(tokenizer_path)]
        tmp = out_dir / f".{dest.name}.{os.getpid()}.tmp"
        shutil.copyfile(tokenizer_path, tmp)
        tmp.replace(dest)
    for name in RUN_FILES.values():
        if dest is None or name != dest.name:
            (out_dir / name).unlink(missing_ok=True)
    return dest


def run_tokenizer_file(run_dir: str | Path) -> Path | None:
    """The tokenizer file a run folder keeps (also found from one of its checkpoints/step-N folders), or None."""
    run_dir = Path(run_dir)
    folder = run_dir.parents[1] if (run_dir / "index.json").is_file() else run_dir   # step-N -> its run
    for name in RUN_FILES.values():
        if (folder / name).is_symlink():   # never followed out of the run folder
            raise ConfigError(f"{folder / name} is a symbolic link; a run's tokenizer copy must be its own file")
    return next((folder / name for name in RUN_FILES.values() if (folder / name).is_file()), None)


def run_tokenizer(run_dir: str | Path) -> Tokenizer:
    """The tokenizer a run trained with (ByteTokenizer when it had none)."""
    return load_tokenizer(run_tokenizer_file(run_dir))
