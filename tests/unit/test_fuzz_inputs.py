"""Property fuzzing of the inputs fivefold reads besides checkpoints (tests/ranks/test_trust.py has those): a Hugging
Face folder (its index and shard headers), a token file's document offsets and mixture specs (whole configs
through `fivefold train`, which start ranks: tests/ranks/test_fuzz_runs.py). The property:
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


def test_the_profile_is_fixed_in_the_suite():
    """The suite's fuzzing replays the same examples (derandomized) unless `make fuzz` asks for a long run."""
    assert LONG or (FUZZ.derandomize and FUZZ.max_examples == 30)
    assert values is not None
