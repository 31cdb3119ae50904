"""Benchmark: a ~1B-parameter Llama on one CUDA GPU through fivefold's own `Trainer` — tokens/s, MFU and
peak memory against the planner — then a small model's losses on CUDA against the CPU.

One command, one GPU (an H100/H200-class device; under 8 minutes there):

    python benchmarks/gpu.py [--quick] [--out runs/gpu.json] [--seq 2048] [--micro-batch-size 0] [--steps 30]
                             [--accum 2] [--no-compile] [--peak-tflops T]

1. Model: Llama-style, hidden 2048, 16 layers, 16 heads / 8 KV heads (head dim 128), SwiGLU ffn 8192,
   vocab 32000, tied embeddings: 1.07 B parameters (printed). bf16 compute with fp32 master weights and
   fp32 main gradients (train.dtype = "bf16", main_grads_fp32), AdamW over foreach kernels, SDPA causal
   attention (flash on bf16; the script checks that the flash kernel accepts these shapes), each block
   compiled with torch.compile (train.compile; `--no-compile` to measure eager). Single process,
   train.device = "cuda", dp = 1 (DataParallelOptimizer with a group of one: no communication).
   `--quick`: hidden 1024, 8 layers, seq 1024, 10 steps: a smoke run of the same path.
2. Micro-batch: the largest power of two whose planned memory (`fivefold.plan.memory.memory` for this
   layout, flash attention: tools/run_plan.py planned_memory) fits in 85% of the GPU's memory; if a step still runs out
   of memory the trainer is rebuilt with half the micro-batch. `--micro-batch-size N` fixes it. Each optimizer
   step runs `--accum` micro-batches (gradient accumulation) on random tokens.
3. Measured over `--steps` steps after 3 warm-up steps (compilation, allocator): median step seconds,
   tokens/s = tokens per step / median, and
       MFU = PlanModel.flops_per_token(seq) x tokens/s / peak bf16 dense FLOP/s
   with the planner's FLOPs formula (plan/models.py: 6·N_matmul + 3·attention, causal; the embedding
   lookup is free, the head is not) and the peak from plan/topology.py ACCELERATORS (h100, h200: 989
   TFLOP/s bf16 dense; a100: 312), chosen by the device name (`--peak-tflops` for other GPUs). Goal: MFU
   >= 45%. Peak memory: torch.cuda.max_memory_allocated against the planner's total for the layout (goal:
   within 10%). What the planner's device reserve (plan/reserve.py) rests on: the CUDA context and kernels
   (device memory in use less the allocator's reserve after a first tensor and a cuBLAS GEMM) and the
   allocator's slack (peak reserved over peak allocated), with `--allocator expandable` (the default here,
   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or `default` (PyTorch's plain caching allocator).
4. Check: a small model (hidden 256, 4 layers, vocab 256, seq 128, the embedded corpus) trains 5 steps
   on the CPU in fp32 (the reference), then on CUDA in fp32 (losses within rtol 1e-3), in bf16 and in
   bf16 with compiled blocks (within rtol 2e-2, bf16's tolerance); and ZeRO-2 with the optimizer state on
   the host and gradients streamed there during the backward (offload = "cpu": the CUDA side-stream
   path) against ZeRO-1 with the state on the host (gradients copied at the step), equal exactly. A miss
   exits with status 1.

Without a CUDA device it prints one line and exits with status 2 (with `--smoke`, tests/ranks/test_benchmarks.py:
it plans the `--quick` micro-batch and exits 0; on CUDA `--smoke` is `--quick` for one eager step without
the loss check). Results go to `--out` as JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import common  # puts src/ on the path
from fivefold.plan.reserve import CUDA_CONTEXT_BYTES as CONTEXT_PLANNED

BIG = dict(vocab=32000, hidden=2048, layers=16, heads=16, kv_heads=8, ffn=8192)
QUICK = dict(vocab=32000, hidden=1024, layers=8, heads=8, kv_heads=4, ffn=4096)
SMALL = dict(vocab=256, hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, max_seq=256)
WARMUP = 3
MEMORY_SHARE = 0.85        # the planned total must fit in this share of the GPU's memory
CHECK_STEPS = 5
RTOL_FP32, RTOL_BF16 = 1e-3, 2e-2


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, shorter sequences, 10 steps")
    ap.add_argument("--out", default="runs/gpu.json", help="results as JSON")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default 2048; --quick 1024)")
    ap.add_argument("--micro-batch-size", dest="micro_batch", type=int, default=0, help="sequences per micro-batch (0: the planner's largest)")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default 30; --quick 10)")
    ap.add_argument("--no-compile", action="store_true", help="eager blocks (train.compile = false)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's bf16 dense peak, for MFU on "
                    "GPUs plan/topology.py does not know")
    ap.add_argument("--skip-check", action="store_true", help="skip the CUDA-vs-CPU loss check")
    ap.add_argument("--allocator", choices=("expandable", "default"), default="expandable",
                    help="PyTorch's caching allocator: expandable segments (default here) or its plain default")
    # --smoke (tests/ranks/test_benchmarks.py): the --quick path for one eager step; without CUDA, the planner side only
    return common.parse_options(ap, argv, quick=True, steps=1, micro_batch=1, no_compile=True, skip_check=True)


def accelerator_for(name: str):
    """plan/topology.py's accelerator for a CUDA device name, or None."""
    from fivefold.plan.topology import ACCELERATORS

    upper = name.upper()
    for key in ("h200", "h100", "a100"):
        if key.upper() in upper:
            return key, ACCELERATORS[key]
    return None, None


def config(model: dict, seq: int, micro_batch: int, accum: int, steps: int, compile_: bool, device="cuda",
           dtype="bf16"):
    from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig

    model = {"max_seq": seq, **model}
    return Config(model=ModelConfig(**model), parallel=ParallelConfig(microbatches=accum),
                  train=TrainConfig(steps=steps, global_batch=micro_batch * accum, seq_len=seq, lr=3e-4,
                                    min_lr=3e-5, warmup=2, dtype=dtype, device=device, compile=compile_,
                                    checkpoint=False, data_limit_mb=1.0))


def planned_total(cfg) -> tuple[float, dict]:
    from fivefold.tools.run_plan import planned_memory

    plan = planned_memory(cfg)
    if "error" in plan:
        raise SystemExit(f"benchmarks/gpu.py: the planner cannot estimate this layout: {plan['error']}")
    return plan["stages"][0]["total"], plan


def pick_micro_batch(model: dict, seq: int, accum: int, capacity: float) -> tuple[int, list]:
    """The largest power-of-two micro-batch whose planned total fits in MEMORY_SHARE of the GPU."""
    rows, best = [], 1
    for mb in (2 ** k for k in range(0, 9)):
        total, _ = planned_total(config(model, seq, mb, accum, 1, False))
        rows.append((mb, total))
        if total <= MEMORY_SHARE * capacity:
            best = mb
        else:
            break
    return best, rows


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def flash_accepts(model: dict, seq: int) -> str:
    """Whether SDPA's flash kernel runs the model's attention shapes (bf16, causal) with the kv heads as
    they are (`enable_gqa`, what model/attention.py `kernel_reads_kv_heads` gives it): yes, or why not."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d = model["hidden"] // model["heads"]
    q = torch.randn(1, model["heads"], seq, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, model["kv_heads"], seq, d, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=model["kv_heads"] != model["heads"])
        return "yes"
    except RuntimeError as e:
        return f"no ({str(e).splitlines()[0][:120]})"


def context_bytes() -> float:
    """Device memory held beyond the caching allocator's reserve once CUDA is up: the context, the loaded
    kernels and cuBLAS's handles (mem_get_info's used bytes less memory_reserved), after a first tensor and a
    bf16 GEMM, before anything else runs on the device."""
    import torch

    a = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    free, total = torch.cuda.mem_get_info()
    used = total - free - torch.cuda.memory_reserved()
    del a
    return float(used)


def random_tokens(vocab: int, n: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, size=n, dtype=np.int64)


def free_cuda() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def train_big(args, model: dict, seq: int, steps: int, capacity: float) -> dict:
    """Build the trainer at the chosen micro-batch (halving on OOM), train, measure."""
    import torch

    from fivefold.plan.models import from_model_config
    from fivefold.train.trainer import Trainer

    if args.micro_batch:
        mb, plan_rows = args.micro_batch, []
    else:
        mb, plan_rows = pick_micro_batch(model, seq, args.accum, capacity)
        print("planned memory by micro-batch (flash attention): " +
              ", ".join(f"{m}: {t / 2**30:.1f} GiB" for m, t in plan_rows) +
              f"  -> micro-batch {mb} (<= {MEMORY_SHARE:.0%} of {capacity / 2**30:.0f} GiB)")
    compile_ = not args.no_compile
    notes = []
    while True:
        cfg = config(model, seq, mb, args.accum, WARMUP + steps, compile_)
        tokens = random_tokens(cfg.model.vocab, max(4 * cfg.train.global_batch * seq, 1 << 20))
        trainer = None
        try:
            t0 = time.perf_counter()
            trainer = Trainer(cfg, quiet=True, tokens=tokens)
            build_s = time.perf_counter() - t0
            print(f"model: {trainer.n_params:,} parameters ({trainer.n_params / 1e9:.2f} B), "
                  f"built in {build_s:.0f} s; micro-batch {mb} x {args.accum} x seq {seq} = "
                  f"{cfg.train.global_batch * seq:,} tokens per step, compile={compile_}", flush=True)
            torch.cuda.reset_peak_memory_stats()
            history = []
            for k in range(WARMUP + steps):
                m = trainer.step(k)
                history.append(m)
                if k < WARMUP or (k + 1) % 10 == 0:
                    print(f"  step {k}: loss {m['loss']:.4f}, {m['seconds']:.3f} s", flush=True)
            free, total = torch.cuda.mem_get_info()
            context_end = float(total - free - torch.cuda.memory_reserved())   # every kernel the run loaded
            break
        except Exception as e:  # noqa: BLE001
            if is_oom(e) and mb > 1:
                notes.append(f"micro-batch {mb} ran out of memory; halved")
                print(f"micro-batch {mb}: out of memory; trying {mb // 2}", flush=True)
                mb //= 2
            elif compile_ and not is_oom(e):
                notes.append(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); eager")
                print(f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}; retrying eager", flush=True)
                compile_ = False
            else:
                raise
        finally:
            del trainer
            free_cuda()
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    planned, plan = planned_total(cfg)
    times = [m["seconds"] for m in history[WARMUP:]]
    step_s = statistics.median(times)
    tokens_per_step = cfg.train.global_batch * seq
    tokens_per_s = tokens_per_step / step_s
    flops_per_token = from_model_config(cfg.model).flops_per_token(seq, causal=True)
    return {"params": cfg.model.num_params(), "model": cfg.model.__dict__, "seq": seq, "micro_batch": mb,
            "accum": args.accum, "compile": compile_, "tokens_per_step": tokens_per_step,
            "step_seconds_median": step_s, "step_seconds": times, "tokens_per_s": tokens_per_s,
            "flops_per_token": flops_per_token, "losses": [m["loss"] for m in history],
            "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved, "planned_bytes": planned,
            "planned": plan, "memory_ratio": peak / planned, "notes": notes, "context_end_bytes": context_end}


# the CUDA side of ZeRO-Offload's gradient streaming (parallel/zero/offload.py: d2h copies on a side stream
# behind the reduce-scatter, pinned landing buffers): ZeRO-2 with gradients streamed to the host during the
# backward must give the losses of ZeRO-1 with the state on the host (gradients copied at the step) bit for
# bit: the same host AdamW, only the gradients' way to the host differs. Against ZeRO-2 on the device it is
# only within fp32's tolerance: AdamW on the host and on CUDA round differently (seen on an H200: one ulp of
# the loss at step 4), where on the CPU both are one kernel and tests/ranks/test_offload.py holds them equal.
OFFLOAD_RUNS = ("cuda fp32 zero1 offload cpu", "cuda fp32 zero2 offload cpu")


def check_losses() -> dict:
    """A small model's losses: CPU fp32 (reference) against CUDA fp32, CUDA bf16, CUDA bf16 compiled; and
    ZeRO-2 with gradients streamed to the host against ZeRO-1 with the state on the host (equal exactly)."""
    from fivefold.train.trainer import Trainer

    runs = {}
    for name, device, dtype, compile_ in (("cpu fp32", "cpu", "fp32", False), ("cuda fp32", "cuda", "fp32", False),
                                          ("cuda bf16", "cuda", "bf16", False),
                                          ("cuda bf16 compiled", "cuda", "bf16", True),
                                          ("cuda fp32 zero2", "cuda", "fp32", False),
                                          (OFFLOAD_RUNS[0], "cuda", "fp32", False),
                                          (OFFLOAD_RUNS[1], "cuda", "fp32", False)):
        cfg = config(SMALL, 128, 8, 1, CHECK_STEPS, compile_, device=device, dtype=dtype)
        for zero in (1, 2):
            if f"zero{zero}" in name:
                cfg.parallel.zero = zero
        if "offload" in name:
            cfg.parallel.offload = "cpu"
        trainer = Trainer(cfg, quiet=True)
        runs[name] = [trainer.step(k)["loss"] for k in range(CHECK_STEPS)]
        del trainer
        free_cuda()
    ref = runs["cpu fp32"]
    out = {"losses": runs, "ok": True, "rtol": {"fp32": RTOL_FP32, "bf16": RTOL_BF16}, "worst": {}}
    streamed, device = runs[OFFLOAD_RUNS[1]], runs[OFFLOAD_RUNS[0]]
    out["offload_streaming_exact"] = streamed == device
    out["ok"] &= streamed == device
    for name, losses in runs.items():
        if name == "cpu fp32":
            continue
        rtol = RTOL_FP32 if "fp32" in name else RTOL_BF16
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        out["worst"][name] = worst
        out["ok"] &= worst <= rtol
    return out


def smoke_without_cuda() -> int:
    """--smoke without a CUDA device: what runs without one (the --quick configs, the planner's memory for
    them, the micro-batch pick for an 80 GiB GPU), then exit 0."""
    mb, rows = pick_micro_batch(QUICK, 1024, 2, 80 * 2**30)
    print(f"benchmarks/gpu.py --smoke: no CUDA device, so the planner side only: the --quick model at seq 1024 "
          f"takes micro-batch {mb} on an 80 GiB GPU ({len(rows)} sizes planned)")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.allocator == "expandable":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # before CUDA starts
    import torch

    if args.smoke and not torch.cuda.is_available():
        return smoke_without_cuda()
    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is "
              f"False): run it on a machine with an NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    model = QUICK if args.quick else BIG
    seq = args.seq or (1024 if args.quick else 2048)
    steps = args.steps or (10 if args.quick else 30)
    props = torch.cuda.get_device_properties(0)
    name, capacity = torch.cuda.get_device_name(0), float(props.total_memory)
    key, accel = accelerator_for(name)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (accel.peak("bf16") if accel else None)
    print(f"device: {name}, {capacity / 2**30:.0f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"bf16 peak {'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown (pass --peak-tflops)'}"
          f"{f' (plan/topology.py ACCELERATORS[{key!r}])' if accel and not args.peak_tflops else ''}", flush=True)
    context = context_bytes()
    print(f"CUDA context and kernels: {context / 2**20:,.0f} MiB (device memory in use less the allocator's "
          f"reserve after a first tensor and a cuBLAS GEMM; plan/reserve.py counts {CONTEXT_PLANNED / 2**20:,.0f} MiB)")
    flash = flash_accepts(model, seq)
    print(f"SDPA flash kernel for these shapes (bf16, causal, head dim {model['hidden'] // model['heads']}, {model['heads']} query / {model['kv_heads']} kv heads as they are): {flash}")

    big = train_big(args, model, seq, steps, capacity)
    mfu = big["flops_per_token"] * big["tokens_per_s"] / peak if peak else None
    print(f"\n{big['params'] / 1e9:.2f} B parameters, seq {seq}, micro-batch {big['micro_batch']} x {big['accum']}, "
          f"compile={big['compile']}")
    print(f"step: {big['step_seconds_median'] * 1e3:.0f} ms (median of {steps}), tokens/s: {big['tokens_per_s']:,.0f}")
    print(f"MFU: {f'{mfu:.1%}' if mfu is not None else 'n/a'} = PlanModel.flops_per_token(seq={seq}) "
          f"{big['flops_per_token'] / 1e9:.2f} GFLOP x tokens/s / peak bf16 "
          f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else '?'} (goal >= 45%: "
          f"{'yes' if mfu is not None and mfu >= 0.45 else 'no'})")
    print(f"CUDA context and kernels after training: {big['context_end_bytes'] / 2**20:,.0f} MiB (every kernel "
          f"the run loaded)")
    slack = big["peak_reserved_bytes"] / big["peak_allocated_bytes"] - 1
    print(f"allocator ({args.allocator}): reserved exceeds allocated at the peak by {slack:.1%} "
          f"({(big['peak_reserved_bytes'] - big['peak_allocated_bytes']) / 2**30:.2f} GiB)")
    print(f"peak memory: {big['peak_allocated_bytes'] / 2**30:.2f} GiB allocated "
          f"({big['peak_reserved_bytes'] / 2**30:.2f} reserved) vs planned {big['planned_bytes'] / 2**30:.2f} GiB: "
          f"ratio {big['memory_ratio']:.3f} (goal within 10%: {'yes' if abs(big['memory_ratio'] - 1) <= 0.1 else 'no'})")
    rows = big["planned"]["stages"][0]
    print("  planned: " + ", ".join(f"{k} {rows[k] / 2**30:.2f}" for k in ("weights", "grads", "optimizer",
                                                                             "activations", "buffers")) + " GiB")
    for note in big["notes"]:
        print(f"  note: {note}")

    check = None
    if not args.skip_check:
        check = check_losses()
        print("\nCUDA vs CPU losses (small model, 5 steps):")
        for name_, losses in check["losses"].items():
            worst = check["worst"].get(name_)
            print(f"  {name_:<20} {' '.join(f'{x:.5f}' for x in losses)}"
                  + (f"   max rel diff {worst:.2e}" if worst is not None else "   (reference)"))
        print(f"  ZeRO-2 with gradients streamed to the host equals ZeRO-1 with the state on the host: "
              f"{'yes' if check['offload_streaming_exact'] else 'NO'}")
        print(f"  within tolerance (fp32 {RTOL_FP32:g}, bf16 {RTOL_BF16:g}): {'yes' if check['ok'] else 'NO'}")

    total_s = time.perf_counter() - t_start
    result = {"device": name, "memory_bytes": capacity, "torch": torch.__version__, "cuda": torch.version.cuda,
              "context_bytes": context, "allocator": args.allocator, "allocator_slack": slack,
              "accelerator": key, "peak_bf16_flops": peak, "flash": flash, "mfu": mfu, "big": big,
              "check": check, "seconds": total_s, "quick": args.quick}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\n{total_s:.0f} s in all; results: {out}")
    return 0 if check is None or check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
