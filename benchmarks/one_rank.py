"""Benchmark: one rank of fivefold against the plain PyTorch + transformers loop it replaces (issue 36).

The same transformers-written Qwen2 (q/k/v biases, untied), the same batches, AdamW (decay on 2-D weights),
clipping 1.0, in fp32 and in bf16:
- `fivefold`: `Trainer` from `--init-hf`, full fine-tuning (bf16: train.dtype = bf16, bf16 weights and
  activations, fp32 master weights and gradients);
- `plain`: `AutoModelForCausalLM`, `torch.optim.AdamW`, `clip_grad_norm_` in a loop (bf16: the same fp32
  weights under `torch.autocast("cpu", torch.bfloat16)`, the usual mixed precision of such a loop).
Each in a fresh process (its own peak RSS, VmHWM), alternating rounds; printed: median step time after two
warm-up steps and peak RSS per implementation, the median over rounds, and ours / plain.

`--malloc` sets glibc's allocator the same way for both sides (fair): `glibc` as it comes (its dynamic mmap
threshold), `pinned` (MALLOC_MMAP_THRESHOLD_ = 2 MiB, what train/malloc.py sets in fivefold's ranks),
`high` (256 MiB), or `fivefold` (ours as `fivefold train` runs it: the Trainer fixes the threshold only
where the layout shards the model state, `rules.pins_mmap_threshold`, so not on one rank; the plain loop as
it comes).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/one_rank.py [--rounds 3] [--steps 8] [--dtype fp32 bf16]
        [--malloc glibc pinned high fivefold] [--profile]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import common  # puts src/ on the path

IMPLS = ("fivefold", "plain")
MALLOC_ENV = {"glibc": {}, "pinned": {"MALLOC_MMAP_THRESHOLD_": str(2 << 20)},
              "high": {"MALLOC_MMAP_THRESHOLD_": str(256 << 20)}, "fivefold": {}}

CHILD = r'''
import json, statistics, sys, time
sys.path.insert(0, sys.argv[4])
import torch
import torch.nn.functional as F
torch.set_num_threads(1)
impl, folder, steps, _, batch, seq, dtype, malloc, profile = sys.argv[1:10]
steps, batch, seq = int(steps), int(batch), int(seq)
gen = torch.Generator().manual_seed(0)
vocab = json.load(open(folder + "/config.json"))["vocab_size"]
rows = [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(steps)]
times = []
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile == "1" else None
if impl == "fivefold":
    from fivefold.config import Config, TrainConfig
    from fivefold.model.hf_weights import hf_config
    from fivefold.train.trainer import Trainer
    t = TrainConfig(steps=steps, global_batch=batch, seq_len=seq, lr=1e-4, min_lr=1e-5, warmup=1, checkpoint=False,
                    init_hf=folder, dtype=dtype, weight_decay=0.1, beta2=0.95)
    tr = Trainer(Config(model=hf_config(folder), train=t), quiet=True)
    def step(i):
        tr.step(i)
else:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    def step(i):
        x, y = rows[i][:, :-1], rows[i][:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
for i in range(steps):
    if prof is not None and i == steps - 2:
        prof.start()
    t0 = time.perf_counter(); step(i); times.append(time.perf_counter() - t0)
if prof is not None:
    prof.stop()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
print("RESULT " + json.dumps({"step_s": statistics.median(times[2:] or times), "rss_mb": peak}))
'''


def run(impl: str, folder: Path, a, dtype: str, malloc: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | MALLOC_ENV[malloc]
    result, err = common.run_child(CHILD, [impl, str(folder), str(a.steps), common.SRC, str(a.batch), str(a.seq),
                                           dtype, malloc, "1" if a.profile else "0"], impl, env)
    if a.profile:
        print(f"--- {impl} {dtype} {malloc}\n{err[-6000:]}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_qwen2_options(ap)
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--malloc", nargs="+", default=["fivefold", "glibc", "pinned"], choices=sorted(MALLOC_ENV))
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table of one step of each")
    a = common.parse_options(ap, **common.QWEN2_SMOKE, dtype=["bf16"], malloc=["fivefold"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="fivefold-one-rank-") as tmp:
        folder = Path(tmp) / "qwen2"
        common.make_qwen2(folder, a.hidden, a.layers, a.vocab)
        for dtype in a.dtype:
            for malloc in a.malloc:
                got: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
                for i in range(a.rounds):
                    for impl in (IMPLS if i % 2 == 0 else tuple(reversed(IMPLS))):
                        got[impl].append(run(impl, folder, a, dtype, malloc))
                        print(f"{dtype} {malloc} round {i + 1} {impl}: {got[impl][-1]['step_s'] * 1e3:.1f} ms, "
                              f"{got[impl][-1]['rss_mb']:.0f} MB", flush=True)
                med = {impl: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "rss_mb")}
                       for impl, rs in got.items()}
                spread = [r["step_s"] / p["step_s"] for r, p in zip(got["fivefold"], got["plain"])]
                rows.append((dtype, malloc, med, min(spread), max(spread)))
    print("\n| dtype | malloc | fivefold step | plain step | time ours / plain (rounds) | fivefold RSS | plain RSS "
          "| RSS ours / plain |\n|---|---|---|---|---|---|---|---|")
    for dtype, malloc, med, lo, hi in rows:
        f, p = med["fivefold"], med["plain"]
        print(f"| {dtype} | {malloc} | {f['step_s'] * 1e3:.1f} ms | {p['step_s'] * 1e3:.1f} ms | "
              f"{f['step_s'] / p['step_s']:.3f} ({lo:.3f}-{hi:.3f}) | {f['rss_mb']:.0f} MB | {p['rss_mb']:.0f} MB | "
              f"{f['rss_mb'] / p['rss_mb']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
