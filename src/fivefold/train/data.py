"""Training data that needs no download.

Default corpus: the Python standard library's own source files (present wherever Python is), read in
sorted order up to a size limit, as byte-level tokens (vocab 256). `--data` takes a user's files:
- text files (any extension not below): their bytes are the tokens;
- `.u16` / `.bin`: raw little-endian uint16 token ids; `.u32`: raw uint32; `.npy`: a 1-D integer array.

Batches do not depend on the layout: the global batch of step k is `global_batch` windows of
`seq_len + 1` tokens at offsets drawn from a generator seeded with (seed, k). Data-parallel rank r
takes rows [r·B/dp, (r+1)·B/dp) and reads only those windows; micro-batches split that slice in order.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError

RAW_DTYPES = {".u16": np.uint16, ".bin": np.uint16, ".u32": np.uint32}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def read_tokens(paths: list[str | Path] | None = None, limit_mb: float = 8.0) -> np.ndarray:
    """All tokens of the corpus as a 1-D integer array (at most limit_mb MiB of text when text)."""
    limit = int(limit_mb * 2**20) if limit_mb > 0 else None
    files = [Path(p) for p in paths] if paths else stdlib_files()
    if not files:
        raise ConfigError("no training data: pass --data FILE (text, .u16/.bin, .u32 or .npy)")
    parts, total = [], 0
    for f in files:
        if not f.is_file():
            raise ConfigError(f"data file {str(f)!r} does not exist")
        if f.suffix in RAW_DTYPES:
            parts.append(np.memmap(f, dtype=RAW_DTYPES[f.suffix], mode="r"))
            continue
        if f.suffix == ".npy":
            parts.append(np.load(f, mmap_mode="r").reshape(-1))
            continue
        data = f.read_bytes()
        if limit is not None:
            data = data[: max(limit - total, 0)]
        parts.append(np.frombuffer(data, dtype=np.uint8))
        total += len(data)
        if limit is not None and total >= limit:
            break
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class Batches:
    """Layout-independent batches: `local(step, dp_rank, dp)` gives this rank's (inputs, targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int, vocab: int | None = None):
        if len(tokens) < seq_len + 2:
            raise ConfigError(f"the corpus has {len(tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        if vocab is not None:
            top = int(tokens[: 1 << 20].max())
            if top >= vocab:
                raise ConfigError(f"token id {top} >= model.vocab ({vocab}); raise model.vocab")

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
