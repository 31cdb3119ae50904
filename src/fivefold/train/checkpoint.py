"""Checkpoints: the full (unsharded) model and optimizer state, keyed by parameter name.

A checkpoint written by any layout holds whole tensors, so any layout can load it. Saved with
`torch.save` as {"format": 1, "step", "config", "state": {"model", "exp_avg", "exp_avg_sq", "opt_t",
"buffers"}}; "buffers" holds the model's persistent buffers (training state that is not a parameter,
e.g. the DeepSeek-V3 router's expert bias), whole, keyed by name. `to_model` puts the weights into a
fresh single-process `Transformer`.
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
    ck = torch.load(path, map_location="cpu", weights_only=True)   # tensors and plain data only: no code
    if ck.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {ck.get('format')!r}")
    return ck


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's persistent buffers by name (its state_dict without the parameters), on the CPU."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in params}


@torch.no_grad()
def load_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy the saved buffers this module holds (a pipeline stage holds some of them)."""
    for name, buf in model.named_buffers():
        if name in buffers:
            buf.copy_(buffers[name])


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
