"""`fivefold tokenize`: a corpus -> one flat token file that training memory-maps. Torch-free.

    fivefold tokenize INPUT... --tokenizer T --out data.bin [--field text] [--workers N] [--overwrite]

Inputs, each told apart by its form:
- a folder: a Hugging Face `datasets` folder written by `save_to_disk` (its state.json lists the
  `*.arrow` files, read with pyarrow's IPC stream or file reader; the `datasets` package is not needed);
- `*.jsonl` / `*.ndjson` (optionally `.gz`): one JSON object per line, its `--field` (default "text");
- `*.parquet` / `*.arrow`: the `--field` column, read a batch of rows at a time;
- anything else: a UTF-8 text file, the whole file one document.
A row or line is one document. Documents are tokenized in parallel by `--workers` processes and written
in input order (the output does not depend on the number of workers), each followed by the tokenizer's
end-of-text id. The byte-level default has none, so its documents simply follow each other.

Output, written to temporary names and renamed into place (the header last), never over an existing
file unless `--overwrite`:

    data.bin            the token ids, flat: uint16 when the vocabulary has <= 65536 ids, else uint32
    data.bin.idx.json   the header: format, dtype, vocab_size, tokenizer {name, digest, eos_id, bos_id},
                        tokens, documents, data_sha256 (of data.bin), offsets_sha256 (of the
                        offsets below; files written before it have none), inputs, field
    data.bin.idx.npy    int64 offsets of the documents' starts, plus the end: documents + 1 values
                        (np.load(..., allow_pickle=False))

A data file with a header beside it is a token file for training (`train.data`): `open_token_file`
reads it on demand (`TokenFile`), never whole.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..rules import ConfigError, install_hint
from ..tokenizer import Tokenizer, load_tokenizer, missing_eos
from .signals import release_sigint, sigint_held

FORMAT = "fivefold-tokens"
VERSION = 1
HEADER_SUFFIX, OFFSETS_SUFFIX, MASK_SUFFIX = ".idx.json", ".idx.npy", ".mask"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TABLE_SUFFIXES = (".parquet", ".arrow")
BATCH_CHARS = 1 << 20        # text handed to a worker at a time (about)
BATCH_DOCS = 1024            # ... or at most this many documents
TEXT_PIECE = 1 << 20         # a text file is encoded in pieces of about this many characters, cut at line ends
ROWS = 1024                  # table rows read at a time
PROGRESS_EVERY_S = 2.0       # seconds between progress lines when stderr is not a terminal


# -- the token file ----------------------------------------------------------------------------------
def header_path(data: str | Path) -> Path:
    return Path(f"{data}{HEADER_SUFFIX}")


def offsets_path(data: str | Path) -> Path:
    return Path(f"{data}{OFFSETS_SUFFIX}")


def mask_path(data: str | Path) -> Path:
    return Path(f"{data}{MASK_SUFFIX}")


def is_token_file(data: str | Path) -> bool:
    """A data file written by `fivefold tokenize` (its header lies beside it)."""
    return header_path(data).is_file()


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype that holds every id: uint16 for vocabularies of <= 65536 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def read_header(data: str | Path) -> dict:
    """The header of token file `data`, checked against the data file's size; ConfigError otherwise."""
    path = header_path(data)
    try:
        header = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"token file {data}: cannot read its header {path} ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ConfigError(f"token file {data}: {path} is not a {FORMAT} header of version {VERSION}; "
                          f"write it again with fivefold tokenize")
    if header.get("dtype") not in ("uint16", "uint32"):
        raise ConfigError(f"token file {data}: header dtype {header.get('dtype')!r}; valid: uint16, uint32")
    size = Path(data).stat().st_size
    expected = header["tokens"] * np.dtype(header["dtype"]).itemsize
    if size != expected:
        raise ConfigError(f"token file {data}: {size} bytes, but its header says {header['tokens']} "
                          f"{header['dtype']} tokens ({expected} bytes); write it again with fivefold tokenize")
    return header


def header_digest(data: str | Path) -> str:
    """A hash of a token file's header bytes (which hold the data's own SHA-256): the file's identity."""
    return hashlib.sha256(header_path(data).read_bytes()).hexdigest()[:16]


class DataChanged(OSError):
    """A data file shrank under a running job: one line naming it (launch.py reports `brief` errors so)."""

    brief = True


class TokenFile:
    """A token file's ids as a read-only 1-D array-like (`len`, `[a:b]` slices, `dtype`) that reads only
    the slices asked for, with positioned reads (os.pread) through the page cache. Not an np.memmap: a
    mapping counts every page it touched in the process's memory (and the kernel maps 64 KiB around
    each fault), so random windows drawn from a mapped file grow the process to the file's size over a
    run; reads leave the process's memory flat, whatever the file's size."""

    def __init__(self, path: str | Path, dtype, count: int, offset: int = 0):
        self.path, self.dtype, self.count, self.offset = Path(path), np.dtype(dtype), count, offset
        self._fd, self._pid = None, None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("TokenFile reads contiguous slices only: tokens[a:b]")
        begin, end, _ = index.indices(self.count)
        size = max(end - begin, 0) * self.dtype.itemsize
        where, parts = self.offset + begin * self.dtype.itemsize, []
        while size:
            part = os.pread(self.fd(), size, where)
            if not part:
                raise DataChanged(f"data file {self.path} ends before byte {where}: it was truncated after "
                                  f"the run checked it; restore it, then --resume auto")
            parts.append(part)
            size -= len(part)
            where += len(part)
        return np.frombuffer(b"".join(parts), dtype=self.dtype)

    def tolist(self) -> list[int]:
        """Every id (reads the whole file: for small files and tests)."""
        return self[:].tolist()

    def fd(self) -> int:
        """The open file (opened again in a child process: descriptors are not shared across fork)."""
        if self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def __del__(self):
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)


def open_token_file(data: str | Path, tokenizer: Tokenizer | None = None) -> tuple[TokenFile, dict]:
    """(the tokens, read on demand: `TokenFile`; the header). With `tokenizer` (the run's), a file made
    by another tokenizer is refused."""
    header = read_header(data)
    if tokenizer is not None and header["tokenizer"]["digest"] != tokenizer.digest:
        made = header["tokenizer"]
        raise ConfigError(f"token file {data} was made with tokenizer {made['name']} ({made['digest']}), this run "
                          f"uses {tokenizer.name} ({tokenizer.digest}): train with --tokenizer set to the file "
                          f"that made it, or tokenize again with this run's")
    return TokenFile(data, header["dtype"], header["tokens"]), header


def open_loss_mask(data: str | Path, verify: bool = False) -> "TokenFile | None":
    """The loss mask of token file `data` (instruction data: one uint8 a token, 1 where the loss counts), or
    None when its header names none. Its size must be the header's token count; `verify` also holds its
    bytes to the header's SHA-256 (read once, before any rank starts)."""
    header = read_header(data)
    claim = header.get("loss_mask")
    if claim is None:
        return None
    path = mask_path(data)
    if not isinstance(claim, dict) or not isinstance(claim.get("sha256"), str):
        raise ConfigError(f"token file {data}: header's loss_mask is not {{trained, sha256}}; write it again with "
                          f"fivefold tokenize --format chat|prompt-completion")
    if not path.is_file() or path.is_symlink():
        raise ConfigError(f"token file {data}: its header names a loss mask, and {path} is missing (or a link); "
                          f"write it again with fivefold tokenize --format chat|prompt-completion")
    if path.stat().st_size != header["tokens"]:
        raise ConfigError(f"token file {data}: loss mask {path} has {path.stat().st_size} bytes for "
                          f"{header['tokens']} tokens; write it again with fivefold tokenize")
    if verify:
        sha, ones = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                sha.update(chunk)
                bits = np.frombuffer(chunk, dtype=np.uint8)
                if bits.max(initial=0) > 1:
                    raise ConfigError(f"token file {data}: loss mask {path} holds values other than 0 and 1")
                ones += int(bits.sum(dtype=np.int64))
        if sha.hexdigest() != claim["sha256"] or ones != claim.get("trained"):
            raise ConfigError(f"token file {data}: loss mask {path} does not match its header (SHA-256 or trained "
                              f"count): write it again with fivefold tokenize")
    return TokenFile(path, np.uint8, header["tokens"])


def read_offsets(data: str | Path) -> np.ndarray:
    """The documents' start offsets plus the end (int64; loaded without pickle), checked against the token
    file's header: a 1-D integer array of documents + 1 values from 0 to the token count, never
    decreasing (an empty document repeats its start). Anything else is one line naming the file: the
    document masks would otherwise be silently wrong."""
    path = offsets_path(data)
    fix = "write the token file again with fivefold tokenize, or train with train.document_mask = false"
    header = read_header(data)
    if path.is_symlink() or not path.is_file():
        raise ConfigError(f"token file {data}: its document offsets {path} are missing (or a link); {fix}")
    try:
        offsets = np.load(path, allow_pickle=False)
    except Exception as e:   # noqa: BLE001 - numpy parses a damaged header with ast/tokenize: any error is "not .npy"
        raise ConfigError(f"token file {data}: {path} is not a .npy array ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                          f"{fix}") from None
    n, tokens = header["documents"], header["tokens"]
    problem = None
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
        problem = f"a {offsets.dtype} array of shape {offsets.shape}, not 1-D integers"
    elif len(offsets) != n + 1:
        problem = f"{len(offsets)} values for the header's {n} documents (documents + 1 expected)"
    elif offsets[0] != 0 or offsets[-1] != tokens:
        problem = f"they run from {offsets[0]} to {offsets[-1]}, not from 0 to the header's {tokens} tokens"
    elif (np.diff(offsets) < 0).any():
        problem = f"they decrease at document {int(np.argmax(np.diff(offsets) < 0)) + 1}"
    elif "offsets_sha256" in header and offsets_digest(offsets) != header["offsets_sha256"]:
        problem = "their SHA-256 is not the one the header recorded (another file's, or edited)"
    if problem:
        raise ConfigError(f"token file {data}: document offsets {path} do not fit it: {problem}; {fix}")
    return offsets.astype(np.int64)


def offsets_digest(offsets: np.ndarray) -> str:
    """SHA-256 of the document offsets as little-endian int64 (what the header records at tokenize time)."""
    return hashlib.sha256(np.ascontiguousarray(offsets, dtype="<i8").tobytes()).hexdigest()


class TokenFileWriter:
    """Writes a token file to temporary names; `commit()` renames them into place (header last) and
    `abort()` removes them. `write(ids, doc_ends)` appends ids and marks where documents end in them;
    `end_document()` marks a boundary at the end."""

    def __init__(self, out: str | Path, tokenizer: Tokenizer, overwrite: bool = False):
        self.out = Path(out)
        check_outputs(self.out, overwrite)
        self.tokenizer, self.dtype = tokenizer, token_dtype(tokenizer.vocab_size)
        self.tmp = self.out.with_name(f".{self.out.name}.{os.getpid()}.tmp")
        self.file = open(self.tmp, "wb")
        self.sha = hashlib.sha256()
        self.tokens, self.starts = 0, [0]
        self.mask_file, self.mask_sha, self.trained = None, hashlib.sha256(), 0

    def write(self, ids, doc_ends=(), mask=None) -> None:
        """Append `ids`; `doc_ends`: positions in `ids` where a document ends (after its last id); `mask`:
        1 for each id the loss counts, 0 for context (instruction data: every write carries one)."""
        arr = np.asarray(ids, dtype=self.dtype)
        data = arr.tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.starts += [self.tokens + end for end in doc_ends]
        self.tokens += len(arr)
        if mask is not None:
            if self.mask_file is None:
                if self.tokens != len(arr):
                    raise ValueError("a loss mask must come with every write")
                self.mask_file = open(self._mask_tmp(), "wb")
            bits = np.asarray(mask, dtype=np.uint8)
            assert len(bits) == len(arr) and bits.max(initial=0) <= 1
            self.mask_file.write(bits.tobytes())
            self.mask_sha.update(bits.tobytes())
            self.trained += int(bits.sum())

    def _mask_tmp(self) -> Path:
        return self.tmp.with_name(self.tmp.name + ".mask")

    def end_document(self) -> None:
        self.starts.append(self.tokens)

    def commit(self, **info) -> dict:
        """Finish: offsets and header written, everything renamed into place; returns the header."""
        self.file.close()
        if self.mask_file is not None:
            self.mask_file.close()
            info["loss_mask"] = {"trained": self.trained, "sha256": self.mask_sha.hexdigest()}
        if self.starts[-1] != self.tokens:    # the last document was not closed
            self.starts.append(self.tokens)
        t = self.tokenizer
        starts = np.asarray(self.starts, dtype=np.int64)
        header = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, "vocab_size": t.vocab_size,
                  "tokenizer": {"name": t.name, "digest": t.digest, "eos_id": t.eos_id, "bos_id": t.bos_id},
                  "tokens": self.tokens, "documents": len(self.starts) - 1,
                  "data_sha256": self.sha.hexdigest(), "offsets_sha256": offsets_digest(starts), **info}
        offsets_tmp = self.tmp.with_name(self.tmp.name + ".npy")
        header_tmp = self.tmp.with_name(self.tmp.name + ".json")
        np.save(offsets_tmp, starts, allow_pickle=False)
        header_tmp.write_text(json.dumps(header, indent=1) + "\n")
        header_path(self.out).unlink(missing_ok=True)   # --overwrite: the old file is never half-replaced
        mask_path(self.out).unlink(missing_ok=True)
        self.tmp.replace(self.out)
        offsets_tmp.replace(offsets_path(self.out))
        if self.mask_file is not None:
            self._mask_tmp().replace(mask_path(self.out))
        header_tmp.replace(header_path(self.out))
        return header

    def abort(self) -> None:
        self.file.close()
        if self.mask_file is not None:
            self.mask_file.close()
        for p in (self.tmp, self.tmp.with_name(self.tmp.name + ".npy"), self.tmp.with_name(self.tmp.name + ".json"),
                  self._mask_tmp()):
            p.unlink(missing_ok=True)


def check_outputs(out: Path, overwrite: bool) -> None:
    """Never write over a token file by accident; the output's folder is made when missing (not through a file)."""
    taken = [p for p in (out, header_path(out), offsets_path(out), mask_path(out)) if p.exists()]
    if taken and not overwrite:
        raise ConfigError(f"--out {out}: {taken[0].name} exists; pass --overwrite to replace it or choose "
                          f"another --out")
    blocked = next((p for p in (out.parent, *out.parent.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ConfigError(f"--out {out}: {blocked} is a file, not a folder; choose another --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot make folder {out.parent} ({e.strerror or e})") from None


# -- reading a corpus ------------------------------------------------------------------------------------
def input_kind(path: Path) -> str:
    """datasets | jsonl | table | text, by the input's form (see the module docstring)."""
    if path.is_dir():
        return "datasets"
    if not path.is_file():
        raise ConfigError(f"input {path} does not exist; give text, .jsonl, .parquet files or a datasets folder")
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TABLE_SUFFIXES):
        return "table"
    return "text"


def documents(path: Path, field: str, errors: str = "strict") -> Iterator[tuple[str, bool]]:
    """(text, whether it ends a document) for every piece of one input, in order. `errors`: what bytes
    that are not UTF-8 in a text or JSON-lines input do: strict (an error naming the file and the byte
    offset) or replace (U+FFFD)."""
    kind = input_kind(path)
    if kind == "text":
        yield from text_pieces(path, errors)
        return
    if kind == "jsonl":
        yield from ((text, True) for text in jsonl_rows(path, field, errors))
        return
    rows = {"table": table_rows, "datasets": datasets_rows}[kind](path, field)
    for text in rows:
        yield text, True


def utf8_lines(path: Path, errors: str = "strict") -> Iterator[str]:
    """The lines of a (gzipped) text file, line ends kept as they are, decoded as UTF-8. A byte that is
    not UTF-8 is an error naming the file, the byte's offset (in the uncompressed text) and its line,
    or with errors="replace" becomes U+FFFD."""
    opener = gzip.open if path.name.endswith(".gz") else open
    offset, n, f = 0, 0, opener(path, "rb")
    try:
        with f:
            for n, raw in enumerate(f, 1):   # b"\n" never occurs inside a UTF-8 sequence
                try:
                    yield raw.decode("utf-8", errors)
                except UnicodeDecodeError as e:
                    raise ConfigError(f"input {path}: not UTF-8 at byte {offset + e.start} (line {n}); convert "
                                      f"it to UTF-8, or pass --errors replace") from None
                offset += len(raw)
    except (OSError, EOFError) as e:   # a damaged gzip stream, a read error
        raise ConfigError(f"input {path}: cannot be read after byte {offset} (line {n + 1}): {e}") from None


def text_pieces(path: Path, errors: str = "strict") -> Iterator[tuple[str, bool]]:
    """A text file as one document, in pieces of about TEXT_PIECE characters cut after a line end."""
    piece, size = [], 0
    for line in utf8_lines(path, errors):
        piece.append(line)
        size += len(line)
        if size >= TEXT_PIECE:
            yield "".join(piece), False
            piece, size = [], 0
    yield "".join(piece), True


def jsonl_rows(path: Path, field: str, errors: str = "strict") -> Iterator[str]:
    """The `field` of every JSON object, one a line (blank lines skipped)."""
    for n, line in enumerate(utf8_lines(path, errors), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            raise ConfigError(f"input {path}:{n}: not a JSON object (JSON lines: one object per line)") from None
        if not isinstance(row, dict) or field not in row:
            keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise ConfigError(f"input {path}:{n}: no field {field!r} (has: {keys}); pass --field NAME")
        yield _text(row[field], path, f"line {n}", field)


def _text(value, path: Path, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"input {path}: {where}: field {field!r} holds {type(value).__name__}, not text; "
                          f"pass --field NAME of a text column")
    return value


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401 (the submodule)
    except ImportError:
        raise ConfigError("reading Parquet, Arrow or datasets folders needs pyarrow "
                          f"({install_hint('data')})") from None
    return pa


def table_rows(path: Path, field: str) -> Iterator[str]:
    """The `field` column of a Parquet file or an Arrow IPC file (stream or file format)."""
    if path.name.lower().endswith(".parquet"):
        pa = _pyarrow()
        pf = pa.parquet.ParquetFile(path)
        _check_column(path, pf.schema_arrow.names, field)
        batches = pf.iter_batches(batch_size=ROWS, columns=[field])
    else:
        batches = arrow_batches(path)
    row = 0
    for batch in batches:
        _check_column(path, batch.schema.names, field)
        for value in batch.column(batch.schema.get_field_index(field)).to_pylist():
            yield _text(value, path, f"row {row}", field)
            row += 1


def _check_column(path: Path, names: list[str], field: str) -> None:
    if field not in names:
        raise ConfigError(f"input {path}: no column {field!r} (has: {', '.join(names)}); pass --field NAME")


def arrow_batches(path: Path):
    """The record batches of an Arrow IPC file: the stream format `datasets` writes, or the file format."""
    pa = _pyarrow()
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
            yield from reader
            return
        except pa.ArrowInvalid:
            source.seek(0)
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            raise ConfigError(f"input {path}: not an Arrow IPC stream or file") from None
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def datasets_rows(folder: Path, field: str) -> Iterator[str]:
    """The rows of a `datasets.Dataset.save_to_disk` folder: state.json's `_data_files`, in order."""
    for path in datasets_files(folder):
        yield from table_rows(path, field)


def datasets_files(folder: Path) -> list[Path]:
    """The Arrow files of a `datasets.Dataset.save_to_disk` folder, in order (state.json's `_data_files`)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise ConfigError(f"input {folder} holds several splits ({', '.join(splits)}); give one split's folder, "
                          f"e.g. {folder / (splits[0] if splits else 'train')}")
    state = folder / "state.json"
    if not state.is_file():
        raise ConfigError(f"input {folder} is a folder without state.json; give a folder written by "
                          f"datasets' save_to_disk, or files")
    files = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    if not files:
        raise ConfigError(f"input {folder}: state.json lists no _data_files")
    return [folder / name for name in files]


def records(path: Path, errors: str = "strict") -> Iterator[tuple[object, str]]:
    """(record, where it is) for every record of a JSON-lines file, a Parquet / Arrow table (its rows as
    dicts) or a datasets folder: instruction data (train/instructions.py)."""
    kind = input_kind(path)
    if kind == "jsonl":
        for n, line in enumerate(utf8_lines(path, errors), 1):
            if line.strip():
                try:
                    yield json.loads(line), f"input {path}:{n}"
                except (ValueError, RecursionError):
                    raise ConfigError(f"input {path}:{n}: not a JSON object (JSON lines: one object per line)") from None
        return
    if kind == "text":
        raise ConfigError(f"input {path}: instruction data (--format chat | prompt-completion) comes as .jsonl, "
                          f".parquet, .arrow or a datasets folder, one record a line or row")
    for table in (datasets_files(path) if kind == "datasets" else [path]):
        if table.name.lower().endswith(".parquet"):
            batches = _pyarrow().parquet.ParquetFile(table).iter_batches(batch_size=ROWS)
        else:
            batches = arrow_batches(table)
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                yield record, f"input {table}: row {row}"
                row += 1


def batches(inputs: list[Path], field: str, errors: str = "strict") -> Iterator[tuple[list[str], list[bool]]]:
    """The corpus in order as work for one worker at a time: (texts, ends-a-document flags, whether the
    first text starts a document)."""
    texts, ends, size, first = [], [], 0, True
    for path in inputs:
        for text, end in documents(path, field, errors):
            texts.append(text)
            ends.append(end)
            size += len(text)
            if size >= BATCH_CHARS or len(texts) >= BATCH_DOCS:
                yield texts, ends, first
                first = ends[-1]
                texts, ends, size = [], [], 0
    if texts:
        yield texts, ends, first


# -- encoding ------------------------------------------------------------------------------------------
_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str | None, eos: str = "", bos: str = "") -> None:
    global _worker_tokenizer
    release_sigint(ignore=True)
    _worker_tokenizer = load_tokenizer(tokenizer_path, eos, bos)




def encode_batch(work: tuple, tokenizer: Tokenizer | None = None):
    """(the batch's ids with start-of-text (--bos) before and end-of-text after each document, the token
    counts at its document ends, characters read). `work`: (texts, ends-a-document flags[, whether the
    first text starts a document: default yes])."""
    tok = tokenizer or _worker_tokenizer
    texts, ends = work[0], work[1]
    starts = [work[2] if len(work) > 2 else True] + list(ends[:-1])
    ids, doc_ends = [], []
    for text, end, start in zip(texts, ends, starts):
        if start and tok.bos_id is not None:
            ids.append(tok.bos_id)
        ids += tok.encode(text)
        if end:
            if tok.eos_id is not None:
                ids.append(tok.eos_id)
            doc_ends.append(len(ids))
    return np.asarray(ids, dtype=token_dtype(tok.vocab_size)), doc_ends, sum(map(len, texts))


def encoded(work: Iterator, tokenizer: Tokenizer, tokenizer_path: str | None, workers: int,
            specials: tuple[str, str] = ("", "")) -> Iterator:
    """encode_batch of every batch, in order: in this process (workers <= 1) or in `workers` processes
    with at most 2·workers batches in flight (reading stays just ahead of encoding)."""
    if workers <= 1:
        for item in work:
            yield encode_batch(item, tokenizer)
        return
    ctx = multiprocessing.get_context("spawn")   # fresh processes: no inherited threads or state
    with sigint_held():                          # workers are deaf to Ctrl-C: the parent stops them
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path, *specials))
    with pool:
        pending = deque()
        for item in work:
            pending.append(pool.apply_async(encode_batch, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Progress:
    """One line on stderr: documents, tokens, text read and its rate (rewritten on a terminal, else every
    PROGRESS_EVERY_S seconds and at the end)."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.tty = enabled, sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()

    def update(self, docs: int, tokens: int, chars: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or not (final or self.tty or now - self.last >= PROGRESS_EVERY_S):
            return
        self.last = now
        rate = chars / 2**20 / max(now - self.t0, 1e-9)
        line = f"tokenize: {docs:,} documents, {tokens:,} tokens, {chars / 2**20:,.1f} MiB text, {rate:,.1f} MiB/s"
        sys.stderr.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        sys.stderr.flush()


def tokenize(inputs: list[str | Path], tokenizer_path: str | Path | None, out: str | Path, field: str = "text",
             workers: int = 1, overwrite: bool = False, progress: bool = True, errors: str = "strict",
             eos: str = "", bos: str = "", fmt: str = "text", chat_template: str | Path | None = None) -> dict:
    """Tokenize the corpus `inputs` into token file `out` (module docstring); returns its header.
    `fmt` "chat" or "prompt-completion": instruction records, with a loss mask (`instructions`).
    Interrupted or failed, it leaves nothing under `out`'s names (temporary files are removed)."""
    if fmt != "text":
        return tokenize_instructions(inputs, tokenizer_path, out, fmt, chat_template, overwrite, progress, errors,
                                     eos, bos)
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ConfigError("no inputs: give text, .jsonl, .parquet files or a datasets folder")
    for p in paths:
        input_kind(p)                      # every input exists before anything is written
    tokenizer = load_tokenizer(tokenizer_path, eos, bos)
    warning = missing_eos(tokenizer, eos)
    if warning and progress:
        print(warning, file=sys.stderr)
    writer = TokenFileWriter(out, tokenizer, overwrite)
    bar = Progress(progress)
    docs = chars = 0
    results = encoded(batches(paths, field, errors), tokenizer, None if tokenizer_path is None else str(tokenizer_path),
                      workers, (eos, bos))
    try:
        for ids, doc_ends, n_chars in results:
            writer.write(ids, doc_ends)
            docs += len(doc_ends)
            chars += n_chars
            bar.update(docs, writer.tokens, chars)
        header = writer.commit(inputs=[str(p) for p in paths], field=field)
    except BaseException:
        writer.abort()
        raise
    finally:
        results.close()                    # the worker pool ends here, also on an error
    bar.update(docs, header["tokens"], chars, final=True)
    return header


def tokenize_instructions(inputs: list[str | Path], tokenizer_path: str | Path | None, out: str | Path, fmt: str,
                          chat_template: str | Path | None = None, overwrite: bool = False, progress: bool = True,
                          errors: str = "strict", eos: str = "", bos: str = "") -> dict:
    """Instruction records -> a token file and its loss mask (OUT.mask: one byte a token, 1 where the loss
    counts), one document a record. The chat template comes from `chat_template` (a Hugging Face folder),
    else from the tokenizer's folder. One process."""
    from .instructions import FORMATS, ChatTemplate, completion_end, encode_record, template_fields

    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ConfigError("no inputs: give .jsonl, .parquet files or a datasets folder")
    for p in paths:
        if input_kind(p) == "text":
            raise ConfigError(f"input {p}: instruction data (--format {fmt}) comes as .jsonl, .parquet, .arrow or "
                              f"a datasets folder, one record a line or row")
    template = None
    folder = chat_template or (Path(tokenizer_path).parent if tokenizer_path else None)
    if fmt == "chat":
        if folder is None:
            raise ConfigError("--format chat needs a chat template: --chat-template HF_FOLDER (or --tokenizer "
                              "HF_FOLDER/tokenizer.json beside its tokenizer_config.json)")
        template = ChatTemplate.from_folder(folder)
    elif folder is not None and template_fields(folder) is not None:   # conversational prompt-completion records
        template = ChatTemplate.from_folder(folder)
    tokenizer = load_tokenizer(tokenizer_path, eos, bos)
    end = completion_end(tokenizer, tokenizer_path, eos) if fmt == "prompt-completion" else None
    writer = TokenFileWriter(out, tokenizer, overwrite)
    bar = Progress(progress)
    docs = chars = 0
    templated = False   # a record rendered by the template (chat, conversational prompt-completion)
    try:
        for p in paths:
            for record, where in records(p, errors):
                ids, mask = encode_record(fmt, record, where, tokenizer, template, end)
                templated = templated or fmt == "chat" or (isinstance(record, dict) and isinstance(record.get("prompt"), list))
                writer.write(ids, [len(ids)], mask)
                docs += 1
                chars += len(json.dumps(record, ensure_ascii=False))
                bar.update(docs, writer.tokens, chars)
        if not docs:
            raise ConfigError(f"no records in {', '.join(map(str, paths))}")
        header = writer.commit(inputs=[str(p) for p in paths], field=None, instructions=fmt,
                               chat_template=template.name if template and templated else None)
    except BaseException:
        writer.abort()
        raise
    bar.update(docs, header["tokens"], chars, final=True)
    return header
