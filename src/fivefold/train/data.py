"""Training data that needs no download.

Default corpus: the Python standard library's own source files (present wherever Python is), read in
sorted order up to a size limit, as byte-level tokens (vocab 256). `--data` takes a user's files:
- text files (any extension not below): their bytes are the tokens;
- `.u16` / `.bin`: raw little-endian uint16 token ids; `.u32`: raw uint32; `.npy`: an integer array
  (flattened; loaded without pickle).

Checks, each a one-line `ConfigError` naming the file: a file exists and is readable, a raw file's size
is a whole number of tokens, a .npy holds integers, and every token id of every file (scanned in chunks,
so a memory-mapped file is never loaded at once) lies in [0, model.vocab). `check_data` runs them all
and the corpus-length rule before any rank starts; `read_tokens(..., vocab)` and `Batches(..., vocab)`
run the id check through the same `check_token_ids`.

Batches do not depend on the layout: the global batch of step k is `global_batch` windows of
`seq_len + 1` tokens at offsets drawn from a generator seeded with (seed, k). Data-parallel rank r
takes rows [r·B/dp, (r+1)·B/dp) and reads only those windows; micro-batches split that slice in order.
"""
from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import ConfigError

if TYPE_CHECKING:
    from ..config import TrainConfig

RAW_DTYPES = {".u16": np.uint16, ".bin": np.uint16, ".u32": np.uint32}
CHECK_CHUNK = 1 << 24        # token ids scanned at a time by check_token_ids
FORMATS = "text, .u16/.bin, .u32 or .npy"


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


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


def corpus_files(paths: list[str | Path] | None) -> list[Path]:
    """The user's data files, or the standard library's sources when none are given."""
    files = [Path(p) for p in paths] if paths else stdlib_files()
    if not files:
        raise ConfigError(f"no training data: pass --data FILE ({FORMATS})")
    return files


def file_tokens(f: Path, budget: int | None = None) -> np.ndarray:
    """The tokens of one data file as a 1-D integer array (raw and .npy files memory-mapped; at most
    `budget` bytes of a text file)."""
    if not f.exists():
        raise ConfigError(f"data file {str(f)!r} does not exist; pass --data FILE ({FORMATS})")
    if not f.is_file():
        raise ConfigError(f"data file {str(f)!r} is not a file; pass --data FILE ({FORMATS})")
    try:
        if f.suffix in RAW_DTYPES:
            return _raw_tokens(f, np.dtype(RAW_DTYPES[f.suffix]))
        if f.suffix == ".npy":
            return _npy_tokens(f)
        with open(f, "rb") as fh:
            return np.frombuffer(fh.read(-1 if budget is None else budget), dtype=np.uint8)
    except OSError as e:
        raise ConfigError(f"data file {str(f)!r} cannot be read ({e.strerror or e})") from None


def _raw_tokens(f: Path, dtype: np.dtype) -> np.ndarray:
    size = f.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(f"data file {str(f)!r} has {size} bytes, not a multiple of {dtype.itemsize}: "
                          f"{f.suffix} holds raw {dtype.name} token ids ({dtype.itemsize} bytes each)")
    if size == 0:
        return np.zeros(0, dtype)
    return np.memmap(f, dtype=dtype, mode="r")


def _npy_tokens(f: Path) -> np.ndarray:
    try:
        arr = np.load(f, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"data file {str(f)!r} is not a .npy array loadable without pickle ({reason}); "
                          f"save token ids with np.save(path, ids.astype(np.uint32))") from None
    if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.integer):
        kind = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ConfigError(f"data file {str(f)!r} holds {kind}, not integer token ids; "
                          f"save them with np.save(path, ids.astype(np.uint32))")
    return arr.reshape(-1)


def iter_tokens(paths: list[str | Path] | None = None, limit_mb: float = 8.0) -> Iterator[tuple[Path, np.ndarray]]:
    """(file, its tokens) for each file of the corpus, text files stopping after limit_mb MiB in all
    (limit_mb <= 0: no limit)."""
    limit = int(limit_mb * 2**20) if limit_mb > 0 else None
    text = 0
    for f in corpus_files(paths):
        if f.suffix in RAW_DTYPES or f.suffix == ".npy":
            yield f, file_tokens(f)
            continue
        part = file_tokens(f, None if limit is None else max(limit - text, 0))
        text += len(part)
        yield f, part
        if limit is not None and text >= limit:
            return


def read_tokens(paths: list[str | Path] | None = None, limit_mb: float = 8.0, vocab: int | None = None) -> np.ndarray:
    """All tokens of the corpus as a 1-D integer array (at most limit_mb MiB of text when text); with
    `vocab`, every file's ids are checked to lie in [0, vocab)."""
    parts = []
    for f, part in iter_tokens(paths, limit_mb):
        if vocab is not None:
            check_token_ids(part, vocab, f)
        parts.append(part)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def check_data(train: TrainConfig, vocab: int) -> int:
    """Run every data check for `train` (files exist and are readable, sizes and dtypes, ids in
    [0, vocab), at least train.seq_len + 2 tokens) without building the corpus; the number of tokens."""
    n = 0
    for f, part in iter_tokens(train.data, train.data_limit_mb):
        check_token_ids(part, vocab, f)
        n += len(part)
    check_length(n, train.seq_len)
    return n


class Batches:
    """Layout-independent batches: `local(step, dp_rank, dp)` gives this rank's (inputs, targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int, vocab: int | None = None):
        check_length(len(tokens), seq_len)
        if vocab is not None:
            check_token_ids(tokens, vocab)
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed

    def offsets(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.global_batch,), generator=gen)

    def rows(self, step: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        offs = self.offsets(step)[start:stop].tolist()
        win = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1], dtype=np.int64) for o in offs])
        win_bs = torch.from_numpy(win)
        return win_bs[:, :-1].contiguous(), win_bs[:, 1:].contiguous()

    def local(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        per = self.global_batch // dp
        return self.rows(step, dp_rank * per, (dp_rank + 1) * per)

    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len
