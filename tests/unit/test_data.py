"""Data files: whole-file token-id checks, raw and .npy formats, check_data; the progress lines."""
import io
import pickle
import re
import types

import numpy as np
import pytest

from fivefold.config import ConfigError, TrainConfig
from fivefold.train import corpus, progress
from fivefold.train.data import Batches
from fivefold.train.corpus import check_data, check_token_ids, read_tokens
from fivefold.train.progress import Progress

N_BIG = (1 << 20) + 1000      # past the 2^20 tokens the old check looked at


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture
def late_bad_u16(tmp_path):
    ids = np.arange(N_BIG, dtype=np.uint16) % 256
    ids[-1] = 300
    f = tmp_path / "late.u16"
    ids.tofile(f)
    return f


# -- check_token_ids -------------------------------------------------------------------------------------
def test_bad_id_past_first_mib_in_read_tokens(late_bad_u16):
    assert len(read_tokens([late_bad_u16])) == N_BIG           # no vocab: no check (as before)
    with pytest.raises(ConfigError) as e:
        read_tokens([late_bad_u16], vocab=256)
    assert one_line(e) == (f"data file {late_bad_u16}: token id 300 at position {N_BIG - 1} >= model.vocab (256); "
                           "raise model.vocab to at least 301")
    assert len(read_tokens([late_bad_u16], vocab=301)) == N_BIG


def test_bad_id_past_first_mib_in_batches(late_bad_u16):
    tokens = read_tokens([late_bad_u16])
    with pytest.raises(ConfigError, match=f"^token id 300 at position {N_BIG - 1} >= model.vocab"):
        Batches(tokens, seq_len=16, global_batch=2, seed=0, vocab=256)
    Batches(tokens, seq_len=16, global_batch=2, seed=0, vocab=512)


def test_first_bad_id_across_chunks(monkeypatch):
    monkeypatch.setattr(corpus, "CHECK_CHUNK", 7)
    ids = np.zeros(50, dtype=np.int64)
    ids[23], ids[40] = 9, 12
    with pytest.raises(ConfigError, match=r"^token id 9 at position 23 >= model\.vocab \(8\); .* at least 10$"):
        check_token_ids(ids, 8)
    check_token_ids(ids, 13)
    check_token_ids(ids[:0], 1)


def test_negative_id_in_npy(tmp_path):
    f = tmp_path / "neg.npy"
    np.save(f, np.array([1, 2, -1, 3], dtype=np.int32))
    with pytest.raises(ConfigError) as e:
        read_tokens([f], vocab=16)
    assert one_line(e) == f"data file {f}: token id -1 at position 2 is negative; token ids must be in [0, model.vocab)"


def test_text_bytes_checked_per_file(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"abc")
    b.write_bytes(b"\x00\xff")
    with pytest.raises(ConfigError, match=re.escape(f"data file {b}: token id 255 at position 1")):
        read_tokens([a, b], vocab=128)
    assert read_tokens([a, b], vocab=256).tolist() == [97, 98, 99, 0, 255]


# -- file formats --------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix, nbytes, item", [(".u16", 7, 2), (".bin", 3, 2), (".u32", 6, 4)])
def test_raw_size_must_be_whole_tokens(tmp_path, suffix, nbytes, item):
    f = tmp_path / f"odd{suffix}"
    f.write_bytes(b"\x01" * nbytes)
    with pytest.raises(ConfigError) as e:
        read_tokens([f])
    assert f"has {nbytes} bytes, not a multiple of {item}" in one_line(e) and str(f) in str(e.value)


def test_raw_u32_and_empty(tmp_path):
    f, empty = tmp_path / "t.u32", tmp_path / "e.u16"
    np.array([5, 70000, 2], dtype=np.uint32).tofile(f)
    empty.write_bytes(b"")
    assert read_tokens([f, empty]).tolist() == [5, 70000, 2]
    assert len(read_tokens([empty])) == 0


@pytest.mark.parametrize("array, words", [
    (np.array([0.5, 1.0], dtype=np.float32), "holds float32, not integer token ids"),
    (np.array([True, False]), "holds bool, not integer token ids"),
])
def test_npy_dtype_must_be_integer(tmp_path, array, words):
    f = tmp_path / "bad.npy"
    np.save(f, array)
    with pytest.raises(ConfigError) as e:
        read_tokens([f])
    assert words in one_line(e) and "np.save" in str(e.value)


def test_npy_2d_integer_is_flattened(tmp_path):
    f = tmp_path / "docs.npy"
    np.save(f, np.arange(12, dtype=np.uint16).reshape(3, 4))
    assert read_tokens([f], vocab=12).tolist() == list(range(12))


def test_pickles_refused(tmp_path):
    obj, raw = tmp_path / "obj.npy", tmp_path / "raw.npy"
    np.save(obj, np.array([1, "a", None], dtype=object), allow_pickle=True)
    raw.write_bytes(pickle.dumps([1, 2, 3]))
    for f in (obj, raw):
        with pytest.raises(ConfigError) as e:
            read_tokens([f])
        assert "not a .npy array loadable without pickle" in one_line(e) and str(f) in str(e.value)


def test_missing_and_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        read_tokens([tmp_path / "nope.u16"])
    assert "does not exist" in one_line(e) and "nope.u16" in str(e.value)
    with pytest.raises(ConfigError, match="is not a file"):
        read_tokens([tmp_path])


# -- check_data ---------------------------------------------------------------------------------------
def test_check_data_counts_and_checks(tmp_path, late_bad_u16):
    f = tmp_path / "ok.u16"
    np.arange(100, dtype=np.uint16).tofile(f)
    t = TrainConfig(data=[str(f)], seq_len=98)
    assert check_data(t, vocab=100) == 100
    with pytest.raises(ConfigError, match="token id 99 at position 99 >= model.vocab \\(99\\)"):
        check_data(t, vocab=99)
    with pytest.raises(ConfigError) as e:
        check_data(TrainConfig(data=[str(f)], seq_len=99), vocab=100)
    assert one_line(e) == ("the corpus has 100 tokens, fewer than train.seq_len + 2 = 101; add data, "
                           "raise train.data_limit_mb or use train.seq_len <= 98")
    with pytest.raises(ConfigError, match="at position 1049575"):
        check_data(TrainConfig(data=[str(f), str(late_bad_u16)]), vocab=256)
    with pytest.raises(ConfigError, match="does not exist"):
        check_data(TrainConfig(data=[str(f), str(tmp_path / "gone.txt")]), vocab=256)


def test_check_data_text_limit(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"x" * 600_000)
    b.write_bytes(b"y" * 600_000)
    t = TrainConfig(data=[str(a), str(b)], data_limit_mb=1.0)
    assert check_data(t, vocab=256) == 1 << 20 == len(read_tokens(t.data, t.data_limit_mb))
    t.data_limit_mb = 0.0
    assert check_data(t, vocab=256) == 1_200_000


def test_check_data_default_corpus():
    assert check_data(TrainConfig(data_limit_mb=0.01), vocab=256) == int(0.01 * 2**20)


# -- progress lines -----------------------------------------------------------------------------------
class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_bar(monkeypatch, stream, steps, **kw):
    """Feed Progress steps (global, 1-based: steps done) of 10 tokens in 1 second each, one second apart;
    stderr's text."""
    clock = [0.0]
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr("sys.stderr", stream)
    bar = Progress(**kw)
    for s in steps:
        clock[0] += 1.0
        bar.update({"step": s + 1, "tokens": 10, "seconds": 1.0, "loss": 2.0, "grad_norm": 0.5, "lr": 1e-3})
    bar.close()
    return stream.getvalue()


def logged_steps(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step +(\d+)/", text, re.M)]


def test_progress_auto_interval(monkeypatch):
    text = run_bar(monkeypatch, io.StringIO(), range(100), total=100)
    assert logged_steps(text) == [1] + list(range(5, 101, 5))
    assert logged_steps(run_bar(monkeypatch, io.StringIO(), range(7), total=7)) == list(range(1, 8))


def test_progress_log_every(monkeypatch):
    text = run_bar(monkeypatch, io.StringIO(), range(10), total=10, log_every=3)
    assert logged_steps(text) == [1, 3, 6, 9, 10]
    assert "\r" not in text


def test_progress_resumed_run(monkeypatch):
    text = run_bar(monkeypatch, io.StringIO(), range(6, 10), total=10, log_every=4, start=6)
    assert logged_steps(text) == [7, 8, 10]
    first = text.splitlines()[0]
    assert first.startswith("step     7/10 [################........]") and first.endswith(" 10 tok/s  ETA 3s")


def test_progress_on_terminal_every_step(monkeypatch):
    text = run_bar(monkeypatch, Tty(), range(5), total=5, log_every=100)
    assert text.count("\r") == 5 and text.endswith("tok/s\n") and "ETA 1s" in text


def test_progress_disabled(monkeypatch):
    assert run_bar(monkeypatch, io.StringIO(), range(5), total=5, enabled=False) == ""


def test_a_text_budget_larger_than_the_memory_reads_the_file(tmp_path):
    """train.data_limit_mb = 50000 on a small file: the file, not a 50 GB allocation (a MemoryError before;
    found by tests/unit/test_fuzz_inputs.py's config fuzzer)."""
    from fivefold.train.corpus import file_tokens

    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world")
    assert bytes(file_tokens(f, budget=50_000 * 2**20)) == b"hello world"
    assert bytes(file_tokens(f, budget=5)) == b"hello"
