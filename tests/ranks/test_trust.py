"""Trust nothing on disk: a checkpoint's claims are checked against its own bytes, a run folder's
names are never followed out of it, only fivefold's own files are removed, and a branch never mixes
with the run it leaves. Most cases call the checks in-process; a few spawn the CLI."""
import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fivefold.config import Config, ConfigError
from fivefold.train import checkpoint, rundir, verify
from fivefold.train.trainer import Trainer, supported

from tests.support.spawn import TIMEOUT_S, run_ranks
from tests.support.tiny import tiny_config
from tests.support.cli import TINY, fivefold, metrics

pytestmark = pytest.mark.ranks     # a real run's folder from two spawned ranks; the CLI in subprocesses

STEP = "step-00000002"


def tp2_run(rank, world, out):
    """Two steps with tp=2 (each matrix in two chunks, written by two ranks), one checkpoint at step 2."""
    cfg = tiny_config(tp=2)
    cfg.train.steps, cfg.train.checkpoint = 2, True
    Trainer(cfg, rank, world, quiet=True).run(out)
    return None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real run folder (`fivefold train`'s layout: the model is TINY's) with one checkpoint at step 2."""
    out = tmp_path_factory.mktemp("trust") / "run"
    run_ranks(tp2_run, 2, (str(out),), timeout_s=TIMEOUT_S)
    return out


@pytest.fixture(scope="module")
def original(run):
    ckpt = run / "checkpoints" / STEP
    return {key: checkpoint.Reader(ckpt).full(key) for key in rundir.read_index(ckpt)["tensors"]}


def copy_run(run: Path, dest: Path) -> Path:
    """A copy of the run folder (rank files hard-linked, never written: a test replaces one whole)."""
    def copy(src, dst):
        return os.link(src, dst) if src.endswith(".safetensors") else shutil.copy2(src, dst)
    shutil.copytree(run, dest, copy_function=copy)
    return dest


def edit_index(ckpt: Path, edit) -> None:
    path = ckpt / "index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.unlink()
    path.write_text(json.dumps(index))


def one_line(r, code=2):
    assert r.returncode == code, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len([x for x in r.stderr.splitlines() if x.startswith("fivefold: ")]) == 1, r.stderr


# ---- 1. dtypes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int64", "float16"])
def test_an_index_dtype_other_than_the_files_is_refused(run, tmp_path, dtype):
    ckpt = copy_run(run, tmp_path / "r") / "checkpoints" / STEP
    edit_index(ckpt, lambda i: i["tensors"]["model/embed.weight"].update(dtype=dtype))
    with pytest.raises(ConfigError, match=f"the index says {dtype}"):
        verify.verify(ckpt)
    with pytest.raises(ConfigError, match="the index says"):
        checkpoint.full_tensors(ckpt)


def test_a_dtype_that_is_not_a_name_is_refused(run, tmp_path):
    """Found by the fuzz test below: a list where a dtype name belongs (unhashable) is a refusal too."""
    ckpt = copy_run(run, tmp_path / "r") / "checkpoints" / STEP
    edit_index(ckpt, lambda i: i["tensors"]["model/embed.weight"].update(dtype=["float32"]))
    with pytest.raises(ConfigError, match="needs a shape"):
        verify.verify(ckpt)


def test_resume_from_a_retyped_checkpoint_exits_2_before_training(run, tmp_path):
    ckpt = copy_run(run, tmp_path / "r") / "checkpoints" / STEP
    edit_index(ckpt, lambda i: i["tensors"]["model/embed.weight"].update(dtype="int64"))
    out = tmp_path / "new"
    r = fivefold("train", *TINY, "--resume", str(ckpt), "--out", str(out))
    one_line(r)
    assert "int64" in r.stderr and not (out / "metrics.jsonl").exists()


# ---- 2. step and optimizer counters ---------------------------------------------------------------

@pytest.mark.parametrize("field,value,rule", [("step", -5, "'step' must be an integer >= 0"),
                                              ("step", 7, "but the folder is step-00000002"),
                                              ("step", 2.0, "'step' must be an integer"),
                                              ("opt_t", -1, "'opt_t' must be an integer >= 0"),
                                              ("opt_t", 3, "opt_t 3"),
                                              ("world_size", 0, "world_size must be >= 1")])
def test_counters_are_checked(run, tmp_path, field, value, rule):
    ckpt = copy_run(run, tmp_path / "r") / "checkpoints" / STEP
    edit_index(ckpt, lambda i: i.update({field: value}))
    with pytest.raises(ConfigError, match=rule):
        verify.verify(ckpt)


def test_resume_of_a_negative_step_exits_2(run, tmp_path):
    out = copy_run(run, tmp_path / "r")
    edit_index(out / "checkpoints" / STEP, lambda i: i.update(step=-5))
    r = fivefold("train", *TINY, "--steps", "8", "--resume", "auto", "--out", str(out))
    one_line(r)
    assert "'step' must be an integer >= 0" in r.stderr
    assert [m["step"] for m in metrics(out)] == [1, 2]        # nothing trained, nothing trimmed


# ---- 3. a config the tensors cannot be ------------------------------------------------------------

def huge(index):
    index["config"]["model"].update(hidden=16384, layers=2000, ffn=65536, heads=128, kv_heads=8)


def test_a_huge_config_is_refused_before_any_model_is_built(run, tmp_path):
    ckpt = copy_run(run, tmp_path / "r") / "checkpoints" / STEP
    edit_index(ckpt, huge)
    with pytest.raises(ConfigError, match="parameters, its tensors hold"):
        verify.check_shapes(Config.from_dict(rundir.read_index(ckpt)["config"]), rundir.read_index(ckpt)["tensors"],
                            "here")   # the parameter count alone refuses it
    with pytest.raises(ConfigError):
        checkpoint.to_model(ckpt)


def test_generate_and_export_refuse_a_huge_config_in_one_line(run, tmp_path):
    out = copy_run(run, tmp_path / "r")
    edit_index(out / "checkpoints" / STEP, huge)
    one_line(fivefold("generate", str(out), "--prompt", "hi", "--max-tokens", "2"))
    one_line(fivefold("export", str(out), "--hf", str(tmp_path / "hf")))
    assert not (tmp_path / "hf").exists()


def test_a_config_of_the_same_size_but_other_shapes_is_refused(run, tmp_path):
    ckpt = copy_run(run, tmp_path / "r") / "checkpoints" / STEP
    edit_index(ckpt, lambda i: i["config"]["model"].update(tie_embeddings=False, vocab=128))   # as many parameters
    # without the copy of the claims in rank 0's file (a checkpoint from before it), the shapes decide
    index = rundir.read_index(ckpt)
    with pytest.raises(ConfigError, match="its config's model has"):
        verify.check_shapes(Config.from_dict(index["config"]), index["tensors"], "here")
    with pytest.raises(ConfigError, match="differs from the copy its rank files carry"):
        verify.verify(ckpt)


# ---- 4. branches ---------------------------------------------------------------------------------

class Crash(RuntimeError):
    pass


def test_a_branch_removes_the_newer_checkpoints_it_abandons(tmp_path):
    cfg = tiny_config()
    cfg.train.steps, cfg.train.checkpoint, cfg.train.checkpoint_every = 4, True, 2
    out = tmp_path / "run"
    Trainer(cfg, quiet=True).run(out)
    assert [c.name for c in rundir.checkpoints(out)] == ["step-00000002", "step-00000004"]
    cfg.train.steps = 6
    branch = Trainer(cfg, quiet=True)
    step = branch.step

    def crash(k):
        if k == 3:
            raise Crash("killed before the branch's first save")
        return step(k)
    branch.step = crash
    with pytest.raises(Crash):
        branch.run(out, out / "checkpoints" / "step-00000002")
    assert [c.name for c in rundir.checkpoints(out)] == ["step-00000002"]   # step 4 was the abandoned run's
    assert rundir.resolve_resume("auto", out).name == "step-00000002"
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]                # the branch's history


# ---- 5. only what fivefold wrote -----------------------------------------------------------------

def foreign(out: Path) -> Path:
    """A folder another tool wrote: its own checkpoints/ and tensorboard/."""
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "model-epoch3.ckpt").write_bytes(b"theirs")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"theirs")
    return out


@pytest.mark.parametrize("flags", [(), ("--overwrite",), ("--resume", "auto")])
def test_another_tools_folders_are_never_a_run_and_never_removed(tmp_path, flags):
    out = foreign(tmp_path / "theirs")
    with pytest.raises(ConfigError, match="fivefold did not write"):
        rundir.check_out(out, "auto" if "auto" in flags else None, "--overwrite" in flags)
    with pytest.raises(ConfigError, match="does not hold a fivefold run"):
        rundir.clear(out)
    assert (out / "checkpoints" / "model-epoch3.ckpt").exists() and (out / "tensorboard").is_dir()


def test_overwrite_in_the_cli_leaves_another_tools_files(tmp_path):
    out = foreign(tmp_path / "theirs")
    r = fivefold("train", *TINY, "--overwrite", "--out", str(out))
    one_line(r)
    assert "already holds a run" not in r.stderr and "fivefold did not write" in r.stderr
    assert sorted(p.name for p in out.rglob("*")) == ["checkpoints", "events.out.tfevents.1.host",
                                                      "model-epoch3.ckpt", "tensorboard"]


def test_overwrite_removes_only_fivefolds_own_files(run, tmp_path):
    out = copy_run(run, tmp_path / "r")
    (out / "checkpoints" / "notes.txt").write_text("mine")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"")
    (out / "tensorboard" / "my-plot.png").write_bytes(b"")
    (out / "README").write_text("mine")
    rundir.clear(out)
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == [".fivefold-run", "README", "checkpoints", "checkpoints/notes.txt", "tensorboard",
                    "tensorboard/my-plot.png"]


# ---- 6. symbolic links ---------------------------------------------------------------------------

def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        rundir.RunLock(out)
    r = fivefold("train", *TINY, "--out", str(out))
    one_line(r)
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("name", ["metrics.jsonl", "run.json", "checkpoints"])
def test_no_run_file_is_written_through_a_link(tmp_path, name):
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(ConfigError, match=f"{name} is a symbolic link"):
        rundir.check_out(out, None, True)


def test_a_rank_file_linked_out_of_the_checkpoint_is_refused(run, tmp_path):
    ckpt = copy_run(run, tmp_path / "r") / "checkpoints" / STEP
    outside = tmp_path / "outside.safetensors"
    (ckpt / "rank-00001.safetensors").rename(outside)
    (ckpt / "rank-00001.safetensors").symlink_to(outside)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        verify.verify(ckpt)
    with pytest.raises(ConfigError, match="symbolic link"):
        checkpoint.Reader(ckpt)


def test_a_linked_checkpoint_folder_is_not_listed(run, tmp_path):
    out = copy_run(run, tmp_path / "r")
    (out / "checkpoints" / "step-00000009").symlink_to(out / "checkpoints" / STEP)
    (out / "checkpoints" / "step-abc").mkdir()
    assert [c.name for c in rundir.checkpoints(out)] == [STEP]


# ---- the verifier: an untouched checkpoint passes, and reads what was written ----------------------

def test_an_untouched_checkpoint_verifies_and_carries_its_claims(run, original):
    ckpt = run / "checkpoints" / STEP
    index = verify.verify(ckpt)
    assert index["step"] == 2 and index["world_size"] == 2
    meta = verify.read_header(ckpt / "rank-00000.safetensors")["__metadata__"]
    assert json.loads(meta[verify.CLAIMS])["config"] == index["config"]
    assert len(index["tensors"]["model/layers.0.attn.wq.weight"]["chunks"]) == 2   # tp: two chunks
    assert original["model/embed.weight"].dtype == torch.float32


def test_chunk_boxes_must_cover_the_tensor_exactly(run, tmp_path):
    ckpt = copy_run(run, tmp_path / "r") / "checkpoints" / STEP
    key = "model/layers.0.attn.wq.weight"
    edit_index(ckpt, lambda i: i["tensors"][key]["chunks"].pop())
    with pytest.raises(ConfigError, match="do not cover"):
        verify.verify(ckpt)


# ---- fuzz: random mutations of a real checkpoint are refused in one line, or change nothing ---------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support.mutate import mutate  # noqa: E402

FUZZ = settings(max_examples=75, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def fresh_checkpoint(run: Path, root: Path) -> Path:
    ckpt = root / STEP
    ckpt.mkdir(parents=True)
    for f in (run / "checkpoints" / STEP).iterdir():
        if f.suffix == ".safetensors":
            os.link(f, ckpt / f.name)
    return ckpt


def same_as_untouched(ckpt: Path, original: dict, index: dict, untouched: dict) -> None:
    """A checkpoint the checks accepted reads exactly the untouched one's tensors and claims."""
    for name in verify.CLAIMED + ("world_size",):
        assert verify.canonical(index.get(name)) == verify.canonical(untouched.get(name)), name
    reader = checkpoint.Reader(ckpt)
    assert reader.tensors.keys() == original.keys()
    for key, want in original.items():
        got = reader.full(key)
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert reader.rng(1).keys() == checkpoint.Reader(ckpt).rng(1).keys()


def accept_or_refuse(ckpt: Path, original: dict, untouched: dict) -> str:
    try:
        index = verify.verify(ckpt)
        same_as_untouched(ckpt, original, index, untouched)
    except ConfigError as e:
        assert "\n" not in str(e), str(e)      # one line
        return "refused"
    return "accepted"


@FUZZ
@given(data=st.data())
def test_fuzz_index_json(run, original, tmp_path_factory, data):
    untouched = rundir.read_index(run / "checkpoints" / STEP)
    ckpt = fresh_checkpoint(run, tmp_path_factory.mktemp("fuzz"))
    doc = json.loads(json.dumps(untouched))
    for _ in range(data.draw(st.integers(1, 3))):
        doc = mutate(doc, data)
    (ckpt / "index.json").write_text(json.dumps(doc))
    accept_or_refuse(ckpt, original, untouched)
    assert sorted(p.name for p in ckpt.parent.rglob("*")) == sorted([STEP, "index.json", *(
        f.name for f in (run / "checkpoints" / STEP).glob("*.safetensors"))])   # nothing written


@FUZZ
@given(data=st.data())
def test_fuzz_rank_file_headers(run, original, tmp_path_factory, data):
    untouched = rundir.read_index(run / "checkpoints" / STEP)
    ckpt = fresh_checkpoint(run, tmp_path_factory.mktemp("fuzz"))
    shutil.copy(run / "checkpoints" / STEP / "index.json", ckpt / "index.json")
    name = data.draw(st.sampled_from(["rank-00000.safetensors", "rank-00001.safetensors"]))
    raw = (ckpt / name).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, rest = json.loads(raw[8:8 + n]), raw[8 + n:]
    if data.draw(st.booleans()):
        new = json.dumps(mutate(header, data)).encode()
    else:   # raw bytes: one flipped, or the header's length field wrong
        new = bytearray(raw[8:8 + n])
        new[data.draw(st.integers(0, n - 1))] ^= data.draw(st.integers(1, 255))
        new = bytes(new)
    cut = data.draw(st.sampled_from([None, None, None, 0, 7, len(rest) // 2]))
    (ckpt / name).unlink()
    (ckpt / name).write_bytes(len(new).to_bytes(8, "little") + new + (rest if cut is None else rest[:cut]))
    accept_or_refuse(ckpt, original, untouched)


def test_the_cli_refuses_mutations_in_one_line(run, tmp_path):
    """A few representative mutations through the tools themselves: train --resume, generate, export."""
    cases = [lambda i: i["tensors"]["model/norm.weight"]["chunks"][0].update(offsets=[1]),
             lambda i: i["tensors"]["model/embed.weight"].update(shape=[512, 64]),
             lambda i: i["tensors"]["model/embed.weight"]["chunks"][0].update(file="../../run.json")]
    for k, edit in enumerate(cases):
        out = copy_run(run, tmp_path / f"r{k}")
        edit_index(out / "checkpoints" / STEP, edit)
        tool = [("train", *TINY, "--resume", "auto", "--out", str(out)),
                ("generate", str(out), "--prompt", "a", "--max-tokens", "1"),
                ("export", str(out), str(tmp_path / f"e{k}.safetensors"))][k]
        one_line(fivefold(*tool))


# ---- fuzz: config TOML into train, HF config.json and TOML into plan -----------------------------

from fivefold import cli  # noqa: E402
from fivefold.tools import training  # noqa: E402

HF_LLAMA = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 4, "vocab_size": 1000, "intermediate_size": 512, "max_position_embeddings": 2048,
            "hidden_act": "silu", "tie_word_embeddings": False}
TRAIN_TOML = {"model": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256, "max_seq": 64},
              "parallel": {"dp": 2, "tp": 1, "microbatches": 2},
              "train": {"steps": 4, "global_batch": 8, "seq_len": 32, "lr": 0.01, "checkpoint": True}}
scalars = (st.integers(-3, 3) | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=True) | st.booleans()
           | st.text(max_size=6) | st.sampled_from(["llama", "mixtral", "gpt2", "silu", "1f1b", "megatron"]))


def toml_text(tables: dict) -> str:
    """Tables of scalars (and lists of them) as TOML."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(v), repr(v))
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v) if isinstance(v, str) else str(v)
    lines = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            lines.append(f"{name} = {value(table)}")
            continue
        lines.append(f"[{name}]")
        lines += [f"{json.dumps(k)} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    return "\n".join(lines) + "\n"


def edit_config(doc: dict, data) -> dict:
    """One random edit of a table of tables: a key set to a random scalar, removed, or added."""
    table = data.draw(st.sampled_from(sorted(doc)))
    if isinstance(doc[table], dict):
        keys = sorted(doc[table]) + ["experts", "zero", "pp", "cp", "vocab", "num_experts", "x"]
        key = data.draw(st.sampled_from(keys))
        if data.draw(st.integers(0, 5)) == 0:
            doc[table].pop(key, None)
        else:
            doc[table][key] = data.draw(scalars | st.lists(scalars, max_size=2))
    return doc


def plan_exit(argv) -> int:
    """`fivefold plan ...` in this process: its exit status (a traceback fails the test)."""
    return cli.main(["plan", *argv, "--json"])


PLANNED = (0, 1, 2)   # a plan, a search that found no layout that fits, a one-line refusal


@FUZZ
@given(data=st.data())
def test_fuzz_hf_config_into_plan(tmp_path_factory, capsys, data):
    doc = dict(HF_LLAMA)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(doc) + ["num_local_experts", "head_dim", "num_experts_per_tok"]))
        doc[key] = data.draw(scalars)
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps(doc) if data.draw(st.integers(0, 9)) else json.dumps(doc)[:-3])
    assert plan_exit(["--model", str(path), "--gpus", "2", "--tp", "1", "--pp", "1", "--cp", "1"]) in PLANNED
    err = capsys.readouterr().err
    assert "Traceback" not in err


@FUZZ
@given(data=st.data())
def test_fuzz_config_toml_into_train_and_plan(tmp_path_factory, capsys, data):
    doc = json.loads(json.dumps(TRAIN_TOML))
    for _ in range(data.draw(st.integers(1, 3))):
        doc = edit_config(doc, data)
    path = tmp_path_factory.mktemp("toml") / "run.toml"
    path.write_text(toml_text(doc) if data.draw(st.integers(0, 9)) else toml_text(doc)[:-4] + "= [")
    ap = argparse.ArgumentParser()
    training.add_train_args(ap)
    args = ap.parse_args(["--config", str(path), "--out", str(path.parent / "out")])
    try:
        cfg = training.resolve_train_config(args)
        cfg.validate(cfg.parallel.world_size)
        supported(cfg)
    except ConfigError as e:
        assert "\n" not in str(e)
    assert plan_exit(["--config", str(path)]) in PLANNED
    assert "Traceback" not in capsys.readouterr().err


def test_plan_refuses_bad_model_files_in_one_line(tmp_path, capsys):
    cases = {"zero heads": dict(HF_LLAMA, num_attention_heads=0), "negative heads": dict(HF_LLAMA, num_attention_heads=-4),
             "vocab 0": dict(HF_LLAMA, vocab_size=0), "float": dict(HF_LLAMA, hidden_size=64.5),
             "string": dict(HF_LLAMA, hidden_size="256"), "kv": dict(HF_LLAMA, num_key_value_heads=3)}
    for name, doc in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        assert plan_exit(["--model", str(path)]) == 2, name
    (tmp_path / "nan.json").write_text(json.dumps(HF_LLAMA).replace("256", "NaN"))
    (tmp_path / "not.json").write_text("not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "zero.toml").write_text("[model]\nheads = 0\n")
    (tmp_path / "bad.toml").write_text("[model\n")
    for argv in (["--model", "nan.json"], ["--model", "not.json"], ["--model", "list.json"],
                 ["--config", "zero.toml"], ["--model", "zero.toml"], ["--config", "bad.toml"],
                 ["--config", "missing.toml"]):
        assert plan_exit([argv[0], str(tmp_path / argv[1])]) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("fivefold: config error:") == 13


def test_train_refuses_a_missing_or_malformed_config_in_one_line(tmp_path):
    (tmp_path / "bad.toml").write_text("[train\nsteps = 3\n")
    for path in (tmp_path / "bad.toml", tmp_path / "missing.toml"):
        r = fivefold("train", "--config", str(path), "--out", str(tmp_path / "out"))
        one_line(r)
        assert str(path) in r.stderr


# ---- weak today: one line, exit 2, before any rank starts ----------------------------------------

def test_an_out_that_cannot_be_a_folder_is_one_line(tmp_path):
    (tmp_path / "file").write_text("mine")
    for out in ("/proc/fivefold-x", tmp_path / "file" / "child", tmp_path / "file"):
        r = fivefold("train", *TINY, "--out", str(out))
        one_line(r)
        assert "folder" in r.stderr
    assert (tmp_path / "file").read_text() == "mine"


def test_a_checkpoints_folder_that_cannot_take_a_save_fails_at_start(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rundir.mark(out)
    (out / "checkpoints").write_text("")
    with pytest.raises(ConfigError, match="checkpoints is not a folder"):
        rundir.check_writable(out, checkpoints_too=True)
    rundir.check_writable(out, checkpoints_too=False)   # a run that saves nothing does not care
    if os.geteuid() != 0:   # root writes through permission bits
        (out / "checkpoints").unlink()
        (out / "checkpoints").mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not writable"):
            rundir.check_writable(out, checkpoints_too=True)


def test_an_offload_dir_that_cannot_hold_the_state_fails_at_start(tmp_path, monkeypatch):
    cfg = tiny_config(dp=2, zero=1, offload="nvme")
    (tmp_path / "file").write_text("")
    cfg.parallel.offload_dir = str(tmp_path / "file")
    planned = training.planned_memory(cfg)
    with pytest.raises(ConfigError, match="is not a folder"):
        training.check_offload_dir(cfg, 2, planned)
    cfg.parallel.offload_dir = str(tmp_path / "file" / "under")
    with pytest.raises(ConfigError, match="not writable"):
        training.check_offload_dir(cfg, 2, planned)
    cfg.parallel.offload_dir = str(tmp_path / "nvme")
    per_rank = max(s["disk"] for s in planned["stages"])
    assert per_rank > 0
    training.check_offload_dir(cfg, 2, planned)                 # room enough here
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=2 * per_rank - 1))
    with pytest.raises(ConfigError, match=r"needs .* GiB \(2 rank\(s\)"):
        training.check_offload_dir(cfg, 2, planned)


def test_an_offload_dir_that_is_a_file_is_one_line_in_the_cli(tmp_path):
    (tmp_path / "file").write_text("mine")
    r = fivefold("train", "--nproc", "2", *TINY, "--zero", "1", "--set", "parallel.offload=nvme",
                 "--set", f"parallel.offload_dir={tmp_path / 'file'}", "--out", str(tmp_path / "out"))
    one_line(r)
    assert "offload_dir" in r.stderr and (tmp_path / "file").read_text() == "mine"


def test_a_linked_tokenizer_copy_is_refused(run, tmp_path):
    from fivefold.tokenizer import run_tokenizer_file

    out = copy_run(run, tmp_path / "r")
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (out / "tokenizer.json").symlink_to(outside)
    with pytest.raises(ConfigError, match="symbolic link"):
        run_tokenizer_file(out)
    with pytest.raises(ConfigError, match="symbolic link"):
        rundir.check_out(out, "auto", False)


def test_a_model_too_big_for_this_machine_is_refused_before_any_rank_starts(tmp_path):
    r = fivefold("train", "--nproc", "2", *TINY, "--set", "model.hidden=65536", "--set", "model.heads=64",
                 "--set", "model.kv_heads=8", "--set", "model.layers=64", "--set", "model.ffn=262144",
                 "--out", str(tmp_path / "out"))
    one_line(r)
    assert "parameters" in r.stderr and "GiB" in r.stderr and not (tmp_path / "out").exists()
