"""A run's corpus: which files it reads, their tokens, and every check on them, before any rank starts.

Torch-free (numpy only), so `fivefold train`'s launcher runs these checks without importing torch; the
batches each step draws from the corpus are train/data.py's.

Default corpus: the Python standard library's own source files (present wherever Python is), read in
sorted order up to a size limit, as byte-level tokens (vocab 256). Which library that was differs between
Pythons, so a run records it (`default_corpus`: run.json's and a checkpoint's "data"; a resume on another
Python's library is warned about as other data is). `FIVEFOLD_DEFAULT_CORPUS=FOLDER` reads FOLDER's `.py`
files instead, the same way: for a Python shipped without its sources, and for the test suite, which
trains on a corpus it generates (tests/support/corpus.py) so that no test depends on the machine's Python. `--data` takes a user's files:
- text files (any extension not below): their bytes are the tokens;
- `.u16` / `.bin`: raw little-endian uint16 token ids; `.u32`: raw uint32; `.npy`: an integer array
  (flattened; loaded without pickle);
- a token file written by `fivefold tokenize` (any name, with its header `FILE.idx.json` beside it,
  tokenize.py): read on demand (`TokenFile`: only the windows a step draws, and the id check a chunk at
  a time), never loaded whole and never cut by `data_limit_mb`; refused when another tokenizer than
  the run's (`train.tokenizer`, default byte-level) made it;
- a mixture (`--data a.bin:0.7 b.bin:0.3`): each source read and checked on its own (`mixture_of`).
With `train.tokenizer` a text file is tokenized in memory (up to data_limit_mb of text), its tokens
followed by the tokenizer's end-of-text id.

Checks, each a one-line `ConfigError` naming the file: a file exists and is readable, a raw file's size
is a whole number of tokens, a .npy holds integers, and every token id of every file (scanned in chunks,
so a memory-mapped file is never loaded at once) lies in [0, model.vocab). `check_data` runs them all
and the corpus-length rule; `check_eval_data` those of the evaluation data (`eval_corpus`: train.eval_data,
or the held-out tail of the training stream, train.eval_fraction, `split_corpus`, which training never
reads) and its batch count (`eval_batch_count`). `read_tokens(..., vocab)` and the batches run the id
check through the same `check_token_ids`.

Documents (train.document_mask): where documents start in the stream (a token file's offsets,
FILE.idx.npy; each text file is one document; raw and .npy files have none, an error at start).
"""
from __future__ import annotations

import math
import os
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config import ConfigError
from ..tokenizer import ByteTokenizer, Tokenizer, file_digest, load_tokenizer
from .tokenize import (TABLE_SUFFIXES, JSONL_SUFFIXES, TokenFile, header_digest, is_token_file, open_loss_mask,
                       open_token_file, read_offsets, token_dtype)

if TYPE_CHECKING:
    from ..config import TrainConfig

RAW_DTYPES = {".u16": np.uint16, ".bin": np.uint16, ".u32": np.uint32}
CHECK_CHUNK = 1 << 24        # token ids scanned at a time by check_token_ids
FORMATS = "text, .u16/.bin, .u32, .npy, or a token file from fivefold tokenize"


DEFAULT_CORPUS_ENV = "FIVEFOLD_DEFAULT_CORPUS"


def default_corpus() -> dict:
    """What the default corpus reads: {"folder"} from $FIVEFOLD_DEFAULT_CORPUS, else this Python's standard
    library {"folder", "python": its version}."""
    folder = os.environ.get(DEFAULT_CORPUS_ENV)
    if folder:
        return {"folder": str(Path(folder).resolve())}
    return {"folder": sysconfig.get_paths()["stdlib"], "python": platform.python_version()}


def stdlib_files() -> Iterator[Path]:
    """The default corpus's Python sources (`default_corpus`), in sorted path order, found as they are
    read: a walk of each folder's sorted entries (not into site-packages or symlinked folders) yields the
    order sorting every path would, without listing 1,800 files first (0.7 s a run) when the default
    corpus stops after 8 MiB."""
    yield from _sorted_sources(Path(default_corpus()["folder"]))


def _sorted_sources(folder: Path) -> Iterator[Path]:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.is_dir() and not e.is_symlink():
            if e.name != "site-packages":
                yield from _sorted_sources(Path(e.path))
        elif e.name.endswith(".py") and e.is_file():
            yield Path(e.path)


def check_token_ids(tokens: np.ndarray, vocab: int, source: str | Path | None = None) -> None:
    """Every id in `tokens` lies in [0, vocab); else ConfigError naming the first bad id, its position
    and `source` (a file name). Scans CHECK_CHUNK ids at a time, so np.memmap stays on disk."""
    for begin in range(0, len(tokens), CHECK_CHUNK):
        chunk = np.asarray(tokens[begin:begin + CHECK_CHUNK])
        if chunk.size and (chunk.min() < 0 or chunk.max() >= vocab):
            at = int(np.flatnonzero((chunk < 0) | (chunk >= vocab))[0])
            raise ConfigError(_bad_id_message(int(chunk[at]), begin + at, vocab, source))


def _bad_id_message(token: int, position: int, vocab: int, source: str | Path | None) -> str:
    where = f"data file {source}: " if source is not None else ""
    if token < 0:
        return f"{where}token id {token} at position {position} is negative; token ids must be in [0, model.vocab)"
    return (f"{where}token id {token} at position {position} >= model.vocab ({vocab}); "
            f"raise model.vocab to at least {token + 1}")


def check_length(n_tokens: int, seq_len: int) -> None:
    """The corpus holds at least one window of seq_len + 1 tokens at two offsets (seq_len + 2 tokens)."""
    if n_tokens < seq_len + 2:
        raise ConfigError(f"the corpus has {n_tokens} tokens, fewer than train.seq_len + 2 = {seq_len + 2}; "
                          f"add data, raise train.data_limit_mb or use train.seq_len <= {max(n_tokens - 2, 1)}")


def corpus_files(paths: list[str | Path] | None) -> Iterator[Path]:
    """The user's data files, or the standard library's sources when none are given (read as found)."""
    if paths:
        yield from (Path(p) for p in paths)
        return
    found = False
    for f in stdlib_files():
        found = True
        yield f
    if not found:
        raise ConfigError(f"no training data: pass --data FILE ({FORMATS})")


def file_tokens(f: Path, budget: int | None = None, tokenizer: Tokenizer | None = None) -> np.ndarray:
    """The tokens of one data file as a 1-D integer array-like (raw, .npy and token files read on demand:
    `TokenFile`; at most `budget` bytes of a text file). `tokenizer`: the run's, which a token file
    must have been made with (None: not checked)."""
    if not f.exists():
        raise ConfigError(f"data file {str(f)!r} does not exist; pass --data FILE ({FORMATS})")
    datasets = f.is_dir() and ((f / "state.json").is_file() or (f / "dataset_dict.json").is_file())
    if datasets or f.name.lower().removesuffix(".gz").endswith(JSONL_SUFFIXES + TABLE_SUFFIXES):
        raise ConfigError(f"data {str(f)!r} holds records, not text or tokens: tokenize it first, e.g. fivefold "
                          f"tokenize {f} --tokenizer TOKENIZER --out {f.name.split('.')[0]}.bin [--format chat|"
                          f"prompt-completion], then --data {f.name.split('.')[0]}.bin")
    if not f.is_file():
        raise ConfigError(f"data file {str(f)!r} is not a file; pass --data FILE ({FORMATS})")
    try:
        if is_token_file(f):
            return open_token_file(f, tokenizer)[0]
        if f.suffix in RAW_DTYPES:
            return _raw_tokens(f, np.dtype(RAW_DTYPES[f.suffix]))
        if f.suffix == ".npy":
            return _npy_tokens(f)
        with open(f, "rb") as fh:   # read(n) allocates n bytes first: never ask for more than the file holds
            size = os.fstat(fh.fileno()).st_size
            return np.frombuffer(fh.read(-1 if budget is None or budget >= size else budget), dtype=np.uint8)
    except OSError as e:
        raise ConfigError(f"data file {str(f)!r} cannot be read ({e.strerror or e})") from None


def _raw_tokens(f: Path, dtype: np.dtype) -> TokenFile:
    """A raw file of token ids, read on demand (a file that shrinks under the run is named, not a SIGBUS)."""
    size = f.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(f"data file {str(f)!r} has {size} bytes, not a multiple of {dtype.itemsize}: "
                          f"{f.suffix} holds raw {dtype.name} token ids ({dtype.itemsize} bytes each)")
    return TokenFile(f, dtype, size // dtype.itemsize)


def _npy_tokens(f: Path) -> TokenFile:
    """A .npy array of integer token ids (flattened), read on demand after its header (no pickle)."""
    fix = "save token ids with np.save(path, ids.astype(np.uint32))"
    try:
        with open(f, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(fh)
            offset = fh.tell()
    except (ValueError, EOFError, SyntaxError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"data file {str(f)!r} is not a .npy array loadable without pickle ({reason}); {fix}") from None
    if dtype.hasobject:
        raise ConfigError(f"data file {str(f)!r} is not a .npy array loadable without pickle (it holds Python "
                          f"objects); {fix}")
    if not np.issubdtype(dtype, np.integer):
        raise ConfigError(f"data file {str(f)!r} holds {dtype}, not integer token ids; {fix}")
    count = int(np.prod(shape)) if shape else 1
    if fortran and len([n for n in shape if n > 1]) > 1:
        raise ConfigError(f"data file {str(f)!r} is a Fortran-ordered {shape} array; {fix}")
    if f.stat().st_size < offset + count * dtype.itemsize:
        raise ConfigError(f"data file {str(f)!r} is shorter than its header says ({count} ids of {dtype}): "
                          f"a truncated file; {fix}")
    return TokenFile(f, dtype, count, offset)


def is_mapped(f: Path) -> bool:
    """A file read whole without loading it (a token, raw or .npy file), not text cut by data_limit_mb."""
    return is_token_file(f) or f.suffix in RAW_DTYPES or f.suffix == ".npy"


def text_tokens(raw: np.ndarray, tokenizer: Tokenizer | None) -> np.ndarray:
    """A text file's bytes as tokens: the bytes themselves (no tokenizer, or the byte-level one without
    --eos / --bos), else the tokenizer's ids of the text, after its start-of-text id (--bos) and followed
    by its end-of-text id when it has them."""
    if tokenizer is None or (isinstance(tokenizer, ByteTokenizer) and tokenizer.eos_id is None
                             and tokenizer.bos_id is None):
        return raw
    ids = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    ids += tokenizer.encode(raw.tobytes().decode("utf-8", errors="replace"))
    if tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return np.asarray(ids, dtype=token_dtype(tokenizer.vocab_size))


def iter_tokens(paths: list[str | Path] | None = None, limit_mb: float = 8.0,
                tokenizer: Tokenizer | None = None) -> Iterator[tuple[Path, np.ndarray]]:
    """(file, its tokens) for each file of the corpus, text files stopping after limit_mb MiB in all
    (limit_mb <= 0: no limit) and tokenized by `tokenizer` (None: bytes; token files are then not
    checked against a tokenizer)."""
    limit = int(limit_mb * 2**20) if limit_mb > 0 else None
    text = 0
    for f in corpus_files(paths):
        if is_mapped(f):
            yield f, file_tokens(f, tokenizer=tokenizer)
            continue
        raw = file_tokens(f, None if limit is None else max(limit - text, 0))
        text += len(raw)
        yield f, text_tokens(raw, tokenizer)
        if limit is not None and text >= limit:
            return


def read_tokens(paths: list[str | Path] | None = None, limit_mb: float = 8.0, vocab: int | None = None,
                tokenizer: Tokenizer | None = None) -> np.ndarray:
    """All tokens of the corpus as a 1-D integer array (at most limit_mb MiB of text when text); with
    `vocab`, every file's ids are checked to lie in [0, vocab). Token files stay on disk: one is
    returned as its `TokenFile`, several files of which any is one as a `Joined` view (both array-likes
    with `len` and `[a:b]`)."""
    return read_corpus(paths, limit_mb, vocab, tokenizer)[0]


class Ones:
    """A loss mask of `n` ones (a file without one, beside files with one): every target counts."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: slice) -> np.ndarray:
        return np.ones(len(range(*index.indices(self.n))), dtype=np.uint8)


def read_corpus(paths: list[str | Path] | None = None, limit_mb: float = 8.0, vocab: int | None = None,
                tokenizer: Tokenizer | None = None, documents: bool = False) -> tuple:
    """(`read_tokens`'s tokens, where documents start in them: sorted int64 offsets, or None unless
    `documents`; the loss mask: one uint8 a token, 1 where the loss counts, from the token files of
    instruction data (`fivefold tokenize --format chat|prompt-completion`), ones for the other files,
    None when no file has one). A file without document boundaries (raw, .npy) is a ConfigError with
    `documents`."""
    parts, starts, masks, base = [], [], [], 0
    for f, part in iter_tokens(paths, limit_mb, tokenizer):
        if vocab is not None:
            check_token_ids(part, vocab, f)
        if documents:
            starts.append(file_document_starts(f) + base)
        parts.append(part)
        masks.append(open_loss_mask(f) if is_token_file(f) else None)
        base += len(part)
    starts = np.concatenate(starts) if documents else None
    mask = joined_mask(masks, parts)
    if len(parts) == 1:
        return parts[0], starts, mask
    return (Joined(parts) if any(isinstance(p, TokenFile) for p in parts) else np.concatenate(parts)), starts, mask


def joined_mask(masks: list, parts: list):
    """One loss mask for `parts` joined end to end: each part's own (`masks[i]`) or ones where it has
    none; None when no part has one."""
    if all(m is None for m in masks):
        return None
    filled = [m if m is not None else Ones(len(p)) for m, p in zip(masks, parts)]
    return filled[0] if len(filled) == 1 else Joined(filled)


def file_document_starts(f: Path) -> np.ndarray:
    """Where the documents of one data file start, in its tokens: a token file's offsets (FILE.idx.npy,
    written by `fivefold tokenize`); a text file is one document. A raw or .npy file has no boundaries:
    a ConfigError naming the rule (train.document_mask) and what works."""
    if is_token_file(f):
        return read_offsets(f)[:-1].astype(np.int64)
    if is_mapped(f):
        raise ConfigError(f"train.document_mask needs document boundaries, and data file {str(f)!r} (raw token "
                          f"ids) has none; valid: token files from `fivefold tokenize` (FILE.idx.npy), text "
                          f"files (one document each), or train.document_mask = false")
    return np.zeros(1, dtype=np.int64)


def starts_within(starts: np.ndarray | None, lo: int, hi: int) -> np.ndarray | None:
    """The document starts in tokens [lo, hi), counted from lo (a `Slice` of the stream)."""
    if starts is None:
        return None
    return starts[(starts >= lo) & (starts < hi)] - lo


def run_tokenizer_of(train: TrainConfig) -> Tokenizer:
    """The tokenizer of a run: `train.tokenizer`, or the byte-level default, with train.eos / train.bos."""
    return load_tokenizer(train.tokenizer or None, train.eos, train.bos)


def uses_token_files(train: TrainConfig) -> bool:
    """The run trains on token files only (then batches are shuffled by sequence: ShuffledBatches)."""
    files = data_files(train)
    return bool(files) and all(is_token_file(f) for f in files)


def parse_source(entry: str) -> tuple[str, float | None]:
    """One train.data entry: FILE, or FILE:WEIGHT (a mixture source; an entry that names an existing file
    is that file, colons and all). WEIGHT must be a finite number > 0, else a one-line ConfigError."""
    path, sep, weight = str(entry).rpartition(":")
    if not sep or Path(entry).is_file() or not path:
        return str(entry), None
    try:
        w = float(weight)
    except ValueError:
        raise ConfigError(f"data source {entry!r}: weight {weight!r} is not a number; a mixture source is "
                          f"FILE:WEIGHT with WEIGHT a finite number > 0, e.g. --data a.bin:0.7 b.bin:0.3") from None
    if not (math.isfinite(w) and w > 0):
        raise ConfigError(f"data source {entry!r}: weight {weight} must be a finite number > 0 (FILE:WEIGHT, "
                          f"e.g. --data a.bin:0.7 b.bin:0.3)")
    return path, w


def mixture_of(train: TrainConfig) -> list[tuple[str, float]] | None:
    """[(file, weight)] when train.data is a mixture (every entry FILE:WEIGHT), else None; mixing weighted
    and plain entries is a ConfigError."""
    parsed = [parse_source(e) for e in train.data]
    weighted = [w is not None for _, w in parsed]
    if not any(weighted):
        return None
    if not all(weighted):
        plain = next(e for e, (_, w) in zip(train.data, parsed) if w is None)
        raise ConfigError(f"data source {plain!r} has no weight while others do; give every source as FILE:WEIGHT "
                          f"(e.g. --data a.bin:0.7 b.bin:0.3) or none")
    return [(f, w) for f, w in parsed]


def data_files(train: TrainConfig) -> list[str]:
    """The files of train.data, without mixture weights."""
    return [parse_source(e)[0] for e in train.data]


def check_data(train: TrainConfig, vocab: int) -> int:
    """Run every data check for `train` (files exist and are readable, sizes and dtypes, a token file's
    tokenizer is the run's, ids in [0, vocab), at least train.seq_len + 2 tokens) without building the
    corpus; the number of tokens."""
    mixture = mixture_of(train)
    groups = [[f] for f, _ in mixture] if mixture else [train.data]
    total = 0
    for files in groups:   # a mixture: each source on its own
        n = 0
        for f, part in iter_tokens(files, train.data_limit_mb, run_tokenizer_of(train)):
            check_token_ids(part, vocab, f)
            if train.document_mask:
                file_document_starts(f)
            if is_token_file(f):
                open_loss_mask(f, verify=True)
            n += len(part)
        check_length(n, train.seq_len)
        check_held_out(n, train)
        total += n
    return total


def check_held_out(n_tokens: int, train: TrainConfig) -> None:
    """With train.eval_fraction, both parts of a source's `split_corpus` hold a window (seq_len + 2 tokens),
    or one line naming the setting (it used to fail inside a rank as a short corpus)."""
    if not train.eval_fraction:
        return
    held = math.ceil(train.eval_fraction * n_tokens)
    need = train.seq_len + 2
    if n_tokens - held < need or held < need:
        lo, hi = need / n_tokens, (n_tokens - need) / n_tokens
        hint = (f"valid: train.eval_fraction from {lo:.2e} to {hi:.6f}" if lo <= hi else
                f"valid: at least {2 * need} tokens of data, or eval_fraction = 0")
        raise ConfigError(f"train.eval_fraction = {train.eval_fraction:g} of {n_tokens:,} tokens leaves "
                          f"{n_tokens - held:,} to train and {held:,} to evaluate; each needs train.seq_len + 2 = "
                          f"{need}; {hint}")


def data_identity(train: TrainConfig) -> dict:
    """What a run trains on, for a checkpoint: the tokenizer's digest and, per data file, its size (and
    for a token file a hash of its header, which holds the data's SHA-256; in a mixture its weight). A
    resume compares them."""
    files = []
    weights = [w for _, w in mixture_of(train) or []]
    for i, f in enumerate(map(Path, data_files(train))):
        entry = {"file": f.name, "bytes": f.stat().st_size if f.is_file() else None}
        if is_token_file(f):
            entry["header"] = header_digest(f)
        if weights:   # a mixture: a resume with other weights draws other sequences
            entry["weight"] = weights[i]
        files.append(entry)
    default = {} if train.data else {"default": default_corpus()}   # which Python's library, or which folder
    return {"tokenizer": file_digest(train.tokenizer) if train.tokenizer else ByteTokenizer.digest, "files": files,
            **default}



def one_document(train: TrainConfig) -> np.ndarray | None:
    """The starts of a stream that is one document, when the run masks documents."""
    return np.zeros(1, dtype=np.int64) if train.document_mask else None


def split_corpus(tokens, fraction: float) -> tuple:
    """(training part, held-out part) of a token stream: the last ceil(fraction * len) tokens are held
    out for evaluation (train.eval_fraction), so no training window (seq_len + 1 tokens inside the first
    part) shares a token with an evaluation window. fraction 0: (tokens, None); tokens None (no loss mask):
    (None, None)."""
    if tokens is None or not fraction:
        return tokens, None
    cut = len(tokens) - math.ceil(fraction * len(tokens))
    return Slice(tokens, 0, cut), Slice(tokens, cut, len(tokens))


def eval_corpus(train: TrainConfig, vocab: int, tokens: np.ndarray | None = None):
    """(tokens, document starts, loss mask) evaluations read: the files train.eval_data (read like
    train.data, ids checked), or the held-out tail of the training corpus (train.eval_fraction; `tokens`
    stands for that corpus when given); None when neither is set. Starts are None without
    train.document_mask, the mask None without instruction data."""
    docs = train.document_mask
    if train.eval_data:
        return read_corpus(train.eval_data, train.data_limit_mb, vocab, run_tokenizer_of(train), docs)
    if not train.eval_fraction:
        return None
    mixture = mixture_of(train) if tokens is None else None
    if mixture:   # each source's held-out tail
        tails = [held_out(*read_corpus([f], train.data_limit_mb, vocab, run_tokenizer_of(train), docs),
                          train.eval_fraction) for f, _ in mixture]
        joined = Joined([t for t, _, _ in tails])
        starts = (np.concatenate([s + lo for (_, s, _), lo in zip(tails, joined.starts[:-1])]) if docs else None)
        return joined, starts, joined_mask([m for _, _, m in tails], [t for t, _, _ in tails])
    if tokens is None:
        return held_out(*read_corpus(train.data, train.data_limit_mb, vocab, run_tokenizer_of(train), docs),
                        train.eval_fraction)
    return held_out(tokens, one_document(train), None, train.eval_fraction)


def held_out(tokens, starts, mask, fraction: float) -> tuple:
    """(the held-out tail of `tokens`, its document starts, its loss mask)."""
    tail = split_corpus(tokens, fraction)[1]
    return tail, starts_within(starts, tail.lo, tail.hi), split_corpus(mask, fraction)[1]




def eval_batch_count(n_tokens: int, seq_len: int, global_batch: int, eval_tokens: int) -> int:
    """How many fixed batches an evaluation of `n_tokens` evaluation tokens runs (EvalBatches in
    train/data.py): ceil(eval_tokens / (B·seq_len)), at most as many as the data holds; fewer than one
    batch of non-overlapping windows is a ConfigError."""
    windows = (n_tokens - 1) // seq_len
    if windows < global_batch:
        raise ConfigError(f"the evaluation data has {n_tokens} tokens, fewer than one global batch of "
                          f"windows (train.global_batch x train.seq_len + 1 = {global_batch * seq_len + 1}); "
                          f"add evaluation data, lower train.seq_len or train.global_batch (--seq-len, "
                          f"--global-batch), or raise train.eval_fraction")
    return min(-(-eval_tokens // (global_batch * seq_len)), windows // global_batch)


def check_eval_data(train: TrainConfig, vocab: int) -> int | None:
    """The evaluation data's checks (files, ids, at least one global batch of windows) before any rank
    starts; the tokens an evaluation covers, or None without eval data."""
    corpus = eval_corpus(train, vocab)
    if corpus is None:
        return None
    count = eval_batch_count(len(corpus[0]), train.seq_len, train.global_batch, train.eval_tokens)
    return count * train.global_batch * train.seq_len


class Slice:
    """Tokens [lo, hi) of a 1-D array-like (length and slices), read on demand like the array itself."""

    def __init__(self, tokens, lo: int, hi: int):
        self.tokens, self.lo, self.hi = tokens, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, index: slice) -> np.ndarray:
        begin, end, _ = index.indices(len(self))
        return np.asarray(self.tokens[self.lo + begin:self.lo + max(begin, end)])

    def tolist(self) -> list[int]:
        return self[:].tolist()


class Joined:
    """Several 1-D token arrays read as one (length and slices), without copying them together."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        begin, end, _ = index.indices(len(self))
        out = []
        for part, lo in zip(self.parts, self.starts[:-1]):
            a, b = max(begin - lo, 0), min(end - lo, len(part))
            if a < b:
                out.append(np.asarray(part[a:b]))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def tolist(self) -> list[int]:
        return self[:].tolist()
