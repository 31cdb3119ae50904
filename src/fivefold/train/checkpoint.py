"""Checkpoints: the full (unsharded) model and optimizer state, keyed by parameter name.

A checkpoint written by any layout holds whole tensors, so any layout can load it. Saved with
`torch.save` as {"format": 1, "step", "config", "state": {"model", "exp_avg", "exp_avg_sq", "opt_t"}}.
`to_model` puts the weights into a fresh single-process `Transformer`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import Config

FORMAT = 1


def save(path: str | Path, state: dict, step: int, cfg: Config) -> None:
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    torch.save({"format": FORMAT, "step": step, "config": cfg.to_dict(), "state": state}, tmp)
    tmp.replace(path)


def load(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if ck.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {ck.get('format')!r}")
    return ck


def to_model(path: str | Path):
    """A single-process Transformer holding the checkpoint's weights."""
    from ..model import Transformer

    ck = load(path)
    cfg = Config.from_dict(ck["config"])
    model = Transformer(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ck["state"]["model"][name])
    return model
