"""Sharded checkpoints: any layout loads any other with optimizer state, resume is exact, saves are
atomic and never hold NaN, nothing on disk runs code."""
import json
import math
import pickle

import pytest
import torch

from fivefold.config import ConfigError
from fivefold.train import checkpoint, rundir
from fivefold.train.outputs import finite_or_null
from fivefold.train.step_guard import NonFiniteError
from fivefold.train.trainer import Trainer

from tests.support.spawn import TIMEOUT_S, run_jobs, run_ranks
from tests.support.tiny import FP32, assert_states_close, tiny_config


def cfg_of(steps=4, every=2, **parallel):
    cfg = tiny_config(**parallel)
    cfg.train.steps, cfg.train.checkpoint, cfg.train.checkpoint_every = steps, True, every
    return cfg


def train(rank, world, cfg_dict, out, resume=None):
    from fivefold.config import Config

    result = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True).run(out, resume)
    return [m["loss"] for m in result["history"]]


def moe(cfg):
    cfg.model.experts, cfg.model.top_k, cfg.model.moe_ffn = 4, 2, 32
    return cfg


def resave(rank, world, cfg_dict, ckpt, out, step):
    """Restore `ckpt` into this layout and save it again at the same step, training nothing."""
    from pathlib import Path

    from fivefold.config import Config

    t = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True, fill=False)
    t.restore(ckpt)
    t.save(Path(out), step)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """Layouts on 4 ranks, each writing step 2 and 4; then other layouts continue from step 2."""
    root = tmp_path_factory.mktemp("ck4")
    d = lambda name: str(root / name)   # noqa: E731
    jobs = [
        ("dp4", train, (cfg_of(dp=4).to_dict(), d("dp4"))),
        ("dp4->tp2pp2", train, (cfg_of(tp=2, pp=2, microbatches=2).to_dict(), d("a"), d("dp4") + "/checkpoints/step-00000002")),
        ("zero3", train, (cfg_of(dp=4, zero=3).to_dict(), d("zero3"))),
        ("zero3->zero0", train, (cfg_of(dp=2, tp=2).to_dict(), d("b"), d("zero3") + "/checkpoints/step-00000002")),
        ("ep4", train, (moe(cfg_of(dp=4, ep=4)).to_dict(), d("ep4"))),
        ("ep4->ep2", train, (moe(cfg_of(dp=4, ep=2, zero=1)).to_dict(), d("c"), d("ep4") + "/checkpoints/step-00000002")),
        # MoE parallel folding: ep4 over tp2 x dp2, then its step 2 re-saved by etp2 x ep2 (ZeRO-1)
        ("folded", train, (moe(cfg_of(tp=2, dp=2, ep=4)).to_dict(), d("folded"))),
        ("folded->etp2", resave, (moe(cfg_of(tp=2, dp=2, ep=2, etp=2, zero=1)).to_dict(),
                                  d("folded") + "/checkpoints/step-00000002", d("etp2"), 2)),
    ]
    results = run_ranks(run_jobs, 4, (jobs,), timeout_s=TIMEOUT_S)
    return root, results[0]


@pytest.mark.parametrize("before,after", [("dp4", "dp4->tp2pp2"), ("zero3", "zero3->zero0"), ("ep4", "ep4->ep2")])
@pytest.mark.ranks
def test_another_layout_continues_the_run(four, before, after):
    _, r = four
    assert len(r[before]) == 4 and len(r[after]) == 2
    torch.testing.assert_close(torch.tensor(r[after]), torch.tensor(r[before][2:]), rtol=1e-5, atol=0)


@pytest.mark.ranks
def test_folded_experts_reshard_bit_for_bit_optimizer_included(four, tmp_path):
    """ep4 folded over tp2 x dp2 -> etp2 x ep2 with ZeRO-1 -> one rank: each layout restores the last one's
    checkpoint and writes it again, and every tensor of every section (weights, Adam's moments) is the
    same bits; a run continued from the folded checkpoint on one rank trains as the folded run did."""
    root, r = four
    first = root / "folded" / "checkpoints" / "step-00000002"
    one = Trainer(moe(cfg_of()), quiet=True, fill=False)
    one.restore(root / "etp2" / "checkpoints" / "step-00000002")
    one.save(tmp_path / "one", 2)
    for section in checkpoint.SECTIONS:
        want = checkpoint.full_tensors(first, section)
        for again in (root / "etp2" / "checkpoints" / "step-00000002", tmp_path / "one" / "checkpoints" / "step-00000002"):
            got = checkpoint.full_tensors(again, section)
            assert got.keys() == want.keys() and any("experts" in k for k in got)
            assert all(torch.equal(got[k], want[k]) for k in want), section
    continued = Trainer(moe(cfg_of()), quiet=True).run(tmp_path / "cont", resume=first)
    torch.testing.assert_close(torch.tensor([m["loss"] for m in continued["history"]]),
                               torch.tensor(r["folded"][2:]), rtol=1e-5, atol=0)


@pytest.mark.ranks
def test_every_layout_writes_the_same_checkpoint(four, tmp_path):
    root, _ = four
    a = checkpoint.full_tensors(root / "dp4" / "checkpoints" / "step-00000002")
    b = checkpoint.full_tensors(root / "zero3" / "checkpoints" / "step-00000002")
    assert a.keys() == b.keys() and "embed.weight" in a and "head.weight" not in a   # tied: held once
    assert_states_close(a, b, **FP32)      # the same weights, up to fp32 summation order
    for section in ("exp_avg", "exp_avg_sq"):
        assert checkpoint.full_tensors(root / "dp4", section).keys() == a.keys()
    # the pieces were written by several ranks in parallel, none gathered to one
    index = rundir.read_index(root / "a" / "checkpoints" / "step-00000004")   # written by tp2 x pp2
    files = {c["file"] for t in index["tensors"].values() for c in t["chunks"]}
    assert len(files) == 4
    assert len(index["tensors"]["model/layers.0.attn.wq.weight"]["chunks"]) == 2   # the two tp pieces
    # export: one safetensors file that a single process loads
    dest = checkpoint.export(root / "a", tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    assert load_file(str(dest)).keys() == checkpoint.full_tensors(root / "a").keys()
    with pytest.raises(ConfigError, match="never overwrites"):
        checkpoint.export(root / "a", dest)
    model = checkpoint.to_model(root / "a")
    assert sum(p.numel() for p in model.parameters()) == tiny_config().model.num_params()


@pytest.mark.ranks
def test_keep_checkpoints_and_atomic_publish(four):
    root, _ = four
    names = [p.name for p in rundir.checkpoints(root / "dp4")]
    assert names == ["step-00000002", "step-00000004"]
    assert not list((root / "dp4" / "checkpoints").glob(".*"))   # no temporary folder left


def dropout_resume(rank, world, out):
    cfg = cfg_of(steps=4, every=2, dp=2)
    cfg.model.dropout = 0.1
    return split_run(rank, world, out, cfg)


def bf16_zero1_resume(rank, world, out):
    """ZeRO-1 in bf16: a load reads each whole parameter through one fp32 staging copy into its bf16
    buffer (parallel/zero/engine.py read_param)."""
    cfg = cfg_of(steps=4, every=2, dp=2, zero=1)
    cfg.train.dtype = "bf16"
    return split_run(rank, world, out, cfg)


def split_run(rank, world, out, cfg):
    """Four steps whole, and two, saved, then resumed to four: (whole losses, resumed losses, metrics steps)."""
    whole = train(rank, world, cfg.to_dict(), out + "/whole")
    cfg.train.steps = 2
    train(rank, world, cfg.to_dict(), out + "/part")
    cfg.train.steps = 4
    rest = train(rank, world, cfg.to_dict(), out + "/part", "auto")
    lines = [json.loads(x)["step"] for x in open(out + "/part/metrics.jsonl")]
    return whole, rest, lines


def nonfinite(rank, world, out):
    """Step 1's loss is made NaN: the step is skipped (parameters and Adam's count unchanged), step 2 trains;
    then NaN from every step stops the run after max_skips, without saving."""
    import fivefold.train.trainer as T

    cfg = cfg_of(steps=6, every=0, dp=2)
    cfg.train.max_skips = 2
    t = Trainer(cfg, rank, world, quiet=True)
    loss_sum = t.loss_sum
    t.step(0)
    before = [p.detach().clone() for p in t.params]
    t.loss_sum = lambda *a, **k: loss_sum(*a, **k) * float("nan")
    m1 = t.step(1)
    same = all(torch.equal(a, b) for a, b in zip(before, t.params))
    t_adam = t.engine.optimizer.t
    t.loss_sum = loss_sum
    m2 = t.step(2)
    t.loss_sum = lambda *a, **k: loss_sum(*a, **k) * float("nan")
    t.step(3)
    try:
        t.step(4)
        stopped = None
    except NonFiniteError as e:
        stopped = str(e)
    with torch.no_grad():
        t.params[0].view(-1)[0] = float("nan")
        t.engine.master[0].view(-1)[0] = float("nan")
    try:
        t.save(T.Path(out), 5)
        refused = None
    except checkpoint.NonFiniteState as e:
        refused = str(e)
    return {"m1": m1, "same": same, "t": t_adam, "m2": m2, "stopped": stopped, "refused": refused,
            "saved": [p.name for p in rundir.checkpoints(out)], "metrics": finite_or_null(m1)}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck2")
    jobs = [("dropout", dropout_resume, (str(root),)), ("nonfinite", nonfinite, (str(root / "nan"),)),
            ("bf16-zero1", bf16_zero1_resume, (str(root / "bf16"),))]
    return run_ranks(run_jobs, 2, (jobs,), timeout_s=TIMEOUT_S)[0]


@pytest.mark.ranks
def test_resume_is_bit_exact_with_dropout_and_appends_metrics(two):
    whole, rest, lines = two["dropout"]
    assert rest == whole[2:]            # random streams restored: exactly equal
    assert lines == [1, 2, 3, 4]        # the resumed run appended to the same metrics


@pytest.mark.ranks
def test_bf16_zero1_resume_is_bit_exact(two):
    whole, rest, _ = two["bf16-zero1"]
    assert rest == whole[2:]


@pytest.mark.ranks
def test_nonfinite_step_is_skipped_then_the_run_stops(two):
    r = two["nonfinite"]
    assert r["m1"]["skipped"] and math.isnan(r["m1"]["loss"])
    assert r["same"] and r["t"] == 1                                  # no update, Adam's count kept
    assert "skipped" not in r["m2"] and math.isfinite(r["m2"]["loss"])
    assert "step 5:" in r["stopped"] and "2 non-finite steps in a row" in r["stopped"]   # t.step(4): metrics' step 5
    assert "NaN or inf" in r["refused"] and r["saved"] == []          # a NaN state is never written
    assert r["metrics"]["loss"] is None                               # JSON null, not NaN


def test_compare_configs_names_the_field():
    old = tiny_config().to_dict()
    new = tiny_config()
    new.model.layers, new.train.lr, new.parallel.tp = 3, 5e-3, 2
    errors, warnings = rundir.compare_configs(old, new.to_dict())
    assert errors == ["model.layers: checkpoint 2, now 3"]
    assert warnings == ["train.lr: checkpoint 0.01, now 0.005"]     # the layout change is silent


def test_a_crafted_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    ck = tmp_path / "run" / "checkpoints" / "step-00000001"
    ck.mkdir(parents=True)
    (ck / "rank-00000.safetensors").write_bytes(pickle.dumps({"x": Payload()}))
    shape = [2]
    (ck / "index.json").write_text(json.dumps({"format": rundir.FORMAT, "step": 1, "config": {}, "world_size": 1,
                                               "opt_t": 1, "tensors": {"model/x": {"shape": shape, "dtype": "float32",
                                               "chunks": [{"file": "rank-00000.safetensors", "key": "model/x@0",
                                                           "offsets": [0], "sizes": shape}]}}}))
    with pytest.raises(ConfigError, match="not a safetensors file"):
        checkpoint.Reader(ck).full("model/x")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "index.json").write_text(json.dumps({"format": 1}))
    with pytest.raises(ConfigError, match="unknown checkpoint format"):
        rundir.read_index(bad)
    assert not marker.exists()


def test_newest_checkpoint_ignores_unfinished_saves(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-00000004").mkdir(parents=True)                # no index.json: incomplete
    (root / ".tmp-step-00000006-abcd").mkdir()
    done = root / "step-00000002"
    done.mkdir()
    (done / "index.json").write_text("{}")
    assert rundir.newest_checkpoint(tmp_path) == done
    checkpoint.prune(tmp_path, keep=1)
    assert not (root / ".tmp-step-00000006-abcd").exists()


def test_flat_boxes_cover_a_flat_range_in_order():
    shape = (3, 4, 5)
    full = torch.arange(60).view(shape)
    for start in range(0, 60, 7):
        for stop in range(start, 61, 5):
            boxes = checkpoint.flat_boxes(shape, start, stop)
            got = [full[tuple(slice(o, o + n) for o, n in zip(off, size))].reshape(-1) for off, size in boxes]
            assert (torch.cat(got).tolist() if got else []) == list(range(start, stop))
    assert len(checkpoint.flat_boxes((1000, 1000), 500, 999_700)) == 3   # partial row, whole rows, partial row


@pytest.mark.ranks
def test_zero_shards_are_written_where_they_are(four):
    """ZeRO-3 on 4 ranks: each rank wrote its own slice of the embedding; nothing was gathered."""
    root, _ = four
    index = rundir.read_index(root / "zero3" / "checkpoints" / "step-00000002")
    files = {c["file"] for c in index["tensors"]["exp_avg/embed.weight"]["chunks"]}
    assert len(files) >= 2


@pytest.mark.ranks
def test_a_restore_reads_its_own_chunks_straight_into_place(four, monkeypatch):
    """A box that is one stored chunk (a rank restoring the shards it saved) goes from the file into the
    caller's tensor with no staging buffer; a box across chunks (another layout) reads the same values."""
    from fivefold.model.hf_weights import SafetensorsFile
    from fivefold.shapes import Box

    root, _ = four
    reader = checkpoint.Reader(root / "zero3" / "checkpoints" / "step-00000002")
    entry = reader.tensors["exp_avg/embed.weight"]
    shape = tuple(entry["shape"])
    whole = reader.full("exp_avg/embed.weight")
    assert len(entry["chunks"]) >= 2
    monkeypatch.setattr(SafetensorsFile, "read", lambda *a: pytest.fail("staged through a buffer"))
    for chunk in entry["chunks"]:
        box = Box(shape, tuple(chunk["offsets"]), tuple(chunk["sizes"]))
        out = torch.full(box.sizes, float("nan"))
        reader.read_into("exp_avg/embed.weight", box, out)
        assert torch.equal(out, whole[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))])
    monkeypatch.undo()
    rows = shape[0] // 2
    across = Box(shape, (1, 0), (rows, shape[1]))   # rows 1.. : the first chunk's tail, the next's head
    padded = torch.full((rows + 3, shape[1]), float("nan"))
    reader.read_into("exp_avg/embed.weight", across, padded)
    assert torch.equal(padded[:rows], whole[1:1 + rows]) and not padded[rows:].any()
    monkeypatch.setattr(checkpoint, "OPEN_FILES", 1)    # an export of a many-rank checkpoint: few descriptors
    few = checkpoint.Reader(root / "zero3" / "checkpoints" / "step-00000002")
    assert torch.equal(few.full("exp_avg/embed.weight"), whole) and len(few._files) == 1


@pytest.mark.ranks
def test_export_to_hugging_face_loads_in_transformers(four, tmp_path):
    from transformers import AutoModelForCausalLM

    root, _ = four
    dest = checkpoint.export_hf(root / "a", tmp_path / "hf")     # written by tp2 x pp2
    hf = AutoModelForCausalLM.from_pretrained(str(dest))
    ours = checkpoint.to_model(root / "a")
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="not empty"):
        checkpoint.export_hf(root / "a", dest)


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial_save(tmp_path, monkeypatch):
    """ENOSPC while a rank writes its file: SaveFailed (brief: the launcher prints one line), the save's
    temporary folder removed, the earlier checkpoint kept and still the newest."""
    from fivefold.train import checkpoint as ck
    from fivefold.train.launch import _describe

    cfg = tiny_config()
    cfg.train.steps, cfg.train.checkpoint, cfg.train.checkpoint_every = 4, True, 2
    real = ck._write_safetensors
    calls = []

    def full_after_first(path, tensors, metadata):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(path, tensors, metadata)

    monkeypatch.setattr(ck, "_write_safetensors", full_after_first)
    with pytest.raises(ck.SaveFailed, match=r"the checkpoint of step 4 was not saved: rank 0: No space left on device") as e:
        Trainer(cfg, quiet=True).run(tmp_path / "run")
    assert "\n" not in _describe(e.value) and e.value.brief
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step-00000002"]
