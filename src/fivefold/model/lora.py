"""LoRA and frozen weights: fine-tuning that trains a few tensors and leaves the rest as they are.

Paper: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021). A target linear layer
y = x Wᵀ (+ b) becomes

    y = x Wᵀ (+ b) + (alpha / r) · dropout(x) Aᵀ Bᵀ,      A (r, in), B (out, r)

with W (and b) frozen, B starting at zero (so the first step computes what the base model computes) and A
drawn from N(0, 1/(3·in)): the variance of PEFT's default kaiming-uniform (bound 1/sqrt(in)), drawn by
model/init.py's tiles, so any piece of A has the same values on any layout. Every other parameter is
frozen too (PEFT's default, bias="none"); `train.freeze` freezes by name pattern without LoRA.

Names: the adapted module keeps its parameters (`layers.0.attn.wq.weight`) and gains `lora_A` and
`lora_B` beside them (`layers.0.attn.wq.lora_A`), so checkpoints, Hugging Face import and the parallel
dimensions see the base weight where they always did. Targets are our module names or Hugging Face's
(q_proj = wq, k_proj = wk, v_proj = wv, o_proj = wo, gate_proj = gate, up_proj = up, down_proj = down):
attention's projections and the dense and shared-expert MLPs (routed experts stay frozen).

Communication: none of its own. A frozen weight has no gradient, so no engine holds it: no optimizer
state, no data-parallel reduction (the ledger and the planner count the adapters' bytes only). Under
tensor parallelism (parallel/tensor.py) a column-parallel layer's B is split by output rows like W and
its A is whole on every rank with partial gradients (each rank's dy covers its rows) summed over tp; a
row-parallel layer's A is split by input columns like W and its B whole, its gradient partial (each rank's
x·Aᵀ is a partial sum), summed over tp; the adapter's output joins the base's partial sum before g.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..rules import check_lora_targets, frozen_by, is_adapter, lora_scale
from .init import WeightSource, normal_rows
from .layers import Dropout


class Adapter(nn.Module):
    """The low-rank path of one layer: (alpha/r) · dropout(x) Aᵀ Bᵀ, its parameters registered on the
    layer itself (`attach`) so their names sit beside the base weight's."""

    def __init__(self, scale: float, dropout: float):
        super().__init__()
        self.scale = scale
        self.drop = Dropout(dropout)

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(self.drop(x), a), b) * self.scale       # PEFT's order of operations


def attach(module: nn.Module, a: nn.Parameter, b: nn.Parameter, adapter: Adapter) -> None:
    """Give `module` the adapter parameters (`lora_A`, `lora_B`) and its low-rank path (`lora`)."""
    module.lora_A, module.lora_B, module.lora = a, b, adapter


def low_rank(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The adapter's output for input x, or None when `module` has no adapter."""
    adapter = getattr(module, "lora", None)
    return None if adapter is None else adapter(x, module.lora_A, module.lora_B)


class LoRALinear(nn.Linear):
    """nn.Linear with an adapter: base output plus the low-rank path. Built from an existing layer
    (its weight and bias kept, frozen) by `add_lora`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + low_rank(self, x)


def adapt_linear(linear: nn.Linear, r: int, scale: float, dropout: float) -> LoRALinear:
    """A LoRALinear holding `linear`'s (frozen) parameters and new adapters on their device and dtype."""
    new = LoRALinear.__new__(LoRALinear)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight, new.bias = linear.weight, linear.bias
    w = linear.weight
    a = nn.Parameter(torch.zeros(r, linear.in_features, dtype=w.dtype, device=w.device))
    b = nn.Parameter(torch.zeros(linear.out_features, r, dtype=w.dtype, device=w.device))
    attach(new, a, b, Adapter(scale, dropout))
    return new


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float, targets) -> list[str]:
    """Replace every target nn.Linear inside `model`'s blocks by a LoRALinear (in place) and freeze every
    other parameter. Works on a meta model (the adapters are then meta too). Returns the adapted modules'
    names; ValueError when no module matches."""
    ours = set(check_lora_targets(targets))
    scale = lora_scale(alpha, r)
    for p in model.parameters():
        p.requires_grad_(False)
    done = []
    for name, parent in list(model.named_modules()):
        if ".experts" in f".{name}" or "layers" not in name.split("."):
            continue
        for child_name, child in list(parent.named_children()):
            if child_name in ours and type(child) is nn.Linear:
                setattr(parent, child_name, adapt_linear(child, r, scale, dropout))
                done.append(f"{name}.{child_name}")
    if not done:
        raise ValueError(f"train.lora_targets {sorted(ours)} match no linear layer of this model")
    return done


def freeze(model: nn.Module, patterns) -> list[str]:
    """Freeze every parameter whose name matches one of the fnmatch `patterns` ("embed.*", "layers.0.*");
    returns their names. ValueError for a pattern that matches nothing (a typo freezes nothing silently)."""
    names = [n for n, _ in model.named_parameters()]
    frozen = []
    for pattern in patterns:
        hits = [n for n in names if frozen_by(n, [pattern])]
        if not hits:
            raise ValueError(f"train.freeze pattern {pattern!r} matches no parameter; names look like "
                             f"{names[0]}, layers.0.attn.wq.weight, norm.weight")
        frozen += hits
    params = dict(model.named_parameters())
    for n in frozen:
        params[n].requires_grad_(False)
    return sorted(set(frozen))


def adapter_init(name: str, shape, offsets, sizes, seed: int) -> torch.Tensor:
    """The start of a box of adapter `name` of full `shape`: B zeros; A N(0, 1/(3·in)), layout-free."""
    if name.endswith("lora_B"):
        return torch.zeros(tuple(sizes))
    std = 1.0 / math.sqrt(3 * shape[-1])
    r0, c0 = offsets
    return normal_rows(seed, name, shape, r0, r0 + sizes[0], c0, c0 + sizes[1]).mul_(std)


class AdapterSource(WeightSource):
    """A weight source (model/init.py's protocol) that answers adapters' keys with their start
    (`adapter_init`: their optimizer moments zeros) and every other key from `base` (the seeded init or
    a Hugging Face folder)."""

    def __init__(self, base, seed: int):
        self.base, self.seed = base, seed

    def read(self, key: str, box, local_shape) -> torch.Tensor:
        section, _, name = key.partition("/")
        if not is_adapter(name):
            return self.base.read(key, box, local_shape)
        out = torch.zeros(tuple(local_shape))
        if section == "model" and box.numel:
            out[tuple(slice(0, n) for n in box.sizes)] = adapter_init(name, box.shape, box.offsets, box.sizes,
                                                                     self.seed)
        return out


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale · B A in W's dtype, computed in fp32 (fp64 for fp64): the merged export's weight."""
    work = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return (weight.to(work) + scale * (b.to(work) @ a.to(work))).to(weight.dtype)


def choose_trainable(model: nn.Module, train) -> nn.Module:
    """What a run trains, applied to `model` in place (a meta model before any dimension cuts it):
    LoRA adapters (train.lora_rank > 0, everything else frozen) and the train.freeze patterns. The
    trainer, the checkpoint verifier and the single-process loaders all call this one function."""
    if train.lora_rank:
        add_lora(model, train.lora_rank, train.lora_alpha, train.lora_dropout, train.lora_targets)
    if train.freeze:
        freeze(model, train.freeze)
    return model
