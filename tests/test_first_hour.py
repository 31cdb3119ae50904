"""First-hour fixes: tokenize makes its folder, the banner says tokens to train, outputs follow the
umask, export FILE says what it wrote, the README's output paths are git-ignored."""
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from fivefold.train.tokenize import tokenize

from .test_train_cli import fivefold

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--set", "model.hidden=32", "--set", "model.layers=2", "--set", "model.ffn=64", "--set", "model.max_seq=32",
        "--seq-len", "16", "--global-batch", "4", "--set", "train.data_limit_mb=0.05", "--set", "train.warmup=1"]


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
    ranks = list((run / "checkpoints").glob("step-*/rank-*.safetensors"))
    assert ranks and all(stat.S_IMODE(p.stat().st_mode) == 0o640 for p in ranks)   # 0666 & ~umask, not 0600
    e = fivefold("export", str(run), str(file))
    assert e.returncode == 0, e.stderr
    assert re.search(r"wrote .*m\.safetensors: \d+ tensors, [\d,]+ parameters \(F32, hidden 32, 2 layers, vocab 256\) "
                     r"of step 3, [\d,]+ bytes", e.stdout), e.stdout


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_readme_output_paths_are_ignored():
    readme = (ROOT / "README.md").read_text()
    paths = set(re.findall(r"--out ((?:data|runs|hf-)[\w./-]*)", readme)) | set(re.findall(r"--hf (hf-[\w-]+)", readme))
    paths |= set(re.findall(r"export runs/\w+ ([\w-]+\.safetensors)", readme))
    assert {"data/train.bin", "hf-mine", "model.safetensors"} <= paths
    for p in sorted(paths):
        probe = p + ("/config.json" if p.startswith("hf-") else "")
        assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT).returncode == 0, f"{p} is not git-ignored"
