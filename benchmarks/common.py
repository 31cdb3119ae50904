"""Shared benchmark helpers: run a step function on ranks, median step time, peak RSS per rank."""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fivefold.config import ModelConfig  # noqa: E402

BENCH_MODEL = ModelConfig(vocab=256, hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, max_seq=256)
SRC = str(Path(__file__).resolve().parents[1] / "src")


# ---- one-process races against transformers (lora.py, one_rank.py) --------------------------------------

def add_qwen2_options(ap) -> None:
    """Rounds, steps and the size of the Qwen2 that `make_qwen2` writes, with the full run's defaults."""
    for name, default in (("rounds", 3), ("steps", 8), ("hidden", 256), ("layers", 4), ("vocab", 8192),
                          ("batch", 8), ("seq", 256)):
        ap.add_argument(f"--{name}", type=int, default=default)


QWEN2_SMOKE = dict(rounds=1, steps=3, hidden=64, layers=2, vocab=256, batch=2, seq=32)


def make_qwen2(folder: Path, hidden: int, layers: int, vocab: int) -> None:
    """A transformers-written Qwen2 (q/k/v biases, untied, 8 heads / 4 KV heads) saved to `folder`."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=4, intermediate_size=hidden * 11 // 4,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder)


def run_child(code: str, argv: list[str], what: str, env: dict | None = None) -> tuple[dict, str]:
    """Run `code` in a fresh interpreter (one intra-op thread) with `argv`; (the JSON of its `RESULT ` line,
    its stderr). No such line: RuntimeError naming `what` with the end of its stderr."""
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=1800, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{what} failed:\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):]), r.stderr


def parse_options(ap, argv=None, **smoke):
    """`ap`'s options plus --smoke. With --smoke the values in `smoke` replace the options: one timed step of
    one round at the smallest sizes that still run every implementation once, so tests/ranks/test_benchmarks.py
    runs each script in seconds; a script then treats any implementation's failure as an error (its
    `keep_going` is off) instead of reporting it and going on."""
    ap.add_argument("--smoke", action="store_true",
                    help="one step of one round at a tiny size; any failure is an error (tests/ranks/test_benchmarks.py)")
    a = ap.parse_args(argv)
    if a.smoke:
        vars(a).update(smoke)
    return a


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_steps(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def summarize(name: str, per_rank: list[dict]) -> dict:
    """Median step time over ranks' medians (the slowest rank sets the pace) and max peak RSS."""
    med = max(statistics.median(r["times"]) for r in per_rank)
    rss = max(r["rss_mb"] for r in per_rank)
    return {"name": name, "median_s": med, "peak_rss_mb": rss}


def report(rows: list[dict], baseline: str) -> str:
    base = next(r for r in rows if r["name"] == baseline)
    lines = [f"{'impl':<28}{'median step':>14}{'peak RSS':>12}{'time ratio':>12}{'mem ratio':>11}"]
    for r in rows:
        lines.append(f"{r['name']:<28}{r['median_s'] * 1e3:>11.1f} ms{r['peak_rss_mb']:>9.0f} MB"
                     f"{r['median_s'] / base['median_s']:>12.3f}{r['peak_rss_mb'] / base['peak_rss_mb']:>11.3f}")
    return "\n".join(lines)


def best_of_rounds(bench_rank, nproc: int, impls: list[tuple[str, str]], args_of, rounds: int,
                   keep_going: bool = False, worst: tuple[str, ...] = ()) -> dict[str, dict]:
    """Alternate the implementations `rounds` times in fresh processes; keep each one's fastest round
    (the machine is noisy). `args_of(impl)` gives bench_rank's arguments after (rank, world). A row also
    carries rank 0's other results (first loss, bytes, activation peak: they do not depend on the
    round), the maximum over ranks of the keys in `worst`, and every round's median ("rounds"). With
    keep_going, an implementation that cannot run here is reported and skipped."""
    from fivefold.train.launch import run_ranks

    best: dict[str, dict] = {}
    for _ in range(rounds):
        for impl, name in impls:
            try:
                per_rank = run_ranks(bench_rank, nproc, args_of(impl), timeout_s=900)
            except Exception as e:  # noqa: BLE001
                if not keep_going:
                    raise
                print(f"{name}: failed: {str(e).strip().splitlines()[-1]}")
                continue
            row = summarize(name, per_rank)
            row.update({k: v for k, v in per_rank[0].items() if k not in ("times", "rss_mb")})
            row.update({k: max(r[k] for r in per_rank) for k in worst})
            row["rounds"] = best.get(name, {}).get("rounds", []) + [row["median_s"]]
            if name not in best or row["median_s"] < best[name]["median_s"]:
                best[name] = row
            else:
                best[name]["rounds"] = row["rounds"]
    return best


def sum_grads(params: list, reduce_grads) -> None:
    """Sum `params`' gradients across ranks with one flat collective (`reduce_grads(flat)`, in place)."""
    import torch

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    reduce_grads(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


class AllToAllCount:
    """Counts the bytes a peer's all-to-alls send (the chunk a rank keeps excluded), for a peer whose
    collectives do not go through our ledger: wraps torch.distributed.all_to_all_single between start
    and stop; stop returns {dim: bytes}."""

    def __init__(self, dim: str):
        self.dim = dim

    def start(self) -> None:
        import torch.distributed as tdist

        self.sent, self.real = 0.0, tdist.all_to_all_single

        def counting(output, input, *args, **kwargs):
            n = tdist.get_world_size(kwargs.get("group"))
            self.sent += input.numel() * input.element_size() * (n - 1) / n
            return self.real(output, input, *args, **kwargs)
        tdist.all_to_all_single = counting

    def stop(self) -> dict:
        import torch.distributed as tdist

        tdist.all_to_all_single = self.real
        return {self.dim: self.sent}


class LedgerCount:
    """Bytes this rank sent between start and stop, by ledger dimension (our side of a race: every
    collective of ours goes through the ledger)."""

    def __init__(self, ledger):
        self.ledger = ledger

    def start(self) -> None:
        self.snap = self.ledger.snapshot()

    def stop(self) -> dict:
        new = self.ledger.since(self.snap)
        return {d: new.total(d) for d in sorted({r["dim"] for r in new.rows()})}


def measured_first_step(step, counter) -> dict:
    """Run the first step while counting what autograd saves (activation peak) and what `counter`
    (AllToAllCount, or our ledger's) sends; the loss is summed over the ranks (each holds its share of
    the global mean). Returns first_loss, sent and act_peak."""
    import torch.distributed as tdist

    from fivefold.train.activations import ActivationMeter

    meter = ActivationMeter()
    counter.start()
    with meter:
        first = step()
    sent = counter.stop()
    tdist.all_reduce(first)
    return {"first_loss": float(first), "sent": sent, "act_peak": meter.peak}


def deepspeed_step(model, zero: dict, x, y, n_tokens: int, torch_adam: bool = True):
    """A DeepSpeed engine step (forward, backward, optimizer) for `model` with the `zero_optimization`
    section `zero`, AdamW lr 1e-4 / weight decay 0.1 (torch's, or DeepSpeed's CPU Adam with
    torch_adam=False), inside this already-initialised gloo process group (CPU accelerator)."""
    import os

    import torch.distributed as dist

    # DeepSpeed reads its launcher's variables; this process group is already up (gloo)
    os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()), LOCAL_SIZE=str(dist.get_world_size()))
    import deepspeed

    from fivefold.model import loss_sum

    cfg = {"train_micro_batch_size_per_gpu": x.shape[0], "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": torch_adam}},
           "zero_optimization": zero, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      dist_init_required=False)

    def step():
        loss = loss_sum(engine(x), y) / n_tokens
        engine.backward(loss)
        engine.step()
    return step
