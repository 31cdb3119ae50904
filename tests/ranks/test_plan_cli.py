"""`fivefold plan` (tools/plan.py): estimate, search, --json keys, --plot, bad input."""
import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from fivefold.config import ConfigError
from fivefold.cli import main
from fivefold.tools.plan import add_plan_args, cmd_plan
from fivefold.plan.models import PRESETS


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
    for key in ("memory", "traffic", "bubble", "step_time_s", "mfu", "order_recommended", "layout_order"):
        assert key in d
    assert set(d["memory"]) >= {"weights", "grads", "optimizer", "activations", "total"}
    assert d["layout"]["dp"] == 4                         # derived from --gpus
    assert d["traffic"]["tp"][0]["tier"] == "nvlink"
    for rows in d["traffic"].values():
        assert {"op", "bytes_sent", "message_bytes", "tier"} <= set(rows[0])   # comm.json's names
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


# -- bad input: every numeric option, the topology's numbers, a GPU count too large --------------------
BAD_OPTIONS = [
    (["--seq", "0"], r"--seq must be between 1 and 1073741824, got 0; valid: 1..1073741824"),
    (["--seq", "-4096"], "--seq must be between 1 and"),
    (["--seq", str(2**122)], "--seq must be between 1 and 1073741824"),
    (["--global-batch", "0"], "--global-batch must be between 1 and 1073741824"),
    (["--global-batch", str(2**40)], "--global-batch must be between 1 and 1073741824"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be between 1 and 1073741824"),
    (["--gpus", "0"], "--gpus must be between 1 and 1048576"),
    (["--gpus", "-8"], "--gpus must be between 1 and 1048576"),
    (["--tp", "0"], "--tp must be between 1 and 1048576"),
    (["--ep", str(2**21)], "--ep must be between 1 and 1048576"),
    (["--pp", "-1"], "--pp must be between 1 and"),
    (["--dp", "0"], "--dp must be between 1 and"),
    (["--cp", "0"], "--cp must be between 1 and"),
    (["--ep", "0"], "--ep must be between 1 and"),
    (["--vpp", "0"], "--vpp must be between 1 and"),
    (["--ulysses", "0"], "--ulysses must be between 1 and"),
    (["--top", "0"], r"--top must be >= 1, got 0; valid: 1, 2, 3, ..."),
    (["--bucket-mb", "0"], r"--bucket-mb must be a finite number > 0 \(MiB of gradients per reduction bucket\)"),
    (["--bucket-mb", "nan"], r"--bucket-mb must be a finite number > 0 .*got nan"),
    (["--moe-route-nodes", "-1"], r"--moe-route-nodes must be between 0 and 1048576, got -1"),
    (["--microbatch-group", "-1"], r"--microbatch-group must be between 0 and"),
    (["--zero", "4"], r"--zero must be between 0 and 3, got 4; valid: 0, 1, 2, 3"),
    (["--zero", "-1"], "--zero must be between 0 and 3"),
    (["--efficiency", "0"], r"--efficiency must be a finite number > 0 and <= 1 .*valid: \(0, 1\]"),
    (["--efficiency", "-0.5"], r"--efficiency must be a finite number > 0 and <= 1"),
    (["--efficiency", "1.5"], r"--efficiency must be a finite number > 0 and <= 1 .*got 1.5"),
    (["--efficiency", "nan"], r"--efficiency must be a finite number .*got nan"),
    (["--efficiency", "inf"], r"--efficiency must be a finite number .*got inf"),
    (["--capacity-factor", "-1"], r"--capacity-factor must be a finite number >= 0 .*valid: \[0, inf\)"),
    (["--capacity-factor", "nan"], r"--capacity-factor must be a finite number"),
    (["--capacity-factor", "inf"], r"--capacity-factor must be a finite number"),
    (["--gpus", "2147483648"], r"--gpus must be between 1 and 1048576, got 2147483648; valid: 1..1048576"),
    (["--gpus", "30000", "--topology", "llama3"], r"at most the 24576 GPUs of topology llama3.*valid: 1..24576"),
    (["--tp", "8", "--pp", "16", "--dp", "256", "--topology", "llama3"],
     r"tp\*pp\*dp\*cp must be at most the 24576 GPUs of topology llama3, got 32768"),
    (["--tp", "65536", "--pp", "65536"], r"tp\*pp\*dp\*cp = 4294967296 GPUs, more than the planner's limit"),
]


def one_line_error(argv, capsys) -> str:
    """`fivefold plan ...` exits 2 with one line on stderr, the config error."""
    assert main(["plan", "--model", "llama3-8b", *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fivefold: config error: "), err
    return lines[0]


@pytest.mark.parametrize("argv,message", BAD_OPTIONS)
def test_every_numeric_option_is_checked(argv, message, capsys):
    assert re.search(message, one_line_error(argv, capsys))


def test_capacity_factor_is_bounded_by_the_moe_model(capsys):
    """Above experts/top_k every expert already takes every token (and 1e300 overflowed the capacity)."""
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--capacity-factor", "1e300"]) == 2
    err = capsys.readouterr().err
    assert "--capacity-factor must be a finite number >= 0 and <= 4" in err and "valid: [0, 4]" in err
    assert len(err.strip().splitlines()) == 1


def test_options_are_checked_before_any_work(capsys, monkeypatch):
    """A bad number is refused before the model, topology or search is touched."""
    import fivefold.tools.plan as plan_cli

    def boom(*a, **k):
        raise AssertionError("work started")

    for name in ("load_model", "load_topology", "search", "estimate"):
        monkeypatch.setattr(plan_cli, name, boom)
    assert "--seq must be" in one_line_error(["--seq", "0", "--gpus", "16384"], capsys)
    assert "--top must be" in one_line_error(["--top", "0", "--topology", "nowhere"], capsys)


def test_a_huge_gpu_count_answers_at_once(capsys, monkeypatch):
    """Refused before the model, the topology or the search is touched (not timed: no work starts)."""
    import fivefold.tools.plan as plan_cli

    for name in ("load_model", "load_topology", "search", "estimate"):
        monkeypatch.setattr(plan_cli, name, lambda *a, **k: pytest.fail("work started"))
    for gpus in ("2147483648", "4294967296", str(2**62)):
        assert "valid: 1..1048576" in one_line_error(["--gpus", gpus, "--topology", "dgx-h100"], capsys)


# -- bad input: the sequence, the model and config files, the plot's folder (issue 26, item 6) -----------------
@pytest.mark.parametrize("layout", [["--gpus", "64"], ["--tp", "8", "--pp", "1", "--cp", "1", "--dp", "1"]])
def test_a_sequence_beyond_the_models_positions_is_refused(layout, capsys):
    """A billion tokens was searched, or estimated at 120% MFU; llama3-8b has 8192 positions."""
    line = one_line_error(["--seq", str(10**9), *layout], capsys)
    assert "--seq (1000000000) is beyond the position limit of model llama3-8b" in line
    assert "must be <= max_seq = 8192; valid: 1..8192 (fivefold has no RoPE scaling: a longer context needs" in line


def test_a_configs_sequence_beyond_another_models_positions_is_refused(tmp_path, capsys):
    """--model replaces a --config's model; the config's train.seq_len is then held to the new model's limit."""
    f = tmp_path / "run.toml"
    f.write_text("[model]\nmax_seq = 9000\n[train]\nseq_len = 9000\n")
    line = one_line_error(["--config", str(f)], capsys)   # one_line_error gives --model llama3-8b
    assert f"train.seq_len of --config {f} (9000) is beyond the position limit of model llama3-8b" in line


def test_a_json_config_is_refused(tmp_path, capsys):
    f = tmp_path / "config.json"
    f.write_text('{"hidden_size": 4096}')
    line = one_line_error(["--config", str(f)], capsys)
    assert "--config takes a fivefold training TOML, got the JSON file" in line and "goes to --model" in line


def test_a_missing_config_is_refused(tmp_path, capsys):
    line = one_line_error(["--config", str(tmp_path / "nowhere.toml")], capsys)
    assert "nowhere.toml: cannot open it (No such file or directory)" in line


def test_a_config_that_is_not_toml_is_refused(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text('{"model": {"hidden": 64}}')
    assert "run.toml is not TOML (" in one_line_error(["--config", str(f)], capsys)


def test_a_config_with_zero_heads_is_refused(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text("[model]\nhidden = 64\nlayers = 2\nheads = 0\nkv_heads = 2\nffn = 128\n")
    for argv in (["--config", str(f)], ["--model", str(f), "--gpus", "8"]):
        assert re.search(r"model.heads must be (>= 1|between 1 and \d+), got 0", one_line_error(argv, capsys))


def test_an_hf_config_that_is_not_json_is_refused(tmp_path, capsys):
    f = tmp_path / "config.json"
    f.write_text('{"model_type": "llama", broken')
    line = one_line_error(["--model", str(f), "--gpus", "8"], capsys)
    assert "cannot read it as JSON (JSONDecodeError" in line and "give a Hugging Face config.json" in line
    f.write_text("[1, 2]")
    assert "a Hugging Face config.json is a JSON object, got list" in one_line_error(["--model", str(f)], capsys)


HF_LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


@pytest.mark.parametrize("change,message", [   # each names the config.json key it read
    ({"num_attention_heads": 0}, r"num_attention_heads must be >= 1, got 0; valid: 1, 2, 3"),
    ({"num_attention_heads": -32}, r"num_attention_heads must be >= 1, got -32"),
    ({"hidden_size": float("nan")}, r"hidden_size must be an integer, got nan"),
    ({"num_hidden_layers": 32.5}, r"num_hidden_layers must be an integer, got 32.5"),
    ({"num_key_value_heads": float("nan")}, r"num_key_value_heads must be an integer, got nan"),
    ({"intermediate_size": -1}, r"intermediate_size must be >= 1, got -1"),
    ({"max_position_embeddings": float("nan")}, r"max_position_embeddings must be an integer, got nan"),
    ({"num_key_value_heads": 5}, r"heads \(32\) must divide by kv_heads \(5\) .*valid kv_heads: \[1, 2, 4"),
])
def test_bad_sizes_in_an_hf_config_are_refused(change, message, tmp_path, capsys):
    """0 or negative heads reached a ValueError deep in the search; NaN sizes searched nothing silently."""
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**HF_LLAMA, **change}))   # Python's json writes NaN, as HF's own files may hold
    assert re.search(message, one_line_error(["--model", str(f), "--gpus", "8"], capsys))


def test_a_plot_into_a_missing_folder_is_refused_before_the_search(tmp_path, capsys, monkeypatch):
    import fivefold.tools.plan as plan_cli

    monkeypatch.setattr(plan_cli, "search", lambda *a, **k: pytest.fail("searched first"))
    png = tmp_path / "no" / "such" / "plan.png"
    line = one_line_error(["--gpus", "8", "--plot", str(png)], capsys)
    assert f"--plot {png}: the folder {png.parent} does not exist" in line



@pytest.mark.parametrize("argv,message", [
    (["--gpus", "abc"], "argument --gpus: invalid int value: 'abc'"),
    (["--accelerator", "tpu"], "argument --accelerator: invalid choice: 'tpu' (choose from 'h100', "),
    (["--gpus"], "argument --gpus: expected one argument"),
])
def test_argparses_own_errors_are_one_line(argv, message, capsys):
    """argparse printed its 25-line usage before the error (flags.OneLineParser)."""
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines() == [f"fivefold plan: error: {message}"
                                                      + err.split(message, 1)[1].rstrip()], err
    assert err.rstrip().endswith("; see fivefold plan --help")


def test_a_plot_that_is_a_folder_is_refused(tmp_path, capsys):
    """It was saved as FOLDER.png, and the line on stderr named the folder."""
    line = one_line_error(["--gpus", "8", "--plot", str(tmp_path)], capsys)
    assert f"--plot {tmp_path} is a folder; give a file name in it, e.g. --plot {tmp_path / 'plan.png'}" in line


@pytest.mark.parametrize("name", ["plan.xyz", "plan"])
def test_a_plot_of_an_unknown_type_is_refused_before_the_search(name, tmp_path, capsys, monkeypatch):
    """matplotlib raised its ValueError after the search (a traceback); a bare name was saved as NAME.png."""
    pytest.importorskip("matplotlib")
    import fivefold.tools.plan as plan_cli

    monkeypatch.setattr(plan_cli, "search", lambda *a, **k: pytest.fail("searched first"))
    line = one_line_error(["--gpus", "8", "--plot", str(tmp_path / name)], capsys)
    assert "the file type is the suffix, one of " in line and "png" in line and "svg" in line


def test_a_plot_is_written_in_the_type_its_suffix_names(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    svg = tmp_path / "plan.svg"
    assert main(["plan", "--model", "llama3-8b", "--tp", "8", "--pp", "1", "--dp", "1", "--plot", str(svg)]) == 0
    assert svg.read_text().lstrip().startswith("<?xml") and f"plot: {svg}" in capsys.readouterr().err


def test_a_missing_model_file_is_named_as_missing(tmp_path, capsys):
    for name in ("config.json", "model.toml"):
        line = one_line_error(["--model", str(tmp_path / name)], capsys)
        assert f"model {tmp_path / name}: no such file; give a preset (llama3-8b" in line


def test_a_model_toml_without_a_model_table_is_refused(tmp_path, capsys):
    """It planned the defaults, a tiny test model, at 0.02 GiB a device."""
    f = tmp_path / "run.toml"
    f.write_text("[parallel]\ndp = 2\n")
    line = one_line_error(["--model", str(f), "--tp", "1", "--pp", "1", "--dp", "1"], capsys)
    assert f"model {f}: the TOML has no [model] table (hidden, layers, heads, ...)" in line


def test_a_model_folder_is_read_by_its_config_json(tmp_path, capsys):
    """A Hugging Face checkpoint's folder (what `train --init-hf` takes) is its config.json; a folder without
    one is one line."""
    assert "a folder without config.json" in one_line_error(["--model", str(tmp_path)], capsys)
    (tmp_path / "config.json").write_text(json.dumps({**HF_LLAMA, "num_attention_heads": 0}))
    assert "config.json: num_attention_heads must be >= 1, got 0" in one_line_error(["--model", str(tmp_path)], capsys)
    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
    assert main(["plan", "--model", str(tmp_path), "--tp", "8", "--pp", "1", "--dp", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["params"] == PRESETS["llama3-8b"].num_params()


@pytest.mark.parametrize("spec,message", [
    ("nowhere.toml", "topology nowhere.toml: no such file; give a preset (dgx-h100, llama3), nodes:K or a .toml"),
    ("{tmp}", "topology {tmp}: a folder; give a preset"),
])
def test_a_missing_topology_file_or_a_folder_is_refused(spec, message, tmp_path, capsys):
    line = one_line_error(["--gpus", "8", "--topology", spec.format(tmp=tmp_path)], capsys)
    assert message.format(tmp=tmp_path) in line


@pytest.mark.parametrize("argv,message", [   # a fixed degree no layout can take: refused before the search
    (["--tp", "3", "--gpus", "6"], r"heads \(32\) must divide by tp \(3\): each tp rank computes whole heads; "
                                   r"valid tp: \[1, 2, 4\]"),
    (["--ep", "2", "--gpus", "8"], r"ep \(2\) needs a mixture-of-experts model .*this model is dense: valid ep: \[1\]"),
    (["--model", "mixtral-8x7b", "--ep", "3", "--gpus", "6"], r"experts \(8\) must divide by ep \(3\); valid ep: "
                                                              r"\[1, 2, 4\]"),
    (["--tp", "4", "--gpus", "6"], r"--gpus 6 must divide by the given degrees tp = 4; valid --gpus: \[4, 8, 12\]"),
    (["--pp", "40", "--gpus", "40"], r"model.layers \(32\) must be >= pp\*vpp = 40\*1 = 40"),
    (["--pp", "8", "--vpp", "8", "--gpus", "64"], r"valid: pp <= 4 at vpp=8, or vpp <= 4 at pp=8"),
    (["--pp", "1", "--vpp", "2", "--gpus", "8"], r"vpp > 1 interleaves model chunks .*valid: vpp = 1 at pp = 1"),
    (["--pp", "2", "--partition", "1,2", "--gpus", "8"], r"\[1, 2\] sums to 3, the model has 32 layers"),
    (["--global-batch", "1", "--micro-batch-size", "2", "--gpus", "8"],
     r"global_batch \(1\) must divide by dp\*micro_batch = 1\*2 = 2; valid global batches: \[2, 4\]"),
    (["--moe-route-nodes", "2", "--gpus", "8"], r"moe_route_nodes=2 limits expert routing, but llama3-8b has no experts"),
])
def test_a_fixed_degree_no_layout_can_take_is_refused(argv, message, capsys, monkeypatch):
    """It searched and answered "no layout fits; rejected, by reason: rule 84" (exit 1), or --ep on a dense
    model failed inside the search naming a dp*cp nobody gave."""
    import fivefold.tools.plan as plan_cli

    monkeypatch.setattr(plan_cli, "search", lambda *a, **k: pytest.fail("searched first"))
    model = [] if "--model" in argv else ["--model", "llama3-8b"]
    assert main(["plan", *model, *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


@pytest.mark.parametrize("flag", [["--bucket-mb", "1"], ["--no-overlap-grad-reduce"],
                                  ["--overlap-param-gather"], ["--ulysses", "2"], ["--microbatch-group", "8"],
                                  ["--reduce-each-microbatch"]])
def test_a_mechanism_of_one_layout_is_refused_in_a_search(flag, capsys, monkeypatch):
    """A search keeps Layout's defaults for these: they changed nothing in it, silently. (--[no-]ep-overlap
    and --[no-]recompute-norm-mla are search dimensions: tests/unit/test_plan_search_mechanisms.py.)"""
    import fivefold.tools.plan as plan_cli

    monkeypatch.setattr(plan_cli, "search", lambda *a, **k: pytest.fail("searched"))
    line = one_line_error(["--gpus", "8", *flag], capsys)
    assert f"{flag[0]} sets a mechanism of one layout, which a search does not vary" in line
    assert "give every degree (--tp --pp --cp --dp, and --ep for a MoE model)" in line


def test_a_mechanism_of_one_layout_changes_that_layout(capsys):
    """The same flag, with every degree given, is planned: expert all-to-alls behind other compute."""
    argv = ["--model", "mixtral-8x7b", "--tp", "1", "--pp", "4", "--dp", "16", "--ep", "8", "--json"]
    plain, overlapped = (json.loads(run(argv + extra, capsys)[1]) for extra in ([], ["--ep-overlap"]))
    assert overlapped["layout"]["ep_overlap"] and not plain["layout"]["ep_overlap"]
    assert overlapped["step_time_s"] < plain["step_time_s"]


def test_a_search_where_nothing_fits_shows_the_layouts_closest_to_fitting(capsys):
    """When no layout fits, the rejections are what to act on, so they show without --verbose: the leanest
    first (it showed the first three tried, tp1 pp1, at 3093 GiB, while tp8 needed 854)."""
    rc, out = run(["--model", "llama3-405b", "--gpus", "8", "--offload", "none"], capsys)
    assert rc == 1 and "no layout fits" in out and "closest to fitting:" in out
    from fivefold.plan.layout import Workload
    from fivefold.plan.report import _needs
    from fivefold.plan.reserve import planned_limit
    from fivefold.plan.search import search
    from fivefold.plan.topology import TOPOLOGIES

    free = planned_limit(TOPOLOGIES["dgx-h100"].accelerator, Workload()) / 2**30   # 80 GiB less the reserve: 75.6
    shown = [float(g) for g in re.findall(rf"^  tp\d+ .*needs ([\d.]+) GiB > {free:.1f} GiB free$", out, re.M)]
    assert len(shown) == 3 and shown == sorted(shown), out

    res = search(PRESETS["llama3-405b"], Workload(seq=4096, global_batch=1024), TOPOLOGIES["dgx-h100"], 8,
                 {"offload": "none"}, top=10)
    needs = [n for n in (_needs(why) for _, why in res.rejected) if n is not None]   # some reject a whole structure
    assert shown[0] == min(needs) < 3093


def test_the_planners_own_order_is_no_warning(capsys):
    """Issue 26 item 5: the order nobody chose is the planner's default; it warned about it. The user's own
    order still gets the warning, as a --config's does (the runtime runs that order)."""
    argv = ["--model", "llama3-70b", "--tp", "8", "--pp", "8", "--dp", "8", "--zero", "1"]
    rc, out = run(argv, capsys)
    assert rc == 0 and "warning: order" not in out
    assert "rank order tp-cp-ep-dp-pp (innermost first): tp on nvlink, pp on spine, dp on leaf" in out
    rc, out = run(argv + ["--order", "tp-cp-ep-dp-pp"], capsys)
    assert "warning: order tp-cp-ep-dp-pp places groups on other tiers than the recommended tp-cp-ep-pp-dp" in out
    rc, out = run(argv + ["--json"], capsys)
    assert not [w for w in json.loads(out)["warnings"] if w.startswith("order ")]


def test_a_faster_order_is_named_with_its_step_time(tmp_path, capsys):
    """Where the recommended order beats the planner's default by more than a tie, the summary names the flag
    and the step time of that order's own estimate. Two GPUs a node and a 5 GB/s network: the default order
    puts pp's sends across it, the recommended one dp's reduction, which hides behind the backward."""
    f = tmp_path / "t.toml"
    f.write_text(TOPOLOGY.format(**dict(GOOD, size=2)).replace("bandwidth_gbps = 50", "bandwidth_gbps = 5"))
    argv = ["--model", "llama3-8b", "--tp", "1", "--pp", "2", "--dp", "2", "--zero", "1", "--topology", str(f)]
    _, out = run(argv, capsys)
    _, alt = run(argv + ["--order", "tp-cp-ep-pp-dp", "--json"], capsys)
    alt = json.loads(alt)["step_time_s"]
    first = out.splitlines()[:5]
    assert first[0].endswith("order tp-cp-ep-dp-pp") and f"step {alt:.3f} s" not in first[2]
    assert first[4].startswith(f"faster with --order tp-cp-ep-pp-dp: step {alt:.3f} s, MFU ")
    assert first[4].endswith("(pp on nvlink instead of net, dp on net instead of nvlink)")
    _, doc = run(argv + ["--json"], capsys)
    assert json.loads(doc)["faster_order"]["step_time_s"] == alt
    _, bigger = run(argv + ["--global-batch", "4096"], capsys)   # pp's share of the step shrinks: no gain
    assert "faster with" not in bigger


TOPOLOGY = """name = "t"
[accelerator]
name = "a"
memory_gib = {memory}
hbm_gbps = 3350
peak_tflops = {{ bf16 = {peak} }}
[[tier]]
name = "nvlink"
size = {size}
bandwidth_gbps = {bandwidth}
latency_us = {latency}
[[tier]]
name = "net"
bandwidth_gbps = 50
oversubscription = {over}
"""
GOOD = dict(memory=80, peak=989, size=8, bandwidth=450, latency=2, over=1)


@pytest.mark.parametrize("change,message", [
    (dict(bandwidth=0), r"tier 0 \(nvlink\) bandwidth_gbps must be a finite number > 0, got 0.0; valid: \(0, inf\)"),
    (dict(bandwidth=-450), r"tier 0 \(nvlink\) bandwidth_gbps must be a finite number > 0, got -450"),
    (dict(bandwidth="nan"), r"bandwidth_gbps must be a finite number > 0, got nan"),
    (dict(bandwidth="inf"), r"bandwidth_gbps must be a finite number > 0, got inf"),
    (dict(bandwidth='"fast"'), r"topology .*t\.toml: cannot read it \(TypeError"),
    (dict(latency=-1), r"tier 0 \(nvlink\) latency_us must be a finite number >= 0, got -1"),
    (dict(size=0), r"tier 0 \(nvlink\) size must be >= 1, got 0"),
    (dict(size=8.5), r"tier 0 \(nvlink\) size must be an integer, got 8.5"),
    (dict(over=0.5), r"tier 1 \(net\) oversubscription must be a finite number >= 1 \(1: non-blocking\)"),
    (dict(peak=0), r"accelerator peak_tflops.bf16 must be a finite number > 0, got 0"),
    (dict(memory=-80), r"accelerator memory_gib must be a finite number > 0"),
])
def test_topology_numbers_are_checked(change, message, tmp_path, capsys):
    f = tmp_path / "t.toml"
    f.write_text(TOPOLOGY.format(**dict(GOOD, **change)))
    assert re.search(message, one_line_error(["--gpus", "16", "--topology", str(f)], capsys))


def test_a_good_topology_file_plans_and_a_broken_one_is_one_line(tmp_path, capsys):
    f = tmp_path / "t.toml"
    f.write_text(TOPOLOGY.format(**GOOD))
    rc, out = run(["--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--topology", str(f), "--top", "1"],
                  capsys)
    assert rc == 0 and "nvlink" in out
    f.write_text("name = 't'\n[[tier]\n")
    assert "cannot read it (TOMLDecodeError" in one_line_error(["--gpus", "16", "--topology", str(f)], capsys)


# -- no torch: the plan CLI and its error handler run without it -------------------------------------------
NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch' (blocked by the test)")
        return None

sys.meta_path.insert(0, NoTorch())
for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
    del sys.modules[name]
from fivefold.cli import main
rc = main(sys.argv[1:])
assert "torch" not in sys.modules
sys.exit(rc)
"""


def plan_without_torch(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH, "plan", *argv], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.ranks
def test_plan_runs_without_torch_and_its_errors_do_not_mention_it(tmp_path_factory):
    good = plan_without_torch("--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "1")
    assert good.returncode == 0, good.stderr
    assert "best layout" in good.stdout
    bad = plan_without_torch("--model", "llama3-8b", "--gpus", "64", "--tp", "8", "--pp", "3", "--cp", "1")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()] and "must divide" in bad.stderr
    assert "torch" not in bad.stderr
    broken = tmp_path_factory.mktemp("toml") / "broken.toml"   # a path without the word in it
    broken.write_text("[[tier]\n")
    bad = plan_without_torch("--model", "llama3-8b", "--gpus", "16", "--topology", str(broken))
    assert bad.returncode == 2 and "cannot read it" in bad.stderr and "torch" not in bad.stderr


@pytest.mark.ranks
def test_a_reader_that_leaves_gets_no_traceback(tmp_path):
    """`fivefold plan ... | head`: the pipe's reader is gone before the plan is written (closed here before the
    child has imported anything); it was a BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, "-c", "import sys; from fivefold.cli import main; sys.exit(main())", "plan",
                          "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1 and err == "", err


def test_the_error_handler_tells_rank_failures_without_importing_them():
    from fivefold.process import is_rank_failure

    assert is_rank_failure(TimeoutError("rank 1 made no progress"))
    assert not is_rank_failure(ValueError("not a rank"))
    launch = pytest.importorskip("fivefold.train.launch")
    assert is_rank_failure(launch.RankError("rank 0 failed"))


@pytest.mark.parametrize("extra", [[], ["--gpus", "8"], ["--gpus", "8", "--search"]])
def test_a_given_schedule_and_vpp_follow_one_rule_with_or_without_a_search(extra, capsys):
    """vpp > 1 under --schedule 1f1b is refused alike whether the layout is given whole, completed from --gpus
    or searched (the search printed an interleaved layout, exit 0)."""
    line = one_line_error(["--pp", "2", "--vpp", "2", "--schedule", "1f1b", "--dp", "4", "--tp", "1", "--cp", "1",
                           *extra], capsys)
    assert "vpp > 1 needs the interleaved schedule" in line


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", None])
def test_the_search_keeps_the_schedule_given(schedule, capsys):
    rc, out = run(["--model", "llama3-70b", "--gpus", "64", "--top", "5", "--json",
                   *(["--schedule", schedule] if schedule else [])], capsys)
    ranked = json.loads(out)["search"]["ranked"]
    assert rc == 0 and ranked
    for row in ranked:
        lay = row["layout"]
        if schedule in ("1f1b", "gpipe"):
            assert lay["schedule"] == schedule and lay["vpp"] == 1, lay
        elif lay["pp"] > 1:
            assert (lay["schedule"] == "interleaved") == (schedule == "interleaved" or lay["vpp"] > 1), lay


def test_the_search_takes_any_vpp_the_rules_allow(capsys):
    """NVIDIA's recipes use vpp 5, 7 and 12 (a KeyError before: the search knew 1, 2, 4 and 8 only)."""
    rc, out = run(["--model", "llama3-70b", "--gpus", "64", "--pp", "4", "--vpp", "5", "--search", "--json"], capsys)
    best = json.loads(out)["search"]["ranked"][0]["layout"]
    assert rc == 0 and best["vpp"] == 5 and best["schedule"] == "interleaved"
