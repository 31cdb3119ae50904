"""`fivefold train --dry-run` runs the real Trainer at real size under fake tensors and a fake process
group: model-state bytes per rank equal the planner's exactly, every ledger row equals the planner's
per-rank prediction, and the activation, buffer and total peaks are within 10% of the planner's (the
README's "Will it fit?" has every figure). Layouts: Llama-3 8B on 8 ranks, tp8 and ZeRO-3 dp8 (also with
full recompute), and with LoRA on tp8 x ZeRO-3 dp2; Mixtral
8x7B ep8 x tp2 in capacity mode, and ep8 dropless (routed as balanced); DeepSeek-V3's pp16 x ep64, two
stages of 2,048 ranks (under GPipe: the same sequences in flight as 1F1B in fewer dispatches); Llama-3
405B's tp8 x pp16 x dp128 (1F1B) and dp64 (GPipe), one stage each, and tp8 x cp16 x pp16 at seq 131,072."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ranks


def dry(tmp_path, *args):
    out = tmp_path / "dry"
    r = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", "--dry-run", "--dtype", "bf16", "--out", str(out),
                        *args], capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return r, (json.loads((out / "dryrun.json").read_text()) if (out / "dryrun.json").is_file() else None)


CASES = {
    "llama3-8b-tp8": ["--model", "llama3-8b", "--tp", "8", "--seq-len", "2048", "--global-batch", "1", "--steps", "1"],
    # fp32 (the runner's --dtype bf16 overridden): the head's backward holds the logits' gradient beside the
    # table's, 0.40 GiB against the 0.28 planned before the head's edge counted it
    "llama3-8b-tp8-fp32": ["--model", "llama3-8b", "--tp", "8", "--seq-len", "2048", "--global-batch", "1", "--steps", "1",
                           "--dtype", "fp32"],
    "llama3-8b-zero3-dp8": ["--model", "llama3-8b", "--dp", "8", "--zero", "3", "--seq-len", "1024",
                            "--global-batch", "8", "--steps", "1"],
    # full recompute at pp = 1 (parallel/recompute.py): the blocks' inputs and the head's fp32 loss gradient
    "llama3-8b-zero3-dp8-full": ["--model", "llama3-8b", "--dp", "8", "--zero", "3", "--seq-len", "1024",
                                 "--global-batch", "8", "--steps", "1", "--recompute", "full"],
    # LoRA (model/lora.py): the adapters sharded by ZeRO-3 and the frozen base whole beside them
    "llama3-8b-lora-tp8-zero3-dp2": ["--model", "llama3-8b", "--tp", "8", "--dp", "2", "--zero", "3", "--lora-rank", "16",
                                     "--seq-len", "1024", "--global-batch", "2", "--steps", "1"],
    # capacity mode: every MoE layer's (E, B, C) buffers by shape (the planner's bucket count matched only
    # once it listed an MoE layer's tensors one by one: each is larger than a bucket at this size)
    "mixtral-8x7b-ep8-tp2": ["--model", "mixtral-8x7b", "--tp", "2", "--ep", "8", "--dp", "8", "--seq-len", "4096",
                             "--global-batch", "16", "--set", "model.capacity_factor=1.25", "--steps", "1"],
    # dropless: routed as perfectly balanced (the planner's assumption), through the counts exchange
    "mixtral-8x7b-ep8-dropless": ["--model", "mixtral-8x7b", "--ep", "8", "--dp", "8", "--seq-len", "1024",
                                  "--global-batch", "8", "--steps", "1"],
    # DeepSeek-V3's layout (pp16 x ep64 on 2048 ranks): the dense first stage and a MoE stage. GPipe's two
    # micro-batches of 8 hold the 16 sequences in flight that 1F1B's 16 of 1 hold on stage 0 (the same
    # peak and the same bytes on every dimension) in an eighth of the fake dispatches: 15 s, not 60
    "deepseek-v3-pp16-ep64": ["--model", "deepseek-v3", "--pp", "16", "--dp", "128", "--ep", "64", "--microbatches", "2",
                              "--schedule", "gpipe",
                              "--seq-len", "4096", "--global-batch", "2048", "--set", "model.capacity_factor=1.0",
                              "--ranks", "0,128", "--steps", "1"],
    # DeepSeek-V3 with tp > 1: tp2 x pp16 x dp64, its 256 experts over ep64 folded across tp2 x dp32 (capacity
    # mode: each tp rank routes its half of the sequences), a MoE stage
    "deepseek-v3-tp2-pp16-ep64": ["--model", "deepseek-v3", "--tp", "2", "--pp", "16", "--dp", "64", "--ep", "64",
                                  "--microbatches", "2", "--schedule", "gpipe", "--seq-len", "4096", "--global-batch",
                                  "2048", "--set", "model.capacity_factor=1.0", "--ranks", "128", "--steps", "1"],
    # Qwen3-235B-A22B folded as Megatron-LM's example runs it on 256 GPUs (TP2 PP8 EP32: ep over tp2 x dp16;
    # its vpp 4 aside): q/k norms, 128-wide heads, 128 experts top-8; the first and the last stage
    "qwen3-235b-tp2-pp8-ep32": ["--model", "qwen3-235b-a22b", "--tp", "2", "--pp", "8", "--dp", "16", "--ep", "32",
                                "--sp-mode", "megatron", "--microbatches", "2", "--schedule", "gpipe", "--seq-len",
                                "4096", "--global-batch", "32", "--ranks", "0,255", "--steps", "1"],
    # long context: 131,072-token sequences under cp16 (ring attention), stage 0 of 16,384 ranks; one
    # micro-batch of both sequences under GPipe keeps it to 20 s (the published 16 under 1F1B run in benchmarks/)
    "llama3-405b-tp8-cp16-pp16": ["--model", "llama3-405b", "--tp", "8", "--cp", "16", "--pp", "16", "--dp", "8",
                                  "--microbatches", "1", "--schedule", "gpipe", "--seq-len", "131072",
                                  "--global-batch", "16", "--set", "model.max_seq=131072", "--ranks", "0",
                                  "--steps", "1"],
    # dp64 under GPipe (two micro-batches of 8), dp128 under the published 1F1B (16 of 1)
    "llama3-405b-tp8-pp16-dp64": ["--model", "llama3-405b", "--tp", "8", "--pp", "16", "--dp", "64",
                                  "--microbatches", "2", "--schedule", "gpipe", "--seq-len", "8192", "--global-batch", "1024",
                                  "--ranks", "0", "--steps", "1"],
    "llama3-405b-tp8-pp16-dp128": ["--model", "llama3-405b", "--tp", "8", "--pp", "16", "--dp", "128",
                                   "--microbatches", "16", "--seq-len", "8192", "--global-batch", "2048",
                                   "--ranks", "0", "--steps", "1"],
}


# Llama-3 405B's and Mixtral's cases are xdist groups of their own (conftest.py), so that pytest-xdist runs
# the three parts side by side instead of one worker running all of them at the suite's end.
GROUPS = {"llama3-405b": "405b", "mixtral": "moe"}


def case_id(name: str) -> str:
    group = next((g for prefix, g in GROUPS.items() if name.startswith(prefix)), None)
    return f"{name}@{group}" if group else name


@pytest.mark.parametrize("case", [pytest.param(name, id=case_id(name)) for name in CASES])
def test_model_state_and_ledger_equal_the_planner(tmp_path, case):
    check_case(tmp_path, case)


def check_case(tmp_path, case):
    r, report = dry(tmp_path, *CASES[case])
    assert r.returncode == 0, r.stderr[-3000:]
    assert report["ledger_equals_plan"], json.dumps(report["ledger_by_rank"])[:3000]
    for rank in report["ranks"]:
        for kind in ("weights", "grads", "optimizer"):
            assert rank["measured"][kind] == rank["planned"][kind], (case, rank["rank"], kind)
        for kind in ("activations", "buffers", "total"):   # the peaks: within 10% of the plan (README table)
            measured, planned = rank["measured"][kind], rank["planned"][kind]
            assert abs(measured / planned - 1) <= 0.10, (case, rank["rank"], kind, measured, planned)


def test_a_layout_that_does_not_fit_is_refused_naming_the_rank(tmp_path):
    """Llama-3 8B on one rank: 8.0B x (2 + 4 + 4 + 8) bytes of bf16 weights, fp32 masters, gradients and
    Adam = 134 GiB of model state, which the planner (exact for it) says before anything is built."""
    r, _ = dry(tmp_path, "--model", "llama3-8b", "--seq-len", "512", "--global-batch", "1", "--steps", "1",
               "--device-memory", "80")
    assert r.returncode == 1, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "rank 0 (pipeline stage 0) holds 134.6 GiB of model state" in line and "--device-memory 80 GiB" in line


@pytest.mark.parametrize("args, words", [
    (["--model", "nowhere-7b"], "nowhere-7b"),
    (["--model", "llama3-8b", "--init-hf", "/nonexistent"], "--init-hf"),
    (["--ranks", "x"], "--ranks takes stages, all or a list"),
    (["--tp", "3"], "tp"),
    # absurd sizes: refused from the estimate of the dry run's own cost (dryrun.dry_run_cost), not left to run
    # for hours: 65,536 layers (9,209 s estimated), hidden 1M (36T parameters in 4 layers: 86,514 s)
    (["--set", "model.layers=65536"], "is estimated at 9,209 s here (> --max-seconds 1800: 65,536 layers"),
    (["--set", "model.hidden=1048576", "--set", "model.heads=64", "--set", "model.kv_heads=8", "--set",
      "model.ffn=2097152"], "(> --max-seconds 1800: 4 layers, 36,284,161,589,248 parameters)"),
    (["--max-seconds", "0"], "--max-seconds must be a"),
])
def test_bad_input_is_one_line_before_anything_runs(tmp_path, args, words):
    r, _ = dry(tmp_path, *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr
