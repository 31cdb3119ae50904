"""Evaluation: held-out or separate data, forward only, the same loss under every layout; `fivefold eval`."""
import json
import math

import numpy as np
import pytest

from fivefold.config import Config, ConfigError
from fivefold.train.data import EvalBatches, make_batches, make_eval_batches
from fivefold.train.corpus import split_corpus
from fivefold.train.trainer import Trainer

from tests.support.spawn import spawn_jobs
from tests.support.tiny import tiny_config
from tests.support.cli import TINY, fivefold, metrics


def eval_config(**parallel) -> Config:
    cfg = tiny_config(**parallel)
    cfg.train.eval_fraction, cfg.train.eval_tokens = 0.1, 600   # 3 batches of 8 x 32 tokens
    return cfg


def test_held_out_tail_is_never_trained_on():
    tokens = np.arange(10_000) % 256
    train, held = split_corpus(tokens, 0.1)
    assert len(train) == 9_000 and len(held) == 1_000
    assert held[0:3].tolist() == tokens[9_000:9_003].tolist()
    cfg = eval_config()
    batches = make_batches(cfg.train, 256, tokens)
    assert len(batches.tokens) == 9_000   # training windows lie inside the first part
    ev = make_eval_batches(cfg.train, 256, tokens)
    assert ev.count == 3 and ev.total_tokens() == 3 * 8 * 32
    x, y = ev.local(1, 0, 1)
    assert x[0].tolist() == tokens[9_000 + 8 * 32:9_000 + 9 * 32].tolist()   # fixed windows, in order
    assert y[0, -1] == tokens[9_000 + 9 * 32]


def test_eval_rules_are_one_line():
    cfg = tiny_config()
    cfg.train.eval_every = 5
    with pytest.raises(ConfigError, match="train.eval_every = 5 needs evaluation data"):
        cfg.validate()
    cfg.train.eval_fraction, cfg.train.eval_data = 0.1, ["x.bin"]
    with pytest.raises(ConfigError, match="both give evaluation data"):
        cfg.validate()
    cfg.train.eval_data, cfg.train.eval_fraction = [], 1.0
    with pytest.raises(ConfigError, match=r"train.eval_fraction must be in \[0, 1\)"):
        cfg.validate()
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        EvalBatches(np.zeros(100, np.int64), 32, 8, 1000)
    from fivefold.train.corpus import check_held_out  # before any rank starts: both parts hold a window
    cfg.train.eval_fraction = 0.999999
    with pytest.raises(ConfigError, match=r"train.eval_fraction = 0.999999 of 8,388,608 tokens leaves 8 to train "
                                          r"and 8,388,600 to evaluate; each needs train.seq_len \+ 2 = 34"):
        check_held_out(8_388_608, cfg.train)
    cfg.train.eval_fraction = 1e-7
    with pytest.raises(ConfigError, match="leaves 8,388,607 to train and 1 to evaluate"):
        check_held_out(8_388_608, cfg.train)
    cfg.train.eval_fraction = 0.5
    check_held_out(8_388_608, cfg.train)


def test_evaluation_changes_no_training():
    """Dropout on: an evaluation draws no random number, takes no step; the run trains as without it."""
    plain, with_eval = eval_config(), eval_config()
    plain.model.dropout = with_eval.model.dropout = 0.1
    a = Trainer(plain, quiet=True)   # one after the other: the default random stream is the process's
    losses_a = [a.step(k)["loss"] for k in range(3)]
    b = Trainer(with_eval, quiet=True)
    losses_b = []
    for k in range(3):
        first = b.evaluate()
        assert b.evaluate() == first   # forward only, dropout off: the same number twice
        losses_b.append(b.step(k)["loss"])
    assert losses_a == losses_b
    assert b.ledger.rows() == a.ledger.rows()   # evaluations are recorded apart (the "eval" section)
    assert math.isclose(first["eval_ppl"], math.exp(first["eval_loss"]))


def eval_losses(rank, world, cfg_dict):
    """The eval loss before training and after two steps, and this rank's eval-section ledger rows."""
    tr = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    before = tr.evaluate()["eval_loss"]
    for k in range(2):
        tr.step(k)
    return {"losses": [before, tr.evaluate()["eval_loss"]], "eval_rows": tr.ledger.part("eval").rows()}


LAYOUTS = {"dp2-zero3": dict(dp=2, zero=3, reshard_after_forward=False), "tp2": dict(tp=2, sp_mode="megatron"),
           "pp2": dict(pp=2, microbatches=2), "cp2": dict(cp=2), "dp2-mb2": dict(dp=2, microbatches=2)}


@pytest.mark.ranks
def test_eval_loss_is_the_same_under_every_layout():
    ref = eval_losses(0, 1, eval_config().to_dict())
    jobs = [(name, eval_losses, (eval_config(**p).to_dict(),)) for name, p in LAYOUTS.items()]
    out = spawn_jobs(2, jobs)
    for name in LAYOUTS:
        for r in out[name]:
            np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, err_msg=name)
    dims = {name: {row["dim"] for row in out[name][0]["eval_rows"]} for name in LAYOUTS}
    assert "pp" in dims["pp2"] and "tp" in dims["tp2"] and "loss" in dims["dp2-mb2"]
    pp_ops = {row["op"] for row in out["pp2"][0]["eval_rows"] if row["dim"] == "pp"}
    assert pp_ops == {"send"}   # the first stage only sends activations forward: no gradient comes back


def moe_config(**parallel) -> Config:
    cfg = eval_config(**parallel)
    cfg.model.experts, cfg.model.top_k, cfg.model.moe_ffn, cfg.model.capacity_factor = 4, 2, 64, 1.0
    return cfg


@pytest.mark.ranks
def test_moe_eval_loss_is_the_same_under_expert_parallelism():
    ref = eval_losses(0, 1, moe_config().to_dict())
    out = spawn_jobs(2, [("ep2", eval_losses, (moe_config(dp=2, ep=2).to_dict(),))])
    for r in out["ep2"]:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5)
        assert {row["dim"] for row in r["eval_rows"]} == {"ep", "loss"}   # no routing statistics, no balance loss


@pytest.mark.ranks
def test_train_cli_evaluates(tmp_path):
    data, out = tmp_path / "eval.txt", tmp_path / "run"
    data.write_text("the evaluation text, held apart from training. " * 200)
    r = fivefold("train", "--nproc", "2", "--pp", "2", "--microbatches", "2", *TINY, "--eval-data", str(data), "--eval-every", "3",
                 "--eval-tokens", "256", "--out", str(out))
    assert r.returncode == 0, r.stderr
    m = metrics(out)
    assert [("eval_loss" in x) for x in m] == [False, False, True, True]   # every 3 steps, and the last
    assert m[2]["eval_loss_tokens"] == 256 and math.isclose(m[2]["eval_ppl"], math.exp(m[2]["eval_loss"]))
    assert "eval " in r.stderr and "ppl" in r.stderr
    comm = json.loads((out / "comm.json").read_text())
    assert comm["eval"]["evaluations"] == 2
    assert {row["dim"] for row in comm["eval"]["rows"]} >= {"pp", "loss"}
    assert all(row["dim"] != "eval" for row in comm["rows"])


def printed_loss(r) -> float:
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("eval loss"))
    return float(line.split()[2])


@pytest.mark.ranks
def test_eval_command_loads_any_layout_and_hf_folders(tmp_path):
    """`fivefold eval` of a run's last checkpoint gives the run's own last evaluation, under any layout,
    and the same for the run exported as a Hugging Face folder."""
    data, run = tmp_path / "eval.txt", tmp_path / "run"
    data.write_text("words the model has not seen while it trained. " * 300)
    r = fivefold("train", *TINY, "--eval-data", str(data), "--eval-every", "4", "--eval-tokens", "512",
                 "--set", "train.checkpoint=true", "--out", str(run))
    assert r.returncode == 0, r.stderr
    trained = metrics(run)[-1]["eval_loss"]
    shape = ["--data", str(data), "--eval-tokens", "512", "--seq-len", "32", "--global-batch", "8"]
    for layout in ([], ["--nproc", "2", "--tp", "2"], ["--nproc", "2", "--pp", "2", "--microbatches", "2"]):
        assert math.isclose(printed_loss(fivefold("eval", str(run), *shape, *layout)), trained, rel_tol=1e-5), layout
    hf = tmp_path / "hf"
    assert fivefold("export", str(run), "--hf", str(hf)).returncode == 0
    assert math.isclose(printed_loss(fivefold("eval", str(hf), *shape, "--nproc", "2", "--dp", "2")), trained,
                        rel_tol=1e-5)
    bad = fivefold("eval", str(run), "--data", str(data), "--global-batch", "3", "--nproc", "2", "--dp", "2")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_eval_scalars_and_report_summary(tmp_path):
    """TensorBoard gets eval_loss / eval_ppl on the steps that evaluated; the report's table the last ones."""
    from fivefold.tools.report import read_run, summary
    from fivefold.train.scalars import step_scalars

    step = {"step": 0, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 256, "seconds": 0.5}
    assert set(step_scalars(step)) == {"loss", "grad_norm", "lr", "tokens_per_s"}   # no optional scalar in the record
    evaluated = {**step, "step": 1, "eval_loss": 4.5, "eval_ppl": math.exp(4.5)}
    assert step_scalars(evaluated)["eval_loss"] == 4.5 and step_scalars(evaluated)["eval_ppl"] == math.exp(4.5)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in (step, evaluated, {**step, "step": 2})))
    table = summary([read_run(run)])
    assert "eval loss" in table.splitlines()[0] and "4.5000" in table and f"{math.exp(4.5):.4f}" in table


def test_eval_of_a_keep_best_run_and_too_little_data_say_what_eval_can_change(tmp_path):
    """`fivefold eval` of a run that kept its best checkpoint failed on the run's own keep-best rule (it judges
    evaluations the eval command does not schedule); too little data named train.eval_fraction, which eval
    cannot set, instead of --seq-len and --global-batch."""
    import argparse

    from fivefold.tools.evaluate import add_eval_args, eval_config
    from fivefold.train.corpus import eval_batch_count

    run = tiny_config()
    run.train.keep_best, run.train.stop_after, run.train.eval_every, run.train.eval_fraction = True, 2, 4, 0.1
    ap = argparse.ArgumentParser()
    add_eval_args(ap)
    cfg = eval_config(run, ap.parse_args([str(tmp_path), "--data", str(tmp_path / "x.txt")]))
    cfg.validate(1)
    assert (cfg.train.keep_best, cfg.train.stop_after, cfg.train.eval_every) == (False, 0, 0)
    with pytest.raises(ConfigError, match=r"lower train.seq_len or train.global_batch \(--seq-len, --global-batch\)"):
        eval_batch_count(100, 32, 8, 512)
