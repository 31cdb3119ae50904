"""The batches of a run: what step k's global batch holds, drawn from the corpus (train/corpus.py: the files,
their tokens and every check on them).

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
stream (`starts`) and gives each window's per-token document ids (`local_documents`: 0 for the window's
first token, +1 at every document start inside it).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from ..config import ConfigError
from ..model.loss import IGNORE_INDEX
from .corpus import (Ones, check_length, check_token_ids, eval_batch_count, eval_corpus, is_token_file, mixture_of,
                     one_document, read_corpus, run_tokenizer_of, split_corpus, starts_within, uses_token_files)

if TYPE_CHECKING:
    from ..config import TrainConfig

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15   # 2**64 / φ: the step of MixtureBatches' Weyl sequence
SOURCE_SEED_STRIDE = 7919     # mixture source i draws its windows from seed + stride · i
MIX_CHUNK = 1 << 20           # samples whose sources MixtureBatches.drawn counts at a time


def make_batches(train: TrainConfig, vocab: int, tokens: np.ndarray | None = None) -> "Batches":
    """The batches of a run: `tokens` if given, else the corpus of `train` (ids checked against vocab);
    shuffled by sequence when the run trains on token files only (module docstring). With
    train.eval_fraction the held-out tail (`split_corpus`) is left out."""
    if tokens is not None:   # given tokens: one document (with train.document_mask)
        part = split_corpus(tokens, train.eval_fraction)[0]
        return Batches(part, train.seq_len, train.global_batch, train.seed, vocab, one_document(train))
    mixture = mixture_of(train)
    if mixture and train.records != "stream":
        raise ConfigError(f"train.records = {train.records} keeps one file's records whole; a mixture draws windows "
                          f"(records stream); valid: one data file, or records stream")
    if mixture:
        return MixtureBatches([source_batches(train, f, vocab, i) for i, (f, _) in enumerate(mixture)],
                              [w for _, w in mixture], [f for f, _ in mixture], train.seed)
    whole = train.records != "stream"
    corpus, starts, mask = read_corpus(train.data, train.data_limit_mb, vocab, run_tokenizer_of(train),
                                       train.document_mask or whole)
    kind = ShuffledBatches if uses_token_files(train) else Batches
    part = split_corpus(corpus, train.eval_fraction)[0]
    if mask is not None and kind is ShuffledBatches and not whole:   # instruction data in stream windows: say
        records = starts if starts is not None else read_corpus(            # how many records rows cut
            train.data, train.data_limit_mb, vocab, run_tokenizer_of(train), True)[1]
        batches = kind(part, train.seq_len, train.global_batch, train.seed, starts=starts_within(starts, 0, len(part)),
                       mask=split_corpus(loss_mask_of(train, mask), train.eval_fraction)[0])
        within = starts_within(records, 0, len(part))
        batches.stream_records = {"mode": "stream", "records": len(within), "cut": batches.records_cut(within)}
        return batches
    if whole:   # records kept whole: the held-out tail's records left out
        return RecordBatches(part, starts_within(starts, 0, len(part)), split_corpus(loss_mask_of(train, mask),
                             train.eval_fraction)[0], train.seq_len, train.global_batch, train.seed, train.records,
                             train.record_overflow)
    return kind(part, train.seq_len, train.global_batch, train.seed, starts=starts_within(starts, 0, len(part)),
                mask=split_corpus(loss_mask_of(train, mask), train.eval_fraction)[0])


def loss_mask_of(train: TrainConfig, mask):
    """The data's loss mask, or None (every token trained) with train.loss_mask off."""
    return mask if train.loss_mask else None


def source_batches(train: TrainConfig, file: str, vocab: int, index: int) -> "Batches":
    """One mixture source's batches, as a run on that file alone would draw them (its held-out tail left
    out), from its own seed (train.seed + SOURCE_SEED_STRIDE · index)."""
    tokens, starts, mask = read_corpus([file], train.data_limit_mb, vocab, run_tokenizer_of(train),
                                       train.document_mask)
    corpus = split_corpus(tokens, train.eval_fraction)[0]
    kind = ShuffledBatches if is_token_file(Path(file)) else Batches
    return kind(corpus, train.seq_len, train.global_batch, train.seed + SOURCE_SEED_STRIDE * index,
                starts=starts_within(starts, 0, len(corpus)),
                mask=split_corpus(loss_mask_of(train, mask), train.eval_fraction)[0])


def make_eval_batches(train: TrainConfig, vocab: int, tokens: np.ndarray | None = None) -> "EvalBatches | None":
    """The evaluation batches of a run (`EvalBatches` over `eval_corpus`), or None without eval data."""
    corpus = eval_corpus(train, vocab, tokens)
    if corpus is None:
        return None
    return EvalBatches(corpus[0], train.seq_len, train.global_batch, train.eval_tokens, corpus[1],
                       loss_mask_of(train, corpus[2]))


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
    def data_tokens(self) -> int: ...
    def loss_tokens(self, step: int) -> int: ...
    def mixture(self, first_step: int, steps: int = 1) -> dict | None: ...


def local_rows(global_batch: int, dp_rank: int, dp: int) -> tuple[int, int]:
    """[start, stop): the rows of a step's global batch that data-parallel rank `dp_rank` of `dp` reads."""
    per = global_batch // dp
    return dp_rank * per, (dp_rank + 1) * per


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
        return self.rows(step, *local_rows(self.global_batch, dp_rank, dp))

    def documents(self, step: int, start: int, stop: int) -> torch.Tensor:
        """(rows, seq_len) document ids of the input tokens of rows [start, stop) (module docstring)."""
        return window_documents(self.starts, self.offsets(step)[start:stop], self.seq_len)

    def local_documents(self, step: int, dp_rank: int, dp: int) -> torch.Tensor:
        """The document ids of `local`'s rows."""
        return self.documents(step, *local_rows(self.global_batch, dp_rank, dp))

    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def data_tokens(self) -> int:
        """The training stream's tokens: one epoch (metrics.jsonl's `epoch` counts them)."""
        return len(self.tokens)


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
        self.stream_records: dict | None = None   # instruction data: its records and how many windows cut

    def records_cut(self, records: np.ndarray) -> int:
        """How many of the records starting at `records` (sorted offsets) no window holds whole: window k
        holds tokens [k·seq_len, k·seq_len + seq_len + 1)."""
        s = self.seq_len
        starts = np.asarray(records, dtype=np.int64)
        ends = np.append(starts[1:], len(self.tokens))
        return int(np.count_nonzero(ends > (starts // s) * s + s + 1))

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

    def data_tokens(self) -> int:
        """Every source's tokens: one epoch of the mixture's data."""
        return sum(src.data_tokens() for src in self.sources)

    def mixture(self, first_step: int, steps: int = 1) -> dict:
        """The sources' weights and the tokens each gave over `steps` steps from `first_step`."""
        return {"weights": dict(zip(self.names, self.weights)), "tokens": self.drawn(first_step, steps)}


class RecordBatches:
    """Batches of whole records (train.records; instruction data: one record a document): each row holds
    whole records and padding, never a record cut across rows (TRL keeps records whole).

    - "padded": a record a row, padded to seq_len + 1 tokens (TRL without packing);
    - "packed": best-fit decreasing packing of the records into rows of seq_len + 1 tokens (TRL's "bfd"),
      each record its own document (attention kept inside it: train.document_mask), the rest padding.

    A record longer than seq_len + 1 tokens is truncated to them or dropped (train.record_overflow); the
    counts are `cut` and `dropped` (the console and run.json say them). Padding is token 0, its targets
    ignored, and so is the target after a record's last token (the next record's first). Row j of the run
    (j = step·B + r) is bin `permute(j mod N, N, key(seed, j // N))` of the N bins, so every bin is trained
    once an epoch and step k depends on (seed, k, the data) alone: the same under every layout."""

    def __init__(self, tokens, starts: np.ndarray, mask, seq_len: int, global_batch: int, seed: int, mode: str,
                 overflow: str):
        self.tokens, self.mask, self.seq_len, self.global_batch, self.seed = tokens, mask, seq_len, global_batch, seed
        window = seq_len + 1
        bounds = np.append(np.asarray(starts, dtype=np.int64), len(tokens))
        records, self.cut, self.dropped = [], 0, 0
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            if hi - lo > window:
                if overflow == "drop":
                    self.dropped += 1
                    continue
                self.cut += 1
                hi = lo + window
            if hi > lo:
                records.append((lo, hi - lo))
        if not records:
            raise ConfigError(f"every record is longer than seq_len + 1 = {window} tokens and "
                              f"train.record_overflow = drop: nothing to train on; valid: a longer train.seq_len, "
                              f"or record_overflow truncate")
        self.records = records
        self.bins = [[r] for r in records] if mode == "padded" else best_fit_decreasing(records, window)
        # each bin's trained targets, counted once: a step's loss divisor is the sum over its rows' bins
        self.trained = [sum(n - 1 if mask is None else int(np.count_nonzero(np.asarray(mask[lo + 1:lo + n])))
                            for lo, n in b) for b in self.bins]
        if len(self.bins) < global_batch:
            raise ConfigError(f"the data makes {len(self.bins)} rows of whole records, fewer than one global batch "
                              f"({global_batch}); valid: more records or a smaller train.global_batch")

    def bin_index(self, j: int) -> int:
        n = len(self.bins)
        return permute(j % n, n, mix(self.seed, j // n))

    def bin_of(self, j: int) -> list[tuple[int, int]]:
        return self.bins[self.bin_index(j)]

    def documents_of(self, j: int) -> np.ndarray:
        """(seq_len + 1,) document ids of row j: record k of the row k, padding the row's record count."""
        recs = self.bin_of(j)
        ids = np.full(self.seq_len + 1, len(recs), dtype=np.int64)
        at = 0
        for k, (_, n) in enumerate(recs):
            ids[at:at + n] = k
            at += n
        return ids

    def row(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, target mask, document ids) of row j: seq_len + 1 tokens; seq_len target flags (1: the
        loss counts); seq_len + 1 document ids (record k of the row: k; padding: the row's record count)."""
        window = self.seq_len + 1
        win = np.zeros(window, dtype=np.int64)
        keep = np.zeros(window, dtype=np.uint8)     # whether the token at each position is a trained target
        at = 0
        for lo, n in self.bin_of(j):
            win[at:at + n] = np.asarray(self.tokens[lo:lo + n], dtype=np.int64)
            keep[at + 1:at + n] = 1 if self.mask is None else np.asarray(self.mask[lo + 1:lo + n], dtype=np.uint8)
            at += n
        return win, keep[1:], self.documents_of(j)

    def rows(self, step: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = [self.row(step * self.global_batch + r) for r in range(start, stop)]
        win_bs = torch.from_numpy(np.stack([w for w, _, _ in got]))
        return win_bs[:, :-1].contiguous(), masked_targets(win_bs[:, 1:].contiguous(), np.stack([k for _, k, _ in got]))

    def local(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(step, *local_rows(self.global_batch, dp_rank, dp))

    def local_documents(self, step: int, dp_rank: int, dp: int) -> torch.Tensor:
        start, stop = local_rows(self.global_batch, dp_rank, dp)
        return torch.from_numpy(np.stack([self.documents_of(step * self.global_batch + r)[:-1]
                                          for r in range(start, stop)]))

    @property
    def masked(self) -> bool:
        return True   # padding is never trained

    def loss_tokens(self, step: int) -> int:
        first = step * self.global_batch
        return max(1, sum(self.trained[self.bin_index(j)] for j in range(first, first + self.global_batch)))

    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def data_tokens(self) -> int:
        """One epoch's tokens: every row once (padding included), so `epoch` counts passes over the rows."""
        return len(self.bins) * self.seq_len

    def mixture(self, first_step: int, steps: int = 1) -> None:
        return None

    def summary(self) -> dict:
        """What run.json and the console say of the records: rows, records, and those cut or dropped."""
        kept = sum(n for _, n in self.records)
        return {"rows": len(self.bins), "records": len(self.records) + self.dropped, "cut": self.cut,
                "dropped": self.dropped, "padding": 1 - kept / (len(self.bins) * (self.seq_len + 1))}


def best_fit_decreasing(records: list[tuple[int, int]], capacity: int) -> list[list[tuple[int, int]]]:
    """Records (start, length) packed into bins of `capacity` tokens: longest first, each into the bin it
    fills the most (the least room left that still holds it), a new bin when none does; bins in the
    order they were opened, records in each in the order they went in."""
    import bisect

    bins: list[list[tuple[int, int]]] = []
    room: list[tuple[int, int]] = []   # (room left, bin index), sorted
    for rec in sorted(records, key=lambda r: (-r[1], r[0])):
        i = bisect.bisect_left(room, (rec[1], -1))
        if i < len(room):
            left, b = room.pop(i)
            bins[b].append(rec)
            bisect.insort(room, (left - rec[1], b))
        else:
            bins.append([rec])
            bisect.insort(room, (capacity - rec[1], len(bins) - 1))
    return bins


class EvalBatches(Batches):
    """The fixed batches of an evaluation: batch b holds the non-overlapping windows b·B .. b·B + B - 1
    of the evaluation tokens (window i starts at i·seq_len), the same in every evaluation and under every
    layout. `count` batches cover about `eval_tokens` tokens: ceil(eval_tokens / (B·seq_len)) batches,
    at most as many as the data holds; fewer than one batch of windows is a ConfigError."""

    def __init__(self, tokens, seq_len: int, global_batch: int, eval_tokens: int, starts: np.ndarray | None = None,
                 mask=None):
        self.count = eval_batch_count(len(tokens), seq_len, global_batch, eval_tokens)
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, 0
        self.starts, self.mask = starts, mask

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

    def data_tokens(self) -> int:
        return self.global_batch * self.seq_len

    def mixture(self, first_step: int, steps: int = 1) -> None:
        return None

    masked = False

    def loss_tokens(self, step: int) -> int:
        return self.tokens_per_step()
