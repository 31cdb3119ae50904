"""The run folder: what a run writes into `--out`, who may write it, and where a resume starts.

    OUT/.lock                           held (flock) by the run writing OUT; freed when its process ends
    OUT/metrics.jsonl                   one line per step (step N: the N-th, 1-based); a resume keeps 1..start
    OUT/config.toml                     the resolved config (written at the start): --config OUT/config.toml reruns it
    OUT/comm.json, run.json, pipeline.* written at the end of a run
    OUT/tensorboard/                    train.tensorboard: the same scalars as TensorBoard events
    OUT/tokenizer.json or .tiktoken     train.tokenizer: a copy of the run's tokenizer (tokenizer.save_to_run)
    OUT/checkpoints/step-00000050/      complete checkpoints: index.json + one safetensors file per rank
    OUT/checkpoints/.tmp-...            a save in progress (never read; a failed save's is removed later)
    OUT/best.json                       train.keep_best: {"step", "eval_loss"} of the checkpoint kept for its eval
                                        loss (never pruned); `generate RUN --checkpoint best` reads it

    OUT/.fivefold-run                   the marker: this folder holds a fivefold run (written at its start)

Rules, checked by the CLI before any rank starts: a folder holding a run is never written over unless
the user says `--resume` (continue it) or `--overwrite` (start again); two runs never share a folder
(the lock); `--resume auto` continues from the newest complete checkpoint in OUT, or starts fresh when
there is none (what a restarted torchrun worker does). Torch-free: the CLI and the planner import it.

Trust nothing on disk. fivefold removes only what it wrote, recognised by its own markers (`clear`): a
folder whose checkpoints/, tensorboard/ or metrics are another tool's is refused, `--overwrite` or not.
No name fivefold writes in OUT may be a symbolic link (`check_no_links`; the lock is opened with
O_NOFOLLOW), so a run never writes outside its folder. A checkpoints/ entry that is not `step-<digits>`
is skipped with a warning.

Branches. Resuming from checkpoint step N into a run folder makes step N the end of that folder's
history: its metric lines from step N on are rewritten, and its checkpoints newer than N (the abandoned
run's) are removed when the branch starts (`start_run`), so `--resume auto` after a crash continues the
branch, never the run it left.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from ..config import RUN_CONFIG, ConfigError

CHECKPOINTS = "checkpoints"
INDEX = "index.json"
FORMAT = 2
MARKER = ".fivefold-run"
LOCK = ".lock"
BEST = "best.json"
RUN_FILES = ("metrics.jsonl", "comm.json", "run.json", "pipeline.json", "pipeline.svg", "tensorboard", CHECKPOINTS, BEST)
# RUN_CONFIG (config.toml) is written at the start like the tokenizer copy: not a sign that a run trained here
STEP_NAME = re.compile(r"step-(\d+)")
TEMP_NAME = re.compile(r"\.(tmp|old)-step-\d+-[0-9a-f]+")   # a save in progress, a replaced checkpoint
EVENTS_NAME = re.compile(r"events\.out\.tfevents\..+")      # TensorBoard's SummaryWriter files

# model fields that change the parameters' names or shapes: a checkpoint cannot load into another value
SHAPE_FIELDS = ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "tie_embeddings", "experts", "moe_ffn",
                "shared_experts", "dense_layers", "shared_expert_gate", "router")
# fields that say where and how often to write, not what is trained: changing them is silent
# (train.tokenizer is a path: the tokenizer itself is compared by its digest, `compare_data`)
QUIET_FIELDS = ("train.out", "train.checkpoint", "train.checkpoint_every", "train.keep_checkpoints",
                "train.log_every", "train.device", "train.compile", "train.tensorboard", "train.tokenizer")


def step_dir(out: str | Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """N for a checkpoint folder named step-N (N digits), else None."""
    m = STEP_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def checkpoints(out: str | Path) -> list[Path]:
    """The complete checkpoints in a run folder, oldest first (a folder is complete once renamed).
    Entries that are not `step-<digits>` folders are skipped with a warning, and so are symbolic links
    (never followed out of the run folder)."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir() or root.is_symlink():
        return []
    found = []
    for d in root.iterdir():
        if TEMP_NAME.fullmatch(d.name):
            continue
        if step_of(d.name) is None or d.is_symlink() or not d.is_dir():
            print(f"warning: {d}: not a fivefold checkpoint (step-<digits> folder); skipped", file=sys.stderr)
        elif (d / INDEX).is_file() and not (d / INDEX).is_symlink():
            found.append(d)
    return sorted(found, key=lambda d: step_of(d.name))


def newest_checkpoint(out: str | Path) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


def read_index(ckpt: str | Path) -> dict:
    """A checkpoint's index.json (plain JSON: nothing on disk is executed; never a symbolic link)."""
    path = Path(ckpt) / INDEX
    if path.is_symlink():
        raise ConfigError(f"{path} is a symbolic link; a checkpoint's files must be its own")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
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
    """Whether `out` holds any of the names a run writes (fivefold's or not)."""
    out = Path(out)
    return out.is_dir() and any(os.path.lexists(out / name) for name in RUN_FILES)


def is_fivefold_run(out: str | Path) -> bool:
    """Whether fivefold wrote the run in `out`, by its own markers: OUT/.fivefold-run, or (runs from
    before the marker) a run.json naming fivefold's version or a checkpoint with fivefold's index."""
    out = Path(out)
    marker = out / MARKER
    if marker.is_file() and not marker.is_symlink():
        return True
    try:
        if json.loads((out / "run.json").read_text())["versions"]["fivefold"]:
            return True
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    for ckpt in checkpoints(out):
        try:
            read_index(ckpt)
            return True
        except ConfigError:
            continue
    return False


def mark(out: str | Path) -> None:
    """Write the marker that says fivefold writes this folder (OUT/.fivefold-run), once."""
    path = Path(out) / MARKER
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        return
    try:
        os.write(fd, b'{"written_by": "fivefold"}\n')
    finally:
        os.close(fd)


def check_no_links(out: str | Path) -> None:
    """No name fivefold writes in OUT may be a symbolic link: writing through it would write outside."""
    from ..tokenizer import RUN_FILES as TOKENIZER_FILES
    from ..tokenizer import SPECIALS

    out = Path(out)
    for name in (*RUN_FILES, LOCK, MARKER, *TOKENIZER_FILES.values(), SPECIALS, RUN_CONFIG):
        if (out / name).is_symlink():
            raise ConfigError(f"--out {out}: {name} is a symbolic link; fivefold never writes through one out "
                              f"of the run folder: remove it, or choose another --out")


def check_out(out: str | Path, resume: str | None, overwrite: bool) -> None:
    """Never write over a run by accident: a folder holding one needs --resume or --overwrite; a folder
    holding another tool's files under a run's names is never written, whatever the flags."""
    check_folder(out)
    check_no_links(out)
    if not holds_run(out):
        return
    if not is_fivefold_run(out):
        names = [f"{n}/" if (Path(out) / n).is_dir() else n for n in RUN_FILES if os.path.lexists(Path(out) / n)]
        raise ConfigError(f"--out {out} holds {', '.join(names)} that fivefold did not write (no {MARKER}); "
                          f"fivefold removes only its own files: choose another --out")
    if overwrite or resume == "auto":
        return
    if resume:
        r = Path(resume).resolve()
        if Path(out).resolve() in (r, *r.parents):   # continuing this folder's own run
            return
    raise ConfigError(f"--out {out} already holds a run: continue it with --resume auto, start again with "
                      f"--overwrite, or choose another --out")


def check_folder(out: str | Path) -> None:
    """--out must be, or be able to become, a folder this process can write."""
    out = Path(out)
    if out.is_dir():
        if not os.access(out, os.W_OK | os.X_OK):
            raise ConfigError(f"--out {out}: the folder is not writable; choose another --out")
        return
    if os.path.lexists(out):
        raise ConfigError(f"--out {out} exists and is not a folder; choose a folder")
    parent = next((p for p in out.absolute().parents if os.path.lexists(p)), None)
    if parent is None or not parent.is_dir():
        raise ConfigError(f"--out {out} cannot be a folder: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out} cannot be created: {parent} is not writable")


def check_writable(out: str | Path, checkpoints_too: bool) -> None:
    """OUT, and OUT/checkpoints when the run saves, take a new file: probed by making and removing one
    (permission bits alone miss read-only mounts, full disks and root), so a run that could not save
    fails before its first step, not after its last."""
    out = Path(out)
    folders = [out]
    root = out / CHECKPOINTS
    if checkpoints_too and os.path.lexists(root):
        if root.is_symlink() or not root.is_dir():
            raise ConfigError(f"--out {out}: {CHECKPOINTS} is not a folder; checkpoints could not be saved there")
        folders.append(root)
    for folder in folders:
        probe = folder / f".probe-{os.getpid()}"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            os.unlink(probe)
        except OSError as e:
            what = "checkpoints could not be saved" if folder == root else "the run could not write it"
            raise ConfigError(f"--out {out}: {folder} is not writable ({e.strerror or e}); {what}") from None


def clear(out: str | Path) -> None:
    """--overwrite: remove what a fivefold run wrote, and nothing else: its metric and report files,
    its TensorBoard event files, and its checkpoints (folders holding fivefold's index) and interrupted
    saves. Anything else under those names stays; a folder left empty is removed."""
    out = Path(out)
    if not is_fivefold_run(out):
        raise ConfigError(f"--overwrite: {out} does not hold a fivefold run; nothing removed")
    check_no_links(out)
    for name in (*RUN_FILES, RUN_CONFIG):
        path = out / name
        if name == CHECKPOINTS:
            _clear_checkpoints(path)
        elif name == "tensorboard":
            _clear_folder(path, lambda p: p.is_file() and EVENTS_NAME.fullmatch(p.name))
        elif path.is_file():
            path.unlink()


def _clear_checkpoints(root: Path) -> None:
    def ours(p: Path) -> bool:
        if p.is_symlink() or not p.is_dir():
            return False
        if TEMP_NAME.fullmatch(p.name):
            return True
        try:
            return step_of(p.name) is not None and read_index(p) is not None
        except ConfigError:
            return False
    _clear_folder(root, ours)


def _clear_folder(root: Path, ours) -> None:
    """Remove the entries of folder `root` for which ours(path) holds, then `root` if it is left empty."""
    if not root.is_dir() or root.is_symlink():
        return
    for p in root.iterdir():
        if not ours(p):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    if not any(root.iterdir()):
        root.rmdir()


def start_run(out: str | Path, start: int) -> list[Path]:
    """Rank 0, as a run begins at step `start` (0, or the step of the checkpoint it resumed): mark the
    folder as a fivefold run, keep only the metric lines before `start`, and remove the checkpoints
    newer than `start` (a branch abandons them; module docstring). Returns the removed checkpoints."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    check_no_links(out)
    mark(out)
    trim_metrics(out / "metrics.jsonl", start)
    best = read_best(out)
    if best is not None and best["step"] > start:    # the abandoned run's best
        (out / BEST).unlink()
    newer = [c for c in checkpoints(out) if step_of(c.name) > start]
    for ckpt in newer:
        shutil.rmtree(ckpt)
    return newer


class RunLock:
    """An exclusive lock on a run folder (`flock` on OUT/.lock), held while the run writes it. The kernel
    frees it when the holding process ends, however it ends, so a killed run leaves no stale lock. The
    lock file is opened with O_NOFOLLOW: a symbolic link planted there is refused, never written through."""

    def __init__(self, out: str | Path):
        import fcntl

        out = Path(out)
        check_folder(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {out} cannot be a folder ({e.strerror or e}); choose another --out") from None
        try:
            self.path = out / LOCK
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            why = "is a symbolic link" if (out / LOCK).is_symlink() else f"cannot be opened ({e.strerror})"
            raise ConfigError(f"--out {out}: {LOCK} {why}; remove it or choose another --out") from None
        if not _is_regular(self.fd):
            os.close(self.fd)
            raise ConfigError(f"--out {out}: {LOCK} is not a regular file; remove it or choose another --out")
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


def checked_tokenizer_file(ckpt: str | Path) -> Path | None:
    """The tokenizer copy of checkpoint `ckpt`'s run folder (None: byte-level), held to the digest the
    checkpoint recorded when it was trained (its index's data.tokenizer): a copy replaced since is one
    line, not another tokenizer used silently by generate, eval or export."""
    from ..tokenizer import ByteTokenizer, file_digest, run_tokenizer_file

    found = run_tokenizer_file(ckpt)
    recorded = (read_index(ckpt).get("data") or {}).get("tokenizer")
    have = file_digest(found) if found is not None else ByteTokenizer.digest
    if recorded is not None and recorded != have:
        what = found.name if found is not None else "no tokenizer file (byte-level)"
        raise ConfigError(f"{ckpt}: the run folder's {what} ({have}) is not the tokenizer the run trained with "
                          f"({recorded}); put that tokenizer back (the run's tokenizer.json or tokenizer.tiktoken)")
    return found


def read_best(out: str | Path) -> dict | None:
    """OUT/best.json ({"step": N, "eval_loss": x}, train.keep_best), checked: a positive step whose
    checkpoint exists and a finite loss; None when there is none. Anything else is a ConfigError."""
    path = Path(out) / BEST
    if not os.path.lexists(path):
        return None
    try:
        if path.is_symlink():
            raise ValueError("a symbolic link")
        d = json.loads(path.read_text())
        ok = (isinstance(d, dict) and isinstance(d.get("step"), int) and d["step"] >= 1
              and isinstance(d.get("eval_loss"), float) and d["eval_loss"] == d["eval_loss"]
              and abs(d["eval_loss"]) != float("inf"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable ({e}); remove it") from None
    if not ok:
        raise ConfigError(f"{path} is not {{\"step\": N >= 1, \"eval_loss\": finite}}; remove it")
    return d


def write_best(out: str | Path, step: int, eval_loss: float) -> None:
    """Rank 0: name checkpoint `step` the best (written to a temporary name, then renamed)."""
    path = Path(out) / BEST
    tmp = path.with_name(f".{BEST}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"step": step, "eval_loss": float(eval_loss)}) + "\n")
    tmp.replace(path)


def _is_regular(fd: int) -> bool:
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)


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
    other data files (names, sizes, token-file headers) or another default corpus a warning, since step k then reads other tokens."""
    if not saved:
        return [], []
    errors = []
    if saved.get("tokenizer") != new.get("tokenizer"):
        errors.append(f"tokenizer: checkpoint {saved.get('tokenizer')!r}, now {new.get('tokenizer')!r} "
                      f"(train with the run's tokenizer, OUT/tokenizer.*)")
    warnings = []
    if saved.get("files") != new.get("files"):
        warnings.append(f"data: checkpoint {saved.get('files')}, now {new.get('files')}")
    elif "default" in saved and saved["default"] != new.get("default"):   # the default corpus of another Python
        warnings.append(f"default corpus: checkpoint {saved['default']}, now {new.get('default')}")
    return errors, warnings


def trim_metrics(path: str | Path, start: int) -> None:
    """Keep the metric lines of steps 1..`start` (the checkpoint's steps; a resumed run rewrites the later ones)."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= start:   # step N: the N-th step (1-based)
                kept.append(line)
        except ValueError:
            break   # a line cut short by a killed run ends the valid part
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    tmp.replace(path)
