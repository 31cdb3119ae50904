"""First-hour fixes: tokenize makes its folder, the banner says tokens to train, outputs follow the
umask, export FILE says what it wrote, the README's output paths are git-ignored, one step convention,
the run's config.toml reruns it, install hints name the checkout's extras."""
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from fivefold.train.tokenize import tokenize

from tests.support.cli import fivefold
from tests.support.paths import ROOT

TINY = ["--set", "model.hidden=32", "--set", "model.layers=2", "--set", "model.ffn=64", "--set", "model.max_seq=32",
        "--seq-len", "16", "--global-batch", "4", "--set", "train.data_limit_mb=0.05", "--set", "train.warmup=1"]


def losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_tokenize_makes_the_out_folder(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some text to tokenize. " * 20)
    out = tmp_path / "data" / "deeper" / "x.bin"
    tokenize([text], None, out, progress=False)
    assert out.is_file()


@pytest.mark.ranks
def test_banner_outputs_and_export(tmp_path):
    run, file = tmp_path / "run", tmp_path / "exports" / "m.safetensors"
    old = os.umask(0o027)
    try:
        r = fivefold("train", *TINY, "--steps", "3", "--out", str(run))
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr
    assert "192 tokens to train (3 steps x 4 x 16; the data holds" in r.stderr   # not the data's size alone
    # one step convention: step N is the N-th step (1-based) in the banner, the console, metrics.jsonl and
    # checkpoints/step-N
    assert "steps 1..3 ->" in r.stderr and re.search(r"^step +3/3 ", r.stderr, re.M)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000003"]
    ranks = list((run / "checkpoints").glob("step-*/rank-*.safetensors"))
    assert ranks and all(stat.S_IMODE(p.stat().st_mode) == 0o640 for p in ranks)   # 0666 & ~umask, not 0600
    # the run folder keeps its resolved config, and --config reruns it (a run.json is one line naming it)
    again = fivefold("train", "--config", str(run / "config.toml"), "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    assert losses(tmp_path / "again") == losses(run)
    wrong = fivefold("train", "--config", str(run / "run.json"))
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and f"--config {run / 'config.toml'}" in wrong.stderr
    e = fivefold("export", str(run), str(file))
    assert e.returncode == 0, e.stderr
    assert re.search(r"wrote .*m\.safetensors: \d+ tensors, [\d,]+ parameters \(F32, hidden 32, 2 layers, vocab 256\) "
                     r"of step 3, [\d,]+ bytes", e.stdout), e.stdout


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_readme_output_paths_are_ignored():
    """The paths the README and docs/ write into are git-ignored."""
    readme = "\n".join(p.read_text() for p in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))))
    paths = set(re.findall(r"--out ((?:data|runs|hf-)[\w./-]*)", readme)) | set(re.findall(r"--hf (hf-[\w-]+)", readme))
    paths |= set(re.findall(r"export runs/\w+ ([\w-]+\.safetensors)", readme))
    assert {"data/train.bin", "hf-mine", "model.safetensors"} <= paths
    for p in sorted(paths):
        probe = p + ("/config.json" if p.startswith("hf-") else "")
        assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT).returncode == 0, f"{p} is not git-ignored"


def test_install_hints_name_the_checkout_extra():
    """fivefold is not on a package index: every install hint, in the code and the README, is
    `pip install -e '.[extra]'` (from the checkout), never `pip install fivefold[extra]`."""
    bad = re.compile(r"pip install(?! -e '\.\[)")
    files = [*sorted((ROOT / "src" / "fivefold").rglob("*.py")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
             if bad.search(line)]
    assert not found, found
    from fivefold.rules import install_hint

    assert install_hint("wandb") == "pip install -e '.[wandb]' from the fivefold checkout"


def plan_text(*argv: str) -> str:
    from fivefold.cli import main

    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *argv]) == 0
    return out.getvalue()


def test_default_order_is_no_planner_warning():
    """The default order (Megatron-Core's tp-cp-ep-dp-pp) differs from the planner's recommendation only
    in dp vs pp; where that moves no group to another tier the planner no longer warns, and an order that
    does move one (tp across nodes) still is a warning naming the group and the tiers."""
    layout = ["--model", "llama3-8b", "--gpus", "32", "--tp", "8", "--pp", "2", "--cp", "1", "--seq", "2048",
              "--global-batch", "64"]
    assert "places groups on other tiers" not in plan_text(*layout)
    bad = plan_text(*layout, "--order", "dp-tp-cp-ep-pp")
    assert "places groups on other tiers" in bad and "tp on leaf instead of nvlink" in bad


def test_offload_on_a_cpu_device_is_no_pcie_traffic(tmp_path):
    """A calibrated CPU topology (no pcie_gbps: host = device) names offload's copies what they are, in
    the plan, the train console's ledger table and the report; a GPU's plan still says PCIe."""
    from fivefold.comm.ledger import CommLedger
    from fivefold.tools.report import Run, summary

    cpu = tmp_path / "cpu.toml"
    cpu.write_text('[accelerator]\nname = "cpu"\nmemory_gib = 64\npeak_tflops = { fp32 = 0.1 }\n'
                   '[[tier]]\nname = "intra"\nbandwidth_gbps = 2\n')
    layout = ["--model", "llama3-8b", "--gpus", "8", "--tp", "1", "--pp", "1", "--cp", "1", "--zero", "1",
              "--offload", "cpu", "--seq", "1024", "--global-batch", "8", "--dtype", "fp32"]
    assert "copied within host memory" in plan_text(*layout, "--topology", str(cpu))
    assert "over PCIe" in plan_text(*layout)
    led = CommLedger(0, 1)
    led.record("offload", "d2h", 1024, 1024, 0.0)
    assert "same memory" in led.table(host_is_device=True) and "same memory" not in led.table()
    rows = [{"dim": "offload", "op": "d2h", "tier": "pcie", "calls": 1, "message_bytes": 1024, "bytes_sent": 1024,
             "seconds": 0.0}]
    metrics = [{"step": 1, "loss": 1.0, "tokens": 8, "seconds": 1.0}]
    run = Run(tmp_path, "r", "dp1 tp1 pp1", metrics, rows, None, rows, "cpu")
    assert "not PCIe traffic" in summary([run])
