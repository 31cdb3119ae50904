"""The console says what trains (issue 55, point 8): every parameter, or how many and their share under LoRA
or train.freeze with the adapters named; the tokens trained and the epochs of the data they make (the
banner, each progress line, metrics.jsonl); `fivefold report --x tokens | epoch` draws against them."""
import json

import pytest

from fivefold.tools.report import ReportError, check_axis, read_run, x_of
from fivefold.tools.training import banner_tokens, trainable_text
from fivefold.train.progress import seen_text
from fivefold.train.trainer import Trainer

from tests.support.tiny import tiny_config


def test_the_banner_says_what_trains_and_for_how_many_epochs():
    cfg = tiny_config()
    assert trainable_text(cfg) == f"{cfg.model.num_params():,} parameters, all trained"
    cfg.train.lora_rank, cfg.train.lora_targets = 4, ["wq", "wv"]
    text = trainable_text(cfg)
    h, layers, heads, kv = cfg.model.hidden, cfg.model.layers, cfg.model.heads, cfg.model.kv_heads
    adapters = layers * 4 * (h + h) + layers * 4 * (h + kv * (h // heads))   # rank x (in + out) per target
    total = cfg.model.num_params() + adapters
    assert text == (f"{total:,} parameters, {adapters:,} trained ({adapters / total:.2%}; LoRA rank 4, alpha 16 "
                    f"on wq wv)")
    cfg.train.lora_rank, cfg.train.freeze = 0, ["embed.*"]
    assert "trained (" in trainable_text(cfg) and "frozen: embed.*" in trainable_text(cfg)
    t = cfg.train
    assert banner_tokens(cfg, 0, t.steps * t.global_batch * t.seq_len * 4).endswith(": 0.25 epochs)")


def test_each_step_records_the_tokens_trained_and_the_epoch():
    tr = Trainer(tiny_config(), quiet=True)
    m = [tr.step(k) for k in range(2)][-1]
    per_step = tr.cfg.train.global_batch * tr.cfg.train.seq_len
    assert m["tokens_seen"] == 2 * per_step and m["epoch"] == pytest.approx(2 * per_step / tr.batches.data_tokens())
    assert seen_text(m) == f"  {2 * per_step} tok (epoch {m['epoch']:.3g})" and seen_text({**m, 'tokens_seen': 1_234_567}).startswith('  1.23M tok')


def test_report_draws_against_tokens_or_epochs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": k, "loss": 5.0 - k, "grad_norm": 1.0, "lr": 1e-3, "tokens": 64, "tokens_seen": 64 * k,
             "epoch": k / 10} for k in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = read_run(run)
    assert [x_of(m, "tokens") for m in r.metrics] == [64, 128] and [x_of(m, "epoch") for m in r.metrics] == [0.1, 0.2]
    check_axis([r], "epoch")
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 1.0, "tokens": 64}) + "\n")
    assert x_of(read_run(old).metrics[0], "tokens") == 192   # step x tokens for a run older than tokens_seen
    with pytest.raises(ReportError, match="--x epoch: old recorded no epochs"):
        check_axis([read_run(old)], "epoch")
