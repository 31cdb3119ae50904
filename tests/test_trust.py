"""Trust nothing on disk: a checkpoint's claims are checked against its own bytes, a run folder's
names are never followed out of it, only fivefold's own files are removed, and a branch never mixes
with the run it leaves. Most cases call the checks in-process; a few spawn the CLI."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fivefold.config import Config, ConfigError
from fivefold.train import checkpoint, rundir, verify
from fivefold.train.trainer import Trainer

from .helpers import TIMEOUT_S, run_ranks, tiny_config
from .test_train_cli import TINY, fivefold, metrics

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
    assert [m["step"] for m in metrics(out)] == [0, 1]        # nothing trained, nothing trimmed


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
    assert [m["step"] for m in metrics(out)] == [0, 1, 2]                # the branch's history


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
