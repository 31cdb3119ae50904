"""`fivefold export RUN --hf DIR`: a Hugging Face folder that `AutoModelForCausalLM.from_pretrained(DIR)`
loads, with the run's tokenizer.

    DIR/config.json, generation_config.json, model.safetensors   train/checkpoint.py's `export_hf`
      (or model-0000k-of-0000n.safetensors + index)              (Llama, Qwen2, Mixtral or Qwen2-MoE:
                                                                   model/hf.py), streamed tensor by tensor
    DIR/tokenizer.json, tokenizer_config.json                    `AutoTokenizer.from_pretrained(DIR)` loads them
    DIR/chat_template.jinja                                      the run's chat template, when its tokenizer's
                                                                 folder had one (apply_chat_template reads it)

written into `.DIR.fivefold-export-PID` beside DIR and renamed into place when whole: an export killed midway
leaves no DIR that transformers would load (the temporary goes at the next export into DIR).

The tokenizer, by what the run trained with (tokenizer.py):
- a Hugging Face tokenizer.json: copied as it is, with a minimal tokenizer_config.json
  (PreTrainedTokenizerFast, the end-of-text token, model_max_length = model.max_seq). Its
  post-processor (a BOS, say) applies in transformers by default; fivefold encodes without it;
- none (byte-level): a tokenizer.json written here whose ids are the UTF-8 bytes, as in training
  (`tokenizers`' byte-level alphabet, a BPE without merges), so Hugging Face tokenizes like fivefold;
- a tiktoken BPE file: copied as tokenizer.tiktoken, which `fivefold generate --hf DIR` reads but
  transformers' AutoTokenizer does not (no conversion is attempted).
config.json and generation_config.json name the tokenizer's end-of-text id (none for bytes) and no
beginning-of-sequence id: fivefold trains without BOS, and transformers' Llama defaults (1, 2) would be
ordinary tokens here. The run's `--eos` / `--bos` (kept beside its tokenizer copy), or the export's own
`--eos TOKEN` / `--bos TOKEN`, choose those ids; a tokenizer whose end-of-text cannot be found is a
warning naming `--eos`.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ..config import ConfigError
from ..rules import install_hint
from .generate import find_checkpoint, run_of
from .stops import generation_defaults, stop_ids
from ..tokenizer import HFTokenizer, load_tokenizer, missing_eos, read_specials
from ..train import checkpoint, rundir
from ..train.instructions import TEMPLATE_FILE, ChatTemplate, kept_tokenizer_settings


def export_hf_folder(run: str | Path, dest: str | Path, step: str | Path | None = None,
                     max_shard_bytes: int = checkpoint.DEFAULT_SHARD_BYTES, eos: str = "", bos: str = "") -> Path:
    """Write the Hugging Face folder `dest` (new or empty) from the run's newest checkpoint (or `step`),
    its weights in files of at most `max_shard_bytes`; `eos`, `bos`: tokens that override the run's."""
    check_dest(Path(dest))
    ckpt = find_checkpoint(run, step)
    run_eos, run_bos = read_specials(run_of(ckpt))
    eos, bos = eos or run_eos, bos or run_bos
    tokenizer = load_tokenizer(rundir.checked_tokenizer_file(ckpt), eos, bos)   # an unknown --eos fails before writing
    warning = missing_eos(tokenizer, eos)
    if warning:
        print(warning, file=sys.stderr)
    final = Path(dest)
    remove_stale_exports(final)
    dest = final.parent / f".{final.name}{EXPORT_TMP}{os.getpid()}"   # written whole, then renamed into place
    try:
        write_folder(ckpt, dest, max_shard_bytes, eos, bos)
        os.rename(dest, final)           # onto a missing or empty folder: atomic, a partial export is never seen
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)   # ours alone: the name carries this process's id
        raise
    return final


EXPORT_TMP = ".fivefold-export-"   # .DEST.fivefold-export-PID: an export in progress beside its destination


def remove_stale_exports(final: Path) -> list[Path]:
    """Remove the temporary folders an export into `final` left when it was killed (their writer's process
    is gone); nothing else. Returns what was removed."""
    gone = []
    parent = final.parent
    if not parent.is_dir():
        return gone
    for p in parent.glob(f".{final.name}{EXPORT_TMP}*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def write_folder(ckpt: Path, dest: Path, max_shard_bytes: int, eos: str, bos: str) -> None:
    """The Hugging Face folder of checkpoint `ckpt` written into `dest` (module docstring)."""
    try:
        checkpoint.export_hf(ckpt, dest, max_shard_bytes)
    except ImportError as e:   # no transformers
        raise ConfigError(f"cannot export to Hugging Face form: {e}; {install_hint('hf')}") from None
    except ValueError as e:    # a model no HF family matches
        raise ConfigError(f"cannot export to Hugging Face form: {e}") from None
    max_seq = rundir.read_index(ckpt)["config"]["model"]["max_seq"]
    tokenizer = write_tokenizer(rundir.checked_tokenizer_file(ckpt), dest, max_seq, eos, bos,
                                kept_tokenizer_settings(run_of(ckpt)))
    stops = sorted(stop_ids(tokenizer, run_of(ckpt)))   # the tokenizer's end, and --init-hf's eos ids the run kept
    set_special_ids(dest, stops[0] if len(stops) == 1 else (stops or None), tokenizer.bos_id)
    keep_sampling_defaults(dest, run_of(ckpt), tokenizer.vocab_size)
    template = ChatTemplate.from_run(run_of(ckpt))   # the run's chat template (its tokenizer folder's), if any
    if template is not None:
        (dest / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")


def check_dest(dest: Path) -> None:
    """`dest` must be a new or empty folder that can be made: not a file, not under a file, not a link."""
    if dest.is_symlink():
        raise ConfigError(f"--hf {dest} is a symbolic link; choose a new folder")
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"--hf {dest} is a file; choose a new folder (export never overwrites)")
    if dest.is_dir() and any(dest.iterdir()):
        raise ConfigError(f"--hf {dest} is not empty; choose a new folder (export never overwrites)")
    parent = next((p for p in dest.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"--hf {dest} cannot be a folder: {parent} is a file")


def write_tokenizer(path: Path | None, dest: Path, max_seq: int, eos: str = "", bos: str = "",
                    settings: dict | None = None):
    """Put the run's tokenizer file (None: byte-level) into `dest` (module docstring); returns it loaded
    (with `eos`, `bos` chosen). `settings`: the base tokenizer folder's (pad token, added tokens' flags, ...),
    kept in tokenizer_config.json beside the run's class, length and eos / bos."""
    tokenizer = load_tokenizer(path, eos, bos)
    if path is not None and not isinstance(tokenizer, HFTokenizer):   # tiktoken: as it is
        shutil.copyfile(path, dest / "tokenizer.tiktoken")
        return tokenizer
    if path is None:
        byte_level_tokenizer().save(str(dest / "tokenizer.json"))
    else:
        shutil.copyfile(path, dest / "tokenizer.json")
    config = {"clean_up_tokenization_spaces": False, **(settings or {}),
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_seq}
    for name in ("eos", "bos"):   # the token's text (a Hugging Face vocabulary's; the byte-level one has none)
        token_id = getattr(tokenizer, f"{name}_id")
        if token_id is not None and isinstance(tokenizer, HFTokenizer):
            config[f"{name}_token"] = tokenizer.backend.id_to_token(token_id)
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer


def byte_bpe_alphabet() -> list[str]:
    """The printable character GPT-2's byte-level BPE uses for each byte 0..255 (byte i -> entry i):
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def byte_level_tokenizer():
    """A `tokenizers` Tokenizer whose ids are a text's UTF-8 bytes (fivefold's byte-level default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in enumerate(byte_bpe_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def keep_sampling_defaults(dest: Path, run: Path, vocab: int) -> None:
    """The sampling defaults of the run's --init-hf folder, which the run kept (stops.py), into
    generation_config.json (and its pad id into config.json), so transformers generates from the export as it
    did from its base (without them it decodes greedily)."""
    kept = generation_defaults(run)
    pad = kept.get("pad_token_id")
    if pad is not None and pad >= vocab:
        raise ConfigError(f"{run / 'generation_config.json'}: pad_token_id {pad} is not below the vocabulary ({vocab})")
    for name, keys in (("generation_config.json", kept), ("config.json", {"pad_token_id": pad} if pad is not None else {})):
        path = dest / name
        if keys and path.is_file():
            config = json.loads(path.read_text())
            config.update(keys)
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def set_special_ids(dest: Path, eos_id: int | list[int] | None, bos_id: int | None = None) -> None:
    """config.json and generation_config.json: eos_token_id = the tokenizer's (and the ids of the run's --init-hf
    folder: a list), bos_token_id only when chosen."""
    for name in ("config.json", "generation_config.json"):
        path = dest / name
        if path.is_file():
            config = json.loads(path.read_text())
            config.update(bos_token_id=bos_id, eos_token_id=eos_id)
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
