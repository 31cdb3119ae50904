"""Sharded checkpoints: every rank writes the pieces it holds, in parallel; any layout reads any other.

One checkpoint is a folder (OUT/checkpoints/step-00000050, see rundir.py):

    index.json              format, step, config, world size, optimizer step count, and for every tensor
                            ("model/<param>", "exp_avg/<param>", "exp_avg_sq/<param>", "buffers/<name>",
                            by its single-process name) its full shape, dtype and chunks
    rank-00003.safetensors  the chunks rank 3 wrote, and rank 3's random-number state ("rng/...")

A chunk is a box of the single-process tensor (offsets and sizes along every dim): a tensor-parallel
piece, a block of experts, a whole replicated tensor, or part of a ZeRO shard. A ZeRO shard is a flat
range of a parameter's (tensor-parallel) piece; `flat_boxes` cuts such a range into the few boxes it
spans (a partial row, whole rows, a partial row), so shards are written as they are, with no gather.
Ranks holding the same box (data-parallel replicas, tied copies) agree on one writer, so the writing is
spread over the ranks and no rank ever holds more than its own state.
To read, each rank computes the box it needs in its own layout and copies in the overlapping parts of
the stored chunks with positioned reads (only the needed runs of bytes are read, straight into the rank's
own tensors where a stored chunk is the box it needs: `Reader.read_into`): dp4 → tp2×pp2,
zero3 → zero0, ep4 → ep2 all load. A tensor the new model lacks, or one the checkpoint lacks, fails.

Nothing on disk is unpickled: tensors are safetensors, the rest is JSON. (torch.distributed.checkpoint
was the other candidate; its metadata file is read with `pickle.load`, so a crafted checkpoint there
runs code on every rank.)

Trusted only as far as its own bytes confirm (verify.py): rank 0's file carries a copy of the index's
step, config and counters in its header metadata, and the index the digest of every rank file's header,
so neither can change without the other.

Atomic: ranks write into OUT/checkpoints/.tmp-step-N-<nonce>/ and fsync; rank 0 writes index.json last,
fsyncs and renames the folder to step-N. Readers only ever see complete checkpoints; the oldest complete
ones beyond `keep` are removed after the new one is in place, stale temporary folders with them.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from pathlib import Path

import torch

from ..comm import gather_objects
from ..config import Config, ConfigError
from ..model.init import WeightSource
from ..parallel.placement import Placement
from ..shapes import Box
from . import rundir
from .rundir import FORMAT, INDEX
from .verify import CLAIMS, DTYPES, canonical, chunk_key, header_digest, rank_file, verify

SECTIONS = ("model", "exp_avg", "exp_avg_sq")


def box_of(local_shape, placement: Placement, groups) -> Box:
    """The box of the full tensor that a rank's piece (shape `local_shape`, zero-padded at the end of
    each sharded dim) holds; `groups[name]` is the rank's group of that name (its rank and size)."""
    shape, offsets, sizes = list(local_shape), [0] * len(local_shape), list(local_shape)
    for s in placement.shards:
        if s.dim is None:
            continue
        g = groups[s.group]
        start, length = s.extent(g.rank, g.size)
        shape[s.dim], offsets[s.dim], sizes[s.dim] = s.full, start, length
    return Box(tuple(shape), tuple(offsets), tuple(sizes))


def _region(t: torch.Tensor, sizes) -> torch.Tensor:
    return t[tuple(slice(0, n) for n in sizes)]


def all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN or inf: its least and largest values, one reduction (`aminmax`) that makes
    no temporary of the tensor's size, finite. A NaN anywhere makes both NaN; an infinity is an extreme.
    The check made a bool mask a block of rows at a time before (and `isfinite`'s own temporaries):
    measured on a 25.7 M-parameter model's save, the anonymous memory it left in the heap was 3.6 of the
    save's 4.1 MiB rise. Integer and bool tensors are finite."""
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def flat_boxes(shape, start: int, stop: int) -> list[tuple[tuple, tuple]]:
    """(offsets, sizes) of the boxes that cover the flat positions [start, stop) of a row-major tensor of
    `shape`, in order; each box is contiguous in memory, so box k is the next prod(sizes) elements."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:   # inside one row of dim 0
        return [((first,) + o, (1,) + n) for o, n in flat_boxes(shape[1:], start - first * inner, stop - first * inner)]
    boxes = []
    if start % inner:   # the end of a first, partial row
        boxes += [((first,) + o, (1,) + n) for o, n in flat_boxes(shape[1:], start % inner, inner)]
        first += 1
    whole_last = last if stop % inner == 0 else last - 1
    if whole_last >= first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (whole_last - first + 1,) + shape[1:]))
    if stop % inner:    # the start of a last, partial row
        boxes += [((last,) + o, (1,) + n) for o, n in flat_boxes(shape[1:], 0, stop % inner)]
    return boxes


def segment_chunks(piece: Box, local_shape, start: int, length: int):
    """For a flat segment [start, start + length) of a rank's piece (shape `local_shape`, whose leading
    `piece.sizes` part is the box `piece` of the full tensor, the rest padding): (box of the full tensor,
    box sizes before clipping the padding, offset into the segment) per box it spans; padding-only boxes
    are left out."""
    out, o = [], 0
    for offsets, sizes in flat_boxes(local_shape, start, start + length):
        clipped = tuple(max(0, min(a + n, r) - a) for a, n, r in zip(offsets, sizes, piece.sizes))
        if math.prod(clipped) or not sizes:
            out.append((Box(piece.shape, tuple(a + b for a, b in zip(offsets, piece.offsets)), clipped), sizes, o))
        o += math.prod(sizes)
    return out


def _chunk_key(key: str, box: Box) -> str:
    return chunk_key(key, box.offsets)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------------------------------
# Save (every rank)

class NonFiniteState(RuntimeError):
    """The state to save holds NaN or inf: it is not written."""

    brief = True


class SaveFailed(RuntimeError):
    """A rank could not write its part of a checkpoint (a full disk, a quota): nothing of it is kept."""

    brief = True


def save(out: str | Path, step: int, cfg: Config, entries: list[tuple[str, torch.Tensor, Box]],
         rng: dict[str, torch.Tensor], meta: dict, keep: int, rank: int, protect: int | None = None) -> Path:
    """Write checkpoint `step` of the run in `out` from every rank's `entries` (key, tensor, the box of
    the full tensor it holds: the tensor's leading box.sizes part), plus this rank's `rng` tensors and
    `meta` (JSON, from rank 0). Call on every rank; returns the checkpoint folder once it is complete
    and visible to every rank."""
    root = Path(out) / rundir.CHECKPOINTS
    entries = [(key, t, box) for key, t, box in entries if box.numel]
    specs = {(key, box.offsets): (box.shape, box.sizes, str(t.dtype).removeprefix("torch."))
             for key, t, box in entries}
    finite = all(all_finite(_region(t, box.sizes)) for _, t, box in entries if t.is_floating_point())
    nonce = secrets.token_hex(4)
    everyone = gather_objects((specs, finite, nonce))   # bookkeeping exchange
    if not all(f for _, f, _ in everyone):
        bad = [r for r, (_, f, _) in enumerate(everyone) if not f]
        raise NonFiniteState(f"not saving the checkpoint of step {step}: ranks {bad} hold NaN or inf "
                             f"in the model or optimizer state")
    tmp = root / f".tmp-step-{step:08d}-{everyone[0][2]}"
    writers = assign_writers([s for s, _, _ in everyone])
    mine = {_chunk_key(key, box): _region(t, box.sizes).detach().to("cpu").contiguous()
            for key, t, box in entries if writers[(key, box.offsets)] == rank}
    mine.update({f"rng/{k}": v.detach().to("cpu").contiguous() for k, v in rng.items()})
    claims = {"step": step, "config": cfg.to_dict(), "world_size": len(everyone), **meta}
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        _write_safetensors(tmp / rank_file(rank), mine, {CLAIMS: canonical(claims)} if rank == 0 else {})
        written = (header_digest(tmp / rank_file(rank)), None)
    except OSError as e:   # ENOSPC, EDQUOT, EIO: said in one line, every rank alike, the partial save removed
        written = (None, f"rank {rank}: {e.strerror or e} ({tmp / rank_file(rank)})")
    results = gather_objects(written)   # every rank's file is written and synced, or why not
    failed = [err for _, err in results if err]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)   # our own temporary folder (its name carries the nonce)
        gather_objects(None)
        raise SaveFailed(f"the checkpoint of step {step} was not saved: {failed[0]}"
                         + (f" and {len(failed) - 1} other rank(s)" if len(failed) > 1 else "")
                         + "; the previous checkpoints are kept")
    digests = [d for d, _ in results]
    final = rundir.step_dir(out, step)
    if rank == 0:
        index = {"format": FORMAT, "step": step, "config": cfg.to_dict(), "world_size": len(everyone), **meta,
                 "files": {rank_file(r): d for r, d in enumerate(digests)},
                 "tensors": build_index(everyone, writers)}
        (tmp / INDEX).write_text(json.dumps(index, indent=1))
        _fsync(tmp / INDEX)
        _fsync(tmp)
        _publish(tmp, final)
        prune(out, keep, protect)
    gather_objects(None)   # the checkpoint is visible
    return final


def assign_writers(specs_by_rank: list[dict]) -> dict[tuple[str, tuple], int]:
    """(key, offsets) -> the rank that writes that chunk: of the ranks holding it, in turn, so replicas
    share the writing. The same on every rank (it depends only on the gathered specs)."""
    holders: dict[tuple[str, tuple], list[int]] = {}
    for r, specs in enumerate(specs_by_rank):
        for chunk in specs:
            holders.setdefault(chunk, []).append(r)
    return {chunk: ranks[i % len(ranks)] for i, (chunk, ranks) in enumerate(sorted(holders.items()))}


def build_index(everyone: list, writers: dict) -> dict:
    tensors: dict[str, dict] = {}
    for r, (specs, _, _) in enumerate(everyone):
        for (key, offsets), (shape, sizes, dtype) in specs.items():
            if writers[(key, offsets)] != r:
                continue
            entry = tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "chunks": []})
            entry["chunks"].append({"file": rank_file(r), "key": _chunk_key(key, Box(shape, offsets, sizes)),
                                    "offsets": list(offsets), "sizes": list(sizes)})
    return dict(sorted(tensors.items()))


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A rank's chunks as one safetensors file, each tensor's bytes written from its own memory
    (`stream_safetensors`): safetensors' `save_file` built the whole file in memory first, an anonymous
    rise of the rank's file size during every save. Mode 0666 less the umask, like every output."""
    from ..model.hf_weights import stream_safetensors

    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))   # wider first: every tensor aligned
    stream_safetensors(path, {k: (tuple(tensors[k].shape), tensors[k].dtype) for k in order}, tensors.__getitem__,
                       {"format": "fivefold", **metadata})


def _publish(tmp: Path, final: Path) -> None:
    """Rename the complete folder into place (a checkpoint of the same step is replaced only after)."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{secrets.token_hex(4)}")
        final.rename(old)
    tmp.rename(final)
    _fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(out: str | Path, keep: int, protect: int | None = None) -> None:
    """Remove the oldest complete checkpoints beyond `keep` (never step `protect`: train.keep_best's), and
    leftovers of interrupted saves (the run folder's lock means no other save is under way)."""
    for old in rundir.checkpoints(out)[:-keep]:
        if protect is not None and rundir.step_of(old.name) == protect:
            continue
        try:
            rundir.read_index(old)   # fivefold's own (its index says so): nothing else is removed
        except ConfigError:
            continue
        shutil.rmtree(old, ignore_errors=True)
    root = Path(out) / rundir.CHECKPOINTS
    for stale in root.glob(".*"):
        if stale.is_dir() and (stale.name.startswith(".tmp-") or stale.name.startswith(".old-")):
            if not (stale / INDEX).exists() or stale.name.startswith(".old-"):
                shutil.rmtree(stale, ignore_errors=True)


# -------------------------------------------------------------------------------------------------------
# Load

READ_DTYPES = {code: getattr(torch, dtype) for code, (dtype, _) in DTYPES.items()}   # what a chunk file may hold
OPEN_FILES = 64   # chunk files a Reader keeps open at once (the oldest closed first)


class Reader(WeightSource):
    """Reads boxes of a checkpoint's tensors from its chunks (files opened lazily, read with positioned
    reads: model/hf_weights.py `SafetensorsFile`), once `verify` has confirmed every claim of its index
    against the files (verify.py)."""

    def __init__(self, ckpt: str | Path, model: bool = True):
        self.path = Path(ckpt)
        self.index = verify(self.path, model)
        self.tensors = self.index["tensors"]
        self._files: dict[str, object] = {}

    def _file(self, name: str):
        from ..model.hf_weights import SafetensorsFile

        if name not in self._files:
            path = self.path / name
            if Path(name).name != name or path.is_symlink() or not path.is_file():
                raise ConfigError(f"{self.path}: chunk file {name!r} is missing (or not a plain file)")
            if len(self._files) >= OPEN_FILES:   # an export reads every rank's file: hold a few descriptors
                self._files.pop(next(iter(self._files))).close()
            # not safetensors (a pickle, say): refused, never run; a link swapped in after the check: refused
            self._files[name] = SafetensorsFile(path, READ_DTYPES, follow_links=False)
        return self._files[name]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def read(self, key: str, box: Box, local_shape) -> torch.Tensor:
        """A tensor of `local_shape` whose leading `box.sizes` part holds the box of tensor `key`
        (the rest zero: the padding of a sharded piece)."""
        out = torch.empty(tuple(local_shape), dtype=getattr(torch, self.tensors[key]["dtype"]))
        self.read_into(key, box, out)
        return out

    def read_into(self, key: str, box: Box, out: torch.Tensor) -> None:
        """`read` into `out`, a tensor of the local shape (any dtype; its part beyond box.sizes zeroed). Where
        a chunk of the file is exactly the box and `out` is contiguous in the chunk's dtype, as when a
        rank restores the shards it saved, the bytes go from the file straight into `out`: a restore
        stages nothing (benchmarks/checkpoint.py's anonymous rise)."""
        entry = self.tensors[key]
        if tuple(entry["shape"]) != box.shape:
            raise ConfigError(f"{self.path}: {key} has shape {tuple(entry['shape'])}, this model's is {box.shape}")
        if tuple(out.shape) != tuple(box.sizes):
            out.zero_()
        covered = 0
        for chunk in entry["chunks"]:
            lo = [max(a, b) for a, b in zip(box.offsets, chunk["offsets"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(box.offsets, box.sizes, chunk["offsets"], chunk["sizes"])]
            if any(h <= low for low, h in zip(lo, hi)) and box.shape:
                continue
            dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, box.offsets))
            src = [low - o for low, o in zip(lo, chunk["offsets"])]
            self._file(chunk["file"]).read_into(chunk["key"], src, [h - low for low, h in zip(lo, hi)], out[dst])
            covered += math.prod(h - low for low, h in zip(lo, hi))
        if covered != box.numel:
            raise ConfigError(f"{self.path}: the chunks of {key} cover {covered} of the {box.numel} "
                              f"elements this rank needs (a damaged index)")

    def rng(self, rank: int) -> dict[str, torch.Tensor]:
        f = self._file(rank_file(rank))
        return {k.removeprefix("rng/"): f.read(k, [0] * len(f.tensors[k][0]), f.tensors[k][0])[0]
                for k in f.keys() if k.startswith("rng/")}   # each whole

    def full(self, key: str) -> torch.Tensor:
        shape = self.shape(key)
        return self.read(key, Box.whole(shape), shape)


def open_matching(ckpt: str | Path, wanted: set[str]) -> Reader:
    """A reader of checkpoint `ckpt`, once the keys the ranks want (`wanted` on each) are checked to be
    exactly those it holds. Call on every rank."""
    reader = Reader(ckpt, model=False)   # the keys and shapes are compared with this model's below and in read
    every = set().union(*gather_objects(sorted(wanted)))   # bookkeeping exchange
    missing = sorted(every - set(reader.tensors))
    extra = sorted(set(reader.tensors) - every)
    if missing or extra:
        raise ConfigError(f"{ckpt} does not match this model: "
                          + "; ".join(f"{what} {len(keys)} tensor(s), e.g. {keys[:3]}"
                                      for what, keys in (("lacks", missing), ("has extra", extra)) if keys))
    return reader


# -------------------------------------------------------------------------------------------------------
# Single process: whole tensors, export

def find(path: str | Path) -> Path:
    """A checkpoint folder, or the newest complete one of a run folder, once `verify` confirmed it."""
    ckpt = rundir.resolve_resume(str(path), path)
    if ckpt is None:
        raise ConfigError(f"{path}: no checkpoint")
    verify(ckpt)
    return ckpt


def full_tensors(path: str | Path, section: str = "model") -> dict[str, torch.Tensor]:
    """Whole single-process tensors of one section ("model", "exp_avg", "exp_avg_sq", "buffers")."""
    reader = Reader(find(path))
    prefix = section + "/"
    return {k.removeprefix(prefix): reader.full(k) for k in reader.tensors if k.startswith(prefix)}


def to_model(path: str | Path, device="cpu"):
    """A single-process Transformer holding the checkpoint's weights (and persistent buffers), filled
    tensor by tensor from the chunk files: what is held is the model and one tensor being read."""
    from ..model import Transformer
    from ..model.init import fill_model, materialize

    from ..model.lora import choose_trainable

    ckpt = find(path)
    reader = Reader(ckpt)
    cfg = Config.from_dict(reader.index["config"])
    model = choose_trainable(Transformer(cfg.model, device="meta"), cfg.train)   # a LoRA run's adapters too
    wanted = {f"model/{n}" for n, _ in model.named_parameters()} | {
        f"buffers/{n}" for n in persistent_buffers(model)}
    missing, unexpected = sorted(wanted - set(reader.tensors)), sorted(set(reader.tensors) - wanted)
    unexpected = [k for k in unexpected if not k.startswith(("exp_avg/", "exp_avg_sq/"))]
    if missing or unexpected:
        raise ConfigError(f"{ckpt}: weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    materialize(model, device)
    fill_model(model, reader)
    return model


def weight_keys(reader: Reader) -> list[str]:
    """The checkpoint's model weights and persistent buffers, as "model/<name>" / "buffers/<name>"."""
    return [k for k in reader.tensors if k.startswith(("model/", "buffers/"))]


def export(path: str | Path, dest: str | Path) -> Path:
    """One safetensors file with the whole model weights (single-process names) and, in its metadata,
    the config and step, streamed tensor by tensor (one tensor held at a time). Never replaces an
    existing file."""
    from ..model.hf_weights import stream_safetensors

    ckpt, dest = find(path), Path(dest)
    if dest.exists():
        raise ConfigError(f"{dest} exists; choose another file (export never overwrites)")
    reader = Reader(ckpt)
    keys = {k.split("/", 1)[1]: k for k in weight_keys(reader)}
    specs = {name: (reader.shape(key), getattr(torch, reader.tensors[key]["dtype"])) for name, key in keys.items()}
    dest.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "fivefold", "step": str(reader.index["step"]), "config": json.dumps(reader.index["config"])}
    stream_safetensors(dest, specs, lambda name: reader.full(keys[name]), meta)
    return dest


DEFAULT_SHARD_BYTES = 2 * 2**30   # export --hf: files of at most 2 GiB (--max-shard-mb)


def export_hf(path: str | Path, dest: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """A Hugging Face model folder (config.json, generation_config.json, and model.safetensors or
    model-0000k-of-0000n.safetensors shards of at most `max_shard_bytes` with their index, as
    `save_pretrained` writes them) holding the checkpoint's weights: Llama, Qwen2, Mixtral or Qwen2-MoE
    by the model's config (model/hf.py). Streamed tensor by tensor from the chunk files: one Hugging
    Face tensor is held at a time (a packed expert gate_up_proj: both halves). Needs `transformers`
    for the config; never writes into a non-empty folder."""
    from ..model.hf_map import config_to_hf, name_map, packed_map
    from ..model.hf_weights import write_sharded

    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"{dest} is not empty; choose a new folder (export never overwrites)")
    reader = Reader(find(path))
    cfg = Config.from_dict(reader.index["config"]).model
    hf_cfg = config_to_hf(cfg)
    sources = {theirs: (f"model/{ours}",) for ours, theirs in name_map(cfg).items()}
    sources.update({theirs: tuple(f"model/{o}" for o in ours) for theirs, ours in packed_map(cfg).items()})
    missing = sorted(k for ks in sources.values() for k in ks if k not in reader.tensors)
    if missing:
        raise ConfigError(f"{reader.path}: the checkpoint lacks {missing[:3]} for the Hugging Face export")

    def shape_of(keys):   # a packed tensor: its parts concatenated along dim 1
        shapes = [reader.shape(k) for k in keys]
        return shapes[0] if len(shapes) == 1 else (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])

    from ..rules import lora_scale

    train = Config.from_dict(reader.index["config"]).train
    scale = lora_scale(train.lora_alpha, train.lora_rank) if train.lora_rank else 0.0

    def fetch(theirs):
        parts = [reader.full(k) for k in sources[theirs]]
        if len(parts) > 1:
            return torch.cat(parts, dim=1)
        a = sources[theirs][0].removesuffix(".weight") + ".lora_A"
        if a in reader.tensors:   # LoRA: W + (alpha / r) B A (model/lora.py `merged`), one layer at a time
            from ..model.lora import merged
            return merged(parts[0], reader.full(a), reader.full(a.removesuffix("_A") + "_B"), scale)
        return parts[0]

    dtype = getattr(torch, reader.tensors[sources["model.embed_tokens.weight"][0]]["dtype"])
    specs = {theirs: (shape_of(keys), dtype) for theirs, keys in sorted(sources.items(), key=lambda kv: hf_order(kv[0]))}
    dest.mkdir(parents=True, exist_ok=True)
    hf_cfg.dtype = str(dtype).removeprefix("torch.")
    hf_cfg.architectures = [type(hf_cfg).__name__.replace("Config", "ForCausalLM")]
    hf_cfg.save_pretrained(str(dest))
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(hf_cfg).save_pretrained(str(dest))
    write_sharded(dest, specs, fetch, max_shard_bytes)
    return dest


def export_peft(path: str | Path, dest: str | Path) -> Path:
    """A LoRA run's adapters alone in PEFT's format (what `peft.PeftModel.from_pretrained(base, dest)`
    loads over the base model): adapter_config.json (r, lora_alpha, lora_dropout, the target modules by
    Hugging Face's names, bias "none", the base folder train.init_hf) and adapter_model.safetensors with
    `base_model.model.<Hugging Face module>.lora_A.weight` / `.lora_B.weight`. Never writes into a
    non-empty folder."""
    from ..model.hf_map import name_map
    from ..model.hf_weights import stream_safetensors
    from ..rules import HF_LORA_TARGETS

    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"{dest} is not a new or empty folder; choose another (export never overwrites)")
    reader = Reader(find(path))
    cfg = Config.from_dict(reader.index["config"])
    t = cfg.train
    if not t.lora_rank:
        raise ConfigError(f"{reader.path} was not trained with LoRA (train.lora_rank = 0): no adapters to export; "
                          f"use export --hf for the whole model")
    theirs_of = name_map(cfg.model)
    keys = {}
    for key in sorted(reader.tensors):
        name = key.removeprefix("model/")
        if not key.startswith("model/") or not name.endswith(".lora_A"):
            continue
        base = theirs_of[name.removesuffix(".lora_A") + ".weight"].removesuffix(".weight")
        for part in ("A", "B"):
            keys[f"base_model.model.{base}.lora_{part}.weight"] = f"model/{name[:-1]}{part}"
    ours_to_hf = {v: k for k, v in HF_LORA_TARGETS.items()}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": t.lora_rank, "lora_alpha": t.lora_alpha,
              "lora_dropout": t.lora_dropout, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
              "target_modules": sorted({ours_to_hf[HF_LORA_TARGETS.get(x, x)] for x in t.lora_targets}),
              "base_model_name_or_path": t.init_hf or None}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2))
    specs = {k: (reader.shape(v), getattr(torch, reader.tensors[v]["dtype"])) for k, v in keys.items()}
    stream_safetensors(dest / "adapter_model.safetensors", specs, lambda k: reader.full(keys[k]),
                       {"format": "pt"})
    return dest


def hf_order(name: str) -> tuple:
    """Hugging Face tensors in model order: the embedding, the layers by number, the final norm, the head."""
    part = name.split(".")
    if part[:2] == ["model", "layers"]:
        return (1, int(part[2]), name)
    return (0 if "embed" in name else 2 if part[1:2] == ["norm"] else 3, 0, name)


# -------------------------------------------------------------------------------------------------------
# Persistent buffers

def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's persistent buffers by name (its state_dict without the parameters)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {k: v.detach() for k, v in model.state_dict().items() if k not in params}


@torch.no_grad()
def load_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy the saved buffers this module holds (a pipeline stage holds some of them)."""
    for name, buf in model.named_buffers():
        if name in buffers:
            buf.copy_(buffers[name])
