"""A model small enough to train a few steps on several ranks in seconds, and what "equal" means between
a layout and the single process (tolerances per dtype)."""
from __future__ import annotations

import torch

from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig


# a tiny latent-attention (MLA) model: q latent 24, kv latent 16, per head 8 nope + 8 rope q/k dims, 12 v dims
TINY_MLA = dict(kv_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=12)


def tiny_config(mla: bool = False, model: dict | None = None, **parallel) -> Config:
    """A model small enough to train a few steps on several ranks in seconds (`mla`: with latent attention;
    `model`: fields changed beside that)."""
    return Config(
        model=ModelConfig(**{**dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_seq=64),
                             **(TINY_MLA if mla else {}), **(model or {})}),
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(steps=3, global_batch=8, seq_len=32, lr=1e-2, min_lr=1e-3, warmup=1, seed=7,
                          data_limit_mb=0.25, grad_clip=0.5, checkpoint=False),
    )


def assert_states_close(a: dict, b: dict, rtol=1e-5, atol=1e-7, outliers=0.0, outlier_atol=0.0) -> None:
    """Every tensor within rtol/atol, except at most a fraction `outliers` of all elements, which must
    still be within outlier_atol (see FP32 below for why fp32 runs need that)."""
    assert a.keys() == b.keys()
    bad = total = 0
    for name in a:
        x, y = a[name].double(), b[name].double()
        off = (x - y).abs() > atol + rtol * y.abs()
        bad += int(off.sum())
        total += x.numel()
        if outlier_atol:
            torch.testing.assert_close(x, y, rtol=0, atol=outlier_atol, msg=lambda m: f"{name}: {m}")
        elif off.any():
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert bad <= outliers * total, f"{bad} of {total} elements differ by more than rtol={rtol}, atol={atol}"


# fp32 parallel runs sum gradients in another order than one process. Where a gradient is ~0 (rare
# bytes' embedding rows, a few MLP entries), that rounding noise is as large as the gradient, and Adam's
# g/(sqrt(v)+eps) turns it into a visible change of that one element. So fp32 comparisons allow 0.2% of
# elements outside rtol 1e-5 + atol 1e-6 (but within 1e-4 absolute); fp64 runs, where the noise is 1e-16, must agree
# everywhere to 1e-10, which shows the differences are rounding and not a wrong reduction. How many such
# elements there are depends on the text trained on: the suite's corpus (tests/support/corpus.py) leaves up
# to 0.14% in the layouts tested (the standard library of Python 3.11 stayed under 0.1%, the budget then).
FP32 = dict(rtol=1e-5, atol=1e-6, outliers=2e-3, outlier_atol=1e-4)
FP64 = dict(rtol=1e-10, atol=1e-12)
TOL = {"fp32": FP32, "fp64": FP64}


def perturb_qk_norms(model, std: float = 0.3):
    """Qwen3's q/k norm weights start at one, where a missing or misplaced norm would pass unnoticed: draw
    them around one instead (in place; returns the model)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, std)
    return model


def scratch_folder(prefix: str) -> str:
    """A new temporary folder, removed when this test process exits (a disk-offload folder the spawned ranks
    of a test use: made here, before any rank starts, so left behind by nobody)."""
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path
