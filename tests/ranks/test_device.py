"""Device plumbing (issue 15): train.device, every tensor on the model's device, and the pieces of the
CUDA path that run on the CPU too (foreach AdamW, torch.compile per block, run.json's memory fields).

This machine may have no GPU, so a tensor landing "on the host instead of the GPU" cannot show up as a
wrong device here. Two checks stand in for it:
- a spy (a TorchFunctionMode) records every tensor factory (torch.zeros, empty, arange, ...) called from
  fivefold's code without a `device` while a trainer is built and steps: on CUDA such a tensor would land
  on the CPU. Only what is on the host by design may do that (`HOST_BY_DESIGN`): the values that fill a
  rank's pieces (the seeded init, Hugging Face slices), staged on the host a piece at a time; token batches, made on the host and moved by `Trainer.micro_batches`;
  the offload store's host state.
- a walk over every parameter, gradient, main gradient, module buffer, optimizer state and engine
  buffer (DDP buckets, ZeRO units, flat buffers and shards; the offload store excepted by design) after
  a step asserts they sit on the model's device. Here that is the CPU; where CUDA is present the
  single-process case also runs with train.device = "cuda".
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.utils._device as torch_device
from torch import nn
from torch.overrides import TorchFunctionMode

from fivefold.tools import run_plan
from fivefold.comm import CommLedger, Group
from fivefold.config import ConfigError, ModelConfig
from fivefold.train import launch, optim
from fivefold.train import trainer as trainer_mod
from fivefold.train.optim import AdamW
from fivefold.train.trainer import Trainer

from tests.support.spawn import spawn_jobs
from tests.support.tiny import tiny_config
from tests.support.paths import ROOT

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FACTORIES = torch_device._device_constructors()
SRC = f"{os.sep}fivefold{os.sep}"
# (file under src/fivefold, function) whose device-less tensors are on the host by design
HOST_BY_DESIGN = {
    ("model/init.py", "*"),          # init values: drawn on the host (the same on any device), then moved
    ("model/hf_weights.py", "*"),    # Hugging Face slices: read from the files into host memory, then moved
    ("train/data.py", "*"),          # token batches: made on the host, moved by Trainer.micro_batches
    ("parallel/context.py", "token_indices"), ("parallel/ring.py", "zigzag_positions"),   # context parallel:
                                     # the token shares, host indices into the host batch (moved for the model)
    ("parallel/zero/offload.py", "*"),    # the offload store's host memory
}
# engine attributes not walked: the state store (offloaded: host state by design; on the device its tensors are
# the parameter shards and moments, walked through the optimizer), the model (walked by itself)
NOT_WALKED = {"state", "model", "mesh", "groups"}


class FactorySpy(TorchFunctionMode):
    """Records (factory, file:line, function) for each tensor factory fivefold's code calls without a
    device, outside HOST_BY_DESIGN."""

    def __init__(self):
        super().__init__()
        self.hits: set[tuple[str, str, str]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frames = [f for f in traceback.extract_stack()[:-1] if SRC in f.filename]
            if frames:
                f = frames[-1]
                where = f.filename.split(SRC, 1)[1].replace(os.sep, "/")
                if (where, f.name) not in HOST_BY_DESIGN and (where, "*") not in HOST_BY_DESIGN:
                    self.hits.add((func.__name__, f"{where}:{f.lineno}", f.name))
        return func(*args, **kwargs)


def _walk(obj, path: str, out: list, seen: set, depth: int = 0) -> None:
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _walk(x, f"{path}[{i}]", out, seen, depth + 1)
    elif isinstance(obj, dict):
        for i, x in enumerate(obj.values()):
            _walk(x, f"{path}{{{i}}}", out, seen, depth + 1)
    elif (type(obj).__module__.startswith("fivefold.") and hasattr(obj, "__dict__")
          and not isinstance(obj, (Group, CommLedger, nn.Module))):
        for k, x in vars(obj).items():
            if k not in NOT_WALKED:
                _walk(x, f"{path}.{k}", out, seen, depth + 1)


def held_tensors(t: Trainer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the trainer keeps between steps: parameters, their gradients and main gradients,
    module buffers, the engine's buffers, shards and optimizer state (not the offload store)."""
    out = []
    for name, p in t.model.named_parameters():
        out.append((name, p))
        for attr in ("grad", "main_grad"):
            if getattr(p, attr, None) is not None:
                out.append((f"{name}.{attr}", getattr(p, attr)))
    out += [(f"buffer {name}", b) for name, b in t.model.named_buffers()]
    _walk(t.engine, "engine", out, set())
    if t.positions is not None:
        out.append(("trainer.positions", t.positions))
    return out


def misplaced(t: Trainer) -> list[str]:
    want = t.device
    return [f"{path}: {x.device}" for path, x in held_tensors(t) if x.device != want]


def _train_one_step(cfg, rank: int = 0, world: int = 1) -> tuple[Trainer, FactorySpy, float]:
    spy = FactorySpy()
    with spy:
        t = Trainer(cfg, rank, world, quiet=True)
        loss = t.step(0)["loss"]
    return t, spy, loss


def _device_job(rank, world, cfg_dict):
    from fivefold.config import Config

    cfg = Config.from_dict(cfg_dict)
    t, spy, loss = _train_one_step(cfg, rank, world)
    return {"device": str(t.device), "host_factories": sorted(spy.hits), "misplaced": misplaced(t),
            "held": len(held_tensors(t)), "loss": loss}


def _compile_job(rank, world, cfg_dict, backend):
    """Two steps with and without train.compile (backend swapped in this rank): losses and ledger rows."""
    from fivefold.config import Config

    trainer_mod.COMPILE_BACKEND = backend
    out = {}
    for compiled in (False, True):
        cfg = Config.from_dict(cfg_dict)
        cfg.train.compile = compiled
        t = Trainer(cfg, rank, world, quiet=True)
        losses = [t.step(k)["loss"] for k in range(2)]
        rows = {(r["dim"], r["op"]): (r["calls"], r["bytes_sent"]) for r in t.ledger.rows()}
        out[compiled] = {"losses": losses, "rows": rows}
    return out


MOE = dict(experts=4, top_k=2, moe_ffn=64)
LAYOUTS = {   # name -> (parallel, model overrides); each trains one step on 2 ranks
    "dp2": (dict(dp=2, microbatches=2), {}),
    "dp2-zero2": (dict(dp=2, zero=2, microbatches=2), {}),
    "dp2-zero3": (dict(dp=2, zero=3), {}),
    "dp2-zero1-offload": (dict(dp=2, zero=1, offload="cpu"), {}),
    "tp2-sp": (dict(tp=2, sp_mode="megatron"), {}),
    "pp2": (dict(pp=2, microbatches=2), {}),
    "cp2-ring": (dict(cp=2, cp_mode="ring"), {}),
    "ep2": (dict(dp=2, ep=2), MOE),
}


def _layout_config(parallel, model):
    cfg = tiny_config(model=model, **parallel)
    cfg.train.device = "cpu"
    return cfg


@pytest.fixture(scope="module")
def two_rank_runs():
    jobs = [(name, _device_job, (_layout_config(*spec).to_dict(),)) for name, spec in LAYOUTS.items()]
    jobs.append(("compile-tp2", _compile_job, (_layout_config(dict(tp=2), {}).to_dict(), "aot_eager")))
    return spawn_jobs(2, jobs, timeout_s=400)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.ranks
def test_every_tensor_is_made_on_the_models_device(two_rank_runs, name):
    for rank, r in enumerate(two_rank_runs[name]):
        assert r["device"] == "cpu"
        assert r["held"] > 10
        assert not r["misplaced"], f"rank {rank}: tensors off the model's device: {r['misplaced']}"
        assert not r["host_factories"], (f"rank {rank}: tensors made without a device (on CUDA they would land "
                                         f"on the host): {r['host_factories']}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_single_process_tensors_on_the_device(device, zero):
    cfg = tiny_config(zero=zero)
    cfg.train.device = device
    cfg.train.dtype = "bf16" if device == "cuda" else "fp32"
    t, spy, loss = _train_one_step(cfg)
    assert t.device.type == device and torch.isfinite(torch.tensor(loss))
    assert not misplaced(t)
    assert not spy.hits, sorted(spy.hits)


def test_the_spy_sees_a_tensor_made_without_a_device():
    """The check above can fail: a factory call without a device inside fivefold is reported."""
    spy = FactorySpy()
    with spy:
        optim.global_grad_norm([], None, None)    # device=None: the sum is made on the default device
    assert any(name == "zeros" and where.startswith("train/optim.py") for name, where, _ in spy.hits)


# -- device selection ----------------------------------------------------------------------------------

@pytest.fixture
def cuda_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.fixture
def cuda_absent(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("backend", [None, "gloo", "nccl"])
def test_resolve_device_without_cuda(cuda_absent, backend):
    assert launch.resolve_device("auto", backend) == torch.device("cpu")
    assert launch.resolve_device("cpu", backend) == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device"):
        launch.resolve_device("cuda", backend)


def test_resolve_device_with_cuda(cuda_present):
    assert launch.resolve_device("auto", None) == torch.device("cuda", 0)      # one process
    assert launch.resolve_device("auto", "nccl") == torch.device("cuda", 0)    # torchrun on GPUs
    assert launch.resolve_device("auto", "gloo") == torch.device("cpu")        # local --nproc ranks
    assert launch.resolve_device("cpu", "nccl") == torch.device("cpu")
    assert launch.resolve_device("cuda", "nccl") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="needs NCCL"):
        launch.resolve_device("cuda", "gloo")


@pytest.mark.parametrize("driver", [False, True])
def test_launcher_device_asks_torch_only_where_a_gpu_can_be(monkeypatch, cuda_present, driver):
    """The launcher's device type: cpu without asking torch for cpu, for auto over gloo and for auto where no
    GPU driver exists (torch can find no device there); otherwise resolve_device's answer."""
    asked = []
    monkeypatch.setattr(launch, "gpu_driver_present", lambda: driver)
    monkeypatch.setattr(launch, "resolve_device", lambda name, backend: asked.append(name) or torch.device("cuda", 0))
    assert launch.launcher_device("cpu", None) == "cpu"
    assert launch.launcher_device("auto", "gloo") == "cpu"
    assert launch.launcher_device("auto", None) == ("cuda" if driver else "cpu")
    assert launch.launcher_device("cuda", None) == "cuda"            # a bad request is resolve_device's to refuse
    assert asked == (["auto", "cuda"] if driver else ["cuda"])


@pytest.mark.parametrize("device,cuda,backend", [("auto", True, "nccl"), ("cuda", True, "nccl"),
                                                 ("auto", False, "gloo"), ("cpu", True, "gloo")])
def test_torchrun_picks_nccl_for_cuda(monkeypatch, device, cuda, backend):
    """init_torchrun joins over NCCL exactly when the run's device is CUDA, on its local rank's GPU."""
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("gpu", i))
    monkeypatch.setattr(launch, "torchrun_store", lambda rank, world, timeout: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.setdefault("backend", backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch.init_torchrun(device=device) == (3, 8)
    assert seen["backend"] == backend
    assert seen.get("gpu") == (1 if backend == "nccl" else None)


def test_explicit_cpu_device_single_process():
    cfg = tiny_config()
    cfg.train.device = "cpu"
    t = Trainer(cfg, quiet=True)
    assert t.device == torch.device("cpu")
    assert {p.device for p in t.model.parameters()} == {torch.device("cpu")}


# -- foreach AdamW ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,grad_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                              (torch.float64, torch.float64)])
@pytest.mark.parametrize("chunk", [optim.FOREACH_CHUNK, 500])
def test_foreach_adamw_is_bit_identical_to_eager(monkeypatch, dtype, grad_dtype, chunk):
    """The multi-tensor path runs the eager ops in the same order: on the CPU the same bits, also on
    views of one flat buffer (ZeRO's shards), with decay on some tensors, over several chunks."""
    monkeypatch.setattr(optim, "FOREACH_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (300, 7), (5,), (1000, 3), (1,)]
    sizes = [torch.Size(s).numel() for s in shapes]
    flat = torch.randn(sum(sizes) + 3, generator=gen, dtype=dtype)

    def views(f):
        return [f[o:o + n].view(s) for o, n, s in zip([sum(sizes[:i]) for i in range(len(sizes))], sizes, shapes)]

    a, b = flat.clone(), flat.clone()
    decay = [len(s) == 2 for s in shapes]
    eager, multi = AdamW(views(a), decay, foreach=False), AdamW(views(b), decay)
    assert multi.foreach and not eager.foreach
    for k in range(4):
        grads = [(torch.randn(s, generator=gen, dtype=dtype) * 10.0 ** (k - 2)).to(grad_dtype) for s in shapes]
        eager.step(grads, 1e-2 * (k + 1))
        multi.step(grads, 1e-2 * (k + 1))
    assert torch.equal(a, b)
    for x, y in zip(eager.exp_avg + eager.exp_avg_sq, multi.exp_avg + multi.exp_avg_sq):
        assert torch.equal(x, y)


def test_foreach_chunks_bound_each_call():
    assert optim.foreach_chunks([3, 3, 3], 6) == [(0, 2), (2, 3)]
    assert optim.foreach_chunks([10, 1, 1], 4) == [(0, 1), (1, 3)]   # a larger tensor goes alone
    assert optim.foreach_chunks([], 4) == []


# -- torch.compile per block ------------------------------------------------------------------------------

def _losses(compiled: bool, steps: int = 2, **parallel) -> tuple[list[float], int]:
    cfg = tiny_config(**parallel)
    cfg.train.compile = compiled
    t = Trainer(cfg, quiet=True)
    n = sum(getattr(m, "_compiled_call_impl", None) is not None for m in t.model.modules())
    return [t.step(k)["loss"] for k in range(steps)], n


@pytest.mark.parametrize("zero", [0, 3])
def test_compile_per_block_trains_the_same(monkeypatch, zero):
    """train.compile with a cheap backend (aot_eager: dynamo + AOT autograd, no code generation) gives
    the eager losses; every block (and only the blocks) is compiled."""
    monkeypatch.setattr(trainer_mod, "COMPILE_BACKEND", "aot_eager")
    eager, n_eager = _losses(False, zero=zero)
    compiled, n_compiled = _losses(True, zero=zero)
    assert n_eager == 0 and n_compiled == tiny_config().model.layers
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-6, atol=0)


def _cxx() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.mark.skipif(_cxx() is None, reason="torch.compile's inductor backend needs a C++ compiler on the CPU")
@pytest.mark.ranks
def test_compile_with_inductor_matches_eager():
    """The default backend (inductor, what a GPU run uses): generated kernels, fp32 tolerance (~30 s of
    compilation on a small CPU)."""
    eager, _ = _losses(False)
    compiled, _ = _losses(True)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


@pytest.mark.ranks
def test_compile_under_tensor_parallel_sends_the_same_bytes(two_rank_runs):
    """Collectives inside a compiled block are graph breaks that still go through comm/: same losses,
    same ledger (calls and bytes per dim and op)."""
    for r in two_rank_runs["compile-tp2"]:
        torch.testing.assert_close(torch.tensor(r[True]["losses"]), torch.tensor(r[False]["losses"]),
                                   rtol=1e-6, atol=0)
        assert r[True]["rows"] == r[False]["rows"] and ("tp", "all_reduce") in r[True]["rows"]


# -- run.json ----------------------------------------------------------------------------------------------

TINY = ["--set", "model.hidden=64", "--set", "model.layers=2", "--set", "model.ffn=128",
        "--set", "model.max_seq=64", "--seq-len", "32", "--global-batch", "8", "--steps", "2",
        "--set", "train.data_limit_mb=0.25", "--set", "train.warmup=1", "--set", "train.checkpoint=false"]


def fivefold(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fivefold.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.ranks
def test_run_json_has_device_peak_memory_and_the_plan(tmp_path):
    out = tmp_path / "pp2"
    r = fivefold("train", "--nproc", "2", "--pp", "2", "--microbatches", "2", *TINY,
                 "--set", "train.device=cpu", "--out", str(out))
    assert r.returncode == 0, r.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["train"]["device"] == "cpu" and run["config"]["train"]["compile"] is False
    assert run["device"] == "cpu" and run["device_by_rank"] == ["cpu", "cpu"]
    assert run["peak_device_memory_bytes_by_rank"] == [None, None]    # no allocator counter on the CPU
    assert all(b > 50 * 2**20 for b in run["peak_rss_bytes_by_rank"])   # the whole process: interpreter, torch
    plan = run["planned_memory"]
    assert plan["flash"] is True and [s["stage"] for s in plan["stages"]] == [0, 1]   # SDPA fused on the CPU too
    assert run["planned_memory_bytes_by_rank"] == [s["total"] for s in plan["stages"]]   # rank r is stage r
    for key in ("model_state_bytes_per_rank", "peak_activation_bytes_by_rank", "versions", "params"):
        assert key in run                                                  # the keys run.json had before


@pytest.mark.ranks
def test_a_cuda_device_without_cuda_fails_at_start_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = fivefold("train", *TINY, "--set", "train.device=cuda", "--out", str(tmp_path / "x"), timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "train.device = 'cuda'" in lines[0] and "no CUDA device" in lines[0]


def test_planned_memory_plans_the_attention_the_runtime_runs():
    """SDPA takes its fused kernel on the CPU too (causal, or with the document mask), which saves o and
    the log-sum-exp and no s x s scores: the plan of a run is the flash one on every device."""
    from fivefold.model.attention import attention_core

    q = torch.randn(1, 4, 64, 16, requires_grad=True)
    mask = torch.zeros(1, 64, dtype=torch.long)
    for o in (attention_core(q, q[:, :2], q[:, :2]), attention_core(q, q[:, :2], q[:, :2], documents_bS=mask)):
        assert "FlashAttention" in o.grad_fn.name(), o.grad_fn.name()
    assert run_plan.planned_memory(tiny_config(dp=2))["flash"] is True


def test_planned_memory_never_fails_a_run(monkeypatch):
    import fivefold.plan.run as run

    def broken(cfg, backend=None):
        raise ConfigError("the planner cannot do this")
    monkeypatch.setattr(run, "from_config", broken)   # plan_of's first call
    assert run_plan.planned_memory(tiny_config()) == {"error": "ConfigError: the planner cannot do this"}


def test_model_config_for_the_gpu_benchmark_is_about_a_billion_parameters():
    """benchmarks/gpu.py's model (hidden 2048, 16 layers, 16 heads, 8 KV heads, ffn 8192, vocab 32000)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu
    finally:
        sys.path.pop(0)
    n = ModelConfig(**gpu.BIG).num_params()
    assert 0.9e9 < n < 1.4e9
