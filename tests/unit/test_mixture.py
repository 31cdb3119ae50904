"""Data mixtures: `--data a.bin:0.7 b.bin:0.3` draws sources by weight, from (seed, step) alone."""
import json

import numpy as np
import pytest

from fivefold.config import ConfigError
from fivefold.train.data import make_batches
from fivefold.train.corpus import mixture_of, parse_source
from fivefold.train.trainer import Trainer

from tests.support.tiny import tiny_config


def sources(tmp_path, n=3):
    """Raw uint16 token files whose ids tell their source: file i holds ids in [64 i, 64 i + 64)."""
    rng = np.random.default_rng(0)
    files = []
    for i in range(n):
        f = tmp_path / f"s{i}.u16"
        (rng.integers(0, 64, 5_000) + 64 * i).astype(np.uint16).tofile(f)
        files.append(str(f))
    return files


@pytest.mark.parametrize("entry, words", [
    ("a.bin:abc", "weight 'abc' is not a number"), ("a.bin:0", "must be a finite number > 0"),
    ("a.bin:-1", "must be a finite number > 0"), ("a.bin:nan", "must be a finite number > 0"),
    ("a.bin:inf", "must be a finite number > 0")])
def test_bad_weights_are_one_line(entry, words):
    with pytest.raises(ConfigError, match=words) as e:
        parse_source(entry)
    assert "\n" not in str(e.value)


def test_weights_are_all_or_none(tmp_path):
    cfg = tiny_config()
    cfg.train.data = ["a.bin:0.5", "b.bin"]
    with pytest.raises(ConfigError, match="has no weight while others do"):
        mixture_of(cfg.train)
    odd = tmp_path / "x:1"   # an existing file is itself, colon and all
    odd.write_bytes(b"hello")
    assert parse_source(str(odd)) == (str(odd), None)


@pytest.mark.parametrize("weights", [(0.7, 0.3), (5, 3, 2), (1e308, 1e308)])   # (their sum overflows: scaled first)
def test_mixture_draws_within_one_percent_of_its_weights(tmp_path, weights):
    files = sources(tmp_path, len(weights))
    cfg = tiny_config()
    cfg.train.global_batch, cfg.train.seq_len = 16, 8
    cfg.train.data = [f"{f}:{w}" for f, w in zip(files, weights)]
    batches = make_batches(cfg.train, 256)
    steps = 10_000 // 16   # 10k sequences
    seen = np.zeros(len(weights))
    for k in range(steps):
        x, _ = batches.local(k, 0, 1)
        seen += np.bincount(x[:, 0].numpy() // 64, minlength=len(weights))
    share = np.asarray(weights) / max(weights) / sum(np.asarray(weights) / max(weights))
    np.testing.assert_allclose(seen / seen.sum(), share, atol=0.01)
    drawn = batches.drawn(0, steps)
    assert list(drawn.values()) == [int(n) * 8 for n in seen]   # the record counts what the batches hold
    x1, _ = make_batches(cfg.train, 256).local(123, 1, 2)        # a new reader (a resumed run): same rows
    assert (x1 == batches.local(123, 1, 2)[0]).all()


def test_mixture_resumes_exactly_and_records_tokens(tmp_path):
    files = sources(tmp_path, 2)

    def cfg(steps):
        c = tiny_config()
        c.train.data = [f"{files[0]}:0.7", f"{files[1]}:0.3"]
        c.train.steps, c.train.checkpoint, c.train.checkpoint_every = steps, True, 2
        return c

    full, part = tmp_path / "full", tmp_path / "part"
    Trainer(cfg(4), quiet=True).run(full)
    Trainer(cfg(2), quiet=True).run(part)
    Trainer(cfg(4), quiet=True).run(part, resume="auto")
    read = lambda out: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = read(full), read(part)
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    assert [m["data_tokens"] for m in a] == [m["data_tokens"] for m in b]
    assert all(sum(m["data_tokens"].values()) == m["tokens"] for m in a)
    run = json.loads((part / "run.json").read_text())
    assert run["data_mixture"]["weights"] == {files[0]: 0.7, files[1]: 0.3}
    assert run["data_mixture"]["tokens"] == {f: sum(m["data_tokens"][f] for m in a) for f in files}


def test_each_source_keeps_its_own_held_out_tail(tmp_path):
    from fivefold.train.data import make_eval_batches

    files = sources(tmp_path, 2)
    cfg = tiny_config()
    cfg.train.data = [f"{files[0]}:0.5", f"{files[1]}:0.5"]
    cfg.train.eval_fraction, cfg.train.global_batch, cfg.train.seq_len = 0.1, 4, 8
    batches, held = make_batches(cfg.train, 256), make_eval_batches(cfg.train, 256)
    assert [len(s.tokens) for s in batches.sources] == [4_500, 4_500]
    assert len(held.tokens) == 1_000
    tail = held.tokens[0:1_000]
    assert (tail[:500] // 64 == 0).all() and (tail[500:] // 64 == 1).all()   # both sources' tails
    full = np.fromfile(files[0], dtype=np.uint16)
    assert tail[:500].tolist() == full[4_500:].tolist()


def test_a_resume_with_other_weights_is_warned_about(tmp_path):
    from fivefold.train.corpus import data_identity
    from fivefold.train.rundir import compare_data

    files = sources(tmp_path, 2)
    cfg = tiny_config()
    cfg.train.data = [f"{files[0]}:0.7", f"{files[1]}:0.3"]
    before = data_identity(cfg.train)
    assert [f["weight"] for f in before["files"]] == [0.7, 0.3]
    cfg.train.data = [f"{files[0]}:0.5", f"{files[1]}:0.5"]
    errors, warnings = compare_data(before, data_identity(cfg.train))
    assert not errors and warnings and "'weight': 0.5" in warnings[0]


def test_every_batch_source_is_what_the_trainer_reads(tmp_path):
    """One source, several, and a dry run's stand-ins all keep `BatchSource` (train/data.py), the one
    interface the trainer reads; only a mixture reports weights and tokens per source."""
    from fivefold.train.data import BatchSource, SyntheticBatches

    cfg = tiny_config()
    one = make_batches(cfg.train, cfg.model.vocab)
    cfg.train.data = [f"{f}:{w}" for f, w in zip(sources(tmp_path, 2), (0.25, 0.75))]
    mixed = make_batches(cfg.train, cfg.model.vocab)
    for source in (one, mixed, SyntheticBatches(cfg.train)):
        assert isinstance(source, BatchSource), type(source).__name__
    assert one.mixture(0) is None and SyntheticBatches(cfg.train).mixture(0) is None
    m = mixed.mixture(0, 4)
    assert set(m) == {"weights", "tokens"} and sum(m["tokens"].values()) == 4 * one.tokens_per_step()
