"""A checkpoint's claims about itself, checked against its own bytes before anything trusts them.

`verify(ckpt)` returns the checkpoint's index.json once every claim in it is confirmed, and raises
ConfigError naming the first one that is not (a one-line error: the CLI exits 2 before any rank
starts). What is checked, reading only the index and the safetensors headers (no tensor data):

- the index: format, `step` an integer >= 0 equal to the folder's name step-N, `opt_t` (Adam's step
  count) in 0..step, `world_size` >= 1, `skips` >= 0, `data` an object, and `config` a valid config;
- every rank file named by a chunk: a plain file in the checkpoint folder (not a symbolic link), named
  rank-NNNNN.safetensors for a rank below world_size, whose header parses, has only known dtypes, and
  whose tensors' byte ranges tile the file's data exactly (each range's length is its shape's bytes);
- every tensor: a known section and dtype, a shape of non-negative integers, chunks whose boxes lie
  inside it and cover it exactly (no overlap, no gap), each chunk stored once under the key that names
  its tensor and offsets, with the index's dtype and the chunk's sizes as its shape in the header;
- the index's step, config, world size and optimizer counters equal the copy rank 0's file carries in
  its header metadata, and the index's digest of each rank file's header equals that header's
  (written by the same save: the claims travel with the bytes, and a header that changed is refused,
  say two tensors' byte ranges swapped);
- the config's model against the tensors: its parameter count first (cheap: a config claiming a huge
  model is refused before anything is built), then every parameter's and buffer's name and shape, from
  the model built on the meta device (no memory).

So a reader that passes `verify` allocates no more than the checkpoint's own tensors hold, and reads
what was written. Not checked: the tensor bytes themselves (no checksum over the data; a resume reads
only its own boxes). Torch is imported only for the meta-device model.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path

from ..config import Config, ConfigError
from ..rules import is_adapter
from ..safetensors_header import read_header as read_header_of
from . import rundir

CLAIMS = "fivefold_claims"   # rank 0's safetensors metadata: the index's claims, as canonical JSON
CLAIMED = ("step", "config", "world_size", "opt_t", "skips", "data")
SECTIONS = ("model", "exp_avg", "exp_avg_sq", "buffers")
RANK_FILE = re.compile(r"rank-(\d{5})\.safetensors")
# safetensors dtype names -> torch's (the index's names) and item sizes
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
          "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
          "BOOL": ("bool", 1)}
ITEMSIZE = dict(DTYPES.values())


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def chunk_key(key: str, offsets) -> str:
    """The name a chunk of tensor `key` at `offsets` is stored under in its rank file."""
    return f"{key}@{','.join(map(str, offsets))}"


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def header_digest(path: str | Path) -> str:
    """sha256 of a safetensors file's checked header (its tensors' names, dtypes, shapes and byte
    ranges, and its metadata), as the index records it for every rank file."""
    return hashlib.sha256(canonical(read_header(path)).encode()).hexdigest()


class Bad(ConfigError):
    """A checkpoint whose claims its bytes do not confirm."""


# -------------------------------------------------------------------------------------------------------
# Safetensors headers

def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _named(x, table: dict) -> bool:
    """Whether x is one of the string keys of `table` (a list or table from JSON is not hashable)."""
    return isinstance(x, str) and x in table


def _counts(x) -> bool:
    return isinstance(x, list) and all(_is_count(v) for v in x)


def open_plain(path: Path) -> int:
    """A read-only descriptor of `path`, refusing a symbolic link or anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        why = "is a symbolic link" if path.is_symlink() else f"cannot be read ({e.strerror})"
        raise Bad(f"{path} {why}; a checkpoint's files must be its own") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Bad(f"{path} is not a regular file")
    return fd


def read_header(path: str | Path) -> dict:
    """The header of safetensors file `path`, checked against the file itself: its length fits the
    file, it is a JSON object of string metadata and tensors of known dtypes whose byte ranges tile the
    data after the header exactly, each as long as its shape's bytes."""
    path = Path(path)
    fd = open_plain(path)
    try:
        size = os.fstat(fd).st_size
        header, start = read_header_of(fd, path, Bad)
    finally:
        os.close(fd)
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise Bad(f"{path}: header metadata is not a table of strings")
    _check_tiling(path, {k: v for k, v in header.items() if k != "__metadata__"}, size - start)
    return header


def _check_tiling(path: Path, tensors: dict, data_bytes: int) -> None:
    ranges = []
    for name, t in tensors.items():
        ok = (isinstance(t, dict) and _named(t.get("dtype"), DTYPES) and _counts(t.get("shape"))
              and _counts(t.get("data_offsets")) and len(t["data_offsets"]) == 2)
        if not ok:
            raise Bad(f"{path}: header entry {name!r} is not a tensor of a known dtype")
        a, b = t["data_offsets"]
        if b - a != math.prod(t["shape"]) * DTYPES[t["dtype"]][1]:
            raise Bad(f"{path}: {name!r} spans {b - a} bytes, its shape {t['shape']} needs "
                      f"{math.prod(t['shape']) * DTYPES[t['dtype']][1]}")
        ranges.append((a, b))
    end = 0
    for a, b in sorted(ranges):
        if a != end:
            raise Bad(f"{path}: the tensors' byte ranges do not tile the file (gap or overlap at byte {end})")
        end = b
    if end != data_bytes:
        raise Bad(f"{path}: the header describes {end} bytes of tensors, the file holds {data_bytes}")


# -------------------------------------------------------------------------------------------------------
# The index

def verify(ckpt: str | Path, model: bool = True) -> dict:
    """The checkpoint's index, once every claim it makes is confirmed by the checkpoint's own bytes
    (module docstring); ConfigError naming the first claim that is not. model=False leaves out the
    meta-device model (the trainer's ranks compare the tensors with their own model instead)."""
    ckpt = Path(ckpt)
    index = rundir.read_index(ckpt)
    where = f"{ckpt / rundir.INDEX}"
    counters(index, ckpt.name, where)
    headers: dict[str, dict] = {}
    check_claims(ckpt, index, headers, where)
    cfg = config_of(index, where)
    tensors = index.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise Bad(f"{where}: 'tensors' must be a non-empty table")
    used: set[tuple[str, str]] = set()
    for key, entry in tensors.items():
        check_tensor(ckpt, key, entry, index["world_size"], headers, used, where)
    if model:
        check_shapes(cfg, tensors, where)
    return index


def counters(index: dict, folder: str, where: str) -> None:
    """step, opt_t, world_size, skips: integers in range, the step the folder's name says."""
    for name in ("step", "opt_t", "world_size"):
        if not _is_count(index.get(name)):
            raise Bad(f"{where}: {name!r} must be an integer >= 0, got {index.get(name)!r}")
    step = index["step"]
    named = rundir.step_of(folder)
    if named is not None and named != step:
        raise Bad(f"{where}: step {step}, but the folder is {folder}")
    if index["opt_t"] > step:
        raise Bad(f"{where}: opt_t {index['opt_t']} (optimizer steps) must be in 0..{step} (the step)")
    if index["world_size"] < 1:
        raise Bad(f"{where}: world_size must be >= 1, got {index['world_size']}")
    if not _is_count(index.get("skips", 0)):
        raise Bad(f"{where}: 'skips' must be an integer >= 0, got {index.get('skips')!r}")
    if not isinstance(index.get("data", {}), (dict, type(None))):
        raise Bad(f"{where}: 'data' must be a table, got {index.get('data')!r}")


def config_of(index: dict, where: str) -> Config:
    """The index's config, valid for the world size it claims."""
    d = index.get("config")
    if not isinstance(d, dict):
        raise Bad(f"{where}: 'config' must be a table, got {type(d).__name__}")
    try:
        return Config.from_dict(d).validate(index["world_size"])
    except ConfigError as e:
        raise Bad(f"{where}: its config is not valid ({e})") from None


def header_of(ckpt: Path, name, world: int, headers: dict, where: str) -> dict:
    """The checked header of rank file `name` (read once)."""
    m = RANK_FILE.fullmatch(name) if isinstance(name, str) else None
    if m is None or int(m.group(1)) >= world:
        raise Bad(f"{where}: chunk file {name!r} is not rank-NNNNN.safetensors of a rank below {world}")
    if name not in headers:
        headers[name] = read_header(ckpt / name)
    return headers[name]


def check_tensor(ckpt: Path, key, entry, world: int, headers: dict, used: set, where: str) -> None:
    """One tensor's entry: section, dtype, shape, and chunks that cover it exactly as the headers store them."""
    section = key.split("/", 1)[0] if isinstance(key, str) and "/" in key else None
    if section not in SECTIONS:
        raise Bad(f"{where}: tensor {key!r} is in no known section ({', '.join(SECTIONS)})")
    ok = isinstance(entry, dict) and _named(entry.get("dtype"), ITEMSIZE) and _counts(entry.get("shape"))
    if not ok or not isinstance(entry.get("chunks"), list):
        raise Bad(f"{where}: {key}: needs a shape (integers >= 0), a dtype ({', '.join(ITEMSIZE)}) and chunks")
    shape, boxes = entry["shape"], []
    for chunk in entry["chunks"]:
        boxes.append(check_chunk(ckpt, key, entry, chunk, world, headers, used, where))
    covered = sum(math.prod(sizes) for _, sizes in boxes)
    if covered != math.prod(shape) or overlapping(boxes):
        raise Bad(f"{where}: the chunks of {key} do not cover its {math.prod(shape)} elements exactly once")


def check_chunk(ckpt: Path, key: str, entry: dict, chunk, world: int, headers: dict, used: set, where: str):
    """One chunk: a box inside the tensor, stored once under its own key with the tensor's dtype and the
    box's sizes. Returns (offsets, sizes)."""
    shape = entry["shape"]
    ok = (isinstance(chunk, dict) and _counts(chunk.get("offsets")) and _counts(chunk.get("sizes"))
          and len(chunk["offsets"]) == len(chunk["sizes"]) == len(shape)
          and all(o + n <= full for o, n, full in zip(chunk["offsets"], chunk["sizes"], shape)))
    if not ok:
        raise Bad(f"{where}: a chunk of {key} is not a box inside its shape {shape}")
    offsets, sizes = chunk["offsets"], chunk["sizes"]
    name = chunk_key(key, offsets)
    if chunk.get("key") != name:
        raise Bad(f"{where}: a chunk of {key} at {offsets} is stored as {chunk.get('key')!r}, not {name!r}")
    header = header_of(ckpt, chunk.get("file"), world, headers, where)
    stored = header.get(name)
    if stored is None:
        raise Bad(f"{ckpt / chunk['file']} holds no tensor {name!r}")
    if DTYPES[stored["dtype"]][0] != entry["dtype"] or stored["shape"] != sizes:
        raise Bad(f"{ckpt / chunk['file']}: {name} is {DTYPES[stored['dtype']][0]} {stored['shape']}, the index "
                  f"says {entry['dtype']} {sizes}")
    if (chunk["file"], name) in used:
        raise Bad(f"{where}: chunk {name} of {chunk['file']} is named twice")
    used.add((chunk["file"], name))
    return offsets, sizes


def overlapping(boxes: list[tuple[list, list]]) -> bool:
    """Whether any two boxes (offsets, sizes) share an element."""
    for i, (a, n) in enumerate(boxes):
        for b, m in boxes[:i]:
            if all(max(x, y) < min(x + p, y + q) for x, p, y, q in zip(a, n, b, m)):
                return True
    return False


def check_claims(ckpt: Path, index: dict, headers: dict, where: str) -> None:
    """The index's step, config, world size, ... equal the copy in rank 0's file, and its digest of every
    rank file's header equals the header's (a checkpoint written before these copies existed has
    neither, and is checked by the rest alone)."""
    header = header_of(ckpt, rank_file(0), index["world_size"], headers, where)
    saved = header.get("__metadata__", {}).get(CLAIMS)
    if saved is None and "files" not in index:
        return
    if saved is None:
        raise Bad(f"{ckpt / rank_file(0)} carries no copy of the index's claims, yet the index lists file digests")
    try:
        claims = json.loads(saved)
    except (ValueError, RecursionError):
        raise Bad(f"{ckpt / rank_file(0)}: its copy of the index's claims is not JSON") from None
    if not isinstance(claims, dict):
        raise Bad(f"{ckpt / rank_file(0)}: its copy of the index's claims is not a table")
    for name in CLAIMED:
        if name in claims and canonical(index.get(name)) != canonical(claims[name]):
            raise Bad(f"{where}: {name!r} differs from the copy its rank files carry (the index was changed)")
    check_digests(ckpt, index, headers, where)


def check_digests(ckpt: Path, index: dict, headers: dict, where: str) -> None:
    """Exactly one digest per rank, each equal to that rank file's header's."""
    files, world = index.get("files"), index["world_size"]
    if not isinstance(files, dict) or len(files) != world:
        raise Bad(f"{where}: 'files' must list the header digest of each of the {world} rank files")
    for name, digest in files.items():
        header = header_of(ckpt, name, world, headers, where)
        if digest != hashlib.sha256(canonical(header).encode()).hexdigest():
            raise Bad(f"{ckpt / name}: its header is not the one the index recorded (the file was changed)")


def check_shapes(cfg: Config, tensors: dict, where: str) -> None:
    """The config's model has exactly the checkpoint's tensors: its parameter count first (no model is
    built for a config the tensors cannot be), then every name and shape, built on the meta device."""
    held = sum(math.prod(e["shape"]) for k, e in tensors.items() if k.startswith("model/") and not is_adapter(k))
    claimed = cfg.model.num_params()
    if claimed != held:
        raise Bad(f"{where}: its config's model has {claimed:,} parameters, its tensors hold {held:,}")
    expected = model_shapes(cfg.model, cfg.train)
    got = {k: list(e["shape"]) for k, e in tensors.items()}
    if got != expected:
        diff = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
        first = diff[0]
        raise Bad(f"{where}: {first} is {got.get(first, 'missing')}, its config's model has "
                  f"{expected.get(first, 'none')} ({len(diff)} tensor(s) differ)")


def model_shapes(model_cfg, train_cfg=None) -> dict[str, list[int]]:
    """Checkpoint key -> shape of every tensor a checkpoint of this model holds (trained parameters in
    every section, frozen ones in "model/" alone: train.lora_rank, train.freeze; persistent buffers), from
    the model built on the meta device."""
    from ..model import Transformer
    from ..model.lora import choose_trainable

    model = Transformer(model_cfg, device="meta")
    if train_cfg is not None:
        choose_trainable(model, train_cfg)
    params = {n: list(p.shape) for n, p in model.named_parameters()}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {n: list(b.shape) for n, b in model.state_dict().items() if n not in every}
    out = {f"{s}/{n}": shape for s in SECTIONS[:3] for n, shape in params.items() if s == "model" or n in trained}
    out.update({f"buffers/{n}": shape for n, shape in buffers.items()})
    return out
