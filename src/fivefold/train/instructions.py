"""Instruction data: chat records and prompt/completion pairs as token ids and a loss mask. Torch-free.

Supervised fine-tuning trains on the answers only. Two record forms, as TRL's SFTTrainer takes them:

- **chat**: `{"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}`, rendered
  by the chat template of a Hugging Face folder (its `chat_template.jinja`, or `chat_template` in
  `tokenizer_config.json`) the way transformers' `apply_chat_template` renders it: Jinja2 in a sandbox
  with `trim_blocks` and `lstrip_blocks`, the variables `messages`, `add_generation_prompt`,
  `bos_token`, `eos_token` and the functions `raise_exception` and `strftime_now`. The tokens of every
  assistant turn count (its content and whatever the template closes it with, up to the next turn);
  the rest (system, user, the template's role headers) is context only. An assistant turn's text is
  found by rendering the conversation up to the turn with `add_generation_prompt=True` and then through
  it: the difference is the turn. A template that marks what the assistant generates with
  `{% generation %}...{% endgeneration %}` (TRL's assistant_only_loss templates) trains exactly those
  blocks' text, as transformers' `return_assistant_tokens_mask` finds it.
- **prompt-completion**: `{"prompt": "...", "completion": "..."}`: the prompt is context, the completion
  and the end token after it are trained (TRL's completion-only loss): the tokenizer folder's eos_token
  (tokenizer_config.json: an Instruct model's end of turn, as TRL appends its tokenizer's eos_token), else
  the end-of-text (`completion_end`); the start-of-text token (--bos) before the prompt when the run has one.

Ids are the tokenizer's ids of the whole rendered text (as `apply_chat_template(tokenize=True)` gives
them), and a token is trained when it lies in a trained piece: each piece's first token is the length of
the ids of the text before it, which must be a prefix of the whole text's ids (tokenizers split at the
templates' special tokens, so it is; a record where it is not is refused, naming the record).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

from ..rules import ConfigError, install_hint
from ..tokenizer import Tokenizer

FORMATS = ("text", "chat", "prompt-completion")
TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplate:
    """A Hugging Face chat template, rendered as transformers renders it."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str = "chat template"):
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError(f"chat templates need jinja2 ({install_hint('hf')}: transformers brings it)") from None

        def raise_exception(message):
            raise ConfigError(f"{name}: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", generation_extension()])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ConfigError(f"{name} is not a valid Jinja template ({e})") from None
        self.bos_token, self.eos_token, self.name, self.source = bos_token, eos_token, name, source
        self.spans = next(e for e in env.extensions.values() if hasattr(e, "tracked"))   # {% generation %}

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ChatTemplate":
        """The template of a Hugging Face folder: chat_template.jinja, else tokenizer_config.json's
        `chat_template` (a string, or a list of named templates: the one named "default")."""
        fields = template_fields(folder)
        if fields is None:
            raise ConfigError(f"{folder} has no chat template ({TEMPLATE_FILE}, or chat_template in "
                              f"tokenizer_config.json); give --chat-template a Hugging Face folder that has one")
        return cls(fields["chat_template"], fields["bos_token"], fields["eos_token"], name=fields["name"])

    @classmethod
    def from_run(cls, run: str | Path) -> "ChatTemplate | None":
        """The template a run folder keeps (`keep_in_run`), or None."""
        path = Path(run) / RUN_TEMPLATE
        if not path.is_file() or path.is_symlink():   # never followed out of the run folder
            return None
        d = _read_json(path)
        if not all(isinstance(d.get(k), str) for k in ("chat_template", "bos_token", "eos_token")):
            raise ConfigError(f"{path} is not a chat template fivefold wrote (chat_template, bos_token, eos_token)")
        return cls(d["chat_template"], d["bos_token"], d["eos_token"], name=str(path))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)

    @property
    def marks_generation(self) -> bool:
        """The template wraps what the assistant generates in {% generation %} blocks (TRL's assistant_only_loss
        templates)."""
        return self.spans.seen

    def render_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the (start, end) characters of each {% generation %} block's output,
        as transformers' apply_chat_template(return_assistant_tokens_mask=True) finds them: rendered chunk
        by chunk, a block's start is the length of the text before it."""
        self.spans.tracked, self.spans.found = [], []
        try:
            for chunk in self.template.generate(messages=messages, add_generation_prompt=False,
                                                bos_token=self.bos_token, eos_token=self.eos_token):
                self.spans.tracked.append(chunk)
            return "".join(self.spans.tracked), list(self.spans.found)
        finally:
            self.spans.tracked = self.spans.found = None


def generation_extension():
    """A Jinja extension for {% generation %}...{% endgeneration %} (transformers' AssistantTracker): renders
    its body; while `tracked` holds the chunks rendered so far, records the span the body produced."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationSpans(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.tracked = self.found = None
            self.seen = False

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            self.seen = True
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            out = caller()
            if self.tracked is not None:
                start = len("".join(self.tracked))
                self.found.append((start, start + len(out)))
            return out

    return GenerationSpans


RUN_TEMPLATE = "chat_template.json"   # a run folder's copy of its tokenizer folder's template


def template_fields(folder: str | Path) -> dict | None:
    """{"chat_template", "bos_token", "eos_token", "name"} of a Hugging Face folder's chat template
    (chat_template.jinja, else tokenizer_config.json's), or None when it has none."""
    folder = Path(folder)
    config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
    jinja = folder / TEMPLATE_FILE
    if jinja.is_file() and not jinja.is_symlink():
        return {"chat_template": jinja.read_text(encoding="utf-8"), **specials, "name": str(jinja)}
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return {"chat_template": source, **specials, "name": f"{folder / 'tokenizer_config.json'}: chat_template"}


RUN_TOKENIZER_CONFIG = "tokenizer-config.json"   # a run folder's copy of its tokenizer folder's settings
# the tokenizer_config.json fields an export keeps (its class, length, eos / bos and template are the run's own)
TOKENIZER_SETTINGS = ("pad_token", "unk_token", "add_bos_token", "add_eos_token", "add_prefix_space", "padding_side",
                      "truncation_side", "additional_special_tokens", "split_special_tokens", "errors",
                      "model_input_names", "clean_up_tokenization_spaces", "added_tokens_decoder")
MAX_TOKENIZER_CONFIG = 16 << 20   # bytes: a tokenizer_config.json larger than this is no settings file


def tokenizer_settings(folder: str | Path | None) -> dict:
    """The TOKENIZER_SETTINGS a Hugging Face folder's tokenizer_config.json holds ({} without one)."""
    path = Path(folder) / "tokenizer_config.json" if folder else None
    if path is None or not path.is_file() or path.is_symlink():
        return {}
    if path.stat().st_size > MAX_TOKENIZER_CONFIG:
        raise ConfigError(f"{path} is {path.stat().st_size:,} bytes: more than a tokenizer's settings "
                          f"({MAX_TOKENIZER_CONFIG:,} at most)")
    config = _read_json(path)
    return {k: config[k] for k in TOKENIZER_SETTINGS if k in config}


def keep_tokenizer_settings(tokenizer_path: str | Path | None, out: str | Path) -> Path | None:
    """Keep the run's tokenizer folder's settings (pad token, added tokens' flags, padding side, ...) in the
    run folder, for `export --hf`'s tokenizer_config.json; a stale copy goes."""
    dest = Path(out) / RUN_TOKENIZER_CONFIG
    kept = tokenizer_settings(Path(tokenizer_path).parent) if tokenizer_path else {}
    if not kept:
        dest.unlink(missing_ok=True)
        return None
    dest.write_text(json.dumps(kept, indent=1) + "\n")
    return dest


def kept_tokenizer_settings(run: str | Path) -> dict:
    """What `keep_tokenizer_settings` kept in a run folder, checked again (a JSON object of the kept keys)."""
    path = Path(run) / RUN_TOKENIZER_CONFIG
    if not path.is_file() or path.is_symlink():   # never followed out of the run folder
        return {}
    if path.stat().st_size > MAX_TOKENIZER_CONFIG:
        raise ConfigError(f"{path} is larger than a tokenizer's settings")
    return {k: v for k, v in _read_json(path).items() if k in TOKENIZER_SETTINGS}


def keep_in_run(tokenizer_path: str | Path | None, out: str | Path) -> Path | None:
    """Keep the chat template of the run's tokenizer folder (train.tokenizer's; --init-hf's folder gives it)
    in the run folder as RUN_TEMPLATE, for `generate RUN --chat` and `export --hf`; a stale copy goes."""
    dest = Path(out) / RUN_TEMPLATE
    fields = template_fields(Path(tokenizer_path).parent) if tokenizer_path else None
    if fields is None:
        dest.unlink(missing_ok=True)
        return None
    fields.pop("name")
    dest.write_text(json.dumps(fields, indent=1) + "\n")
    return dest


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return d


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def chat_pieces(template: ChatTemplate, messages, where: str) -> list[tuple[str, bool]]:
    """(text, trained) pieces of one conversation whose concatenation is its rendering: every assistant
    turn trained, everything else not."""
    check_messages(messages, where)
    if template.marks_generation:
        return generation_pieces(template, messages, where)
    full = template.render(messages)
    pieces, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[:i + 1]) if i + 1 < len(messages) else full
        if not (full.startswith(before) and full.startswith(through) and len(before) >= done
                and len(through) >= len(before)):
            raise ConfigError(f"{where}: the chat template does not render this conversation as a sequence of "
                              f"its turns (a turn's rendering is not a prefix of the whole), so its assistant "
                              f"tokens cannot be told apart")
        pieces += [(full[done:len(before)], False), (full[len(before):len(through)], True)]
        done = len(through)
    pieces.append((full[done:], False))
    if not any(trained and text for text, trained in pieces):
        raise ConfigError(f"{where}: no assistant turn with text: nothing to train on")
    return [(t, trained) for t, trained in pieces if t]


def generation_pieces(template: ChatTemplate, messages, where: str) -> list[tuple[str, bool]]:
    """(text, trained) pieces of a conversation under a template that marks what the assistant generates:
    the {% generation %} blocks' text trained, the rest not (TRL's assistant_only_loss)."""
    full, spans = template.render_spans(messages)
    pieces, done = [], 0
    for start, end in sorted(spans):
        if start < done:
            raise ConfigError(f"{where}: {template.name}'s generation blocks overlap")
        pieces += [(full[done:start], False), (full[start:end], True)]
        done = end
    pieces.append((full[done:], False))
    if not any(trained and text for text, trained in pieces):
        raise ConfigError(f"{where}: the template's generation blocks hold no text: nothing to train on")
    return [(t, trained) for t, trained in pieces if t]


def completion_pieces(record: dict, where: str) -> list[tuple[str, bool]]:
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ConfigError(f"{where}: a prompt-completion record needs string fields \"prompt\" and \"completion\", "
                          f"got {sorted(record)}")
    if not completion:
        raise ConfigError(f"{where}: the completion is empty: nothing to train on")
    return [(prompt, False), (completion, True)]


def check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: a chat record needs \"messages\": a non-empty list of {{role, content}}")
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: message {j} is not {{\"role\": str, \"content\": str}}")


def completion_end(tokenizer: Tokenizer, tokenizer_path: str | Path | None, eos: str = "") -> int | None:
    """The id a prompt-completion record's completion ends with, as TRL's SFTTrainer appends
    `processing_class.eos_token`: the token --eos names; else the eos_token of the tokenizer folder's
    tokenizer_config.json (an Instruct model's end of turn, Qwen2's <|im_end|>), when it is one token of the
    vocabulary; else the tokenizer's end-of-text found by name."""
    if eos or tokenizer_path is None:
        return tokenizer.eos_id
    config = Path(tokenizer_path).parent / "tokenizer_config.json"
    name = _token_text(_read_json(config).get("eos_token")) if config.is_file() and not config.is_symlink() else ""
    backend = getattr(tokenizer, "backend", None)
    found = backend.token_to_id(name) if name and backend is not None else None
    return found if found is not None else tokenizer.eos_id


def encode_pieces(tokenizer: Tokenizer, pieces: list[tuple[str, bool]], where: str,
                  eos_trained: bool = False, end_id: int | None = None) -> tuple[list[int], list[int]]:
    """(ids of the pieces' whole text, 1 for each trained token else 0); `eos_trained`: `end_id` (default the
    tokenizer's end-of-text id) appended, trained (a completion's end)."""
    text = "".join(t for t, _ in pieces)
    ids = tokenizer.encode(text)
    mask = [0] * len(ids)
    at = 0
    for piece, trained in pieces:
        lo = _prefix_length(tokenizer, text[:at], ids, where)
        at += len(piece)
        hi = _prefix_length(tokenizer, text[:at], ids, where)
        if trained:
            mask[lo:hi] = [1] * (hi - lo)
    end = tokenizer.eos_id if end_id is None else end_id
    if eos_trained and end is not None:
        ids.append(end)
        mask.append(1)
    return ids, mask


def _prefix_length(tokenizer: Tokenizer, prefix: str, ids: list[int], where: str) -> int:
    if not prefix:
        return 0
    head = tokenizer.encode(prefix)
    if ids[:len(head)] != head:
        raise ConfigError(f"{where}: the tokens of the text before a turn are not a prefix of the whole "
                          f"conversation's tokens (the tokenizer merges across the turn's boundary), so the "
                          f"turn's tokens cannot be told apart; end turns with a special token")
    return len(head)


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}


def sharegpt_messages(conversations, where: str) -> list[dict]:
    """ShareGPT's {"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]} as chat messages."""
    if not isinstance(conversations, list) or not conversations:
        raise ConfigError(f"{where}: \"conversations\" must be a non-empty list of {{\"from\", \"value\"}} turns")
    out = []
    for i, turn in enumerate(conversations):
        role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        if role is None or not isinstance(turn.get("value"), str):
            raise ConfigError(f"{where}: conversations turn {i} needs \"from\" (one of {', '.join(SHAREGPT_ROLES)}) "
                              f"and a string \"value\"")
        out.append({"role": role, "content": turn["value"]})
    return out


def conversational_completion_pieces(template: ChatTemplate | None, record: dict, where: str) -> list[tuple[str, bool]]:
    """TRL's conversational prompt-completion ({"prompt": [messages], "completion": [messages]}): the prompt
    rendered with the generation prompt is context, the rest of prompt + completion's rendering is trained
    (the template closes the turn: no end token is added)."""
    if template is None:
        raise ConfigError(f"{where}: a conversational prompt-completion record needs a chat template: "
                          f"--chat-template HF_FOLDER (or --tokenizer HF_FOLDER/tokenizer.json)")
    prompt, completion = record["prompt"], record.get("completion")
    check_messages(prompt, where)
    check_messages(completion, where)
    before = template.render(prompt, add_generation_prompt=True)
    full = template.render(prompt + completion)
    if not full.startswith(before) or len(full) == len(before):
        raise ConfigError(f"{where}: the chat template does not render the prompt as a prefix of prompt and "
                          f"completion, so the completion's tokens cannot be told apart")
    return [(before, False), (full[len(before):], True)]


def record_pieces(fmt: str, record, where: str, template: ChatTemplate | None) -> list[tuple[str, bool]]:
    """The (text, trained) pieces of one record of format `fmt` ("chat": {"messages"} or ShareGPT's
    {"conversations"}; "prompt-completion": strings, or TRL's conversational lists of messages)."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if fmt == "chat":
        messages = record.get("messages")
        if messages is None and "conversations" in record:
            messages = sharegpt_messages(record["conversations"], where)
        return chat_pieces(template, messages, where)
    if isinstance(record.get("prompt"), list):
        return conversational_completion_pieces(template, record, where)
    return completion_pieces(record, where)


def encode_record(fmt: str, record, where: str, tokenizer: Tokenizer,
                  template: ChatTemplate | None, end_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask) of one record: uint32 ids, uint8 mask (1: the token is trained). A prompt-completion
    record starts with the start-of-text id when the run has one (--bos), untrained, and ends with `end_id`
    (`completion_end`; default the tokenizer's end-of-text); a chat template writes its own."""
    completion = fmt == "prompt-completion" and not (isinstance(record, dict) and isinstance(record.get("prompt"), list))
    ids, mask = encode_pieces(tokenizer, record_pieces(fmt, record, where, template), where, eos_trained=completion,
                              end_id=end_id)
    if completion and tokenizer.bos_id is not None:
        ids, mask = [tokenizer.bos_id] + ids, [0] + mask
    return np.asarray(ids, dtype=np.uint32), np.asarray(mask, dtype=np.uint8)
