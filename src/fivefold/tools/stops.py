"""The ids generation stops after: a tokenizer's end-of-text and a Hugging Face folder's `eos_token_id`s, which a
run started from that folder keeps (OUT/generation_config.json), beside that folder's sampling defaults
(`GENERATION_DEFAULTS`: do_sample, temperature, top_p, top_k, repetition_penalty, pad_token_id), which
`export --hf` puts back, so transformers samples from the fine-tuned model as it did from its base.
Torch-free: `fivefold train`'s launcher writes them before any rank starts."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError


def folder_eos_values(folder: str | Path | None) -> list[tuple[Path, object]]:
    """(file, value) of every `eos_token_id` entry a Hugging Face folder's generation_config.json, then
    config.json, gives (an int or a list of them; checked by the caller); [] without a folder."""
    out = []
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name if folder is not None else None
        if path is None or not path.is_file() or path.is_symlink():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            raise ConfigError(f"{path} is not a readable JSON object") from None
        out += [(path, v) for v in (value if isinstance(value, list) else [value]) if v is not None]
    return out


def is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def stop_ids(tokenizer, folder: str | Path | None = None) -> set[int]:
    """The ids generation stops after: the tokenizer's end-of-text, and a Hugging Face folder's
    `eos_token_id`s (generation_config.json, then config.json; an int or a list)."""
    ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    for path, v in folder_eos_values(folder):
        if not (is_id(v) and v < tokenizer.vocab_size):
            raise ConfigError(f"{path}: eos_token_id {v!r} is not a token id below the vocabulary "
                              f"({tokenizer.vocab_size})")
        ids.add(v)
    return ids


RUN_STOPS = "generation_config.json"   # in a run folder: its --init-hf folder's eos_token_ids (`keep_stop_ids`)

# a Hugging Face generation_config.json's sampling defaults a run keeps, each with the test its value must pass
GENERATION_DEFAULTS = {
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "temperature": (lambda v: _number(v) and 0 < v < 1e6, "a number above 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: is_id(v) and v < 2**31, "an integer >= 0"),
    "repetition_penalty": (lambda v: _number(v) and 0 < v < 1e6, "a number above 0"),
    "pad_token_id": (lambda v: is_id(v) and v < 2**31, "a token id"),
}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def generation_defaults(folder: str | Path | None) -> dict:
    """The sampling defaults (GENERATION_DEFAULTS) a Hugging Face folder's generation_config.json sets; a
    value of the wrong kind is refused in one line naming the file, the key and what it must be."""
    path = Path(folder) / "generation_config.json" if folder else None
    if path is None or not path.is_file() or path.is_symlink():
        return {}
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"{path} is not a readable JSON object") from None
    if not isinstance(found, dict):
        raise ConfigError(f"{path} is not a JSON object")
    out = {}
    for key, (ok, what) in GENERATION_DEFAULTS.items():
        if found.get(key) is not None:
            if not ok(found[key]):
                raise ConfigError(f"{path}: {key} = {found[key]!r} must be {what}")
            out[key] = found[key]
    return out


def keep_stop_ids(init_hf: str | Path | None, out: str | Path) -> Path | None:
    """A run started from a Hugging Face folder keeps that folder's `eos_token_id`s (generation_config.json and
    config.json; a chat model ends its turns with one, e.g. Qwen2's <|im_end|>) as OUT/generation_config.json,
    which `stop_ids` reads like a folder's: `generate RUN` stops there and `export --hf` names them; with the
    folder's sampling defaults (`generation_defaults`), which `export --hf` writes back."""
    dest = Path(out) / RUN_STOPS
    ids = list(dict.fromkeys(v for _, v in folder_eos_values(init_hf or None) if is_id(v)))
    kept = {**({"eos_token_id": ids} if ids else {}), **generation_defaults(init_hf or None)}
    if not kept:
        dest.unlink(missing_ok=True)
        return None
    dest.write_text(json.dumps(kept) + "\n")
    return dest
