"""Property fuzzing of what starts ranks: whole configs through `fivefold train`, and `train --dry-run` of any
size (tests/unit/test_fuzz_inputs.py fuzzes the inputs read without starting any). The property: it trains
(or finishes its dry run), or refuses in one line, and writes nothing outside its --out.

The suite runs a fixed, derandomized profile; `make fuzz` runs a long random one (FIVEFOLD_FUZZ_EXAMPLES,
hypothesis's example database under .hypothesis/ keeps what fails)."""
import json
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.ranks     # each accepted example trains on its own ranks

LONG = int(os.environ.get("FIVEFOLD_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=LONG or 30, deadline=None, derandomize=not LONG,
                database=None if not LONG else settings.default.database,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


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
