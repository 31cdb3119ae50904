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

End and start of text you control (`--eos TOKEN`, `--bos TOKEN` of tokenize, train and export;
`train.eos`, `train.bos`): `load_tokenizer(path, eos, bos)` sets `eos_id` / `bos_id` to the ids of
those tokens of the vocabulary (an unknown one is a one-line ConfigError; `none` means no such token);
without them the end-of-text id is found as above and there is no BOS. `missing_eos(tokenizer)` is the
warning the commands print when a tokenizer's end-of-text cannot be found: then documents get no
separator, `generate` no stop and an export `eos_token_id: null`. A run folder keeps the choice beside
its tokenizer copy (`SPECIALS`), so generate and export read it back with the tokenizer.

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

from .rules import ConfigError, install_hint

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
SPECIALS = "tokenizer-special.json"   # a run's --eos / --bos, beside its tokenizer copy
TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*\s+\d+$")
KINDS = ('a Hugging Face tokenizer.json (a JSON object with a "model")',
         'a tiktoken BPE ranks file (lines "BASE64TOKEN RANK")')


@runtime_checkable
class Tokenizer(Protocol):
    """What training, `tokenize` and `generate` need of a tokenizer."""

    name: str            # kind and file name, e.g. "hf:tokenizer.json"; "bytes" for the default
    vocab_size: int      # ids are in [0, vocab_size)
    eos_id: int | None   # appended after each document by `fivefold tokenize`; None: nothing is
    bos_id: int | None   # put before each document (only when chosen: --bos); None: nothing is
    digest: str          # hash of the tokenizer file's bytes ("bytes" for the default)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids (vocabulary 256, no end-of-text token): what a text file trains on by default."""

    name = "bytes"
    vocab_size = 256
    eos_id = None
    bos_id = None
    digest = "bytes"

    def token_id(self, token: str) -> int | None:
        """The id of a one-byte text (e.g. "\n"), else None."""
        raw = token.encode("utf-8")
        return raw[0] if len(raw) == 1 else None

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
                          f"({install_hint('data')})") from None


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
        self.bos_id = None

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

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
        self.bos_id = None
        self.vocab_size = self.eos_id + 1
        self.name, self.digest = f"tiktoken:{Path(path).name}", file_digest(path)
        try:
            self.backend = tiktoken.Encoding(self.name, pat_str=GPT_SPLIT, mergeable_ranks=ranks,
                                             special_tokens={ENDOFTEXT: self.eos_id})
        except ValueError as e:
            raise ConfigError(f"tokenizer {path}: not a usable tiktoken BPE file ({_first_line(e)})") from None

    def token_id(self, token: str) -> int | None:
        """<|endoftext|>'s id, or the rank of a token the BPE file holds whole."""
        if token == ENDOFTEXT:
            return self.eos_id
        try:
            return self.backend.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

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


def load_tokenizer(path: str | Path | None, eos: str | None = None, bos: str | None = None) -> Tokenizer:
    """The tokenizer in file `path` (kind told by content), or the byte-level one for None / ""; `eos`,
    `bos` (token texts, "none", or None / "": the default) choose its end- and start-of-text ids."""
    tok = ByteTokenizer() if path is None or str(path) == "" else \
        {"hf": HFTokenizer, "tiktoken": TiktokenTokenizer}[detect_kind(path)](path)
    for option, token in (("eos", eos), ("bos", bos)):
        if token:
            setattr(tok, f"{option}_id", special_id(tok, token, option))
    return tok


def special_id(tok: Tokenizer, token: str, option: str) -> int | None:
    """The id `--eos` / `--bos` TOKEN names (None for "none"); one line naming the option otherwise."""
    if token.lower() == "none":
        return None
    found = tok.token_id(token)
    if found is None:
        raise ConfigError(f"--{option} {token!r}: tokenizer {tok.name} has no such token; give one token of its "
                          f"vocabulary (e.g. {ENDOFTEXT}, </s>, <|im_end|>), or none")
    return found


def missing_eos(tok: Tokenizer, eos: str | None = None) -> str | None:
    """The warning for a tokenizer whose end-of-text the tool cannot find (None when it has one, was
    told "none", or is the byte-level default, which has none by design)."""
    if tok.eos_id is not None or isinstance(tok, ByteTokenizer) or (eos or "").lower() == "none":
        return None
    return (f"warning: tokenizer {tok.name} has none of the end-of-text tokens fivefold knows ({', '.join(EOS_NAMES)}): "
            f"documents get no separator, generate has no stop and an export has eos_token_id null; name it with "
            f"--eos TOKEN (or --eos none)")


def read_specials(folder: str | Path) -> tuple[str, str]:
    """(eos, bos) a run folder keeps beside its tokenizer copy ("" each when none)."""
    path = Path(folder) / SPECIALS
    if not path.is_file() or path.is_symlink():
        return "", ""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"{path} is not readable JSON; remove it or write {{\"eos\": TOKEN, \"bos\": TOKEN}}") from None
    return str(d.get("eos") or ""), str(d.get("bos") or "")


def save_to_run(tokenizer_path: str | Path | None, out_dir: str | Path, eos: str = "", bos: str = "") -> Path | None:
    """Copy the tokenizer file into run folder `out_dir` as RUN_FILES[kind] (a temporary copy renamed
    into place) and remove any other tokenizer copy there, so the folder names exactly the run's
    tokenizer; None for the byte-level default (then no copy is left). `eos`, `bos` (train.eos,
    train.bos) are kept in OUT/SPECIALS when set."""
    out_dir = Path(out_dir)
    specials = out_dir / SPECIALS
    if eos or bos:
        out_dir.mkdir(parents=True, exist_ok=True)
        specials.write_text(json.dumps({"eos": eos, "bos": bos}) + "\n")
    else:
        specials.unlink(missing_ok=True)
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
    """The tokenizer a run trained with (ByteTokenizer when it had none), with the run's --eos / --bos."""
    found = run_tokenizer_file(run_dir)
    run_dir = Path(run_dir)
    folder = run_dir.parents[1] if (run_dir / "index.json").is_file() else run_dir
    return load_tokenizer(found, *read_specials(folder))
