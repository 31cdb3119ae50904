"""`fivefold report` draws runs (PNG and SVG), overlaid, with a summary; `train.tensorboard` writes the same
scalars as metrics.jsonl; a missing package or run folder is a one-line error before anything runs."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

TINY = ["--set", "model.hidden=64", "--set", "model.layers=2", "--set", "model.ffn=128",
        "--set", "model.max_seq=64", "--seq-len", "32", "--global-batch", "8", "--steps", "3",
        "--set", "train.data_limit_mb=0.25", "--set", "train.warmup=1", "--set", "train.checkpoint=false"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fivefold(*args, blocked: str | None = None, timeout=180):
    """The CLI in a fresh process; `blocked` names a package made unimportable there."""
    block = f"sys.modules[{blocked!r}] = None; " if blocked else ""
    code = f"import sys; {block}from fivefold.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_png(path):
    assert path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC, path


def assert_svg(path):
    assert path.stat().st_size > 1000 and ET.parse(path).getroot().tag.endswith("svg"), path


@pytest.mark.ranks
def test_report_overlays_a_dp_and_a_pp_run_and_tensorboard_holds_every_loss(tmp_path):
    dp, pp = tmp_path / "dp2", tmp_path / "pp2"
    r = fivefold("train", "--nproc", "2", *TINY, "--set", "train.tensorboard=true", "--out", str(dp))
    assert r.returncode == 0, r.stderr
    r = fivefold("train", "--nproc", "2", "--pp", "2", "--microbatches", "2", *TINY, "--out", str(pp))
    assert r.returncode == 0, r.stderr
    assert not (pp / "tensorboard").exists()

    r = fivefold("report", str(dp), str(pp))
    assert r.returncode == 0, r.stderr
    png = {p.name for p in (dp / "report").iterdir()}
    assert png == {"metrics.png", "comm.png", "pipeline-pp2.png"}
    for name in png:
        assert_png(dp / "report" / name)
        assert f"wrote {dp / 'report' / name}" in r.stdout
    table = r.stdout.splitlines()
    assert table[0].split()[:2] == ["run", "layout"] and "sent dp" in table[0] and "sent pp" in table[0]
    assert table[1].startswith("dp2  dp2 tp1 pp1") and table[2].startswith("pp2  dp1 tp1 pp2")
    assert f"{losses(dp)[-1]:.4f}" in table[1]

    svg = tmp_path / "svg"
    r = fivefold("report", str(dp), str(pp), "--format", "svg", "--out", str(svg))
    assert r.returncode == 0, r.stderr
    assert {p.name for p in svg.iterdir()} == {"metrics.svg", "comm.svg", "pipeline-pp2.svg"}
    for path in svg.iterdir():
        assert_svg(path)
    assert "dp2 (dp2 tp1 pp1)" in (svg / "metrics.svg").read_text()   # the legend names each run

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dp / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "grad_norm", "lr", "tokens_per_s", "peak_memory_gib", "tflops"}
    logged = events.Scalars("loss")
    assert [e.step for e in logged] == [1, 2, 3]
    assert [e.value for e in logged] == pytest.approx(losses(dp), rel=1e-6)   # TensorBoard keeps float32


@pytest.mark.ranks
def test_report_errors_are_one_line_exit_2(tmp_path):
    r = fivefold("report", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such run folder" in r.stderr
    (tmp_path / "empty").mkdir()
    r = fivefold("report", str(tmp_path / "empty"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no metrics" in r.stderr
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0, "grad_norm": 1.0, "lr": 0.1, '
                                                     '"tokens": 8, "seconds": 0.5}\n')
    r = fivefold("report", str(tmp_path / "run"), blocked="matplotlib")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "pip install -e '.[plot]' from the fivefold checkout" in r.stderr
    assert not (tmp_path / "run" / "report").exists()


@pytest.mark.ranks
def test_tensorboard_without_the_package_fails_before_any_rank(tmp_path):
    r = fivefold("train", "--nproc", "2", *TINY, "--set", "train.tensorboard=true", "--out", str(tmp_path / "o"),
                 blocked="tensorboard")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "pip install -e '.[tensorboard]' from the fivefold checkout" in r.stderr
    assert not (tmp_path / "o").exists()
