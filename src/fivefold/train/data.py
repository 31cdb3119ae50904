"""Training data that needs no download.

Default corpus: the Python standard library's own source files (present wherever Python is), read in
sorted order up to a size limit, as byte-level tokens (vocab 256). `--data` takes a user's files:
- text files (any extension not below): their bytes are the tokens;
- `.u16` / `.bin`: raw little-endian uint16 token ids; `.u32`: raw uint32; `.npy`: an integer array
  (flattened; loaded without pickle);
- a token file written by `fivefold tokenize` (any name, with its header `FILE.idx.json` beside it,
  tokenize.py): read on demand (`TokenFile`: only the windows a step draws, and the id check a chunk at
  a time), never loaded whole and never cut by `data_limit_mb`; refused when another tokenizer than
  the run's (`train.tokenizer`, default byte-level) made it.
With `train.tokenizer` a text file is tokenized in memory (up to data_limit_mb of text), its tokens
followed by the tokenizer's end-of-text id.

Checks, each a one-line `ConfigError` naming the file: a file exists and is readable, a raw file's size
is a whole number of tokens, a .npy holds integers, and every token id of every file (scanned in chunks,
so a memory-mapped file is never loaded at once) lies in [0, model.vocab). `check_data` runs them all
and the corpus-length rule before any rank starts; `read_tokens(..., vocab)` and `Batches(..., vocab)`
run the id check through the same `check_token_ids`.

Batches do not depend on the layout: the global batch of step k is `global_batch` windows of
`seq_len + 1` tokens chosen from (seed, k) and the data alone, so a resumed run draws exactly what an
uninterrupted one would. Data-parallel rank r takes rows [r·B/dp, (r+1)·B/dp) and reads only those
windows; micro-batches split that slice in order. How the windows are chosen:
- token files (`ShuffledBatches`, shuffled by sequence): the stream is cut into N = (tokens - 1) // seq_len
  windows (neighbours share one token) and epoch e visits each once, in an order permuted by
  (seed, e): sample j of the run (j = k·B + row) is window perm_e(j mod N), e = j // N. The permutation
  is a keyed Feistel network, so it costs no memory however many windows there are. Windows cross
  document boundaries (documents are separated by the end-of-text id, as in GPT-style packing);
  train.document_mask keeps attention inside each document (below).
- anything else (`Batches`): each window starts at a uniformly random offset drawn from a generator
  seeded with (seed, k).
- a mixture (`--data a.bin:0.7 b.bin:0.3`, `MixtureBatches`): sample j comes from a source chosen by
  weight from (seed, j) alone, and is the window that source's own batches give sample j.
Evaluation (`EvalBatches`): the fixed, non-overlapping windows of train.eval_data, or of the held-out
tail of the training stream (train.eval_fraction, `split_corpus`), which training never reads.

Documents (train.document_mask, model/documents.py): a batch also knows where documents start in its
stream (`starts`: a token file's offsets, FILE.idx.npy; each text file is one document; raw and .npy
files have none, an error at start) and gives each window's per-token document ids (`local_documents`:
0 for the window's first token, +1 at every document start inside it).
"""
from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from ..config import ConfigError
from ..model.transformer import IGNORE_INDEX
from ..tokenizer import ByteTokenizer, Tokenizer, file_digest, load_tokenizer
from .tokenize import (TABLE_SUFFIXES, JSONL_SUFFIXES, TokenFile, header_digest, is_token_file, open_loss_mask,
                       open_token_file, read_offsets, token_dtype)

if TYPE_CHECKING:
    from ..config import TrainConfig

RAW_DTYPES = {".u16": np.uint16, ".bin": np.uint16, ".u32": np.uint32}
CHECK_CHUNK = 1 << 24        # token ids scanned at a time by check_token_ids
FORMATS = "text, .u16/.bin, .u32, .npy, or a token file from fivefold tokenize"
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15   # 2**64 / φ: the step of MixtureBatches' Weyl sequence
SOURCE_SEED_STRIDE = 7919     # mixture source i draws its windows from seed + stride · i
MIX_CHUNK = 1 << 20           # samples whose sources MixtureBatches.drawn counts at a time


def stdlib_files() -> Iterator[Path]:
    """The standard library's Python sources, in sorted path order, found as they are read: a walk of each
    folder's sorted entries (not into site-packages or symlinked folders) yields the order sorting every
    path would, without listing 1,800 files first (0.7 s a run) when the default corpus stops after 8 MiB."""
    yield from _sorted_sources(Path(sysconfig.get_paths()["stdlib"]))


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
    return {"tokenizer": file_digest(train.tokenizer) if train.tokenizer else ByteTokenizer.digest, "files": files}


def make_batches(train: TrainConfig, vocab: int, tokens: np.ndarray | None = None) -> "Batches":
    """The batches of a run: `tokens` if given, else the corpus of `train` (ids checked against vocab);
    shuffled by sequence when the run trains on token files only (module docstring). With
    train.eval_fraction the held-out tail (`split_corpus`) is left out."""
    if tokens is not None:   # given tokens: one document (with train.document_mask)
        part = split_corpus(tokens, train.eval_fraction)[0]
        return Batches(part, train.seq_len, train.global_batch, train.seed, vocab, one_document(train))
    mixture = mixture_of(train)
    if mixture:
        return MixtureBatches([source_batches(train, f, vocab, i) for i, (f, _) in enumerate(mixture)],
                              [w for _, w in mixture], [f for f, _ in mixture], train.seed)
    corpus, starts, mask = read_corpus(train.data, train.data_limit_mb, vocab, run_tokenizer_of(train),
                                       train.document_mask)
    kind = ShuffledBatches if uses_token_files(train) else Batches
    part = split_corpus(corpus, train.eval_fraction)[0]
    return kind(part, train.seq_len, train.global_batch, train.seed, starts=starts_within(starts, 0, len(part)),
                mask=split_corpus(mask, train.eval_fraction)[0])


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


def source_batches(train: TrainConfig, file: str, vocab: int, index: int) -> "Batches":
    """One mixture source's batches, as a run on that file alone would draw them (its held-out tail left
    out), from its own seed (train.seed + SOURCE_SEED_STRIDE · index)."""
    tokens, starts, mask = read_corpus([file], train.data_limit_mb, vocab, run_tokenizer_of(train),
                                       train.document_mask)
    corpus = split_corpus(tokens, train.eval_fraction)[0]
    kind = ShuffledBatches if is_token_file(Path(file)) else Batches
    return kind(corpus, train.seq_len, train.global_batch, train.seed + SOURCE_SEED_STRIDE * index,
                starts=starts_within(starts, 0, len(corpus)),
                mask=split_corpus(mask, train.eval_fraction)[0])


def make_eval_batches(train: TrainConfig, vocab: int, tokens: np.ndarray | None = None) -> "EvalBatches | None":
    """The evaluation batches of a run (`EvalBatches` over `eval_corpus`), or None without eval data."""
    corpus = eval_corpus(train, vocab, tokens)
    if corpus is None:
        return None
    return EvalBatches(corpus[0], train.seq_len, train.global_batch, train.eval_tokens, corpus[1], corpus[2])


def check_eval_data(train: TrainConfig, vocab: int) -> int | None:
    """The evaluation data's checks (files, ids, at least one global batch of windows) before any rank
    starts; the tokens an evaluation covers, or None without eval data."""
    batches = make_eval_batches(train, vocab)
    return None if batches is None else batches.total_tokens()


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


@runtime_checkable
class BatchSource(Protocol):
    """What the trainer reads of a run's batches, whatever makes them (`Batches` and `ShuffledBatches` from
    one source, `MixtureBatches` from several, a dry run's `SyntheticBatches`): this rank's rows of step k
    (`local`, and their document ids, `local_documents`), the step's tokens (`tokens_per_step`) and the
    targets its loss averages over (`loss_tokens`; fewer when `masked`), and the mixture's weights and
    tokens per source (`mixture`; None from one source)."""

    global_batch: int
    seq_len: int

    @property
    def masked(self) -> bool: ...
    def local(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def local_documents(self, step: int, dp_rank: int, dp: int) -> torch.Tensor: ...
    def tokens_per_step(self) -> int: ...
    def loss_tokens(self, step: int) -> int: ...
    def mixture(self, first_step: int, steps: int = 1) -> dict | None: ...


class Batches:
    """Layout-independent batches: `local(step, dp_rank, dp)` gives this rank's (inputs, targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int, vocab: int | None = None,
                 starts: np.ndarray | None = None, mask=None):
        check_length(len(tokens), seq_len)
        if vocab is not None:
            check_token_ids(tokens, vocab)
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.starts = starts   # where documents start in `tokens` (train.document_mask), or None
        self.mask = mask       # the loss mask of `tokens` (instruction data: 1 where the loss counts), or None

    def offsets(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.global_batch,), generator=gen)

    def rows(self, step: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        offs = self.offsets(step)[start:stop].tolist()
        win = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1], dtype=np.int64) for o in offs])
        win_bs = torch.from_numpy(win)
        return win_bs[:, :-1].contiguous(), masked_targets(win_bs[:, 1:].contiguous(), self.mask_rows(offs))

    def mixture(self, first_step: int, steps: int = 1) -> dict | None:
        """One source: no mixture to report (MixtureBatches: its weights and tokens per source)."""
        return None

    @property
    def masked(self) -> bool:
        """Whether the loss skips some targets (instruction data's loss mask)."""
        return self.mask is not None

    def mask_rows(self, offs: list[int]) -> np.ndarray | None:
        """(rows, seq_len) uint8: whether each target of the windows at `offs` counts (None: all do)."""
        return None if self.mask is None else target_mask(self.mask, offs, self.seq_len)

    def loss_tokens(self, step: int) -> int:
        """The targets step `step`'s loss averages over (every rank's rows): all of them, or with a loss mask
        those it keeps (at least 1, so a step whose rows hold no answer trains nothing)."""
        if self.mask is None:
            return self.tokens_per_step()
        return max(1, int(self.mask_rows(self.offsets(step).tolist()).sum(dtype=np.int64)))

    def local(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        per = self.global_batch // dp
        return self.rows(step, dp_rank * per, (dp_rank + 1) * per)

    def documents(self, step: int, start: int, stop: int) -> torch.Tensor:
        """(rows, seq_len) document ids of the input tokens of rows [start, stop) (module docstring)."""
        return window_documents(self.starts, self.offsets(step)[start:stop], self.seq_len)

    def local_documents(self, step: int, dp_rank: int, dp: int) -> torch.Tensor:
        """The document ids of `local`'s rows."""
        per = self.global_batch // dp
        return self.documents(step, dp_rank * per, (dp_rank + 1) * per)

    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def target_mask(mask, offs: list[int], seq_len: int) -> np.ndarray:
    """(rows, seq_len) uint8 loss mask of the targets of the windows at `offs` (a window's targets are
    its tokens 1 .. seq_len); a value other than 0 or 1 means the file changed under the run."""
    m = np.stack([np.asarray(mask[o + 1:o + seq_len + 1], dtype=np.uint8) for o in offs])
    if m.max(initial=0) > 1:
        raise ConfigError("a loss mask holds values other than 0 and 1 (its file changed under the run); "
                          "tokenize the data again")
    return m


def masked_targets(y_bs: torch.Tensor, mask_bs: np.ndarray | None) -> torch.Tensor:
    """The targets with those the loss skips set to IGNORE_INDEX."""
    if mask_bs is not None:
        y_bs[torch.from_numpy(mask_bs == 0)] = IGNORE_INDEX
    return y_bs


def window_documents(starts: np.ndarray, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(rows, seq_len) int64: for windows of input tokens starting at `offsets`, each token's document
    counted from the window's first (0, then +1 at each document start after it)."""
    index_bs = offsets.numpy()[:, None] + np.arange(seq_len)
    docs_bs = np.searchsorted(starts, index_bs, side="right")
    return torch.from_numpy((docs_bs - docs_bs[:, :1]).astype(np.int64))


class ShuffledBatches(Batches):
    """Batches of a token file, shuffled by sequence (module docstring): sample j of the run is window
    `permute(j mod N, N, key(seed, j // N))` of the N non-overlapping windows, so every window is seen
    once an epoch and step k depends on (seed, k, the data) alone."""

    def __init__(self, tokens, seq_len: int, global_batch: int, seed: int, vocab: int | None = None,
                 starts: np.ndarray | None = None, mask=None):
        super().__init__(tokens, seq_len, global_batch, seed, vocab, starts, mask)
        self.windows = (len(tokens) - 1) // seq_len

    def offsets(self, step: int) -> torch.Tensor:
        first = step * self.global_batch
        n = self.windows
        return torch.tensor([permute(j % n, n, mix(self.seed, j // n)) * self.seq_len
                             for j in range(first, first + self.global_batch)], dtype=torch.int64)


class MixtureBatches:
    """Batches drawn from several sources by weight (`--data a.bin:0.7 b.bin:0.3`). Sample j of the run
    (j = k·B + row) comes from source `source_of(j)`: with u_j = frac(j·φ + key(seed)) (φ the golden
    ratio, in exact 64-bit integers: a Weyl sequence), the source whose share of [0, 1) holds u_j. Any
    n consecutive samples then hold each source within a few samples of n · weight (its discrepancy is
    O(log n / n)), and the choice depends on (seed, j) alone, so a resumed run draws what an
    uninterrupted one does. The window itself is the one that source's own batches (`source_batches`:
    shuffled by sequence for a token file) give sample j."""

    def __init__(self, sources: list[Batches], weights: list[float], names: list[str], seed: int):
        self.sources, self.names = sources, names
        self.seq_len, self.global_batch, self.seed = sources[0].seq_len, sources[0].global_batch, seed
        top = max(weights)                           # scaled first: 1e308 + 1e308 would overflow to inf
        total = sum(w / top for w in weights)
        self.weights = [w / top / total for w in weights]
        edges = np.cumsum(self.weights)[:-1]
        self.edges = np.array([min(int(e * 2.0**64), M64) for e in edges], dtype=np.uint64)   # source bounds of u
        self.key = np.uint64(mix(seed, 0x6D69787475726521))

    def source_of(self, first: int, count: int) -> np.ndarray:
        """The source index of samples first .. first + count - 1."""
        j = np.arange(first, first + count, dtype=np.uint64)
        with np.errstate(over="ignore"):
            u = j * np.uint64(GOLDEN) + self.key   # wraps mod 2**64
        return np.searchsorted(self.edges, u, side="right")

    def picks(self, step: int, start: int, stop: int) -> list[tuple[int, int]]:
        """(source, offset in it) of rows [start, stop) of step `step`."""
        which = self.source_of(step * self.global_batch + start, stop - start).tolist()
        offsets = {s: self.sources[s].offsets(step) for s in set(which)}
        return [(s, int(offsets[s][start + i])) for i, s in enumerate(which)]

    def rows(self, step: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        picks = self.picks(step, start, stop)
        win = np.stack([np.asarray(self.sources[s].tokens[o:o + self.seq_len + 1], dtype=np.int64) for s, o in picks])
        win_bs = torch.from_numpy(win)
        return win_bs[:, :-1].contiguous(), masked_targets(win_bs[:, 1:].contiguous(), self.mask_of(picks))

    def mask_of(self, picks: list[tuple[int, int]]) -> np.ndarray | None:
        """The rows' loss mask, each from its source's (ones for a source without one); None if none has."""
        if all(src.mask is None for src in self.sources):
            return None
        return np.concatenate([target_mask(self.sources[s].mask if self.sources[s].mask is not None
                                           else Ones(len(self.sources[s].tokens)), [o], self.seq_len) for s, o in picks])

    @property
    def masked(self) -> bool:
        return any(src.mask is not None for src in self.sources)

    def loss_tokens(self, step: int) -> int:
        mask = self.mask_of(self.picks(step, 0, self.global_batch))
        return self.tokens_per_step() if mask is None else max(1, int(mask.sum(dtype=np.int64)))

    def documents(self, step: int, start: int, stop: int) -> torch.Tensor:
        """Each row's document ids, from the source it was drawn from."""
        which = self.source_of(step * self.global_batch + start, stop - start).tolist()
        offsets = {s: self.sources[s].offsets(step) for s in set(which)}
        return torch.cat([window_documents(self.sources[s].starts, offsets[s][start + i:start + i + 1], self.seq_len)
                          for i, s in enumerate(which)])

    local = Batches.local
    local_documents = Batches.local_documents
    tokens_per_step = Batches.tokens_per_step

    def drawn(self, first_step: int, steps: int = 1) -> dict[str, int]:
        """Tokens drawn from each source (by its file, as train.data names it) over `steps` steps from `first_step`, every rank's
        rows together."""
        counts = np.zeros(len(self.sources), dtype=np.int64)
        per = self.global_batch
        for lo in range(first_step * per, (first_step + steps) * per, MIX_CHUNK):
            n = min(MIX_CHUNK, (first_step + steps) * per - lo)
            counts += np.bincount(self.source_of(lo, n), minlength=len(self.sources))
        return {name: int(c) * self.seq_len for name, c in zip(self.names, counts)}

    def mixture(self, first_step: int, steps: int = 1) -> dict:
        """The sources' weights and the tokens each gave over `steps` steps from `first_step`."""
        return {"weights": dict(zip(self.names, self.weights)), "tokens": self.drawn(first_step, steps)}


class EvalBatches(Batches):
    """The fixed batches of an evaluation: batch b holds the non-overlapping windows b·B .. b·B + B - 1
    of the evaluation tokens (window i starts at i·seq_len), the same in every evaluation and under every
    layout. `count` batches cover about `eval_tokens` tokens: ceil(eval_tokens / (B·seq_len)) batches,
    at most as many as the data holds; fewer than one batch of windows is a ConfigError."""

    def __init__(self, tokens, seq_len: int, global_batch: int, eval_tokens: int, starts: np.ndarray | None = None,
                 mask=None):
        windows = (len(tokens) - 1) // seq_len
        if windows < global_batch:
            raise ConfigError(f"the evaluation data has {len(tokens)} tokens, fewer than one global batch of "
                              f"windows (train.global_batch x train.seq_len + 1 = {global_batch * seq_len + 1}); "
                              f"add evaluation data or raise train.eval_fraction")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, 0
        self.starts, self.mask = starts, mask
        self.count = min(-(-eval_tokens // (global_batch * seq_len)), windows // global_batch)

    def offsets(self, step: int) -> torch.Tensor:
        first = step * self.global_batch
        return torch.arange(first, first + self.global_batch, dtype=torch.int64) * self.seq_len

    def total_tokens(self) -> int:
        """Tokens one evaluation covers (its predicted targets)."""
        return self.count * self.tokens_per_step()

    def loss_tokens_total(self) -> int:
        """The targets one evaluation's loss averages over: all, or with a loss mask those it keeps."""
        if self.mask is None:
            return self.total_tokens()
        return max(1, sum(int(self.mask_rows(self.offsets(b).tolist()).sum(dtype=np.int64)) for b in range(self.count)))


def mix(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): the keys and round functions of `permute`."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & M64)) * 0xBF58476D1CE4E5B9 & M64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & M64
        h ^= h >> 29
    return h


def permute(i: int, n: int, key: int, rounds: int = 4) -> int:
    """Position i of a pseudo-random permutation of range(n) chosen by `key`, in O(1) memory: a
    balanced Feistel network on the smallest even number of bits that holds n, applied again until the
    value falls below n (cycle walking keeps it a bijection of range(n); fewer than 4 tries expected)."""
    bits = max((n - 1).bit_length(), 2)
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for r in range(rounds):
            left, right = right, left ^ (mix(key, r, right) & mask)
        x = (left << half) | right
        if x < n:
            return x


class SyntheticBatches:
    """A dry run's batches (tools/dryrun.py): the shapes of `Batches.local` (global_batch/dp sequences of
    seq_len tokens, inputs and targets), token 0 everywhere; under a FakeTensorMode they hold no memory."""

    def __init__(self, train: TrainConfig):
        self.global_batch, self.seq_len = train.global_batch, train.seq_len

    def local(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.global_batch // dp, self.seq_len)
        return torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)

    def local_documents(self, step: int, dp_rank: int, dp: int) -> torch.Tensor:
        """One document a row (the masks are built as in a real run)."""
        return torch.zeros((self.global_batch // dp, self.seq_len), dtype=torch.long)

    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def mixture(self, first_step: int, steps: int = 1) -> None:
        return None

    masked = False

    def loss_tokens(self, step: int) -> int:
        return self.tokens_per_step()
