"""Real tokenizers and token files: tokenizers built here (no download), `fivefold tokenize` on JSONL,
Parquet and a `datasets` folder, training on the token file (2 ranks, exact resume, odd vocab under tp),
whole-file id checks at start, and memory that stays flat when batches come from a large token file."""
import base64
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fivefold.cli import main as fivefold_main
from fivefold.config import ConfigError
from fivefold.tokenizer import (ByteTokenizer, HFTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer,
                                run_tokenizer, save_to_run)
from fivefold.train import rundir
from fivefold.train.data import ShuffledBatches
from fivefold.train.corpus import read_tokens
from fivefold.train.tokenize import (TokenFileWriter, header_path, offsets_path, read_header, read_offsets,
                                     token_dtype, tokenize)

from tests.support.spawn import shell_signals
from tests.support.cli import fivefold
from tests.support.corpus import DOCS, TINY, one_line


def hf_tokenizer_file(path):
    """A byte-level BPE trained on DOCS, 301 ids (odd: tp=2 has to pad it), <|endoftext|> special."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=301, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(path))
    return path


def tiktoken_file(path):
    """Every byte plus a few merges, in tiktoken's BPE ranks format."""
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b" t", b" the", b"ow", b"ox"]
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks)))
    return path


def datasets_folder(root, docs):
    """What `datasets.Dataset.save_to_disk` writes: state.json naming the arrow files (stream format;
    the second one here in the IPC file format, which is read too)."""
    root.mkdir()
    half = len(docs) // 2
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, part, writer in ((names[0], docs[:half], pa.ipc.new_stream), (names[1], docs[half:], pa.ipc.new_file)):
        table = pa.table({"text": part, "n": list(range(len(part)))})
        with writer(str(root / name), table.schema) as w:
            for batch in table.to_batches(max_chunksize=50):
                w.write_batch(batch)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": "train"}))
    (root / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "c.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"content": DOCS}), root / "c.parquet", row_group_size=64)
    datasets_folder(root / "saved", DOCS)
    return {"root": root, "hf": hf_tokenizer_file(root / "tokenizer.json"),
            "tiktoken": tiktoken_file(root / "ranks.tiktoken")}


@pytest.fixture(scope="module")
def token_file(corpus):
    """DOCS tokenized from Parquet with the HF tokenizer (the training data of the CLI tests)."""
    out = corpus["root"] / "train.bin"
    tokenize([corpus["root"] / "c.parquet"], corpus["hf"], out, field="content", workers=1, progress=False)
    return out


# -- tokenizers ---------------------------------------------------------------------------------------
def test_tokenizers_are_told_apart_by_content(corpus, tmp_path):
    byte, hf, tt = load_tokenizer(None), load_tokenizer(corpus["hf"]), load_tokenizer(corpus["tiktoken"])
    assert isinstance(byte, ByteTokenizer) and (byte.vocab_size, byte.eos_id) == (256, None)
    assert isinstance(hf, HFTokenizer) and hf.vocab_size == 301 and hf.eos_id == 0
    assert isinstance(tt, TiktokenTokenizer) and tt.vocab_size == 263 and tt.eos_id == 262
    text = "the naïve fox — déjà vu 12 345"
    for tok in (byte, hf, tt):
        assert isinstance(tok, Tokenizer)
        ids = tok.encode(text)
        assert tok.decode(ids) == text and all(0 <= i < tok.vocab_size for i in ids)
    assert byte.encode(text) == list(text.encode())
    assert len(hf.encode(text)) < len(byte.encode(text))
    assert tt.encode("the") == [257]
    renamed = tmp_path / "anything.txt"                       # the name does not matter, the content does
    renamed.write_bytes(corpus["hf"].read_bytes())
    assert load_tokenizer(renamed).digest == hf.digest
    bad = tmp_path / "tokenizer.json"
    bad.write_text("just some text\n")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(bad)
    assert "\n" not in str(e.value) and "tokenizer.json" in str(e.value) and "BASE64TOKEN RANK" in str(e.value)


def test_a_run_folder_keeps_its_tokenizer(corpus, tmp_path):
    assert isinstance(run_tokenizer(tmp_path), ByteTokenizer)
    for kind in ("hf", "tiktoken"):
        dest = save_to_run(corpus[kind], tmp_path)
        assert dest.name in ("tokenizer.json", "tokenizer.tiktoken")
        assert run_tokenizer(tmp_path).digest == load_tokenizer(corpus[kind]).digest
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.tiktoken"]   # one tokenizer a run
    assert save_to_run(None, tmp_path) is None and not list(tmp_path.iterdir())   # a byte-level run keeps none
    assert save_to_run(None, tmp_path / "new") is None


# -- fivefold tokenize ----------------------------------------------------------------------------------
def test_jsonl_parquet_and_datasets_folder_give_the_same_tokens(corpus, tmp_path, capsys):
    root, hf = corpus["root"], load_tokenizer(corpus["hf"])
    outs = {}
    for name, src, field, workers in (("jsonl", root / "c.jsonl", "text", 1),
                                      ("parquet", root / "c.parquet", "content", 2),
                                      ("saved", root / "saved", "text", 2)):
        outs[name] = tmp_path / f"{name}.bin"
        args = ["tokenize", str(src), "--tokenizer", str(corpus["hf"]), "--out", str(outs[name]),
                "--field", field, "--workers", str(workers)]
        assert fivefold_main(args) == 0
    assert "tokenize: 240 documents" in capsys.readouterr().err          # the progress line
    tokens = {k: np.fromfile(v, dtype=np.uint16) for k, v in outs.items()}
    assert np.array_equal(tokens["jsonl"], tokens["parquet"]) and np.array_equal(tokens["jsonl"], tokens["saved"])
    h = read_header(outs["jsonl"])
    expected = [i for d in DOCS for i in hf.encode(d) + [hf.eos_id]]
    assert tokens["jsonl"].tolist() == expected
    assert (h["dtype"], h["vocab_size"], h["tokens"], h["documents"]) == ("uint16", 301, len(expected), 240)
    assert h["tokenizer"] == {"name": "hf:tokenizer.json", "digest": hf.digest, "eos_id": 0, "bos_id": None}
    offsets = read_offsets(outs["jsonl"])
    assert offsets.dtype == np.int64 and len(offsets) == 241 and offsets[-1] == len(expected)
    doc7 = tokens["jsonl"][offsets[7]:offsets[8]].tolist()
    assert doc7[-1] == hf.eos_id and hf.decode(doc7[:-1]) == DOCS[7]


def test_text_bytes_tiktoken_and_dtypes(corpus, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("héllo\nworld\n" * 50)
    tokenize([text, text], None, tmp_path / "bytes.bin", progress=False)
    h = read_header(tmp_path / "bytes.bin")
    assert np.fromfile(tmp_path / "bytes.bin", np.uint16).tolist() == list(text.read_bytes() * 2)
    assert (h["documents"], h["tokenizer"]["eos_id"]) == (2, None)     # bytes: no end-of-text id between them
    tokenize([text], corpus["tiktoken"], tmp_path / "tt.bin", workers=2, progress=False)
    tt = load_tokenizer(corpus["tiktoken"])
    assert np.fromfile(tmp_path / "tt.bin", np.uint16).tolist() == tt.encode(text.read_text()) + [tt.eos_id]
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_tokenize_refuses_to_overwrite_and_leaves_nothing_on_failure(corpus, tmp_path, capsys):
    out = tmp_path / "d.bin"
    args = ["tokenize", str(corpus["root"] / "c.jsonl"), "--out", str(out), "--workers", "1"]
    assert fivefold_main(args) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert fivefold_main(args) == 2
    assert "exists; pass --overwrite" in one_line(capsys.readouterr().err)
    assert fivefold_main([*args, "--overwrite", "--tokenizer", str(corpus["hf"])]) == 0
    assert out.read_bytes() != before and read_header(out)["vocab_size"] == 301
    capsys.readouterr()
    failed = tmp_path / "f.bin"      # the second input lacks the field: nothing is written
    assert fivefold_main(["tokenize", str(corpus["root"] / "c.jsonl"), str(corpus["root"] / "c.parquet"),
                          "--out", str(failed), "--workers", "2"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "c.parquet: no column 'text' (has: content); pass --field NAME" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.bin.idx.json", "d.bin.idx.npy"]
    assert fivefold_main(["tokenize", str(corpus["root"] / "c.jsonl"), "--field", "body", "--out", str(failed)]) == 2
    assert "c.jsonl:1: no field 'body' (has: id, text); pass --field NAME" in one_line(capsys.readouterr().err)


def test_bytes_that_are_not_utf8_are_named_by_file_and_offset_or_replaced(tmp_path, capsys):
    text, rows = tmp_path / "latin1.txt", tmp_path / "rows.jsonl"
    text.write_bytes("first line\ncaf".encode() + b"\xe9 au lait\n")
    rows.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    for path, where in ((text, "not UTF-8 at byte 14 (line 2)"), (rows, "not UTF-8 at byte 28 (line 2)")):
        out = tmp_path / f"{path.stem}.bin"
        assert fivefold_main(["tokenize", str(path), "--out", str(out), "--workers", "1"]) == 2
        err = one_line(capsys.readouterr().err)
        assert str(path) in err and where in err and "--errors replace" in err, err
        assert not list(tmp_path.glob(f"*{path.stem}.bin*"))
        assert fivefold_main(["tokenize", str(path), "--out", str(out), "--workers", "1", "--errors", "replace"]) == 0
        assert "\ufffd".encode() in bytes(np.fromfile(out, np.uint16).astype(np.uint8))   # U+FFFD's bytes
        capsys.readouterr()


def test_ctrl_c_in_tokenize_leaves_nothing_and_no_traceback(corpus, tmp_path):
    import signal
    import time

    big = tmp_path / "big.txt"
    big.write_text(" ".join(DOCS) * max(1, (40 << 20) // len(" ".join(DOCS))))   # some seconds of BPE
    out = tmp_path / "d.bin"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "fivefold.cli", "tokenize", str(big), "--out", str(out),
                          "--tokenizer", str(corpus["hf"]), "--workers", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, preexec_fn=shell_signals)
    try:
        until = time.monotonic() + 120
        while not list(tmp_path.glob(".d.bin.*.tmp")) and p.poll() is None and time.monotonic() < until:
            time.sleep(0.05)
        time.sleep(0.5)
        os.killpg(p.pid, signal.SIGINT)     # Ctrl-C reaches the whole process group
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted; nothing written" in err, err[-2000:]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["big.txt"]


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.ranks
def test_train_on_a_token_file_resumes_exactly(corpus, token_file, tmp_path):
    common = ["train", "--nproc", "2", *TINY, "--data", str(token_file), "--tokenizer", str(corpus["hf"])]
    full, part = tmp_path / "full", tmp_path / "part"
    r = fivefold(*common, "--steps", "4", "--out", str(full))
    assert r.returncode == 0, r.stderr
    run = json.loads((full / "run.json").read_text())
    assert run["config"]["model"]["vocab"] == 301                       # the vocabulary follows the tokenizer
    assert run["data"]["files"][0]["header"] and run["data"]["tokenizer"] == load_tokenizer(corpus["hf"]).digest
    assert (full / "tokenizer.json").read_bytes() == corpus["hf"].read_bytes()
    assert fivefold(*common, "--steps", "2", "--out", str(part)).returncode == 0   # (warmup 1: lr as in full)
    # the resume names no tokenizer: the run folder's copy is used
    r = fivefold(*[a for a in common if a not in ("--tokenizer", str(corpus["hf"]))], "--steps", "4",
                 "--out", str(part), "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stderr and "other data" not in r.stderr and "tokenizer" not in r.stderr
    assert rundir.read_index(rundir.newest_checkpoint(part))["data"] == run["data"]
    assert len(losses(full)) == 4 and losses(part) == losses(full)    # exactly the same
    tp = fivefold(*common, "--tp", "2", "--steps", "4", "--out", str(tmp_path / "tp"))   # 301 ids padded to 302
    assert tp.returncode == 0, tp.stderr
    np.testing.assert_allclose(losses(tmp_path / "tp"), losses(full), rtol=1e-5)


def test_token_id_past_the_vocab_anywhere_fails_at_start(corpus, token_file, tmp_path, capsys):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(token_file.read_bytes())
    for p in (header_path, offsets_path):
        p(bad).write_bytes(p(token_file).read_bytes())
    ids = np.memmap(bad, dtype=np.uint16, mode="r+")
    position = len(ids) - 3
    ids[position] = 301
    ids.flush()
    del ids
    out = tmp_path / "out"
    code = fivefold_main(["train", "--nproc", "2", *TINY, "--data", str(bad), "--tokenizer", str(corpus["hf"]),
                          "--out", str(out)])
    assert code == 2 and not out.exists()
    assert one_line(capsys.readouterr().err) == (
        f"fivefold: config error: data file {bad}: token id 301 at position {position} >= model.vocab (301); "
        f"raise model.vocab to at least 302")


def test_a_token_file_of_another_tokenizer_is_refused(corpus, token_file, tmp_path, capsys):
    for tokenizer in ([], ["--tokenizer", str(corpus["tiktoken"])]):
        assert fivefold_main(["train", *TINY, "--data", str(token_file), *tokenizer, "--out", str(tmp_path / "o")]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"token file {token_file} was made with tokenizer hf:tokenizer.json" in err
    assert fivefold_main(["train", *TINY, "--data", str(token_file), "--tokenizer", str(corpus["hf"]),
                          "--set", "model.vocab=256", "--out", str(tmp_path / "o")]) == 2
    assert "model.vocab (256) is smaller than the vocabulary of tokenizer" in one_line(capsys.readouterr().err)
    errors, warnings = rundir.compare_data({"tokenizer": "a", "files": []}, {"tokenizer": "b", "files": []})
    assert len(errors) == 1 and not warnings
    errors, warnings = rundir.compare_data({"tokenizer": "a", "files": [{"file": "x", "bytes": 1}]},
                                           {"tokenizer": "a", "files": [{"file": "x", "bytes": 2}]})
    assert not errors and len(warnings) == 1


def test_text_with_a_tokenizer_is_tokenized_in_memory(corpus, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(DOCS[:20]))
    hf = load_tokenizer(corpus["hf"])
    assert read_tokens([text], tokenizer=hf).tolist() == hf.encode(text.read_text()) + [hf.eos_id]
    assert read_tokens([text]).tolist() == list(text.read_bytes())


def test_shuffled_batches_see_every_window_once_an_epoch():
    tokens = np.arange(16 * 25 + 1, dtype=np.uint16)                  # 25 windows of 16 (+1) tokens
    b = ShuffledBatches(tokens, seq_len=16, global_batch=5, seed=3)
    epoch = [o for step in range(5) for o in b.offsets(step).tolist()]
    assert sorted(epoch) == [16 * w for w in range(25)] and epoch != sorted(epoch)
    again = [o for step in range(5, 10) for o in b.offsets(step).tolist()]
    assert sorted(again) == sorted(epoch) and again != epoch                   # a new order each epoch
    assert b.offsets(7).tolist() == ShuffledBatches(tokens, 16, 5, seed=3).offsets(7).tolist()
    assert b.offsets(7).tolist() != ShuffledBatches(tokens, 16, 5, seed=4).offsets(7).tolist()
    x, y = b.local(2, 1, 5)
    assert x.shape == (1, 16) and (y - x == 1).all()


MEMORY_PROBE = textwrap.dedent("""
    import sys
    from fivefold.config import TrainConfig
    from fivefold.train.data import make_batches

    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024

    train = TrainConfig(data=[sys.argv[1]], data_limit_mb=1, seq_len=128, global_batch=16, seed=1)
    before = rss()
    batches = make_batches(train, vocab=256)          # whole-file id check included
    for step in range(200):
        x, y = batches.local(step, 0, 1)
    print(len(batches.tokens), rss() - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.ranks
def test_batches_from_a_large_token_file_do_not_load_it(tmp_path):
    data = tmp_path / "big.bin"
    writer = TokenFileWriter(data, ByteTokenizer())
    rng = np.random.default_rng(0)
    for _ in range(8):                                                  # 8 x 4 Mi uint16 tokens: 64 MiB
        writer.write(rng.integers(0, 256, 1 << 22, dtype=np.uint16))
        writer.end_document()
    writer.commit()
    assert data.stat().st_size == 64 << 20
    r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(data)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    n, growth = map(int, r.stdout.split())
    assert n == 32 << 20                       # all of it, past data_limit_mb = 1
    assert growth < 16 << 20, f"RSS grew by {growth / 2**20:.1f} MiB reading a 64 MiB token file"
