"""Start-up memory and time per rank: what building a Trainer costs, before vs after meta construction.

    PYTHONPATH=src python benchmarks/startup.py --model 1b --layouts tp2xpp2 zero3-dp4 [--steps 1]
    PYTHONPATH=/tmp/before/src python benchmarks/startup.py ...   # the same on an older checkout
    PYTHONPATH=src python benchmarks/startup.py --init-time --model 1b   # one process: the seeded init
    PYTHONPATH=src python benchmarks/startup.py --init-hf --model 250m   # --init-hf vs from_pretrained
    PYTHONPATH=src python benchmarks/startup.py --cli [--rounds 3]        # `fivefold train`, tiny: the launcher's CPU

Per rank it prints the process's floor (peak RSS before the Trainer: interpreter, torch, the process
group), the peak RSS once the Trainer is built (and after --steps steps), and the seconds to build it.
The same script runs against any checkout (PYTHONPATH), so "before" is the previous commit's code.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import common

MODELS = {   # Llama-style shapes; "1b": ~1.1B parameters
    "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_seq=64),
    "small": dict(vocab=8192, hidden=512, layers=8, heads=8, kv_heads=4, ffn=1536, max_seq=64),
    "250m": dict(vocab=32000, hidden=1024, layers=16, heads=16, kv_heads=8, ffn=2816, max_seq=64,
                 tie_embeddings=False),
    "1b": dict(vocab=32000, hidden=2048, layers=20, heads=16, kv_heads=8, ffn=5632, max_seq=64, tie_embeddings=False),
}
LAYOUTS = {"tp2xpp2": dict(tp=2, pp=2, microbatches=2), "zero3-dp4": dict(dp=4, zero=3), "dp1": dict()}


def config(model: str, layout: str, steps: int):
    from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig

    return Config(model=ModelConfig(**MODELS[model]), parallel=ParallelConfig(**LAYOUTS[layout]),
                  train=TrainConfig(steps=max(1, steps), global_batch=4, seq_len=32, lr=1e-3, min_lr=1e-4, warmup=1,
                                    seed=3, data_limit_mb=0.05, checkpoint=False))


def rank_start(rank, world, cfg_dict, steps):
    from fivefold.config import Config
    from fivefold.train.trainer import Trainer, peak_rss_bytes

    floor = peak_rss_bytes()
    t0 = time.perf_counter()
    t = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    built = time.perf_counter() - t0
    out = {"floor": floor, "built_peak": peak_rss_bytes(), "build_s": built}
    for step in range(steps):
        t.step(step)
    out["peak"] = peak_rss_bytes()
    return out


def run_layouts(args) -> None:
    from fivefold.train.launch import run_ranks

    for layout in args.layouts:
        cfg = config(args.model, layout, args.steps)
        world = cfg.parallel.world_size
        rows = run_ranks(rank_start, world, (cfg.to_dict(), args.steps), timeout_s=3600)
        mib = lambda b: b / 2**20   # noqa: E731
        print(f"{args.model} {layout}: {cfg.model.num_params() / 1e9:.2f}B params, whole fp32 model "
              f"{mib(cfg.model.num_params() * 4):.0f} MiB")
        for r, row in enumerate(rows):
            print(f"  rank {r}: floor {mib(row['floor']):.0f} MiB, built {mib(row['built_peak']):.0f} MiB "
                  f"(+{mib(row['built_peak'] - row['floor']):.0f}), after {args.steps} step(s) {mib(row['peak']):.0f} "
                  f"MiB, built in {row['build_s']:.1f} s")
        print(json.dumps({"model": args.model, "layout": layout, "ranks": rows}))


def init_time(args) -> None:
    """One process: the whole model's seeded init (Transformer(cfg, seed)), seconds."""
    import torch

    from fivefold.config import ModelConfig
    from fivefold.model import Transformer

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = Transformer(ModelConfig(**MODELS[args.model]), seed=0)
    print(f"{args.model}: seeded init of {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters in "
          f"{time.perf_counter() - t0:.1f} s (one thread)")


def init_hf(args) -> None:
    """Write the model as a Hugging Face folder, then time and measure (in fresh processes) loading it with
    transformers' from_pretrained and with fivefold's load_hf_model (the --init-hf reader, one process)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        code = ("import sys, torch; from fivefold.config import ModelConfig; from fivefold.model import Transformer;"
                "from fivefold.model.hf import to_hf; m = Transformer(ModelConfig(**%r), seed=0);"
                "to_hf(m).save_pretrained(sys.argv[1], max_shard_size='500MB')" % MODELS[args.model])
        subprocess.run([sys.executable, "-c", code, tmp], check=True)
        # each then reads every weight once (a checksum): transformers maps the files and reads a weight
        # only when it is first used, so without it from_pretrained would be timed without its reads
        for name, load in (("transformers.from_pretrained",
                            "from transformers import AutoModelForCausalLM as A; m = A.from_pretrained(sys.argv[1])"),
                           ("fivefold load_hf_model",
                            "from fivefold.model.hf_weights import load_hf_model; m = load_hf_model(sys.argv[1])")):
            code = ("import sys, time, resource, torch; torch.set_num_threads(1); t0 = time.perf_counter(); " + load +
                    "; sum(float(p.detach().sum()) for p in m.parameters())"
                    "; print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
            out = subprocess.run([sys.executable, "-c", code, tmp], check=True, capture_output=True, text=True)
            seconds, peak_kib = out.stdout.split()[-2:]
            print(f"{args.model} {name}: {float(seconds):.1f} s, peak RSS {int(peak_kib) / 1024:.0f} MiB")


CLI_CODE = """
import json, resource, sys, time
t0 = time.perf_counter()
from fivefold.cli import main
code = main(sys.argv[1:])
own = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"code": code, "wall_s": time.perf_counter() - t0, "torch": "torch" in sys.modules,
                  "launcher_cpu_s": own.ru_utime + own.ru_stime}))
"""


def cli(args) -> None:
    """`fivefold train` of the tiny model on 1 and 2 ranks (4 steps, or --steps), end to end in a fresh process,
    `--rounds` times:
    wall seconds and the launcher's own CPU seconds (it checks the run and starts the ranks; the fork server
    and the ranks are not its waited children, so not counted). Any checkout: PYTHONPATH."""
    import subprocess
    import tempfile

    m = MODELS["tiny"]
    flags = [f"--set=model.{k}={v}" for k, v in m.items()] + ["--seq-len", "32", "--global-batch", "8", "--steps",
                                                            str(args.steps or 4), "--set", "train.data_limit_mb=0.25"]
    for _ in range(args.rounds):
        for nproc in (1, 2):
            with tempfile.TemporaryDirectory(prefix="fivefold-cli-") as tmp:
                argv = ["train", *flags, "--nproc", str(nproc), "--dp", str(nproc), "--out", f"{tmp}/run"]
                r = subprocess.run([sys.executable, "-c", CLI_CODE, *argv], capture_output=True, text=True, check=True,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"))
                row = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"{nproc} rank(s): {row['wall_s']:.2f} s wall, launcher {row['launcher_cpu_s']:.2f} CPU-s "
                      f"(imported torch: {row['torch']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="small")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=["tp2xpp2", "zero3-dp4"])
    ap.add_argument("--steps", type=int, default=0, help="steps after the build (0: build only)")
    ap.add_argument("--init-time", action="store_true", help="time the seeded init in one process")
    ap.add_argument("--init-hf", action="store_true", help="--init-hf's reader vs transformers.from_pretrained")
    ap.add_argument("--cli", action="store_true", help="`fivefold train` end to end: the launcher's own CPU")
    ap.add_argument("--rounds", type=int, default=3, help="--cli: rounds of the 1- and 2-rank runs")
    args = common.parse_options(ap, model="tiny", layouts=["tp2xpp2"], steps=1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.init_time:
        return init_time(args)
    if args.init_hf:
        return init_hf(args)
    if args.cli:
        return cli(args)
    run_layouts(args)


if __name__ == "__main__":
    main()
