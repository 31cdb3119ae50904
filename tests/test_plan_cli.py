"""`fivefold plan` (plan/cli.py): estimate, search, --json keys, --plot, bad input."""
import argparse
import json

import pytest

from fivefold.config import ConfigError
from fivefold.cli import main
from fivefold.plan.cli import add_plan_args, cmd_plan


def run(argv, capsys):
    ap = argparse.ArgumentParser()
    add_plan_args(ap)
    rc = cmd_plan(ap.parse_args(argv))
    return rc, capsys.readouterr().out


def test_estimate_json_has_the_promised_keys(capsys):
    rc, out = run(["--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "2", "--cp", "1", "--zero", "1",
                   "--seq", "4096", "--global-batch", "64", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    for key in ("memory", "traffic", "bubble", "step_time_s", "mfu", "order"):
        assert key in d
    assert set(d["memory"]) >= {"weights", "grads", "optimizer", "activations", "total"}
    assert d["layout"]["dp"] == 4                         # derived from --gpus
    assert d["traffic"]["tp"][0]["tier"] == "nvlink"
    for rows in d["traffic"].values():
        assert {"op", "bytes", "tier"} <= set(rows[0])
    assert 0 < d["mfu"] < 1 and d["step_time_s"] > 0


def test_search_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    rc, out = run(["--model", "mixtral-8x7b", "--gpus", "64", "--seq", "4096", "--global-batch", "256",
                   "--top", "3", "--plot", str(png)], capsys)
    assert rc == 0
    assert "searched" in out and "rejected, by reason" in out and "best layout" in out
    assert png.exists() and png.stat().st_size > 1000


def test_search_json(capsys):
    rc, out = run(["--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "2", "--json"], capsys)
    d = json.loads(out)
    assert d["search"]["ranked"] and "memory" in d and "mfu" in d
    assert all("reason" in r for r in d["search"]["rejected"])


def test_training_config_is_planned(capsys, tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[model]\nhidden = 64\nlayers = 2\nheads = 4\nkv_heads = 2\nffn = 128\n"
                 "[parallel]\ndp = 2\nzero = 1\n[train]\nglobal_batch = 8\nseq_len = 32\ndtype = \"fp32\"\n")
    rc, out = run(["--config", str(f), "--json"], capsys)
    d = json.loads(out)
    assert d["layout"]["dp"] == 2 and d["layout"]["zero"] == 1 and d["workload"]["dtype"] == "fp32"
    assert [r["op"] for r in d["traffic"]["dp"]] == ["all_gather", "reduce_scatter"]


def test_bad_input(capsys):
    with pytest.raises(ConfigError, match="known models: llama3-8b"):
        run(["--model", "gpt-9"], capsys)
    with pytest.raises(ConfigError, match="known topologies: dgx-h100, llama3"):
        run(["--model", "llama3-8b", "--topology", "nowhere"], capsys)
    with pytest.raises(ConfigError, match=r"tp \(3\)"):
        run(["--model", "llama3-8b", "--tp", "3"], capsys)
    assert main(["plan", "--model", "llama3-8b", "--gpus", "64", "--tp", "8", "--pp", "3", "--cp", "1"]) == 2
    assert "must divide" in capsys.readouterr().err
