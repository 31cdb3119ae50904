"""Hugging Face weight folders read slice by slice, and written tensor by tensor.

Reading (`HFWeights`): a folder that `save_pretrained` wrote — `model.safetensors`, or shards
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` naming the file of every tensor.
`read(key, box, local_shape)` (the source protocol of model/init.py) returns one box of one of *our*
tensors: it finds the Hugging Face tensors that hold the box (`parts`) and reads only the overlapping
slice of each (`SafetensorsFile`: positioned reads of exactly the slice's contiguous runs of bytes, no
memory map, so neither the reads nor the resident memory exceed the slice), counting what it read
(`bytes_read`, per file). So a rank reads its vocabulary rows, its tensor-
parallel column or row piece, its pipeline stage's layers, its experts, or its ZeRO-3 flat shard's rows,
and never a tensor it does not hold.

How our tensors map to theirs (model/hf.py's names): one to one for attention, norms, dense MLPs,
routers and shared experts; the experts' w_gate and w_up are the two halves (dim 1) of transformers
5.x's packed `mlp.experts.gate_up_proj` (E, 2f, h) and w_down is `mlp.experts.down_proj`; folders in the
older per-expert layout (`experts.<e>.gate_proj` / `up_proj` / `down_proj`, Mixtral's `block_sparse_moe.
experts.<e>.w1` / `w3` / `w2`) map expert e's slab of our stacked tensor to its own 2-D tensor.

`check(cfg)` holds a folder against a model config before any rank starts: every tensor the model needs
is there with its shape, each is a floating-point tensor, and nothing is left over (one line naming the
first differences). The shapes and dtypes come from the files' own headers, not from the index.

Writing (`write_sharded`): tensors go one at a time into shard files of at most `max_shard_bytes`
(a tensor larger than that gets a file of its own), with the index Hugging Face writes. The safetensors
format is written directly (an 8-byte header length, the JSON header, the raw bytes), so a file is
streamed tensor by tensor: what is held at once is one tensor, produced by the caller's `fetch(name)`.
"""
from __future__ import annotations

import errno
import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Callable

import torch

from ..config import ConfigError, ModelConfig
from ..rules import install_hint
from ..safetensors_header import read_header
from .hf_map import PACKED_NAMES, config_from_hf, name_map
from .init import WeightSource

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
CODES = {v: k for k, v in DTYPES.items()}
# what a file we write may hold besides weights (checkpoints: random-number states, counters)
WRITE_CODES = {**CODES, torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True)
class Part:
    """Our tensor's region [lo, lo + sizes) is Hugging Face tensor `name`'s region [their_lo, ...),
    with our leading `drop` dims (of size 1 in the region) absent from theirs."""

    name: str
    lo: tuple[int, ...]
    sizes: tuple[int, ...]
    their_lo: tuple[int, ...]
    drop: int = 0


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> its single-process shape (from the meta model: nothing allocated)."""
    from .transformer import Transformer

    return {n: tuple(p.shape) for n, p in Transformer(cfg, device="meta").named_parameters()}


def parts(cfg: ModelConfig, theirs: set[str]) -> dict[str, list[Part]]:
    """Our name -> the Hugging Face regions it is made of, for the layout the folder's names show."""
    shapes = expected_shapes(cfg)
    out = {ours: [Part(n, (0,) * len(shapes[ours]), shapes[ours], (0,) * len(shapes[ours]))]
           for ours, n in name_map(cfg).items()}
    for i in range(cfg.layers):
        if not cfg.is_moe_layer(i):
            continue
        packed = f"model.layers.{i}.mlp.experts.gate_up_proj"
        if packed in theirs or not any(f"model.layers.{i}." in n and ".experts.0." in n for n in theirs):
            f = cfg.expert_ffn
            for k, ours in enumerate(PACKED_NAMES["mlp.experts.gate_up_proj"]):
                shape = shapes[f"layers.{i}.{ours}"]
                out[f"layers.{i}.{ours}"] = [Part(packed, (0, 0, 0), shape, (0, k * f, 0))]
            continue
        legacy = per_expert_names(i, theirs)
        out.pop(f"layers.{i}.mlp.experts.w_down", None)
        for ours, theirs_of in legacy.items():
            shape = shapes[f"layers.{i}.mlp.experts.{ours}"]
            out[f"layers.{i}.mlp.experts.{ours}"] = [Part(theirs_of(e), (e, 0, 0), (1,) + shape[1:], (0, 0), drop=1)
                                                     for e in range(cfg.experts)]
        if f"model.layers.{i}.block_sparse_moe.gate.weight" in theirs:   # Mixtral's older router name
            shape = shapes[f"layers.{i}.mlp.router.weight"]
            out[f"layers.{i}.mlp.router.weight"] = [Part(f"model.layers.{i}.block_sparse_moe.gate.weight",
                                                         (0, 0), shape, (0, 0))]
    return out


def per_expert_names(i: int, theirs: set[str]) -> dict[str, Callable[[int], str]]:
    """Our stacked expert weight -> the name of expert e's own tensor, in the older per-expert layouts."""
    if f"model.layers.{i}.block_sparse_moe.experts.0.w1.weight" in theirs:   # Mixtral
        base = f"model.layers.{i}.block_sparse_moe.experts"
        kinds = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
    else:                                                                        # Qwen2-MoE
        base = f"model.layers.{i}.mlp.experts"
        kinds = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
    return {ours: (lambda e, k=k: f"{base}.{e}.{k}.weight") for ours, k in kinds.items()}


def their_shapes(cfg: ModelConfig, mapping: dict[str, list[Part]]) -> dict[str, tuple[int, ...]]:
    """The shape each Hugging Face tensor must have, from the regions that cover it."""
    shapes: dict[str, list[int]] = {}
    for ps in mapping.values():
        for p in ps:
            hi = [lo + n for lo, n in zip(p.their_lo, p.sizes[p.drop:])]
            have = shapes.setdefault(p.name, [0] * len(hi))
            shapes[p.name] = [max(a, b) for a, b in zip(have, hi)]
    return {k: tuple(v) for k, v in shapes.items()}


class SafetensorsFile:
    """One safetensors file read with positioned reads: the header (8-byte length, JSON) parsed once and
    checked against itself (every tensor's byte range is its shape times its dtype's size, inside the
    file), then any box of any tensor read as the few contiguous runs of bytes it spans. `dtypes`: the
    codes it reads (weights: the float ones; a checkpoint's reader adds its integer random states).
    `follow_links=False` (a run folder's own files) opens the path itself or nothing: a link put there after
    the caller's check is refused at the open (O_NOFOLLOW). Anything but a regular file is refused after
    it (a FIFO does not block the open: O_NONBLOCK, cleared once the file is known regular). An --init-hf
    folder's files may be links (`HFWeights.handle` checks where they lead: the hub cache's are)."""

    def __init__(self, path: Path, dtypes: dict[str, torch.dtype] | None = None, follow_links: bool = True):
        self.path, self.fd, self.dtypes = path, -1, DTYPES if dtypes is None else dtypes
        flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
        try:
            self.fd = os.open(path, flags)
        except OSError as e:
            why = "is a symbolic link" if e.errno == errno.ELOOP and not follow_links else f"cannot be opened ({e.strerror})"
            raise ConfigError(f"{path}: {why}") from None
        try:
            stat = os.fstat(self.fd)
            if not S_ISREG(stat.st_mode):
                raise ConfigError(f"{path}: not a plain file")
            os.set_blocking(self.fd, True)
            size = stat.st_size
            header, self.start = read_header(self.fd, path, ConfigError)
            header.pop("__metadata__", None)
            self.tensors = {name: self._checked(name, info, size - self.start) for name, info in header.items()}
            self._check_disjoint(header)
        except BaseException:
            self.close()
            raise

    def _check_disjoint(self, header: dict) -> None:
        """No two tensors share a byte: sorted by start, each begins at or after the previous one's end (what
        safetensors and transformers refuse too; a shared range would read one tensor's bytes as another's)."""
        ranges = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items())
        for (_, end, before), (start, _, name) in zip(ranges, ranges[1:]):
            if start < end:
                raise ConfigError(f"{self.path}: {name} claims bytes from {start}, inside {before}'s (up to "
                                  f"{end}); the tensors' byte ranges must not overlap")

    def _checked(self, name, info, data_bytes: int) -> tuple[tuple[int, ...], str, int]:
        """(shape, dtype code, first byte) of one header entry, once its claims agree with each other."""
        try:
            shape, code, (lo, hi) = tuple(info["shape"]), info["dtype"], info["data_offsets"]
            ok = isinstance(code, str) and all(isinstance(d, int) and d >= 0 for d in (*shape, lo, hi))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"{self.path}: header entry {name!r} is malformed")
        itemsize = self.dtypes[code].itemsize if code in self.dtypes else None
        if itemsize is not None and (hi - lo != math.prod(shape) * itemsize or hi > data_bytes):
            raise ConfigError(f"{self.path}: {name} claims bytes [{lo}, {hi}) for shape {list(shape)} {code} "
                              f"in {data_bytes} bytes of data")
        return shape, code, lo

    def keys(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, name: str) -> torch.dtype:
        code = self.tensors[name][1]
        if code not in self.dtypes:
            raise ConfigError(f"{self.path}: {name} is {code}; this reader takes {', '.join(self.dtypes)}")
        return self.dtypes[code]

    def _runs(self, name: str, offsets, sizes):
        """The file positions and lengths, in bytes, of the contiguous runs the box (offsets, sizes) of
        tensor `name` spans, in the box's row-major order."""
        shape, _, lo = self.tensors[name]
        item = self.dtype(name).itemsize
        offsets, sizes = tuple(offsets), tuple(sizes)
        if not (len(offsets) == len(sizes) == len(shape)
                and all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, sizes, shape))):
            raise ConfigError(f"{self.path}: box at {list(offsets)} of {list(sizes)} lies outside {name}'s "
                              f"shape {list(shape)}")
        k = len(shape)   # dims k.. are whole in the box: each run is sizes[k-1] x prod(shape[k:]) elements
        while k > 0 and offsets[k - 1] == 0 and sizes[k - 1] == shape[k - 1]:
            k -= 1
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        run = (sizes[k - 1] if k else 1) * math.prod(shape[k:]) * item
        if not math.prod(sizes):
            return
        for index in itertools.product(*(range(o, o + n) for o, n in zip(offsets[:max(k - 1, 0)], sizes))):
            first = sum(i * s for i, s in zip(index, strides)) + (offsets[k - 1] * strides[k - 1] if k else 0)
            yield self.start + lo + first * item, run

    def _fill(self, name: str, offsets, sizes, buffer: torch.Tensor) -> int:
        """Read the box's runs one after another into the contiguous `buffer`'s bytes; the bytes read."""
        view, at = memoryview(buffer.detach().view(-1).view(torch.uint8).numpy()), 0
        for position, run in self._runs(name, offsets, sizes):
            end = at + run
            while at < end:   # one call moves at most ~2 GiB on Linux: read on until the run is in
                got = os.preadv(self.fd, [view[at:end]], position)
                if got <= 0:
                    raise ConfigError(f"{self.path}: {name} is cut short (the file is truncated)")
                at, position = at + got, position + got
        return at

    def read(self, name: str, offsets, sizes) -> tuple[torch.Tensor, int]:
        """(the box (offsets, sizes) of tensor `name`, the bytes read for it)."""
        out = torch.empty(tuple(sizes), dtype=self.dtype(name))   # every byte is read into
        return out, self._fill(name, offsets, sizes, out)

    def read_into(self, name: str, offsets, sizes, dst: torch.Tensor) -> int:
        """dst (of the box's sizes) = the box (offsets, sizes) of tensor `name`; the bytes read. Straight
        from the file into dst's memory where dst is contiguous in the file's dtype (a rank restoring its
        own shards: nothing staged); otherwise through one box-sized buffer, cast by copy_."""
        if tuple(dst.shape) != tuple(sizes):
            raise ValueError(f"{name}: a box of {list(sizes)} read into a tensor of {list(dst.shape)}")
        if dst.dtype == self.dtype(name) and dst.is_contiguous() and dst.device.type == "cpu":
            return self._fill(name, offsets, sizes, dst)
        piece, n = self.read(name, offsets, sizes)
        dst.copy_(piece)
        return n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):   # a reader dropped with its source (a restore, an export) gives its descriptor back
        try:
            self.close()
        except Exception:   # at interpreter shutdown os may be gone already
            pass


class HFWeights(WeightSource):
    """A Hugging Face weight folder as a source of boxes of our tensors (module docstring)."""

    def __init__(self, folder: str | Path, cfg: ModelConfig):
        self.folder, self.cfg = Path(folder), cfg
        self._open: dict[str, object] = {}
        self.bytes_read: dict[str, int] = {}
        self.files = self.weight_files()
        self.mapping = parts(cfg, set(self.files))

    def weight_files(self) -> dict[str, str]:
        """Hugging Face tensor name -> the file holding it (the index's map, or the single file's keys)."""
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{index}: not a Hugging Face weight index ({e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConfigError(f"{index}: weight_map must map tensor names to file names")
            return dict(weight_map)
        if (self.folder / SINGLE).is_file():
            return {k: SINGLE for k in self.handle(SINGLE).keys()}
        raise ConfigError(f"{self.folder}: no {SINGLE} or {INDEX} (a folder written by save_pretrained)")

    def handle(self, file: str) -> SafetensorsFile:
        if file not in self._open:
            path = self.folder / file
            if Path(file).name != file or path.is_symlink() and not self._inside(path.resolve()):
                raise ConfigError(f"{self.folder}: weight file {file!r} is outside the folder")
            if not path.is_file():
                raise ConfigError(f"{self.folder}: weight file {file} is missing")
            self._open[file] = SafetensorsFile(path)   # not safetensors (a pickle, say): refused, never run
        return self._open[file]

    def _inside(self, target: Path) -> bool:
        """Where a weight file's link may lead: inside the folder, or, for a snapshot of the Hugging Face hub's
        cache (<repo>/snapshots/<revision>, whose files are links to ../../blobs/<hash>), into its repository's
        blobs."""
        folder = self.folder.resolve()
        roots = [folder] + ([folder.parent.parent / "blobs"] if folder.parent.name == "snapshots" else [])
        return any(target.is_relative_to(root) for root in roots)

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype code) of Hugging Face tensor `name`, from its file's own header."""
        f = self.handle(self.files[name])
        if name not in f.tensors:
            raise ConfigError(f"{self.folder}: the index puts {name} in {self.files[name]}, which does not hold it")
        shape, code, _ = f.tensors[name]
        return shape, code

    def check(self) -> None:
        """The folder holds exactly the tensors this model needs, with their shapes, in a float dtype."""
        want = their_shapes(self.cfg, self.mapping)
        have = set(self.files)
        missing = sorted(set(want) - have)
        extra = sorted(n for n in have - set(want) if not ignorable(n, self.cfg))
        if missing or extra:
            raise ConfigError(f"{self.folder} does not match its config.json: "
                              + "; ".join(f"{what} {len(v)} tensor(s), e.g. {v[:3]}"
                                          for what, v in (("missing", missing), ("unexpected", extra)) if v)
                              + why_unexpected(extra, self.cfg))
        for name, shape in want.items():
            got, code = self.header(name)
            if got != shape:
                raise ConfigError(f"{self.folder}: {name} has shape {got} in {self.files[name]}, "
                                  f"config.json implies {shape}")
            if code not in DTYPES:
                raise ConfigError(f"{self.folder}: {name} is {code} in {self.files[name]}; weights must be "
                                  f"one of {', '.join(DTYPES)}")

    def read(self, key: str, box, local_shape) -> torch.Tensor:
        """The box of our tensor `key` ("model/<name>"; optimizer moments and buffers start at zero),
        in a tensor of `local_shape` (zero beyond box.sizes), as the checkpoint's reader does."""
        section, _, name = key.partition("/")
        whole = tuple(box.sizes) == tuple(local_shape)   # every element is written below (`covered`)
        out = (torch.empty if whole and section == "model" else torch.zeros)(tuple(local_shape), dtype=torch.float32)
        if section != "model" or not box.numel:
            return out
        covered = 0
        for p in self.mapping[name]:
            lo = [max(a, b) for a, b in zip(box.offsets, p.lo)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(box.offsets, box.sizes, p.lo, p.sizes)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            their_offsets = [low - o + t for low, o, t in zip(lo[p.drop:], p.lo[p.drop:], p.their_lo)]
            their_sizes = [h - low for low, h in zip(lo[p.drop:], hi[p.drop:])]
            file = self.files[p.name]
            piece, n = self.handle(file).read(p.name, their_offsets, their_sizes)
            self.bytes_read[file] = self.bytes_read.get(file, 0) + n
            if whole and [h - low for low, h in zip(lo, hi)] == list(box.sizes):   # one part is the box
                return piece.reshape(tuple(local_shape)).to(torch.float32)
            dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, box.offsets))
            out[dst] = piece.reshape([h - low for low, h in zip(lo, hi)]).to(out.dtype)
            covered += math.prod(h - low for low, h in zip(lo, hi))
        if covered != box.numel:
            raise ConfigError(f"{self.folder}: the tensors of {name} cover {covered} of {box.numel} elements")
        return out


def why_unexpected(extra: list[str], cfg: ModelConfig) -> str:
    """What a folder's unexpected tensors say about it, when they say something we know: FP8 block-quantized
    weights (DeepSeek-V3's release: each weight with a `weight_scale_inv`), or the multi-token-prediction
    module's layers past num_hidden_layers; "" otherwise."""
    notes = []
    if any(n.endswith("weight_scale_inv") for n in extra):
        notes.append("its weights are FP8 with block scales (weight_scale_inv), which fivefold does not read: "
                     "convert them to bf16 first (DeepSeek's inference/fp8_cast_bf16.py)")
    mtp = sorted({int(n.split(".")[2]) for n in extra if n.startswith("model.layers.") and n.split(".")[2].isdigit()
                  and int(n.split(".")[2]) >= cfg.layers})
    if mtp:
        notes.append(f"layer(s) {mtp} lie past num_hidden_layers = {cfg.layers}: a multi-token-prediction module, "
                     f"which fivefold does not build (drop those tensors from the index)")
    return "; " + "; ".join(notes) if notes else ""


def ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors a folder may hold that the model does not need: a tied model's saved head, rotary tables."""
    return (name == "lm_head.weight" and cfg.tie_embeddings) or name.endswith("rotary_emb.inv_freq")


def hf_config(folder: str | Path) -> ModelConfig:
    """Our ModelConfig from a Hugging Face folder's config.json (transformers fills the family's defaults)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--init-hf {folder}: no config.json (a folder written by save_pretrained)")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(f"--init-hf needs transformers: {install_hint('hf')}") from None
    try:
        hf_cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        return config_from_hf(hf_cfg)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ConfigError(f"--init-hf {folder}: {e}".splitlines()[0]) from None


def load_hf_model(folder: str | Path, device="cpu"):
    """A single-process Transformer with a Hugging Face folder's weights, filled tensor by tensor from
    the shard files (no transformers model is built: what is held is our model and one slice)."""
    from .init import fill_model, materialize
    from .transformer import Transformer

    cfg = hf_config(folder)
    weights = HFWeights(folder, cfg)
    weights.check()
    model = Transformer(cfg, device="meta")
    materialize(model, device)
    fill_model(model, weights)
    return model


# -- writing -------------------------------------------------------------------------------------------

def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into files of at most max_shard_bytes (a bigger tensor alone)."""
    files, current, used = [], [], 0
    for name, n in sizes.items():
        if current and used + n > max_shard_bytes:
            files.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        files.append(current)
    return files


def write_sharded(folder: str | Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  fetch: Callable[[str], torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Write tensors `specs` (name -> (shape, dtype)), each produced by `fetch(name)` when its turn
    comes, into `folder` as Hugging Face shards with their index (one file: model.safetensors, no index).
    Returns the file names."""
    folder = Path(folder)
    sizes = {n: math.prod(shape) * dtype.itemsize for n, (shape, dtype) in specs.items()}
    groups = plan_shards(sizes, max_shard_bytes)
    names = [SINGLE] if len(groups) == 1 else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
                                               for k in range(len(groups))]
    weight_map = {}
    for file, group in zip(names, groups):
        stream_safetensors(folder / file, {n: specs[n] for n in group}, fetch)
        weight_map.update({n: file for n in group})
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def stream_safetensors(path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                       fetch: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """One safetensors file, its header first (every tensor's dtype, shape and byte range, known from
    `specs`), then each tensor's bytes as `fetch` produces it, straight from its memory (no serialized
    copy of the file is built); written under a temporary name, synced, then renamed."""
    header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
    for name, (shape, dtype) in specs.items():
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": WRITE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # the data starts 8-byte aligned
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (shape, dtype) in specs.items():
            t = fetch(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: fetched {tuple(t.shape)} {t.dtype}, declared {tuple(shape)} {dtype}")
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
