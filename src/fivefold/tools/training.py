"""`fivefold train`: its flags (each a config key, typed by the key's field), the resolved config (file,
flags, `--set`, a Hugging Face folder's shape, the tokenizer's vocabulary), the checks made before any rank
starts (one line, exit 2), and the run itself: local ranks (`--nproc`), a torchrun rank, or `--dry-run`
(tools/dryrun.py). What it asks the planner (memory per rank, FLOPs and the peak for MFU) goes through
tools/run_plan.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path
from typing import Literal

from ..config import ConfigError, field_doc, field_type, load_config, parse_sets, write_run_config
from ..flags import MICRO_BATCH_SIZE_HELP, MICROBATCHES_HELP, add_renamed
from ..rules import PartitionKind, check_real, check_runtime_support, choices, trains_a_subset
from .run_plan import device_name, peak_text, planned_memory, speed_model

# flag -> dotted config key; each flag's type and choices come from the field's declared type
TRAIN_FLAGS = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep",
    "etp": "parallel.etp",
    "zero": "parallel.zero", "zero_prefetch": "parallel.zero_prefetch", "sp_mode": "parallel.sp_mode",
    "cp_mode": "parallel.cp_mode",
    "order": "parallel.order", "microbatches": "parallel.microbatches", "schedule": "parallel.schedule",
    "vpp": "parallel.vpp", "microbatch_group": "parallel.microbatch_group", "bucket_mb": "parallel.bucket_mb", "partition": "parallel.partition",
    "recompute": "train.recompute", "steps": "train.steps", "global_batch": "train.global_batch",
    "seq_len": "train.seq_len", "lr": "train.lr", "min_lr": "train.min_lr", "warmup": "train.warmup",
    "warmup_ratio": "train.warmup_ratio",
    "lr_schedule": "train.lr_schedule", "weight_decay": "train.weight_decay", "clip": "train.grad_clip",
    "dtype": "train.dtype", "device": "train.device",
    "seed": "train.seed", "out": "train.out", "data": "train.data", "tokenizer": "train.tokenizer",
    "init_hf": "train.init_hf", "eval_data": "train.eval_data", "eval_every": "train.eval_every",
    "eval_tokens": "train.eval_tokens", "eos": "train.eos", "bos": "train.bos",
    "lora_rank": "train.lora_rank", "lora_alpha": "train.lora_alpha", "lora_dropout": "train.lora_dropout",
    "lora_targets": "train.lora_targets", "freeze": "train.freeze",
}
# What a flag means is its config key's (config.field_doc: the field's comment in config.py, written once);
# here only what this command does when a flag is left out, where that is not the key's default
UNSET = {"dp": "the ranks left by tp x cp x pp"}
# [model] fields a run started from Hugging Face weights may set to other values than its config.json:
# they change training, not what the weights mean
HF_TRAINING_FIELDS = ("dropout", "capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "init_std",
                      "max_seq")


def flag_kwargs(kind) -> dict:
    """argparse keywords for a config field's type: Literal -> choices, list -> nargs."""
    if typing.get_origin(kind) is Literal:
        values = choices(kind)
        return {"type": type(values[0]), "choices": values}
    if typing.get_origin(kind) is list:
        return {"nargs": "+"}
    return {"type": kind}


def flag_help(flag: str, key: str) -> str:
    """A train flag's help: its config key's documentation (config.field_doc), the key, and the value the
    run takes when the flag is left out."""
    if flag in UNSET:
        return f"{field_doc(key)} ({key}, default: {UNSET[flag]})"
    default = default_of(key)
    shown = " ".join(default) if isinstance(default, list) else default
    return f"{field_doc(key)} ({key}, default: {shown if shown not in ('', []) else 'none'})"


def default_of(key: str):
    """The default value of a dotted config key."""
    from ..config import Config

    part, _, name = key.partition(".")
    return getattr(getattr(Config(), part), name)


def add_train_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="TOML file with [model], [parallel], [train] tables, e.g. a run's OUT/config.toml "
                    "(default: the embedded small Llama)")
    ap.add_argument("--nproc", type=int, help="local gloo ranks to spawn (default: the layout's world size)")
    for flag, key in TRAIN_FLAGS.items():
        ap.add_argument(f"--{flag.replace('_', '-')}", dest=flag, help=flag_help(flag, key),
                        **flag_kwargs(field_type(key)))
    ap.add_argument("--micro-batch-size", type=int, metavar="B", help=MICRO_BATCH_SIZE_HELP + " (default: unset; "
                    "--microbatches decides)")
    add_renamed(ap)   # --micro-batch: one line naming --micro-batch-size
    ap.add_argument("--resume", help="continue a run: auto (the newest checkpoint in --out, else start fresh), "
                    "a run folder (its newest checkpoint) or a checkpoints/step-N folder; any layout loads it "
                    "(default: none, a fresh start)")
    ap.add_argument("--overwrite", action="store_true", help="start again in an --out that holds a run "
                    "(removes its metrics and checkpoints; default: off)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any config key, e.g. --set model.hidden=256 (repeatable); the keys and their defaults: "
                         "docs/training.md 'Config keys', or the dataclasses ModelConfig / ParallelConfig / TrainConfig in "
                         "src/fivefold/config.py (default: none)")
    ap.add_argument("--timeout", type=float, default=600, help="hang watchdog: local ranks that make no "
                    "progress (no finished step) for this many seconds are killed; a torchrun rank ends itself with one "
                    "line naming the nodes it cannot reach (default: 600)")
    ap.add_argument("--dry-run", action="store_true", help="run the real code for the selected ranks under fake "
                    "tensors and a fake process group (any size, no memory): memory by kind and the ledger beside "
                    "the planner's (OUT/dryrun.json); --steps defaults to 2 (default: off)")
    ap.add_argument("--ranks", default="stages", help="with --dry-run: stages (one rank per pipeline stage), all, "
                    "or a comma-separated list of ranks (default: stages)")
    ap.add_argument("--device-memory", type=float, metavar="GIB", help="with --dry-run: refuse (exit 1) a rank "
                    "that needs more than this many GiB (default: no limit)")
    ap.add_argument("--max-seconds", type=float, default=1800, metavar="S", help="with --dry-run: refuse (exit 2) "
                    "a dry run this process is estimated to need longer for, or more host memory than is available "
                    "(dryrun.dry_run_cost; default: 1800)")
    ap.add_argument("--model", help="with --dry-run: a planner preset (llama3-405b, ...) or a Hugging Face "
                    "config.json as [model] (default: the config's)")


def resolve_train_config(args: argparse.Namespace, world: int | None = None):
    """The config from file + flags; when dp is not given it fills the world left by tp*cp*pp."""
    overrides = train_overrides(args)
    cfg = load_config(args.config, overrides)
    resume_tokenizer(cfg, getattr(args, "resume", None))
    if cfg.train.init_hf:
        model_from_hf(cfg, {k.removeprefix("model.") for k, v in overrides.items()
                            if k.startswith("model.") and v is not None} | file_keys(args.config, "model"))
        fine_tuning_lr(cfg.train, lr_given(args, overrides))
    vocab_from_tokenizer(cfg, "model.vocab" in overrides or sets_key(args.config, "model", "vocab")
                         or bool(cfg.train.init_hf))
    check_lora_flags(cfg.train, {k for k, v in overrides.items() if v is not None} | {   # a run's config.toml lists
        f"train.{k}" for k in file_keys(args.config, "train")                          # every key: its defaults
        if k in LORA_OPTIONS and getattr(cfg.train, k) != default_of(f"train.{k}")})   # are no choice
    p = cfg.parallel
    world = world or args.nproc
    if world and args.dp is None and p.world_size != world:
        other = p.tp * p.cp * p.pp
        if world % other:
            raise ConfigError(f"{world} ranks must divide by tp*cp*pp = {other}")
        p.dp = world // other
    microbatches_from_size(cfg, getattr(args, "micro_batch_size", None), getattr(args, "microbatches", None))
    return cfg


FINE_TUNE_LR = 5e-5     # Hugging Face Trainer's default learning rate
LORA_OPTIONS = ("lora_alpha", "lora_dropout", "lora_targets")   # they shape adapters: meaningless without a rank


def check_lora_flags(train, given: set[str]) -> None:
    """A LoRA option given (flag, --set or the config file) without train.lora_rank would train every weight,
    silently: one line naming the rank."""
    named = [k for k in LORA_OPTIONS if f"train.{k}" in given]
    if named and not train.lora_rank:
        flags = ", ".join("--" + k.replace("_", "-") for k in named)
        raise ConfigError(f"{flags}: LoRA options, but train.lora_rank is 0 (no LoRA: every weight would train); "
                          f"valid: --lora-rank R (typical 8-64) for LoRA, or leave out {flags} for full fine-tuning")


def train_overrides(args: argparse.Namespace) -> dict:
    """The config keys train's flags and --set give (None: a flag not given)."""
    overrides = {key: getattr(args, flag) for flag, key in TRAIN_FLAGS.items()}
    overrides.update(parse_sets(args.set))
    return overrides


def lr_given(args: argparse.Namespace, overrides: dict) -> set[str]:
    """Which of lr and min_lr the user gave (a flag, --set or the config file)."""
    return {k for k in ("lr", "min_lr") if overrides.get(f"train.{k}") is not None
            or sets_key(args.config, "train", k)}


def fine_tuning_lr(train, given: set[str]) -> None:
    """--init-hf without a learning rate: fine-tune at FINE_TUNE_LR (min_lr a tenth of it), not at the
    pretraining default (`fine_tuning_note` says so once the run's checks pass); with --lr but no --min-lr
    below the pretraining default min_lr, min_lr is a tenth of that lr."""
    if "lr" in given:
        if "min_lr" not in given and train.min_lr > train.lr:   # the pretraining default above a fine-tuning lr
            train.min_lr = train.lr / 10
        return
    train.lr = FINE_TUNE_LR
    if "min_lr" not in given:
        train.min_lr = FINE_TUNE_LR / 10
    if train.min_lr > train.lr:
        raise ConfigError(f"train.min_lr = {train.min_lr:g} is above the fine-tuning learning rate {train.lr:g} that "
                          f"--init-hf uses without --lr; give --lr (>= min_lr) or a lower --min-lr")


def fine_tuning_note(train) -> str:
    return (f"note: --init-hf without --lr fine-tunes at train.lr = {train.lr:g} (Hugging Face Trainer's default; "
            f"the pretraining default 3e-3 would wreck pretrained weights), min_lr {train.min_lr:g}; give --lr to "
            f"choose")


def microbatches_from_size(cfg, size: int | None, count: int | None) -> None:
    """--micro-batch-size B: parallel.microbatches = global_batch / (dp x B), a whole number; with an
    explicit --microbatches it must agree."""
    if size is None:
        return
    p, t = cfg.parallel, cfg.train
    per_rank = t.global_batch // p.dp if t.global_batch % p.dp == 0 else 0
    if size < 1 or not per_rank or per_rank % size:
        valid = [b for b in range(1, per_rank + 1) if per_rank % b == 0] if per_rank else []
        raise ConfigError(f"--micro-batch-size {size} must divide global_batch / dp = {t.global_batch} / {p.dp}; "
                          f"valid sizes: {valid or 'none (global_batch must divide by dp first)'}")
    if count is not None and count != per_rank // size:
        raise ConfigError(f"--microbatches {count} and --micro-batch-size {size} disagree: global_batch / dp = "
                          f"{per_rank} sequences make {per_rank // size} micro-batches of {size}; give one of them")
    p.microbatches = per_rank // size


def sets_key(config_file: str | None, table: str, key: str) -> bool:
    """Whether the TOML file `config_file` sets [table] key."""
    return key in file_keys(config_file, table)


def file_keys(config_file: str | None, table: str) -> set[str]:
    """The keys the TOML file `config_file` sets in [table]."""
    if not config_file:
        return set()
    from ..config import read_toml

    return set(read_toml(config_file).get(table, {}))


def model_from_hf(cfg, user_keys: set[str]) -> None:
    """--init-hf DIR: [model] becomes DIR/config.json's model (model/hf.py); a field the user set to
    another value is an error naming it, except the training-only ones (HF_TRAINING_FIELDS), which
    are kept. DIR's tokenizer becomes the run's unless --tokenizer names another."""
    from dataclasses import fields

    from ..model.hf_weights import hf_config
    from ..tokenizer import run_tokenizer_file

    folder = cfg.train.init_hf
    hf = hf_config(folder)
    for f in fields(hf):
        mine, theirs = getattr(cfg.model, f.name), getattr(hf, f.name)
        if f.name not in user_keys or mine == theirs:
            continue
        if f.name not in HF_TRAINING_FIELDS:
            raise ConfigError(f"--init-hf {folder}: its config.json sets model.{f.name} = {theirs!r}, the config "
                              f"or --set asks for {mine!r}; drop model.{f.name} (the weights fix it)")
        if f.name == "max_seq" and mine > theirs:
            raise ConfigError(f"--init-hf {folder}: model.max_seq ({mine}) exceeds the model's position limit "
                              f"({theirs}); use max_seq <= {theirs}")
        setattr(hf, f.name, mine)
    cfg.model = hf
    if not cfg.train.tokenizer:
        found = run_tokenizer_file(folder)
        if found is not None:
            cfg.train.tokenizer = str(found)
        elif hf.vocab != 256:     # training on bytes would silently mean other tokens than the weights learned
            spm = " (it has a SentencePiece tokenizer.model: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) " \
                  "writes the tokenizer.json of a fast tokenizer)" if (Path(folder) / "tokenizer.model").is_file() else ""
            raise ConfigError(f"--init-hf {folder} has no tokenizer.json{spm}, and its vocabulary of {hf.vocab} ids "
                              f"is not bytes; add the model's tokenizer.json to the folder, or pass --tokenizer FILE")


def resume_tokenizer(cfg, resume: str | None) -> None:
    """A resumed run keeps its tokenizer: without --tokenizer, the copy in the run folder (OUT/tokenizer.*)."""
    if not resume or cfg.train.tokenizer:
        return
    from ..tokenizer import run_tokenizer_file

    saved = run_tokenizer_file(cfg.train.out if resume == "auto" else resume)
    if saved is not None:
        cfg.train.tokenizer = str(saved)


def vocab_from_tokenizer(cfg, vocab_given: bool) -> None:
    """With train.tokenizer, model.vocab is the tokenizer's vocabulary (tensor parallelism pads it to a
    multiple of tp itself), unless the user set model.vocab: then it must hold every id."""
    if not cfg.train.tokenizer:
        return
    from ..tokenizer import load_tokenizer

    n = load_tokenizer(cfg.train.tokenizer).vocab_size
    if not vocab_given:
        cfg.model.vocab = n
    elif cfg.model.vocab < n:
        raise ConfigError(f"model.vocab ({cfg.model.vocab}) is smaller than the vocabulary of tokenizer "
                          f"{cfg.train.tokenizer} ({n}); set model.vocab >= {n}, or leave it unset to follow "
                          f"the tokenizer")


def prepare_run(cfg, args) -> tuple[str | None, int]:
    """Out-folder and resume rules, checked before any rank starts: (checkpoint to load or None, its
    step). A changed shape field is an error, other changed settings a warning (rundir.py)."""
    from ..train import rundir

    out = cfg.train.out
    rundir.check_out(out, args.resume, args.overwrite)
    ckpt = rundir.resolve_resume(args.resume, out)
    if ckpt is None:
        return None, 0
    from ..train.verify import verify

    index = verify(ckpt)   # every claim of its index checked against its own bytes (train/verify.py)
    errors, warnings = rundir.compare_configs(index["config"], cfg.to_dict())
    if errors:
        raise ConfigError(f"cannot resume {ckpt} with a different model shape: {'; '.join(errors)}")
    for w in warnings:
        print(f"warning: resuming with a changed setting: {w}", file=sys.stderr)
    from ..train.corpus import data_identity

    errors, warnings = rundir.compare_data(index.get("data"), data_identity(cfg.train))
    if errors:
        raise ConfigError(f"cannot resume {ckpt} with another tokenizer: {'; '.join(errors)}")
    for w in warnings:
        print(f"warning: resuming on other data: {w}", file=sys.stderr)
    return str(ckpt), index["step"]


def warn_missing_eos(train, announce: bool) -> None:
    """A run's tokenizer whose end-of-text cannot be found (and no --eos): one warning naming the option."""
    from ..tokenizer import load_tokenizer, missing_eos

    text = missing_eos(load_tokenizer(train.tokenizer or None, train.eos, train.bos), train.eos)
    if text and announce:
        print(text, file=sys.stderr)


def check_init_hf(cfg) -> None:
    """--init-hf: the folder's tensors are exactly the model's, with their shapes and a float dtype, read
    from the files' own headers (model/hf_weights.py); one line otherwise, before any rank starts."""
    if cfg.train.init_hf:
        from ..model.hf_weights import HFWeights

        HFWeights(cfg.train.init_hf, cfg.model).check()


def physical_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(planned: dict, ranks_here: int, params: int) -> None:
    """Local CPU ranks keep what they hold in this machine's memory, and no rank holds more than its
    pieces (the model is built on the meta device): when the planner's bytes for the `ranks_here` ranks
    (each pipeline stage's total, for its share of the ranks) exceed physical memory, the run is refused
    in one line instead of being left to the kernel's OOM killer."""
    stages = planned.get("stages") or []
    total = physical_memory()
    if total is None:
        return   # the platform does not say
    need = sum(s.get("total", 0) for s in stages) * ranks_here // max(1, len(stages))
    if stages and need > total:
        gib = 2**30
        raise ConfigError(f"the model has {params:,} parameters: its {ranks_here} local rank(s) need "
                          f"{need / gib:,.1f} GiB by the planner's memory per rank, this machine has "
                          f"{total / gib:,.1f} GiB; choose a smaller model or more ranks (fivefold plan shows "
                          f"the bytes per rank)")


def check_offload_dir(cfg, ranks_here: int, planned: dict) -> None:
    """parallel.offload = nvme: offload_dir must be a folder this process can write (made here when
    missing, as the run would), on a disk with room for the offloaded state of the `ranks_here` ranks
    that share it: the planner's `disk` bytes per rank (`planned_memory`, what parallel/zero/offload.py
    writes). Checked before any rank starts, not at the first step."""
    import shutil

    p = cfg.parallel
    if p.offload != "nvme":
        return
    folder = Path(p.offload_dir)
    if os.path.lexists(folder) and not folder.is_dir():
        raise ConfigError(f"parallel.offload_dir {folder} is not a folder; give a folder on a fast local disk")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"parallel.offload_dir {folder} is not writable ({e.strerror or e}); give a folder on a "
                          f"fast local disk") from None
    stages = planned.get("stages") or []
    per_rank = max((s.get("disk", 0) for s in stages), default=0)
    need, free = per_rank * ranks_here, shutil.disk_usage(folder).free
    if need > free:
        gib = 2**30
        raise ConfigError(f"parallel.offload_dir {folder} has {free / gib:.2f} GiB free; the offloaded optimizer "
                          f"state needs {need / gib:.2f} GiB ({ranks_here} rank(s) x {per_rank / gib:.2f} GiB, "
                          f"the planner's disk row): free space there, or choose another offload_dir")


def nodes_from_torchrun(cfg, local_world: int | None, announce: bool) -> None:
    """Under torchrun the ranks of one agent share a node: parallel.ranks_per_node takes its
    LOCAL_WORLD_SIZE unless the config sets it (to emulate other nodes), which is then announced."""
    p = cfg.parallel
    if not local_world:
        return
    if not p.ranks_per_node:
        p.ranks_per_node = local_world
    elif p.ranks_per_node != local_world and announce:
        print(f"fivefold train: parallel.ranks_per_node={p.ranks_per_node} (emulated nodes) while torchrun runs "
              f"{local_world} ranks per node", file=sys.stderr)


def cmd_dry_run(args: argparse.Namespace) -> int:
    """`fivefold train --dry-run`: tools/dryrun.py, for the layout at its own world size."""
    from .dryrun import DoesNotFit, check_dry_run, dry_run, dry_run_cost, model_of_preset, stage_ranks, table

    cfg = resolve_train_config(args)
    if args.model:   # the preset's shape, then any --set model.* on top of it
        from ..config import apply_overrides

        cfg.model = model_of_preset(args.model)
        model_sets = {k: v for k, v in parse_sets(args.set).items() if k.startswith("model.")}
        cfg = apply_overrides(cfg, model_sets)
    if args.steps is None:
        cfg.train.steps = 2
    cfg.train.checkpoint = False
    world = cfg.parallel.world_size
    cfg.validate(world)
    check_dry_run(cfg)
    if args.ranks == "stages":
        ranks = stage_ranks(cfg)
    elif args.ranks == "all":
        ranks = list(range(world))
    else:
        try:
            ranks = sorted({int(r) for r in args.ranks.split(",")})
        except ValueError:
            raise ConfigError(f"--ranks takes stages, all or a list like 0,8,16; got {args.ranks!r}") from None
        if not all(0 <= r < world for r in ranks):
            raise ConfigError(f"--ranks {args.ranks}: ranks are 0..{world - 1} for this layout")
    if args.device_memory is not None and not args.device_memory > 0:
        raise ConfigError(f"--device-memory must be > 0 GiB, got {args.device_memory}")
    check_real("--max-seconds", args.max_seconds, 0)
    seconds, host = dry_run_cost(cfg, ranks, cfg.train.steps)     # before anything is built
    if seconds > args.max_seconds:
        raise ConfigError(f"--dry-run of ranks {ranks[:4]}{'...' if len(ranks) > 4 else ''} is estimated at "
                          f"{seconds:,.0f} s here (> --max-seconds {args.max_seconds:g}: {cfg.model.layers:,} layers, "
                          f"{cfg.model.num_params():,} parameters); valid: fewer --ranks or --steps, or a larger "
                          f"--max-seconds")
    available = physical_memory()
    if available is not None and host > available:
        raise ConfigError(f"--dry-run is estimated to need {host / 2**30:,.1f} GiB of host memory here, "
                          f"this machine has {available / 2**30:,.1f} GiB ({cfg.model.layers:,} layers, "
                          f"{cfg.model.num_params():,} parameters); valid: a smaller model or fewer --ranks")
    print(f"fivefold train --dry-run: {world} ranks (tp={cfg.parallel.tp} cp={cfg.parallel.cp} pp={cfg.parallel.pp} "
          f"dp={cfg.parallel.dp} ep={cfg.parallel.ep} zero={cfg.parallel.zero}), {cfg.model.num_params():,} "
          f"parameters, ranks {ranks}, {cfg.train.steps} step(s), about {seconds:,.0f} s and "
          f"{host / 2**30:.1f} GiB here", file=sys.stderr)
    try:
        report = dry_run(cfg, ranks, cfg.train.steps, Path(cfg.train.out), args.device_memory)
    except DoesNotFit as e:
        print(f"fivefold: {e}", file=sys.stderr)
        return 1
    print(table(report))
    print(f"ledger equals the planner's rows: {report['ledger_equals_plan']}  ({cfg.train.out}/dryrun.json)")
    return 0


TRAIN_RANK = "fivefold.train.trainer:train_rank"   # each local rank's function, imported in the rank: the launcher
                                                    # imports no torch (train/launch.py)


def check_supported(cfg) -> None:
    """The trainer's `supported` rules before any rank starts; torch is imported only where they need a meta
    model (`rules.trains_a_subset`: LoRA targets, freeze patterns), else the torch-free rules alone."""
    if trains_a_subset(cfg.train):
        from ..train.trainer import supported

        supported(cfg)
    else:
        check_runtime_support(cfg.parallel, cfg.train, cfg.model)


def cmd_train(args: argparse.Namespace) -> int:
    from ..train.torchrun_env import torchrun_env, torchrun_ranks_per_node

    if args.dry_run:
        return cmd_dry_run(args)
    env = torchrun_env()
    cfg = resolve_train_config(args, env[1] if env else None)
    if env is not None:
        nodes_from_torchrun(cfg, torchrun_ranks_per_node(), env[0] == 0)
    out = cfg.train.out
    world = env[1] if env else (args.nproc or cfg.parallel.world_size)
    cfg.validate(world)          # the config's own rules first: no torch is imported for a bad one
    from ..comm import CommLedger
    from ..train import rundir
    from ..train.corpus import check_data, check_eval_data
    from ..train.launch import (die_with_parent, init_torchrun, install_stop_handlers, last_stop_signal, start_watchdog,
                               launcher_device, leave_torchrun, rank_context, resolve_device, run_ranks)
    from ..train.scalars import require_tensorboard
    from ..train.wandb_log import require_wandb

    require_tensorboard(cfg.train.tensorboard)
    require_wandb(cfg.train.wandb)
    check_supported(cfg)                                            # before any rank starts: what the runtime
    if env is None:                                                  # does not run, a device it cannot use,
        rank_context()                                              # a TMPDIR too long for the ranks' socket,
        device_type = launcher_device(cfg.train.device, "gloo" if world > 1 else None)
        planned = planned_memory(cfg)                   # more than this machine's memory,
        speed = speed_model(cfg, device_type, device_name(device_type))
        if device_type == "cpu":
            check_host_memory(planned, world, cfg.model.num_params())
    n_tokens = check_data(cfg.train, cfg.model.vocab)               # data it cannot read, a run folder it
    warn_missing_eos(cfg.train, env is None or env[0] == 0)
    check_eval_data(cfg.train, cfg.model.vocab)                     # (evaluation data too)
    check_init_hf(cfg)                                              # HF weights that do not fit the model,
    rundir.check_out(out, args.resume, args.overwrite)              # a run folder it must not touch (again under the lock)
    if cfg.train.init_hf and (env is None or env[0] == 0) and "lr" not in lr_given(args, train_overrides(args)):
        print(fine_tuning_note(cfg.train), file=sys.stderr)     # every check passed: say which lr it uses
    lock = rundir.RunLock(out) if env is None or env[0] == 0 else None
    ckpt, start = prepare_run(cfg, args)
    if lock is not None:
        rundir.check_writable(out, cfg.train.checkpoint)
    if start >= cfg.train.steps:
        print(f"fivefold train: {out} is at step {start} of {cfg.train.steps}: nothing to do "
              f"(raise --steps to train on)", file=sys.stderr)
        return 0
    if args.overwrite and lock is not None and rundir.holds_run(out):
        rundir.clear(out)                                           # only what fivefold wrote
    if lock is not None:
        from ..tokenizer import save_to_run
        from .stops import keep_stop_ids
        from ..train.instructions import keep_in_run, keep_tokenizer_settings

        rundir.mark(out)                                            # OUT/.fivefold-run: fivefold's from now on
        save_to_run(cfg.train.tokenizer, out, cfg.train.eos, cfg.train.bos)   # OUT/tokenizer.*: generate and export read it
        keep_in_run(cfg.train.tokenizer, out)                       # OUT/chat_template.json, when it has one
        keep_tokenizer_settings(cfg.train.tokenizer, out)           # OUT/tokenizer-config.json: pad token, ...
        keep_stop_ids(cfg.train.init_hf, out)                       # OUT/generation_config.json: --init-hf's eos ids
        write_run_config(cfg, out)                                  # OUT/config.toml: --config reruns it
    if ckpt and (env is None or env[0] == 0):
        print(f"fivefold train: resuming from {ckpt} (step {start})", file=sys.stderr)
    if env is not None:  # one rank of a torchrun job
        die_with_parent()          # a killed torchrun agent leaves no rank training headless
        install_stop_handlers()
        rank, world = init_torchrun(device=cfg.train.device)
        start_watchdog(args.timeout)   # no step for --timeout s: one line naming the nodes it cannot reach, exit
        import torch.distributed as dist

        from ..train.trainer import train_rank

        device_type = resolve_device(cfg.train.device, dist.get_backend()).type
        planned = planned_memory(cfg)
        check_offload_dir(cfg, torchrun_ranks_per_node() or 1, planned)
        speed = speed_model(cfg, device_type, device_name(device_type))
        result = train_rank(rank, world, cfg.to_dict(), out, ckpt, planned, speed)
        leave_torchrun(stop_code(result.get("stopped")))   # does not return; failures propagate as usual
    check_offload_dir(cfg, world, planned)
    k = cfg.parallel.ranks_per_node
    nodes = f" as {world // k} emulated nodes of {k}" if 0 < k < world else ""
    print(f"fivefold train: {world} rank(s){nodes}, dp={cfg.parallel.dp} tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
          f"cp={cfg.parallel.cp} ep={cfg.parallel.ep} zero={cfg.parallel.zero}, "
          f"{trainable_text(cfg)}, {banner_tokens(cfg, start, n_tokens)}, steps {start + 1}..{cfg.train.steps} "
          f"-> {out}; {peak_text(speed, cfg.train.calibration)}", file=sys.stderr)
    results = run_ranks(TRAIN_RANK, world, (cfg.to_dict(), out, ckpt, planned, speed), timeout_s=args.timeout)
    lock.release()
    r0 = results[0]
    hist = r0["history"]
    if hist:
        first, last = hist[0], hist[-1]
        print(f"loss {first['loss']:.4f} -> {last['loss']:.4f} over {len(hist)} steps")
    print("\ncommunication (all ranks):")
    print(CommLedger.read(Path(out) / "comm.json").table(host_is_device=device_type == "cpu"))
    # the signal the launcher received (it forwards any stop to the ranks as SIGTERM): Ctrl-C exits 130
    stopped = last_stop_signal() or r0.get("stopped")
    if stopped:
        print(f"fivefold: stopped by {stopped} after step {r0['step']}; checkpoint in "
              f"{rundir.step_dir(out, r0['step'])}; continue with --resume auto --out {out}", file=sys.stderr)
    return stop_code(stopped)


def banner_tokens(cfg, start: int, data_tokens: int) -> str:
    """What the run will train on: steps x global_batch x seq_len tokens (the steps left), beside the data's size
    and the epochs of it they make."""
    t = cfg.train
    steps = t.steps - start
    tokens = steps * t.global_batch * t.seq_len
    epochs = f": {tokens / max(data_tokens, 1):.3g} epochs" if t.records == "stream" else " (whole records: the rows' "\
        "epochs follow)"
    return (f"{tokens:,} tokens to train ({steps} steps x {t.global_batch} x {t.seq_len}; the data holds "
            f"{data_tokens:,}{epochs})")


def trainable_text(cfg) -> str:
    """What trains: every parameter, or (LoRA, train.freeze) how many and their share, and the adapters."""
    if not trains_a_subset(cfg.train):
        return f"{cfg.model.num_params():,} parameters, all trained"
    from ..model import Transformer
    from ..model.lora import choose_trainable

    meta = choose_trainable(Transformer(cfg.model, device="meta"), cfg.train)   # no memory: shapes only
    total = sum(p.numel() for p in meta.parameters())
    trained = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    t = cfg.train
    what = (f"LoRA rank {t.lora_rank}, alpha {t.lora_alpha:g} on {' '.join(t.lora_targets)}" if t.lora_rank
            else f"frozen: {' '.join(t.freeze)}")
    return f"{total:,} parameters, {trained:,} trained ({trained / total:.2%}; {what})"


def stop_code(signal_name: str | None) -> int:
    """Exit status of a run: 0, or 128 + the signal's number when a signal stopped it (after saving)."""
    import signal

    return 0 if not signal_name else 128 + int(getattr(signal, signal_name))
