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

from ..config import Config, ConfigError, ParallelConfig, apply_overrides, field_doc, field_type, parse_sets
from .training import check_init_hf, check_supported, flag_kwargs, model_from_hf, vocab_from_tokenizer

# eval's flags: the layout and the shape of its windows (dotted config keys, typed like train's flags)
EVAL_FLAGS = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep",
    "etp": "parallel.etp",
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
    t.keep_best, t.stop_after = False, 0   # the run's judgement of its evaluations: nothing to judge here
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


HF_EVAL_SEQ = 2048     # eval of a Hugging Face folder: windows of its max_position_embeddings, at most this


def add_eval_args(ap: argparse.ArgumentParser) -> None:

    ap.add_argument("source", help="a run folder (its newest checkpoint), a checkpoints/step-N folder, or a "
                    "Hugging Face model folder (config.json + safetensors)")
    ap.add_argument("--data", nargs="+", required=True, help="text files, or token files (fivefold tokenize's, "
                    ".u16/.bin, .u32, .npy), read with the model's tokenizer")
    ap.add_argument("--nproc", type=int, help="local gloo ranks to spawn (default: the layout's world size)")
    for flag, key in EVAL_FLAGS.items():
        default = ("the run's train.seq_len; a Hugging Face folder's max_position_embeddings, at most "
                   f"{HF_EVAL_SEQ}" if flag == "seq_len" else f"the run's {key}")
        ap.add_argument(f"--{flag.replace('_', '-')}", dest=flag, help=f"{field_doc(key)} (default: {default})",
                        **flag_kwargs(field_type(key)))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config key")
    ap.add_argument("--timeout", type=float, default=600, help="hang watchdog (seconds without progress)")


def cmd_eval(args: argparse.Namespace) -> int:
    """`fivefold eval` (tools/evaluate.py): every rule checked here, then the ranks evaluate."""
    from ..config import Config
    from ..train.corpus import check_data, check_eval_data
    from ..train.launch import launcher_device, run_ranks

    source = Path(args.source)
    if not source.is_dir():
        raise ConfigError(f"{source}: no such run, checkpoint or Hugging Face folder")
    if is_hf_folder(source):   # --init-hf semantics: config.json sets [model], its tokenizer is the run's
        cfg, ckpt = Config(), None
        cfg.train.init_hf = str(source)
        model_from_hf(cfg, set())
        vocab_from_tokenizer(cfg, True)
        cfg.train.seq_len = min(cfg.model.max_seq, HF_EVAL_SEQ)   # what the model was made for, within reason
    else:
        cfg, ckpt = run_config(source)
    cfg = eval_config(cfg, args)
    world = args.nproc or cfg.parallel.world_size
    cfg.validate(world)
    check_supported(cfg)
    launcher_device(cfg.train.device, "gloo" if world > 1 else None)   # a device it cannot use: one line
    check_data(cfg.train, cfg.model.vocab)
    check_eval_data(cfg.train, cfg.model.vocab)
    check_init_hf(cfg)
    result = run_ranks(eval_rank, world, (cfg.to_dict(), ckpt), timeout_s=args.timeout)[0]
    print(f"eval loss {result['eval_loss']:.6f}  perplexity {result['eval_ppl']:.4f}  "
          f"(over {result['eval_loss_tokens']:,} target tokens in windows of {cfg.train.seq_len}, "
          f"{ckpt or args.source})")
    return 0


# third-party progress bars (tqdm: transformers' "Loading checkpoint shards", huggingface_hub, datasets)
# would interleave with our console line; each library reads these at import, so they are set before any
# is imported; a variable the user set is kept (TQDM_DISABLE=0 brings the bars back)
