"""`fivefold eval RUN|HF_DIR --data FILES [layout flags]`: a model's loss and perplexity on data.

The model is a run's checkpoint (a run folder: its newest; or a checkpoints/step-N folder), read into
any layout (train/checkpoint.py), or a Hugging Face folder (save_pretrained's config.json and
safetensors, read slice by slice into each rank's shards as `--init-hf` does: model/hf_weights.py).
The data (`--data`: text or token files, read as `train --data` reads them, with the model's tokenizer)
is cut into the fixed windows of an evaluation (train/data.py `EvalBatches`: `--eval-tokens` tokens in
whole global batches of `--seq-len` windows); the ranks run `Trainer.evaluate` (forward only, no
gradient), so the number is the same under every layout: `--dp/--tp/--pp/--cp/--ep/--zero/...` choose
one, as for `train`. Every rule is checked before any rank starts (one line, exit 2).

Prints `eval loss L  perplexity P  (N tokens, SOURCE)` on stdout. The command's flags and checks are
cli.py's (`add_eval_args`, `cmd_eval`); this module builds the config and runs a rank.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import Config, ConfigError, ParallelConfig, apply_overrides, parse_sets

# eval's flags: the layout and the shape of its windows (dotted config keys, typed like train's flags)
EVAL_FLAGS = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep",
    "zero": "parallel.zero", "sp_mode": "parallel.sp_mode", "cp_mode": "parallel.cp_mode",
    "microbatches": "parallel.microbatches", "schedule": "parallel.schedule", "vpp": "parallel.vpp",
    "partition": "parallel.partition", "seq_len": "train.seq_len", "global_batch": "train.global_batch",
    "eval_tokens": "train.eval_tokens", "dtype": "train.dtype", "device": "train.device",
}


def is_hf_folder(source: Path) -> bool:
    """A Hugging Face folder: config.json and no fivefold checkpoint in or under it."""
    from ..train import rundir

    return ((source / "config.json").is_file() and not (source / rundir.INDEX).is_file()
            and rundir.newest_checkpoint(source) is None)


def run_config(source: Path) -> tuple[Config, str]:
    """(config, checkpoint) of a run folder or checkpoint folder: the checkpoint's config (verified
    against its bytes) with the run's own tokenizer copy and --eos / --bos."""
    from .generate import find_checkpoint, run_of
    from ..tokenizer import read_specials
    from ..train.rundir import checked_tokenizer_file
    from ..train.verify import verify

    ckpt = find_checkpoint(source)
    cfg = Config.from_dict(verify(ckpt)["config"])
    saved = checked_tokenizer_file(ckpt)
    cfg.train.tokenizer = str(saved) if saved is not None else ""
    cfg.train.eos, cfg.train.bos = read_specials(run_of(ckpt))
    cfg.train.init_hf = ""   # the checkpoint holds the weights
    return cfg, str(ckpt)


def eval_config(cfg: Config, args: argparse.Namespace) -> Config:
    """The config the ranks evaluate with: the model's `cfg`, a fresh layout from the flags (not the
    run's), `--data` as both the (unused) training and the evaluation data, nothing written."""
    cfg.parallel = ParallelConfig()
    t = cfg.train
    t.data, t.eval_data, t.eval_fraction, t.eval_every = list(args.data), list(args.data), 0.0, 0
    t.checkpoint, t.tensorboard = False, False
    overrides = {key: getattr(args, flag) for flag, key in EVAL_FLAGS.items()}
    overrides.update(parse_sets(args.set))
    apply_overrides(cfg, overrides)
    p = cfg.parallel
    if args.nproc and args.dp is None and p.world_size != args.nproc:
        other = p.tp * p.cp * p.pp
        if args.nproc % other:
            raise ConfigError(f"{args.nproc} ranks must divide by tp*cp*pp = {other}")
        p.dp = args.nproc // other
    return cfg


def eval_rank(rank: int, world_size: int, cfg_dict: dict, ckpt: str | None) -> dict:
    """One rank: build the model in the layout, load the checkpoint (or the Hugging Face weights), evaluate."""
    from ..train.trainer import Trainer

    trainer = Trainer(Config.from_dict(cfg_dict), rank, world_size, quiet=True)
    if ckpt:
        trainer.restore(ckpt)
    return trainer.evaluate()
