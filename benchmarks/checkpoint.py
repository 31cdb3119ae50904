"""Benchmark: our sharded checkpoints (train/checkpoint.py, through `Trainer.save` / `Trainer.restore`)
vs torch.distributed.checkpoint (DCP) on an FSDP2 model, as torchtitan saves and loads.

Same model (a bigger Llama-style config than common.BENCH_MODEL, so there is something to write), same
gloo ranks, one run. Per layout, each implementation builds its model, takes one training step (so the
Adam moments exist), then, timed between barriers on every rank:
- save: ours `trainer.save(out, step)` (every rank writes the state it holds, its ZeRO shards cut into
  boxes of the full tensors, to its own safetensors file, nothing gathered; replicated boxes are written
  by one holder; rank 0 writes the JSON index last and renames the folder into place); peer
  `get_state_dict(model, optimizer)` + `dcp.save(...)` (each rank writes its DTensor shards, the
  coordinator the pickled metadata). Both fsync their files.
- another training step (so restoring has something to undo), then load: ours `trainer.restore(ckpt)`
  (each rank reads the boxes its own shards cover through safetensors' memory map; ZeRO-1/2 also read
  the full weights, which they keep); peer `get_state_dict` + `dcp.load` + `set_state_dict`.
After the load each rank checks that its master weights and first Adam moments (ours: its ZeRO shards;
peer: its local DTensor shards of every parameter and exp_avg) equal, bit for bit, what it held when it
saved. Then a second save and load, also timed ("2nd": warm, the first call in a process pays one-time
costs; a resume is a first load, periodic saves are mostly later ones). Last, untimed, a third save and
load while a thread samples the rank's anonymous resident memory (/proc/self/statm resident - shared,
every millisecond, after malloc_trim): "anon rise" is how far it climbed above where it started, the
rank's transient allocations for saving / loading (largest over ranks and rounds); file pages mapped for
reading (safetensors' memory map) are page cache and not counted. Loads read files the save just wrote,
so from the page cache on both sides.

Layouts: dp=4 ZeRO-3 vs FSDP2 (per-block `fully_shard`, then the root) over 4 ranks; tp=2 x dp=2 ZeRO-1
vs torchtitan's 2-D layout (the DTensor TP plan of benchmarks/tensor.py on the tp mesh, then FSDP2 on
the dp mesh). Every round uses fresh processes and a fresh folder under /tmp (removed after); the
implementations alternate; best and median over rounds, ratios ours / peer (goal <= 1.0).

    python benchmarks/checkpoint.py [--rounds 3] [--layouts dp4z3,tp2dp2z1]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from common import best_of_rounds, parse_options, peak_rss_mb

from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig

MODEL = ModelConfig(vocab=4096, hidden=512, layers=8, heads=8, kv_heads=4, ffn=1408, max_seq=64)
LAYOUTS = {"dp4z3": dict(dp=4, zero=3), "tp2dp2z1": dict(tp=2, dp=2, zero=1)}


def make_config(model: ModelConfig, parallel: dict, batch: int, seq: int) -> Config:
    return Config(model=model, parallel=ParallelConfig(**parallel),
                  train=TrainConfig(steps=10, global_batch=batch, seq_len=seq, lr=1e-3, min_lr=1e-4, warmup=1,
                                    seed=7, data_limit_mb=0.25, checkpoint=False))


# ---- measuring ------------------------------------------------------------------------------------------

def timed(fn):
    """(fn(), seconds) on this rank, started right after a barrier (every rank starts together)."""
    import time

    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


class AnonRise:
    """Peak growth (MiB) of this process's anonymous resident memory while the block runs: a thread
    samples /proc/self/statm (resident - shared: file pages, such as a memory-mapped checkpoint, are
    left out) every millisecond; freed heap memory is handed back to the OS first (malloc_trim), so
    memory reused from earlier work does not hide a peak."""

    def __enter__(self):
        import ctypes
        import os
        import threading

        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self._rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * self.page

    def _poll(self):
        while not self.done.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self._rss())
        self.mb = (self.peak - self.base) / 2**20


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ---- one rank ---------------------------------------------------------------------------------------------

def bench_rank(rank, world, impl, cfg_dict, root):
    import torch.distributed as dist

    cfg = Config.from_dict(cfg_dict)
    make = ours if impl == "ours" else dcp_fsdp2
    step, save, load, snapshot = make(cfg, rank, world)
    root = Path(root)
    step(0)
    before = snapshot()
    ckpt, save_s = timed(lambda: save(root / "a", 1))      # the process's first save and load ("1st")
    step(1)                                               # move away from the saved state
    _, load_s = timed(lambda: load(ckpt))
    bad = sum(int(not a.equal(b)) for a, b in zip(before, snapshot()))
    disk = folder_bytes(ckpt) if rank == 0 else 0
    ckpt2, save2_s = timed(lambda: save(root / "b", 2))   # again, warm ("2nd")
    _, load2_s = timed(lambda: load(ckpt2))
    dist.barrier()                                        # untimed: the transient memory of a save / load
    with AnonRise() as save_rise:
        ckpt3 = save(root / "c", 3)
    dist.barrier()
    with AnonRise() as load_rise:
        load(ckpt3)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"times": [save_s], "rss_mb": peak_rss_mb(), "save2_s": save2_s, "load_s": load_s, "load2_s": load2_s,
            "bad": bad, "disk_bytes": disk, "save_rise_mb": save_rise.mb, "load_rise_mb": load_rise.mb}


def ours(cfg, rank, world):
    from fivefold.train.trainer import Trainer

    trainer = Trainer(cfg, rank, world, quiet=True)
    engine = trainer.engine

    def snapshot():
        return [t.clone() for t in (*engine.state.masters, *engine.optimizer.exp_avg)]

    return trainer.step, lambda out, n: trainer.save(out, n), trainer.restore, snapshot


def dcp_fsdp2(cfg, rank, world):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from fivefold.model import Transformer, loss_sum
    from tensor import dtensor_loss_sum, dtensor_plan

    p, t = cfg.parallel, cfg.train
    model = Transformer(cfg.model, seed=t.seed)
    if p.tp > 1:   # torchtitan's 2-D layout: TP inside, FSDP2 over the data-parallel ranks
        mesh = init_device_mesh("cpu", (p.dp, p.tp), mesh_dim_names=("dp", "tp"))
        top, blocks = dtensor_plan(model, sp=False)
        for block, plan in blocks:
            parallelize_module(block, mesh["tp"], plan)
        parallelize_module(model, mesh["tp"], top)
        if cfg.model.tie_embeddings:
            model.head.weight = model.embed.weight
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay, foreach=False)
    dp_rank = dp_mesh.get_local_rank()
    local_batch = t.global_batch // p.dp

    def step(i):
        gen = torch.Generator().manual_seed(1000 * i + dp_rank)   # tensor-parallel ranks share a batch
        x = torch.randint(0, cfg.model.vocab, (local_batch, t.seq_len), generator=gen)
        y = torch.roll(x, -1, 1)
        if p.tp > 1:
            with loss_parallel():
                (dtensor_loss_sum(model(x), y) / (y.numel() * p.dp)).backward()
        else:
            (loss_sum(model(x), y) / (y.numel() * p.dp)).backward()
        opt.step()
        opt.zero_grad()

    def save(out, n):
        path = Path(out) / f"step-{n}"
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        return path

    def load(path):
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def snapshot():
        params = list(model.parameters())
        return [local(q).clone() for q in params] + [local(opt.state[q]["exp_avg"]).clone() for q in params]

    return step, save, load, snapshot


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t.detach()


# ---- the run ------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--hidden", type=int, default=MODEL.hidden)
    ap.add_argument("--layers", type=int, default=MODEL.layers)
    ap.add_argument("--ffn", type=int, default=MODEL.ffn)
    ap.add_argument("--vocab", type=int, default=MODEL.vocab)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    # --smoke: the 2-D layout only (TP plan, FSDP2 and DCP; our TP and ZeRO-1): 4 ranks per spawn are slow here
    a = parse_options(ap, rounds=1, layouts="tp2dp2z1", hidden=64, layers=2, ffn=128, vocab=256, batch=8, seq=16)
    model = replace(MODEL, hidden=a.hidden, layers=a.layers, ffn=a.ffn, vocab=a.vocab, max_seq=max(a.seq, 64))
    layouts = [s.strip() for s in a.layouts.split(",") if s.strip()]
    state_mb = model.num_params() * 4 * 3 / 2**20
    print(f"model: {model.num_params() / 1e6:.2f} M parameters (fp32 weights + 2 Adam moments = {state_mb:.0f} MiB), "
          f"{model.layers} layers, hidden {model.hidden}, ffn {model.ffn}, vocab {model.vocab}; global batch "
          f"{a.batch}x{a.seq}; 4 gloo ranks; best / median of {a.rounds} rounds")
    names = {"ours": "fivefold", "peer": "FSDP2 + DCP"}
    folders: list[str] = []

    def args_of(cfg_dict):
        def args(impl):
            folders.append(tempfile.mkdtemp(prefix="fivefold-ckpt-bench-"))
            return impl, cfg_dict, folders[-1]
        return args

    worst = ("save2_s", "load_s", "load2_s", "bad", "save_rise_mb", "load_rise_mb")
    results: dict[str, dict[str, list[dict]]] = {}
    try:
        for _ in range(a.rounds):
            for lay in layouts:
                cfg = make_config(model, LAYOUTS[lay], a.batch, a.seq)
                world = cfg.parallel.world_size
                got = best_of_rounds(bench_rank, world, [("peer", "peer"), ("ours", "ours")],
                                     args_of(cfg.to_dict()), 1, keep_going=not a.smoke,
                                     worst=worst)
                for impl, row in got.items():
                    results.setdefault(lay, {}).setdefault(impl, []).append(row)
    finally:
        for f in folders:
            shutil.rmtree(f, ignore_errors=True)

    def agg(rows, key):
        vals = [r[key] for r in rows]
        return min(vals), statistics.median(vals)

    times = (("save 1st", "median_s"), ("save 2nd", "save2_s"), ("load 1st", "load_s"), ("load 2nd", "load2_s"))
    print("\nseconds: best (median) over rounds; 1st = the process's first save / load, 2nd = the next one")
    print(f"{'layout':<10}{'impl':<13}" + "".join(f"{w:>15}" for w, _ in times)
          + f"{'disk MiB':>10}{'save anon rise':>16}{'load anon rise':>16}{'restored':>10}")
    for lay in layouts:
        for impl in ("peer", "ours"):
            rows = results.get(lay, {}).get(impl)
            if not rows:
                print(f"{lay:<10}{names[impl]:<13}  (failed)")
                continue
            cells = "".join(f"{b:>8.3f} ({m:.3f})" for b, m in (agg(rows, k) for _, k in times))
            ok = "exact" if all(r["bad"] == 0 for r in rows) else f"{max(r['bad'] for r in rows)} differ"
            print(f"{lay:<10}{names[impl]:<13}{cells}{rows[0]['disk_bytes'] / 2**20:>10.1f}"
                  f"{max(r['save_rise_mb'] for r in rows):>12.0f} MiB{max(r['load_rise_mb'] for r in rows):>12.0f} MiB"
                  f"{ok:>10}")
    print("\nratios ours / peer: times best (median); disk; anon rise (largest over rounds)")
    for lay in layouts:
        r = results.get(lay, {})
        if "ours" not in r or "peer" not in r:
            continue
        parts = []
        for what, key in times:
            (ob, om), (pb, pm) = agg(r["ours"], key), agg(r["peer"], key)
            parts.append(f"{what} {ob / pb:.3f} ({om / pm:.3f})")
        parts.append(f"disk {r['ours'][0]['disk_bytes'] / r['peer'][0]['disk_bytes']:.3f}")
        for what, key in (("save anon", "save_rise_mb"), ("load anon", "load_rise_mb")):
            o, p = max(x[key] for x in r["ours"]), max(x[key] for x in r["peer"])
            parts.append(f"{what} {o / p:.2f}" if p > 0 else f"{what} -")
        print(f"{lay:<10}" + ", ".join(parts))
    print("\nper round, seconds (save 1st / 2nd, load 1st / 2nd):")
    for lay in layouts:
        for impl, rows in results.get(lay, {}).items():
            print(f"  {lay:<10}{names[impl]:<13}" + "   ".join(
                f"{x['median_s']:.2f}/{x['save2_s']:.2f}, {x['load_s']:.2f}/{x['load2_s']:.2f}" for x in rows))
    differ = [lay for lay, by_impl in results.items() for rows in by_impl.values() if any(r["bad"] for r in rows)]
    if differ:
        print(f"\nrestored state differs from the saved state: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
