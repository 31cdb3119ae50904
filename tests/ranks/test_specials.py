"""End- and start-of-text you control: --eos / --bos for tokenize, train and export; a tokenizer whose
end-of-text cannot be found is a warning naming the option."""
import json

import numpy as np
import pytest

from fivefold.config import ConfigError
from fivefold.tokenizer import load_tokenizer, missing_eos, run_tokenizer
from fivefold.train.tokenize import read_header, read_offsets, tokenize

from tests.support.cli import fivefold
from tests.support.corpus import DOCS, TINY, one_line


def eot_tokenizer(path):
    """A byte-level BPE whose specials are <EOT> and <BOS>: names fivefold does not know."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<EOT>", "<BOS>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(path))
    return path


@pytest.fixture
def tok_file(tmp_path):
    return eot_tokenizer(tmp_path / "tokenizer.json")


def test_unknown_end_of_text_is_a_warning_and_eos_names_it(tok_file):
    plain = load_tokenizer(tok_file)
    assert plain.eos_id is None and "--eos TOKEN" in missing_eos(plain)
    chosen = load_tokenizer(tok_file, "<EOT>", "<BOS>")
    assert (chosen.eos_id, chosen.bos_id) == (0, 1) and missing_eos(chosen) is None
    assert missing_eos(load_tokenizer(tok_file, "none"), "none") is None   # told: no end-of-text
    assert missing_eos(load_tokenizer(None)) is None                       # bytes have none by design
    with pytest.raises(ConfigError, match="--eos '<END>': tokenizer hf:tokenizer.json has no such token"):
        load_tokenizer(tok_file, "<END>")


def test_tokenize_puts_bos_and_eos_around_every_document(tok_file, tmp_path):
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:20]))
    out = tmp_path / "x.bin"
    tokenize([text], tok_file, out, workers=2, progress=False, eos="<EOT>", bos="<BOS>")
    ids = np.fromfile(out, dtype=np.uint16)
    starts = read_offsets(out)
    assert len(starts) == 21
    assert all(ids[a] == 1 and ids[b - 1] == 0 for a, b in zip(starts[:-1], starts[1:]))
    assert read_header(out)["tokenizer"]["eos_id"] == 0 and read_header(out)["tokenizer"]["bos_id"] == 1
    r = fivefold("tokenize", str(text), "--tokenizer", str(tok_file), "--out", str(tmp_path / "y.bin"))
    assert r.returncode == 0 and "warning: tokenizer hf:tokenizer.json has none of the end-of-text" in r.stderr
    assert "--eos TOKEN" in r.stderr
    bad = fivefold("tokenize", str(text), "--tokenizer", str(tok_file), "--out", str(tmp_path / "z.bin"),
                   "--eos", "<END>")
    assert bad.returncode == 2 and "--eos '<END>'" in one_line(bad.stderr)


@pytest.mark.ranks
def test_train_keeps_eos_for_generate_and_export(tok_file, tmp_path):
    text, run = tmp_path / "t.txt", tmp_path / "run"
    text.write_text(" ".join(DOCS))
    warned = fivefold("train", *TINY, "--steps", "1", "--data", str(text), "--tokenizer", str(tok_file),
                      "--out", str(tmp_path / "plain"))
    assert warned.returncode == 0 and "--eos TOKEN" in warned.stderr
    r = fivefold("train", *TINY, "--steps", "2", "--data", str(text), "--tokenizer", str(tok_file), "--eos", "<EOT>",
                 "--out", str(run))
    assert r.returncode == 0, r.stderr
    assert "end-of-text" not in r.stderr
    assert run_tokenizer(run).eos_id == 0                       # generate stops there
    hf = tmp_path / "hf"
    e = fivefold("export", str(run), "--hf", str(hf))
    assert e.returncode == 0, e.stderr
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == 0
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 0
    assert json.loads((hf / "tokenizer_config.json").read_text())["eos_token"] == "<EOT>"
    hf2 = tmp_path / "hf2"
    e = fivefold("export", str(tmp_path / "plain"), "--hf", str(hf2), "--bos", "<BOS>")
    assert e.returncode == 0 and "--eos TOKEN" in e.stderr     # the export says what is missing
    cfg = json.loads((hf2 / "config.json").read_text())
    assert cfg["eos_token_id"] is None and cfg["bos_token_id"] == 1


def test_train_text_gets_bos_and_eos(tok_file):
    from fivefold.train.corpus import text_tokens

    raw = np.frombuffer(DOCS[0].encode(), dtype=np.uint8)
    tok = load_tokenizer(tok_file, "<EOT>", "<BOS>")
    ids = text_tokens(raw, tok).tolist()
    assert ids[0] == 1 and ids[-1] == 0 and tok.decode(ids[1:-1]) == DOCS[0]
    assert text_tokens(raw, load_tokenizer(tok_file)).tolist() == ids[1:-1]   # unknown end: no separator
    newline = load_tokenizer(None, "\n")                                      # bytes can name one too
    assert newline.eos_id == 10 and text_tokens(raw, newline).tolist()[-1] == 10
