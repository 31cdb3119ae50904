"""Shared test helpers: tiny configs and the multi-rank runner (fresh processes, hard timeout)."""
from __future__ import annotations

import torch

from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig
from fivefold.train.launch import run_ranks

TIMEOUT_S = 180


def tiny_config(**parallel) -> Config:
    """A model small enough to train a few steps on several ranks in seconds."""
    return Config(
        model=ModelConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_seq=64),
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(steps=3, global_batch=8, seq_len=32, lr=1e-2, min_lr=1e-3, warmup=1, seed=7,
                          data_limit_mb=0.25, grad_clip=0.5, checkpoint=False),
    )


def ranks(fn, n: int, *args, timeout_s: float = TIMEOUT_S):
    """Run fn(rank, n, *args) on n gloo ranks in fresh processes; kill them all after timeout_s."""
    return run_ranks(fn, n, args, timeout_s=timeout_s)


def assert_states_close(a: dict, b: dict, rtol=1e-5, atol=1e-7) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
