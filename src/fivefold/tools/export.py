"""`fivefold export`: a run's (or checkpoint's) whole weights into one safetensors file, a Hugging Face
folder (`--hf`: a merged one for LoRA runs) or a PEFT adapter folder (`--peft`), written tensor by tensor
(train/checkpoint.py `export`, tools/hf_export.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ConfigError

def add_export_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("checkpoint", help="a run folder (its newest checkpoint) or a checkpoints/step-N folder")
    ap.add_argument("dest", nargs="?", help="the single safetensors file to write, or with --hf a new folder "
                    "(never overwritten)")
    ap.add_argument("--hf", nargs="?", const=True, metavar="DIR", help="write a Hugging Face model folder DIR "
                    "(Llama / Qwen2 / Mixtral / Qwen2-MoE by the config, with the tokenizer; needs transformers)")
    ap.add_argument("--eos", default="", metavar="TOKEN", help="with --hf: the end-of-text token the export names "
                    "(default: the run's)")
    ap.add_argument("--bos", default="", metavar="TOKEN", help="with --hf: a start-of-text token (default: the run's)")
    ap.add_argument("--peft", metavar="DIR", help="a LoRA run's adapters alone in PEFT's format (adapter_config.json, "
                    "adapter_model.safetensors), for peft.PeftModel.from_pretrained over the base model")
    ap.add_argument("--max-shard-mb", type=float, default=2048, help="with --hf: weight files of at most this "
                    "many MiB, as save_pretrained's max_shard_size (default 2048; a bigger tensor gets its own file)")


def cmd_export(args: argparse.Namespace) -> int:
    from ..train.checkpoint import export, export_peft

    if args.peft is not None:
        if args.hf is not None or args.dest is not None:
            raise ConfigError("export --peft takes one folder and no other destination: fivefold export RUN --peft DIR")
        path = export_peft(args.checkpoint, args.peft)
        print(f"wrote {path}/ ({', '.join(sorted(p.name for p in path.iterdir()))})")
        return 0
    if args.hf is not None:   # `export RUN --hf DIR` or `export RUN DIR --hf`
        if (args.hf is True) == (args.dest is None):
            raise ConfigError("export --hf takes one folder: fivefold export RUN --hf DIR")
        from .hf_export import export_hf_folder

        if not args.max_shard_mb > 0:
            raise ConfigError(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
        path = export_hf_folder(args.checkpoint, args.dest if args.hf is True else args.hf,
                                max_shard_bytes=int(args.max_shard_mb * 2**20), eos=args.eos, bos=args.bos)
        print(f"wrote {path}/ ({', '.join(sorted(p.name for p in path.iterdir()))})")
        return 0
    if args.dest is None:
        raise ConfigError("export needs a destination: fivefold export RUN FILE.safetensors, or --hf DIR")
    path = export(args.checkpoint, args.dest)
    print(exported_summary(path))
    return 0


def exported_summary(path: Path) -> str:
    """What `export FILE` wrote: tensors, parameters and their dtypes, the checkpoint's step, bytes."""
    import json as _json
    import math as _math

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = sorted({str(f.get_slice(k).get_dtype()) for k in f.keys()})
    params = sum(_math.prod(s) for s in shapes.values())
    model = _json.loads(meta.get("config", "{}")).get("model", {})
    shape = f", hidden {model['hidden']}, {model['layers']} layers, vocab {model['vocab']}" if model else ""
    return (f"wrote {path}: {len(shapes)} tensors, {params:,} parameters ({'/'.join(dtypes)}{shape}) of step "
            f"{meta.get('step', '?')}, {path.stat().st_size:,} bytes")
