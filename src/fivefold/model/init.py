"""Models that start empty and are filled piece by piece: construction on the meta device, the seeded
init of any box of any parameter, and turning meta parameters into real ones.

No rank ever builds the whole model (docs/architecture.md, its first paragraph): `Transformer(cfg, device="meta")`
allocates nothing, the parallel dimensions cut the meta parameters, and each rank then allocates only
what it holds (`materialize`) and fills it from a *source*: the seeded init below, a checkpoint
(train/checkpoint.py's Reader), or Hugging Face shard files (model/hf_weights.py). Every source answers
the same question, `read(key, box, local_shape)`: the values of one box of one single-process tensor
(`WeightSource`; its `read_into` puts them straight into the rank's tensor).

The init is layout-independent: the value of every element depends only on the seed, the parameter's
single-process name and the element's position, never on which rank computes it or what else it
computes. A whole-tensor stream (one generator drawn through the model, as before) would make a rank
that holds rows 4096..8191 of a matrix draw rows 0..4095 first; a per-element hash (a counter-based
generator) would make every element cost a dozen integer operations. Here each matrix, seen as rows x
columns (a stacked expert weight (E, f, h) is E·f rows of h), is cut into fixed tiles of TILE_ROWS x
TILE_COLS elements (edge tiles smaller); tile (i, j) is `torch.randn` from its own generator seeded by
a hash of (seed, name, i, j). A box is the tiles it overlaps, drawn and cut: the work is the box plus at
most one tile's rows and columns around it, and the draws are torch's own vectorised normal sampler.
Tensor-parallel column or row pieces, expert blocks, pipeline stages and ZeRO-3 flat shards (a partial
row, whole rows, a partial row) are all such boxes. The bound on what one read allocates: the box, plus
the tiles at its edges (at most 2·TILE_ROWS rows of the box's width and 2·TILE_COLS columns of its
height).

Values: N(0, init_std) for matrices; output projections (attention's wo, an MLP's or shared expert's
down, the experts' w_down) N(0, init_std/sqrt(2·layers)) (GPT-2 style); norms ones; biases zeros;
buffers (the sigmoid router's expert bias) zeros.
"""
from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from ..shapes import Box

TILE_ROWS = 64
TILE_COLS = 1024
OUTPUT_PROJECTIONS = ("wo.weight", "down.weight", "w_down")


def tile_seed(seed: int, name: str, i: int, j: int) -> int:
    """The generator seed of tile (i, j) of parameter `name`: 63 bits of a hash, the same everywhere."""
    digest = hashlib.blake2b(f"{seed}/{name}/{i}/{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def as_matrix(shape) -> tuple[int, int]:
    """(rows, columns) of a tensor seen as a matrix: every dim but the last are rows."""
    shape = tuple(shape)
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def normal_rows(seed: int, name: str, shape, row0: int, row1: int, col0: int, col1: int) -> torch.Tensor:
    """Standard-normal values of rows [row0, row1) and columns [col0, col1) of parameter `name` of
    `shape` (as a matrix: `as_matrix`), drawn tile by tile (module docstring); fp32."""
    rows, cols = as_matrix(shape)
    out = torch.empty(row1 - row0, col1 - col0)
    gen = torch.Generator()
    for i in range(row0 // TILE_ROWS, -(-row1 // TILE_ROWS)):
        r0, r1 = i * TILE_ROWS, min(rows, (i + 1) * TILE_ROWS)
        for j in range(col0 // TILE_COLS, -(-col1 // TILE_COLS)):
            c0, c1 = j * TILE_COLS, min(cols, (j + 1) * TILE_COLS)
            gen.manual_seed(tile_seed(seed, name, i, j))
            tile = torch.randn(r1 - r0, c1 - c0, generator=gen)
            lo_r, hi_r, lo_c, hi_c = max(r0, row0), min(r1, row1), max(c0, col0), min(c1, col1)
            out[lo_r - row0:hi_r - row0, lo_c - col0:hi_c - col0] = tile[lo_r - r0:hi_r - r0, lo_c - c0:hi_c - c0]
    return out


def init_std(cfg, name: str) -> float:
    """The init's standard deviation for matrix `name` (module docstring)."""
    if name.endswith(OUTPUT_PROJECTIONS):
        return cfg.init_std / math.sqrt(2 * cfg.layers)
    return cfg.init_std


def constant_of(name: str, shape) -> float | None:
    """The constant a non-random tensor starts at (norms 1, biases 0), or None for a random matrix."""
    if name.endswith("bias"):
        return 0.0
    if len(tuple(shape)) < 2:
        return 1.0
    return None


def init_box(cfg, seed: int, name: str, shape, offsets, sizes) -> torch.Tensor:
    """The seeded init of the box (offsets, sizes) of parameter `name` (full shape `shape`), fp32.

    The box is read as matrix rows: for a tensor of more than two dims each leading index range is cut
    into runs of whole rows, so a box of a stacked expert weight draws only its own experts' tiles."""
    shape, offsets, sizes = tuple(shape), tuple(offsets), tuple(sizes)
    const = constant_of(name, shape)
    if const is not None:
        return torch.full(sizes, const)
    if math.prod(sizes) == 0:
        return torch.empty(sizes)
    std = init_std(cfg, name)
    col0, col1 = offsets[-1], offsets[-1] + sizes[-1]
    lead_shape, lead_off, lead_sizes = shape[:-1], offsets[:-1], sizes[:-1]
    # the box's leading part, as runs of consecutive matrix rows (one run when it is a slab of dim 0)
    out = torch.empty(math.prod(lead_sizes), sizes[-1])
    row = 0
    for start, length in row_runs(lead_shape, lead_off, lead_sizes):
        out[row:row + length] = normal_rows(seed, name, shape, start, start + length, col0, col1)
        row += length
    return out.mul_(std).view(sizes)


def row_runs(shape, offsets, sizes) -> list[tuple[int, int]]:
    """(first row, count) of the runs of consecutive rows (row-major over `shape`) that the box
    (offsets, sizes) of the leading dims covers, in order."""
    if not shape:
        return [(0, 1)]
    inner = math.prod(shape[1:])
    if tuple(offsets[1:]) == (0,) * (len(shape) - 1) and tuple(sizes[1:]) == tuple(shape[1:]):
        return [(offsets[0] * inner, sizes[0] * inner)]
    runs = []
    for i in range(offsets[0], offsets[0] + sizes[0]):
        runs += [(i * inner + s, n) for s, n in row_runs(shape[1:], offsets[1:], sizes[1:])]
    return runs


class WeightSource:
    """What every weight source answers (module docstring): `read(key, box, local_shape)`, a tensor of
    `local_shape` whose leading box.sizes part holds the box (the rest zero), and `read_into(key, box,
    out)`, the same into `out` (any dtype). By default through `read`; a source that can put the bytes in
    place itself (a checkpoint's reader) overrides it, so a fill stages nothing."""

    def read(self, key: str, box, local_shape) -> torch.Tensor:
        raise NotImplementedError

    def read_into(self, key: str, box, out: torch.Tensor) -> None:
        out.copy_(self.read(key, box, tuple(out.shape)))


class InitSource(WeightSource):
    """The seeded init as a source (module docstring): "model/<name>" is the init of that parameter,
    optimizer moments ("exp_avg/", "exp_avg_sq/") and buffers ("buffers/") are zeros."""

    def __init__(self, cfg, seed: int):
        self.cfg, self.seed = cfg, seed

    def read(self, key: str, box, local_shape) -> torch.Tensor:
        section, _, name = key.partition("/")
        out = torch.zeros(tuple(local_shape))
        if section == "model" and box.numel:
            out[tuple(slice(0, n) for n in box.sizes)] = init_box(self.cfg, self.seed, name, box.shape,
                                                                 box.offsets, box.sizes)
        return out


# -- meta parameters -> real ones ---------------------------------------------------------------------

def placeholder(shape, dtype, device) -> torch.Tensor:
    """A real tensor of `shape` that occupies one element (every index reads it): the stand-in for a
    parameter whose storage an engine keeps elsewhere (ZeRO-3's shards), so its shape, dtype, device
    and placement are all there while nothing of its size is allocated."""
    return torch.empty(1, dtype=dtype, device=device).expand(tuple(shape))


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether `t` holds less storage than its size: a `placeholder` (or a meta tensor)."""
    return t.is_meta or (t.numel() > 1 and t.untyped_storage().nbytes() < t.numel() * t.element_size())


def replace_parameters(module: nn.Module, data_of) -> None:
    """Replace every parameter p of `module` by a new one holding `data_of(p)`, keeping its attributes
    (the placement), requires_grad and ties (a parameter held by two modules stays one)."""
    made: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                new = nn.Parameter(data_of(p), requires_grad=p.requires_grad)
                new.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
                made[id(p)] = new
            m._parameters[key] = made[id(p)]


@torch.no_grad()
def cast_meta(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module.to(dtype)` for a meta model, by new meta parameters, so it also works under a
    FakeTensorMode (where Module.to cannot swap tensors). Floating buffers (the router's expert bias) stay
    fp32, as MoE._apply keeps them, unless the model becomes fp64."""
    replace_parameters(module, lambda p: torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype,
                                                     device="meta"))
    for m in module.modules():
        for key, b in list(m._buffers.items()):
            if b is not None and b.is_floating_point() and dtype == torch.float64:
                m._buffers[key] = torch.empty(b.shape, dtype=dtype, device="meta")
    return module


@torch.no_grad()
def materialize(module: nn.Module, device, whole=True) -> None:
    """Replace every meta parameter of `module` by a real one on `device` (uninitialised; `whole` (a bool,
    or a test of the parameter): its full local size, else a `placeholder`), keeping its attributes and
    ties (`replace_parameters`); meta buffers become zeros on `device`. What is not meta is moved to
    `device` as it is."""
    def data_of(p):
        if not p.is_meta:
            return p.detach().to(device)
        full = whole(p) if callable(whole) else whole
        return torch.empty(p.shape, dtype=p.dtype, device=device) if full else placeholder(p.shape, p.dtype, device)

    replace_parameters(module, data_of)
    for m in module.modules():
        for key, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device=device) if b.is_meta else b.to(device)


@torch.no_grad()
def fill_model(model: nn.Module, source) -> None:
    """Fill a single-process model (every parameter whole) from `source`, one tensor at a time: its
    parameters from "model/<name>", its persistent buffers from "buffers/<name>" (generate, export)."""
    params = dict(model.named_parameters())
    for name, p in params.items():
        p.copy_(source.read(f"model/{name}", Box.whole(p.shape), p.shape))
    for name, b in model.state_dict().items():
        if name not in params and name not in dict(model.named_parameters(remove_duplicate=False)):
            b.copy_(source.read(f"buffers/{name}", Box.whole(b.shape), b.shape))
