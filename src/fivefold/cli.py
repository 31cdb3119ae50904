"""Command line: `fivefold COMMAND [options]`, one command a line (`fivefold COMMAND --help` for its options):

    fivefold train [--config F.toml] [--nproc N] [--dp --tp --pp --cp --ep --etp --zero ...] [--steps K] [--out DIR] [--resume auto|DIR]
    fivefold eval RUN_OR_CHECKPOINT|HF_DIR --data FILES [--nproc N] [--dp --tp --pp --cp ...] [--eval-tokens N]
    fivefold export RUN_OR_CHECKPOINT FILE.safetensors | --hf DIR | --peft DIR
    fivefold generate RUN|--hf DIR --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--checkpoint step-N]
    fivefold report RUN [RUN...] [--out DIR] [--format png|svg]
    fivefold tokenize INPUT... --tokenizer T --out data.bin [--field text] [--workers N] [--overwrite]
    fivefold calibrate [--nproc N] [--out local.toml] [--quick]
    fivefold plan --model llama3-8b --gpus 64 --topology dgx-h100 [--tp --pp --dp ...] [--json]
    fivefold schedule --pp 4 --microbatches 8 --schedule 1f1b [--vpp V] [--out F.svg]
    fivefold cluster --topology fabric.toml --nodes N -- train ... --out DIR    (as root: network namespaces)
"""
from __future__ import annotations

import argparse
import os
import sys

from .config import ConfigError
from .flags import OneLineParser
from .process import is_rank_failure, quiet_third_party_bars

# command -> (help, module of its add_*_args and cmd_* functions (None: this file), their name); a command's
# module is imported only when that command runs (`fivefold plan` never imports tokenize's numpy)
COMMANDS = {
    "train": ("train a model (embedded default when no config)", ".tools.training", "train"),
    "export": ("write a checkpoint's whole weights to one safetensors file", ".tools.export", "export"),
    "generate": ("sample text from a run's checkpoint (or a Hugging Face folder)", ".tools.generate", "generate"),
    "eval": ("a run's checkpoint's (or a Hugging Face folder's) loss and perplexity on data, under any layout",
             ".tools.evaluate", "eval"),
    "report": ("draw runs' loss, grad norm, tokens/s, lr, traffic, pipeline", ".tools.report", "report"),
    "tokenize": ("tokenize text / JSONL / Parquet / datasets folders into a token file for training",
                 ".tools.tokenize", "tokenize"),
    "calibrate": ("measure this machine and write a topology TOML for plan", ".tools.calibrate", "calibrate"),
    "schedule": ("simulate and draw a pipeline schedule", ".tools.schedule", "schedule"),
    "plan": ("estimate memory, traffic and step time of a layout, or search", ".tools.plan", "plan"),
    "cluster": ("run a command on an emulated multi-node cluster and measure its links", ".tools.cluster", "cluster"),
}


def overview() -> str:
    """`fivefold --help`'s text: each command and what it does on one line, then each one's usage on one line."""
    width = max(map(len, COMMANDS))
    what = "\n".join(f"  {cmd:<{width}}  {help_}" for cmd, (help_, _, _) in COMMANDS.items())
    usage = __doc__.split("\n\n", 1)[1].rstrip()
    return f"commands (fivefold COMMAND --help for its options):\n{what}\n\nusage, one command a line:\n\n{usage}"


def _command(cmd: str):
    """(add_args, run) of a command, importing its module only now."""
    import importlib

    _, module, name = COMMANDS[cmd]
    where = importlib.import_module(module, __package__) if module else sys.modules[__name__]
    return getattr(where, f"add_{name}_args"), getattr(where, f"cmd_{name}")


def _chosen(argv: list[str]) -> str | None:
    """The command argv names (its first word that is not an option), if it is one of COMMANDS."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    quiet_third_party_bars()
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = OneLineParser(prog="fivefold", description=overview(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=OneLineParser, metavar="COMMAND",
                            help=argparse.SUPPRESS)   # listed one a line in the description
    chosen = _chosen(argv)
    run = None
    for cmd, (help_, _, _) in COMMANDS.items():
        parser = sub.add_parser(cmd, description=help_)
        if cmd == chosen:               # only the command that runs gets its arguments (and its imports)
            add_args, run = _command(cmd)
            add_args(parser)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except ConfigError as e:
        print(f"fivefold: config error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # the reader left (`fivefold plan ... | head`): no traceback, nothing more to write
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # Python's own advice (signal docs)
        return 1
    except Exception as e:  # a failing rank: its traceback is in the message
        if is_rank_failure(e):
            print(f"fivefold: {e}", file=sys.stderr)
            return 1
        raise


def command(argv: list[str] | None = None) -> int:
    """The `fivefold` command (and `python -m fivefold.cli`): `main`, then the local ranks' fork server is
    ended, if the command started one, so nothing of it outlives the command. `main` called in-process (the
    tests, a notebook) keeps the server for the next call, which then starts ranks without importing torch
    again."""
    try:
        return main(argv)
    finally:
        launch = sys.modules.get(f"{__package__}.train.launch")   # imported only by commands that start ranks
        if launch is not None:
            launch.stop_rank_server()


if __name__ == "__main__":
    sys.exit(command())
