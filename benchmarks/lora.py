"""Benchmark: LoRA against full fine-tuning, and both against transformers (+ PEFT), on one rank.

The same transformers-written Qwen2 (hidden 256, 4 layers, vocab 8192, q/k/v biases), the same 8 x 256-token
batches, fp32, AdamW, clipping 1.0. Four implementations, each in a fresh process (its own peak RSS),
in alternating rounds:
- `fivefold-full`: `Trainer` from `--init-hf`, every parameter trained;
- `fivefold-lora`: the same with train.lora_rank = 16 on every linear layer of each block (alpha 32);
- `hf-full`: transformers' model and torch.optim.AdamW in a plain loop;
- `peft-lora`: transformers + peft.get_peft_model(LoraConfig(r=16, alpha 32, the same targets)).
Printed: the median step seconds (steps after the warm-up) and peak RSS of each, the median of the rounds,
and the ratios LoRA / full (ours and theirs) and ours / theirs. Every process runs glibc's malloc as it
comes (fivefold's launcher pins the mmap threshold, train/malloc.py; here neither side does: fair).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora.py [--rounds 3] [--steps 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import common  # puts src/ on the path

RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IMPLS = ("fivefold-full", "fivefold-lora", "hf-full", "peft-lora")

CHILD = r'''
import json, resource, statistics, sys, time
sys.path.insert(0, sys.argv[4])
import torch
import torch.nn.functional as F
torch.set_num_threads(1)
impl, folder, steps, _, batch, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
RANK, ALPHA, TARGETS = %(rank)d, %(alpha)r, %(targets)r
gen = torch.Generator().manual_seed(0)
vocab = json.load(open(folder + "/config.json"))["vocab_size"]
rows = [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(steps)]
times = []
if impl.startswith("fivefold"):
    from fivefold.config import Config, TrainConfig
    from fivefold.model.hf_weights import hf_config
    from fivefold.train.trainer import Trainer
    t = TrainConfig(steps=steps, global_batch=batch, seq_len=seq, lr=1e-4, min_lr=1e-5, warmup=1, checkpoint=False,
                    init_hf=folder, lora_rank=RANK if impl.endswith("lora") else 0, lora_alpha=ALPHA,
                    lora_targets=TARGETS)
    tr = Trainer(Config(model=hf_config(folder), train=t), quiet=True)
    for i in range(steps):
        t0 = time.perf_counter(); tr.step(i); times.append(time.perf_counter() - t0)
else:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if impl == "peft-lora":
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                           target_modules=TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    for i in range(steps):
        t0 = time.perf_counter()
        x, y = rows[i][:, :-1], rows[i][:, 1:]
        loss = F.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
print("RESULT " + json.dumps({"step_s": statistics.median(times[2:] or times), "rss_mb": peak,
                              "trained": sum(p.numel() for p in (tr.model.parameters() if impl.startswith("fivefold")
                                                                  else params) if p.requires_grad)}))
'''


def run(impl: str, folder: Path, steps: int, batch: int, seq: int) -> dict:
    code = CHILD % {"rank": RANK, "alpha": ALPHA, "targets": TARGETS}
    return common.run_child(code, [impl, str(folder), str(steps), common.SRC, str(batch), str(seq)], impl)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_qwen2_options(ap)
    a = common.parse_options(ap, **common.QWEN2_SMOKE)
    with tempfile.TemporaryDirectory(prefix="fivefold-lora-") as tmp:
        folder = Path(tmp) / "qwen2"
        common.make_qwen2(folder, a.hidden, a.layers, a.vocab)
        got: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
        for i in range(a.rounds):
            for impl in (IMPLS if i % 2 == 0 else tuple(reversed(IMPLS))):
                got[impl].append(run(impl, folder, a.steps, a.batch, a.seq))
                print(f"round {i + 1} {impl}: {got[impl][-1]['step_s'] * 1e3:.1f} ms, "
                      f"{got[impl][-1]['rss_mb']:.0f} MB", flush=True)
    med = {impl: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "rss_mb")} | {"trained": rs[0]["trained"]}
           for impl, rs in got.items()}
    print("\n| impl | trained params | step | peak RSS |\n|---|---|---|---|")
    for impl, m in med.items():
        print(f"| {impl} | {m['trained']:,} | {m['step_s'] * 1e3:.1f} ms | {m['rss_mb']:.0f} MB |")
    ratio = lambda a_, b_, k: med[a_][k] / med[b_][k]   # noqa: E731
    print(f"\nLoRA / full: ours {ratio('fivefold-lora', 'fivefold-full', 'step_s'):.3f} time, "
          f"{ratio('fivefold-lora', 'fivefold-full', 'rss_mb'):.3f} RSS; transformers + PEFT "
          f"{ratio('peft-lora', 'hf-full', 'step_s'):.3f} time, {ratio('peft-lora', 'hf-full', 'rss_mb'):.3f} RSS")
    print(f"ours / theirs: LoRA {ratio('fivefold-lora', 'peft-lora', 'step_s'):.3f} time, "
          f"{ratio('fivefold-lora', 'peft-lora', 'rss_mb'):.3f} RSS; full {ratio('fivefold-full', 'hf-full', 'step_s'):.3f} "
          f"time, {ratio('fivefold-full', 'hf-full', 'rss_mb'):.3f} RSS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
