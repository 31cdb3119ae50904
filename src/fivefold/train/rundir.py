"""The run folder: what a run writes into `--out`, who may write it, and where a resume starts.

    OUT/.lock                           held (flock) by the run writing OUT; freed when its process ends
    OUT/metrics.jsonl                   one line per step; a resumed run keeps the lines before its start
    OUT/comm.json, run.json, pipeline.* written at the end of a run
    OUT/tensorboard/                    train.tensorboard: the same scalars as TensorBoard events
    OUT/tokenizer.json or .tiktoken     train.tokenizer: a copy of the run's tokenizer (tokenizer.save_to_run)
    OUT/checkpoints/step-00000050/      complete checkpoints: index.json + one safetensors file per rank
    OUT/checkpoints/.tmp-...            a save in progress (never read; a failed save's is removed later)

Rules, checked by the CLI before any rank starts: a folder holding a run is never written over unless
the user says `--resume` (continue it) or `--overwrite` (start again); two runs never share a folder
(the lock); `--resume auto` continues from the newest complete checkpoint in OUT, or starts fresh when
there is none (what a restarted torchrun worker does). Torch-free: the CLI and the planner import it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..config import ConfigError

CHECKPOINTS = "checkpoints"
INDEX = "index.json"
FORMAT = 2
RUN_FILES = ("metrics.jsonl", "comm.json", "run.json", "pipeline.json", "pipeline.svg", "tensorboard", CHECKPOINTS)

# model fields that change the parameters' names or shapes: a checkpoint cannot load into another value
SHAPE_FIELDS = ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "tie_embeddings", "experts", "moe_ffn",
                "shared_experts", "dense_layers", "shared_expert_gate", "router")
# fields that say where and how often to write, not what is trained: changing them is silent
# (train.tokenizer is a path: the tokenizer itself is compared by its digest, `compare_data`)
QUIET_FIELDS = ("train.out", "train.checkpoint", "train.checkpoint_every", "train.keep_checkpoints",
                "train.log_every", "train.device", "train.compile", "train.tensorboard", "train.tokenizer")


def step_dir(out: str | Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step:08d}"


def checkpoints(out: str | Path) -> list[Path]:
    """The complete checkpoints in a run folder, oldest first (a folder is complete once renamed)."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if d.name.startswith("step-") and (d / INDEX).is_file()]
    return sorted(found, key=lambda d: int(d.name.split("-")[1]))


def newest_checkpoint(out: str | Path) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


def read_index(ckpt: str | Path) -> dict:
    """A checkpoint's index.json (plain JSON: nothing on disk is executed)."""
    path = Path(ckpt) / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{ckpt} is not a readable fivefold checkpoint ({e.__class__.__name__}: {e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"{path}: unknown checkpoint format {index.get('format') if isinstance(index, dict) else index!r}"
                          f" (this fivefold reads format {FORMAT})")
    return index


def resolve_resume(resume: str | None, out: str | Path) -> Path | None:
    """The checkpoint folder a run continues from: None (a fresh run), `auto` (the newest complete one
    in OUT, or None), a checkpoint folder, or a run folder (its newest)."""
    if not resume:
        return None
    if resume == "auto":
        return newest_checkpoint(out)
    path = Path(resume)
    if (path / INDEX).is_file():
        return path
    if path.is_dir():
        newest = newest_checkpoint(path)
        if newest is None:
            raise ConfigError(f"--resume {resume}: no complete checkpoint in that folder "
                              f"(expected {path}/{CHECKPOINTS}/step-*/{INDEX}); use --resume auto to start fresh")
        return newest
    raise ConfigError(f"--resume {resume}: no such checkpoint or run folder; give a run folder, a "
                      f"checkpoints/step-* folder, or auto")


def holds_run(out: str | Path) -> bool:
    out = Path(out)
    return out.is_dir() and any((out / name).exists() for name in RUN_FILES)


def check_out(out: str | Path, resume: str | None, overwrite: bool) -> None:
    """Never write over a run by accident: a folder holding one needs --resume or --overwrite."""
    if not holds_run(out) or overwrite:
        return
    if resume == "auto":
        return
    if resume:
        r = Path(resume).resolve()
        if Path(out).resolve() in (r, *r.parents):   # continuing this folder's own run
            return
    raise ConfigError(f"--out {out} already holds a run: continue it with --resume auto, start again with "
                      f"--overwrite, or choose another --out")


def clear(out: str | Path) -> None:
    """--overwrite: remove what a run wrote (only fivefold's own files)."""
    for name in RUN_FILES:
        path = Path(out) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


class RunLock:
    """An exclusive lock on a run folder (`flock` on OUT/.lock), held while the run writes it. The kernel
    frees it when the holding process ends, however it ends, so a killed run leaves no stale lock."""

    def __init__(self, out: str | Path):
        import fcntl

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / ".lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ConfigError(f"--out {out} is in use by another run (pid {holder}); wait for it or choose "
                              f"another --out") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)   # closing the descriptor drops the flock
            self.fd = None


def compare_configs(saved: dict, new: dict) -> tuple[list[str], list[str]]:
    """(errors, warnings) for resuming a checkpoint written under config `saved` with config `new`
    (both `Config.to_dict()`): a changed shape field is an error, any other change of the model or the
    training schedule a warning; a different parallel layout is what resharding is for (silent)."""
    errors, warnings = [], []
    for part in ("model", "train"):
        for key, old in saved.get(part, {}).items():
            value = new.get(part, {}).get(key, old)
            name = f"{part}.{key}"
            if value == old or name in QUIET_FIELDS:
                continue
            line = f"{name}: checkpoint {old!r}, now {value!r}"
            (errors if part == "model" and key in SHAPE_FIELDS else warnings).append(line)
    return errors, warnings


def compare_data(saved: dict | None, new: dict) -> tuple[list[str], list[str]]:
    """(errors, warnings) for resuming a checkpoint trained on data `saved` with data `new` (both
    `data.data_identity`; None: an older checkpoint, not compared): another tokenizer is an error,
    other data files (names, sizes, token-file headers) a warning, since step k then reads other tokens."""
    if not saved:
        return [], []
    errors = []
    if saved.get("tokenizer") != new.get("tokenizer"):
        errors.append(f"tokenizer: checkpoint {saved.get('tokenizer')!r}, now {new.get('tokenizer')!r} "
                      f"(train with the run's tokenizer, OUT/tokenizer.*)")
    warnings = []
    if saved.get("files") != new.get("files"):
        warnings.append(f"data: checkpoint {saved.get('files')}, now {new.get('files')}")
    return errors, warnings


def trim_metrics(path: str | Path, start: int) -> None:
    """Keep the metric lines of steps before `start` (a resumed run rewrites the later ones)."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) < start:
                kept.append(line)
        except ValueError:
            break   # a line cut short by a killed run ends the valid part
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    tmp.replace(path)
