"""Property fuzzing of the inputs fivefold reads besides checkpoints (tests/unit/test_trust.py has those): a Hugging
Face folder (its index and shard headers), a token file's document offsets, mixture specs, and whole configs
through `fivefold train`. The property:
either exactly the clean input's result, or a one-line ConfigError, and nothing written.

The suite runs a fixed, derandomized profile (FUZZ_EXAMPLES examples a test); `make fuzz` runs a long random
one (FIVEFOLD_FUZZ_EXAMPLES, hypothesis's example database under .hypothesis/ keeps what fails)."""
import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch

from fivefold.config import ConfigError, TrainConfig
from fivefold.shapes import Box

transformers = pytest.importorskip("transformers")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fivefold.model.hf_weights import HFWeights, hf_config  # noqa: E402
from fivefold.train.corpus import mixture_of  # noqa: E402
from fivefold.train.tokenize import offsets_path, read_offsets, tokenize  # noqa: E402

from tests.support.mutate import mutate, values  # noqa: E402

LONG = int(os.environ.get("FIVEFOLD_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=LONG or 30, deadline=None, derandomize=not LONG,
                database=None if not LONG else settings.default.database,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def one_line(e: ConfigError) -> None:
    assert "\n" not in str(e), str(e)


# ---- a Hugging Face folder ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A transformers-written Llama in several shards, and every tensor as fivefold reads it clean."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="20KB")
    ours = hf_config(folder)
    return folder, ours, read_all(folder, ours)


def read_all(folder, cfg) -> dict[str, torch.Tensor]:
    """Every model tensor through HFWeights (checked first), whole."""
    from fivefold.model import Transformer

    w = HFWeights(folder, cfg)
    w.check()
    out = {}
    for name, p in Transformer(cfg, device="meta").named_parameters():
        out[name] = w.read(f"model/{name}", Box.whole(p.shape), p.shape)
    return out


def copy_folder(folder, root):
    dest = root / "copy"
    shutil.copytree(folder, dest)
    return dest


def read_or_refuse(folder, cfg, clean: dict) -> str:
    try:
        got = read_all(folder, cfg)
    except ConfigError as e:
        one_line(e)
        return "refused"
    assert got.keys() == clean.keys()
    for k in clean:
        assert torch.equal(got[k], clean[k]), k
    return "accepted"


@FUZZ
@given(data=st.data())
def test_fuzz_hf_index(hf, tmp_path_factory, data):
    folder, cfg, clean = hf
    copy = copy_folder(folder, tmp_path_factory.mktemp("fuzz"))
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        index = mutate(index, data)
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    before = sorted(p.name for p in copy.iterdir())
    read_or_refuse(copy, cfg, clean)
    assert sorted(p.name for p in copy.iterdir()) == before          # nothing written


@FUZZ
@given(data=st.data())
def test_fuzz_hf_shard_header(hf, tmp_path_factory, data):
    folder, cfg, clean = hf
    copy = copy_folder(folder, tmp_path_factory.mktemp("fuzz"))
    shard = data.draw(st.sampled_from(sorted(copy.glob("model-*.safetensors"))))
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, rest = json.loads(raw[8:8 + n]), raw[8 + n:]
    if data.draw(st.booleans()):
        new = json.dumps(mutate(header, data)).encode()
    else:   # raw bytes: one flipped
        new = bytearray(raw[8:8 + n])
        new[data.draw(st.integers(0, n - 1))] ^= data.draw(st.integers(1, 255))
        new = bytes(new)
    cut = data.draw(st.sampled_from([None, None, 0, 5, len(rest) // 2]))
    length = data.draw(st.sampled_from([len(new), len(new), len(new) + 1, 2**63, 0]))
    shard.write_bytes(struct.pack("<Q", length) + new + (rest if cut is None else rest[:cut]))
    reads_what_the_file_says(shard)


def reads_what_the_file_says(shard) -> None:
    """A damaged shard is refused in one line, or read exactly as the safetensors library reads it: a header
    that stays self-consistent (two same-shaped tensors' entries swapped, say: the long run's first find) is
    a valid file of another model, which no check of the file alone can tell from the original."""
    from safetensors import safe_open

    from fivefold.model.hf_weights import SafetensorsFile

    try:
        ours = SafetensorsFile(shard)
    except ConfigError as e:
        one_line(e)
        return
    try:
        with safe_open(str(shard), "pt") as f:
            theirs = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:   # noqa: BLE001 - stricter than us (gaps between tensors): we read each by its own range
        theirs = None
    from fivefold.model.hf_weights import DTYPES

    for name in ours.keys():
        shape, code, _ = ours.tensors[name]
        if code not in DTYPES:          # HFWeights.check refuses these before reading (a float dtype each)
            continue
        try:
            got = ours.read(name, (0,) * len(shape), shape)[0]
        except ConfigError as e:        # the data cut short
            one_line(e)
            continue
        if theirs is not None:
            want = theirs[name]
            assert got.view(want.dtype).view(want.shape).equal(want), name


# ---- a token file's document offsets ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    (root / "a.txt").write_text("one two three four five six seven eight nine ten " * 20)
    (root / "b.txt").write_text("alpha beta gamma " * 30)
    out = root / "data.bin"
    tokenize([str(root / "a.txt"), str(root / "b.txt")], None, str(out), progress=False)
    return out, read_offsets(out)


offset_values = st.one_of(st.integers(-3, 3000), st.integers(-2**63, 2**63 - 1))


@FUZZ
@given(data=st.data())
def test_fuzz_document_offsets(token_file, tmp_path_factory, data):
    src, clean = token_file
    root = tmp_path_factory.mktemp("fuzz")
    out = root / src.name
    for f in src.parent.glob(src.name + "*"):
        shutil.copy(f, root / f.name)
    arr = clean.copy()
    kind = data.draw(st.sampled_from(["set", "insert", "delete", "dtype", "shape", "bytes"]))
    i = data.draw(st.integers(0, len(arr) - 1))
    if kind == "set":
        arr[i] = data.draw(offset_values)
    elif kind == "insert":
        arr = np.insert(arr, i, data.draw(st.integers(0, int(clean[-1]))))
    elif kind == "delete":
        arr = np.delete(arr, i)
    elif kind == "dtype":
        arr = arr.astype(data.draw(st.sampled_from([np.float64, np.int8, np.uint64, np.int32, np.bool_])))
    elif kind == "shape":
        arr = arr.reshape(1, -1) if data.draw(st.booleans()) else np.stack([arr, arr])
    path = offsets_path(out)
    np.save(path, arr, allow_pickle=False)
    if kind == "bytes":
        raw = bytearray(path.read_bytes())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        path.write_bytes(bytes(raw))
    try:
        got = read_offsets(out)
    except ConfigError as e:
        one_line(e)
        return
    assert np.array_equal(got, clean)   # any other split is refused too: the header records their SHA-256


# ---- mixture specs ----------------------------------------------------------------------------------------

weights = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5).map(str),
                    st.text(max_size=5), st.sampled_from(["1e308", "1e-320", "inf", "nan", "-0", "0x10", "1_0"]))


@FUZZ
@given(entries=st.lists(st.tuples(st.sampled_from(["a.bin", "b.bin", "c:d.bin", ""]), st.one_of(st.none(), weights)),
                        min_size=1, max_size=4))
def test_fuzz_mixture_specs(entries):
    data = [f if w is None else f"{f}:{w}" for f, w in entries]
    try:
        mixture = mixture_of(TrainConfig(data=data))
    except ConfigError as e:
        one_line(e)
        return
    if mixture is not None:
        assert all(np.isfinite(w) and w > 0 for _, w in mixture)
        assert len(mixture) == len(data)


# ---- a whole config through `fivefold train` -------------------------------------------------------------

CLEAN = dict(model=dict(vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32),
             parallel=dict(dp=1),
             train=dict(global_batch=4, seq_len=16, lr=1e-2, warmup=1, data_limit_mb=0.05, checkpoint=False, seed=3))
# what a user may write: the config's own kinds of value and the usual mistakes (NaN, huge, negative, a path
# out of the folder, a string for a number); parallel degrees stay small so no example starts many ranks
CONFIG_VALUES = st.sampled_from([0, 1, 2, 3, -1, 7, 2**31, 2**63 - 1, 0.5, -0.0, 1e-12, 1e308, float("nan"),
                                 float("inf"), True, False, "", "2", "none", "bf16", "fp8", "cpu", "cuda", "../x",
                                 "/etc/passwd", "auto", [], [1], {"a": 1}])
PARALLEL_VALUES = st.sampled_from([0, 1, 2, -1, 1.5, "2", float("nan"), True, "none", "ulysses", "megatron", []])


def near(v):
    """Values next to a valid one: a number off by one, doubled, zeroed, a thousand times; a list emptied."""
    if isinstance(v, bool) or v is None:
        return st.sampled_from([not v, None, 1])
    if isinstance(v, int):
        return st.sampled_from([v - 1, v + 1, 2 * v, 0, min(v * 1000, 10**6) if v else 1])
    if isinstance(v, float):
        return st.sampled_from([-v, v / 2, 2 * v, 0.0, v * 1e6, v + 1.0])
    if isinstance(v, list):
        return st.sampled_from([[], v + v, [*v, "x"]])
    if isinstance(v, str):
        return st.sampled_from([v.upper(), v + "x", ""])
    return st.sampled_from([{}, "", 0])   # a table an earlier edit wrote


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else ("-inf" if v == -float("inf") else repr(v)))
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def config_text(doc: dict) -> str:
    return "".join(f"[{part}]\n" + "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in table.items())
                   for part, table in doc.items())


def listing(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@settings(FUZZ, max_examples=LONG or 15)   # an accepted example trains a step on its own ranks
@given(data=st.data())
def test_fuzz_configs_through_train(tmp_path_factory, monkeypatch, capsys, data):
    """A config file with one to three keys set to what a user might write (any key of the config, or one it
    does not have): `fivefold train` either trains (exit 0, finite losses) or refuses in one line with exit
    2, and writes nothing outside its --out."""
    from fivefold.cli import main
    from fivefold.config import Config

    work = tmp_path_factory.mktemp("config")
    monkeypatch.chdir(work)
    doc = json.loads(json.dumps(CLEAN))
    known = {part: sorted(table) for part, table in Config().to_dict().items()}
    for _ in range(data.draw(st.integers(1, 3))):
        part = data.draw(st.sampled_from(sorted(known)))
        kind = data.draw(st.integers(0, 9))   # 0: a key the config lacks; 1-3: a wild value; else a near one
        key = data.draw(st.sampled_from(["x", "layer", "Steps"] if kind == 0 else known[part]))
        now = doc[part].get(key, Config().to_dict()[part].get(key))
        wild = PARALLEL_VALUES if part == "parallel" else CONFIG_VALUES
        doc[part][key] = data.draw(wild if kind < 4 else near(now))
    (work / "run.toml").write_text(config_text(doc))
    before = listing(work)
    capsys.readouterr()
    try:
        code = main(["train", "--config", "run.toml", "--steps", "1", "--out", "out", "--timeout", "120"])
    except SystemExit as e:   # argparse
        code = e.code
    err = capsys.readouterr().err
    event(f"exit {code}")
    assert code in (0, 2), (code, err[-3000:], doc)
    if code == 2:
        lines = [line for line in err.splitlines() if line.startswith("fivefold")]
        assert len(lines) == 1 and "Traceback" not in err, (err[-3000:], doc)
    else:
        metrics = [json.loads(line) for line in (work / "out" / "metrics.jsonl").read_text().splitlines()]
        assert metrics and all(m["loss"] is None or np.isfinite(m["loss"]) for m in metrics), doc
    assert [p for p in listing(work) if not p.startswith("out")] == before, doc


# ---- dry-run sizes -----------------------------------------------------------------------------------------

DRY = settings(FUZZ, max_examples=LONG or 8)   # each accepted example builds and steps a model under fake tensors


@DRY
@given(layers=st.sampled_from([1, 2, 3, 64, 65536, 2**31]), hidden=st.sampled_from([8, 64, 4096, 2**20, 2**40]),
       heads=st.sampled_from([1, 2, 8, 3]), vocab=st.sampled_from([1, 256, 2**17, 2**40]),
       seq=st.sampled_from([8, 64, 2**20]), tp=st.sampled_from([1, 2, 8]), pp=st.sampled_from([1, 2, 16]),
       dp=st.sampled_from([1, 4, 1024]), experts=st.sampled_from([0, 4, 2**20]))
def test_fuzz_dry_run_sizes(tmp_path_factory, monkeypatch, capsys, layers, hidden, heads, vocab, seq, tp, pp, dp,
                            experts):
    """`train --dry-run` of any size: it finishes (ledger equal to the plan), says the layout does not fit
    (exit 1, one line), or refuses in one line with exit 2 (a rule, or an estimated time or host memory
    beyond --max-seconds / this machine) — never a traceback, a hang or a machine out of memory."""
    from fivefold.cli import main

    work = tmp_path_factory.mktemp("dry")
    monkeypatch.chdir(work)
    sets = [f"model.layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}", f"model.kv_heads={heads}",
            f"model.ffn={2 * hidden}", f"model.vocab={vocab}", f"model.max_seq={seq}", f"train.seq_len={seq}",
            f"model.experts={experts}", f"model.moe_ffn={hidden if experts else 0}"]
    args = ["train", "--dry-run", "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--global-batch", str(dp),
            "--microbatches", str(pp), "--steps", "1", "--max-seconds", "20", "--out", "out", "--ranks", "0"]
    for kv in sets:
        args += ["--set", kv]
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr()
    event(f"exit {code}")
    assert code in (0, 1, 2), (code, err.err[-3000:])
    if code == 0:
        assert json.loads((work / "out" / "dryrun.json").read_text())["ledger_equals_plan"], args
    else:
        lines = [line for line in err.err.splitlines() if line.startswith("fivefold:")]
        assert len(lines) == 1 and "Traceback" not in err.err, err.err[-3000:]
    assert [p for p in listing(work) if not p.startswith("out")] == []


def test_the_profile_is_fixed_in_the_suite():
    """The suite's fuzzing replays the same examples (derandomized) unless `make fuzz` asks for a long run."""
    assert LONG or (FUZZ.derandomize and FUZZ.max_examples == 30)
    assert values is not None
