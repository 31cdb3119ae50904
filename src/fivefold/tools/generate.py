"""Sampling from a trained model, on one process: `fivefold generate RUN --prompt TEXT`.

    model, tokenizer = load_run("runs/demo")                 # newest checkpoint, the run's tokenizer
    ids = sample(model, tokenizer.encode("Once"), Sampling(max_tokens=50, temperature=0.8, seed=1))
    print(tokenizer.decode(ids))

A checkpoint is layout-free (train/checkpoint.py), so a run trained with any parallel layout loads into
one single-process `Transformer`. `load_hf(DIR)` loads a Hugging Face folder instead: transformers'
`AutoModelForCausalLM` reads it and model/hf.py's `from_hf` converts it, so both paths share this
sampler (the same seed gives the same text from a run and from its export).

Decoding: the prompt runs once, then one token at a time against the model's KV cache
(model/attention.py's `KVCache`); `use_cache=False` re-runs the whole sequence for every token (the
reference the cache is tested against). MoE layers run dropless here, as in Hugging Face: capacity is a
training-time limit, and per-step capacity would make the cached and uncached paths disagree.

Choosing the next token, from the last position's logits (computed on the CPU in fp32, drawn from a
`torch.Generator` seeded by `seed`, so a seed gives the same text again, and the draws do not depend
on the device):
temperature 0 is greedy (argmax), and so is a temperature so small that logits / temperature
overflows; otherwise logits / temperature, then keep the top_k most likely
tokens (0: all), then the smallest set whose probabilities sum to at least top_p (1: all), renormalise
and draw. Generation stops after max_tokens, at a stop id, at a stop text (`--stop`, cut before it),
or when the context reaches the model's max_seq. Stop ids: the tokenizer's end-of-text id, and for a
Hugging Face folder every `eos_token_id` of its `generation_config.json` and `config.json` (an int or a
list: chat models end a turn with another token than the document's end, e.g. Llama 3's <|eot_id|>); a run
started with --init-hf keeps its folder's (OUT/generation_config.json) and stops there too.
`--chat` wraps each prompt as a user message in the chat template (the folder's, or `--chat-template
DIR`'s) with the assistant's turn opened, as transformers' `apply_chat_template(...,
add_generation_prompt=True)`; `--prompt` may be given several times: sampled in one batch (left-padded,
`sample_batch`), each with its own generator of the same seed, as if alone.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError
from ..rules import install_hint
from ..model.attention import KVCache
from ..model.transformer import Transformer
from ..train import checkpoint, rundir
from .stops import stop_ids


@dataclass
class Sampling:
    """How to choose tokens (module docstring); the CLI's flags of the same names."""

    max_tokens: int = 100
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    use_cache: bool = True

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] (1: off), got {self.top_p}")


# -------------------------------------------------------------------------------------------------------
# Loading

def find_checkpoint(run: str | Path, step: str | Path | None = None) -> Path:
    """The checkpoint folder to sample from: `step` (a checkpoints/step-N folder, its name inside the
    run, or its number), else the newest complete one of the run folder `run` (or `run` itself when it is one)."""
    run = Path(run)
    if not run.is_dir():
        raise ConfigError(f"{run}: no such run folder")
    if str(step) == "best":        # train.keep_best's: OUT/best.json names it
        best = rundir.read_best(run)
        if best is None:
            raise ConfigError(f"--checkpoint best: {run} has no {rundir.BEST} (train with train.keep_best=true)")
        step = str(best["step"])
    if step is not None:
        number = str(step).removeprefix("step-")
        named = [rundir.step_dir(run, int(number))] if number.isdigit() else []   # step-2 = step-00000002
        for ckpt in (Path(step), run / rundir.CHECKPOINTS / str(step), *named):
            if (ckpt / rundir.INDEX).is_file():
                return ckpt
        names = [c.name for c in rundir.checkpoints(run)]
        raise ConfigError(f"--checkpoint {step}: no such checkpoint of {run}; choose one of {names or 'none'}")
    if (run / rundir.INDEX).is_file():
        return run
    newest = rundir.newest_checkpoint(run)
    if newest is None:
        raise ConfigError(f"{run} holds no complete checkpoint ({rundir.CHECKPOINTS}/step-*/{rundir.INDEX}); "
                          f"train it with train.checkpoint=true")
    return newest


def run_of(ckpt: Path) -> Path:
    """The run folder a checkpoint folder belongs to (OUT/checkpoints/step-N -> OUT)."""
    return ckpt.parent.parent if ckpt.parent.name == rundir.CHECKPOINTS else ckpt


def for_inference(model: Transformer, device: str = "auto") -> Transformer:
    """Eval mode (no dropout), MoE layers dropless, on `device` (auto: CUDA when available)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    for m in model.modules():
        if hasattr(m, "capacity_factor"):
            m.capacity_factor = 0.0
    return model.eval().to(device)


def load_run(run: str | Path, step: str | Path | None = None, device: str = "auto"):
    """(model, tokenizer) of a run folder: its newest checkpoint (or `step`) in one process, and the
    tokenizer the run trained with (byte-level when it used none)."""
    from ..tokenizer import load_tokenizer, read_specials

    ckpt = find_checkpoint(run, step)
    tokenizer = load_tokenizer(rundir.checked_tokenizer_file(ckpt), *read_specials(run_of(ckpt)))
    return for_inference(checkpoint.to_model(ckpt), device), tokenizer


def load_hf(folder: str | Path, device: str = "auto"):
    """(model, tokenizer) of a Hugging Face folder (Llama, Mixtral or Qwen2-MoE: model/hf.py): the weights
    through transformers and `from_hf`; the tokenizer from its tokenizer.json (or the tokenizer.tiktoken
    `fivefold export --hf` copies), else byte-level when the vocabulary has 256 entries."""
    from ..model.hf import from_hf
    from ..tokenizer import load_tokenizer, run_tokenizer_file

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--hf {folder}: not a Hugging Face model folder (no config.json)")
    try:
        model = from_hf(folder).float()   # tensor by tensor from the shard files (model/hf_weights.py)
    except ImportError as e:
        raise ConfigError(f"--hf {folder}: cannot load it ({str(e).splitlines()[0]}); {install_hint('hf')}") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"--hf {folder}: cannot load it ({str(e).splitlines()[0]})") from None
    path = run_tokenizer_file(folder)
    if path is not None:
        tokenizer = load_tokenizer(path)
    elif model.cfg.vocab == 256:
        tokenizer = load_tokenizer(None)
    else:
        raise ConfigError(f"--hf {folder}: no tokenizer.json, and the vocabulary ({model.cfg.vocab}) is not "
                          f"byte-level (256); add the model's tokenizer.json to the folder")
    return for_inference(model, device), tokenizer


# -------------------------------------------------------------------------------------------------------
# Sampling

def next_token(logits_v: torch.Tensor, s: Sampling, gen: torch.Generator) -> int:
    """The next token from one position's logits (module docstring: temperature, top-k, top-p)."""
    logits_v = logits_v.float().cpu()
    if s.temperature == 0:
        return int(logits_v.argmax())
    scaled_v = logits_v / s.temperature
    if bool(torch.isinf(scaled_v[torch.isfinite(logits_v)]).any()):   # a temperature so small it overflows:
        return int(logits_v.argmax())                                 # the limit of T -> 0 is greedy
    logits_v = scaled_v
    if 0 < s.top_k < logits_v.numel():
        kth = logits_v.topk(s.top_k).values[-1]
        logits_v = logits_v.masked_fill(logits_v < kth, float("-inf"))
    if s.top_p < 1:
        probs_v, order_v = torch.softmax(logits_v, -1).sort(descending=True)
        before_v = probs_v.cumsum(0) - probs_v          # probability of the more likely tokens
        drop_v = order_v[before_v >= s.top_p]           # the most likely token is always kept
        logits_v = logits_v.index_fill(0, drop_v, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits_v, -1), 1, generator=gen))


@torch.no_grad()
def sample(model: Transformer, prompt: list[int], s: Sampling, eos_id: int | set[int] | None = None,
           vocab: int | None = None) -> list[int]:
    """The tokens generated after `prompt` (not including it): at most s.max_tokens, stopping after
    a stop id (`eos_id`: one or a set) or when prompt + generated tokens fill the model's max_seq. Only
    ids below `vocab` (the tokenizer's; None: the model's) are drawn."""
    stops = eos_id if isinstance(eos_id, set) else ({eos_id} if eos_id is not None else set())
    s.validate()
    room = model.cfg.max_seq - len(prompt)
    if not prompt or room < 1:
        raise ConfigError(f"the prompt must be 1..{model.cfg.max_seq - 1} tokens (model.max_seq "
                          f"{model.cfg.max_seq}), got {len(prompt)}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(s.seed)
    cache = KVCache(model.cfg.layers) if s.use_cache else None
    ids, fresh, out = list(prompt), list(prompt), []
    for _ in range(min(s.max_tokens, room)):
        tokens_bs = torch.tensor([fresh if cache is not None else ids], device=device)
        logits_v = model(tokens_bs, cache=cache)[0, -1, :vocab]
        token = next_token(logits_v, s, gen)
        out.append(token)
        ids.append(token)
        fresh = [token]
        if token in stops:
            break
    return out


@torch.no_grad()
def sample_batch(model: Transformer, prompts: list[list[int]], s: Sampling, eos_id: int | set[int] | None = None,
                 vocab: int | None = None) -> list[list[int]]:
    """`sample` for several prompts in one batch: left-padded to the longest (`KVCache(pad_b=...)`: each row's
    positions start at its first token and no token attends to padding), one forward a step for all rows.
    Each row draws from its own generator seeded s.seed, as `sample` does for that prompt alone; a row that
    stopped rides along until every row has. Without the KV cache, or for one prompt, each runs alone."""
    if len(prompts) == 1 or not s.use_cache:
        return [sample(model, p, s, eos_id, vocab) for p in prompts]
    stops = eos_id if isinstance(eos_id, set) else ({eos_id} if eos_id is not None else set())
    s.validate()
    for p in prompts:
        if not p or model.cfg.max_seq - len(p) < 1:
            raise ConfigError(f"each prompt must be 1..{model.cfg.max_seq - 1} tokens (model.max_seq "
                              f"{model.cfg.max_seq}), got {len(p)}")
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    pad_b = torch.tensor([longest - len(p) for p in prompts])
    cache = KVCache(model.cfg.layers, pad_b=pad_b)
    gens = [torch.Generator().manual_seed(s.seed) for _ in prompts]
    limits = [min(s.max_tokens, model.cfg.max_seq - len(p)) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    fresh_bs = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    while not all(done):
        logits_bv = model(fresh_bs, cache=cache)[:, -1, :vocab]
        step = []
        for i, logits_v in enumerate(logits_bv):
            if not done[i]:
                outs[i].append(next_token(logits_v, s, gens[i]))
                done[i] = outs[i][-1] in stops or len(outs[i]) >= limits[i]
            step.append(outs[i][-1])
        fresh_bs = torch.tensor(step, device=device)[:, None]
    return outs


def generate_text(model: Transformer, tokenizer, prompt: str, s: Sampling, stops: set[int] | None = None,
                  stop_texts: tuple[str, ...] = ()) -> tuple[str, int]:
    """(the prompt's continuation as text, without a final stop token and cut before the first stop
    text; how many tokens were generated); a note on stderr when max_seq cut it short."""
    return generate_texts(model, tokenizer, [prompt], s, stops, stop_texts)[0]


def generate_texts(model: Transformer, tokenizer, prompts: list[str], s: Sampling, stops: set[int] | None = None,
                   stop_texts: tuple[str, ...] = ()) -> list[tuple[str, int]]:
    """`generate_text` of several prompts, sampled in one batch (`sample_batch`)."""
    stops = stop_ids(tokenizer) if stops is None else stops
    outs = sample_batch(model, [tokenizer.encode(p) for p in prompts], s, stops, tokenizer.vocab_size)
    return [finish_text(model, tokenizer, out, s, stops, stop_texts) for out in outs]


def finish_text(model: Transformer, tokenizer, out: list[int], s: Sampling, stops: set[int],
                stop_texts: tuple[str, ...]) -> tuple[str, int]:
    ended = bool(out) and out[-1] in stops
    text = tokenizer.decode(out[:-1] if ended else out)
    cuts = [text.find(t) for t in stop_texts if t and t in text]
    if cuts:
        return text[:min(cuts)], len(out)
    if not ended and len(out) < s.max_tokens:
        print(f"note: stopped after {len(out)} tokens: the context is full (model.max_seq "
              f"{model.cfg.max_seq})", file=sys.stderr)
    return text, len(out)


# -------------------------------------------------------------------------------------------------------
# Command line (cli.py defines the flags)

def check_utf8(name: str, text: str) -> None:
    """Text from the command line must be valid UTF-8 (Python keeps undecodable argv bytes as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = text[e.start].encode("utf-8", "surrogateescape")
        raise ConfigError(f"{name} is not valid UTF-8: byte 0x{byte.hex()} at character {e.start}; "
                          f"give UTF-8 text") from None


def add_generate_args(ap) -> None:
    ap.add_argument("run", nargs="?", help="a run folder (its newest checkpoint) or a checkpoints/step-N folder")
    ap.add_argument("--prompt", required=True, action="append", help="the text to continue (several --prompt: "
                    "sampled in one batch, each as if alone)")
    ap.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop where the continuation "
                    "contains TEXT, cut before it (several allowed; stop ids: the end-of-text token and a Hugging "
                    "Face folder's eos_token_id)")
    ap.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat "
                    "template (the --hf folder's, or --chat-template's) with the assistant's turn opened")
    ap.add_argument("--chat-template", metavar="HF_FOLDER", help="the folder whose chat template --chat uses "
                    "(default: the --hf folder)")
    ap.add_argument("--max-tokens", type=int, default=100, help="tokens to generate at most (default 100)")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy; default 1")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set with this "
                    "much probability (1: all)")
    ap.add_argument("--seed", type=int, default=0, help="the sampler's random seed (default 0)")
    ap.add_argument("--checkpoint", help="a checkpoint of RUN to use instead of the newest: step-N, best "
                    "(train.keep_best's) or a path")
    ap.add_argument("--no-cache", action="store_true", help="re-run the whole sequence for every token "
                    "instead of using the KV cache (slower; the same tokens)")
    ap.add_argument("--hf", metavar="DIR", help="sample from a Hugging Face folder (e.g. `fivefold export "
                    "--hf`) instead of a run")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when available")


def cmd_generate(args) -> int:
    """`fivefold generate`: print the prompt and its sampled continuation; speed on stderr."""
    s = Sampling(args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed, not args.no_cache)
    s.validate()
    if not all(args.prompt):
        raise ConfigError("--prompt must not be empty")
    for p in args.prompt + args.stop:
        check_utf8("--prompt" if p in args.prompt else "--stop", p)
    template = None
    if args.chat:
        from ..train.instructions import ChatTemplate

        folder = args.chat_template or args.hf
        template = ChatTemplate.from_folder(folder) if folder is not None else \
            ChatTemplate.from_run(run_of(find_checkpoint(args.run, args.checkpoint))) if args.run is not None else None
        if template is None:
            raise ConfigError("--chat needs a chat template: the run's (its tokenizer folder had none), "
                              "--chat-template HF_FOLDER or --hf HF_FOLDER")
    elif args.chat_template:
        raise ConfigError("--chat-template is used by --chat; add --chat")
    if (args.run is None) == (args.hf is None):
        raise ConfigError("give a run folder (fivefold generate RUN --prompt ...) or --hf DIR, not both or neither")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available; use --device cpu or auto")
    if args.hf is not None:
        if args.checkpoint:
            raise ConfigError("--checkpoint applies to a run folder, not to --hf DIR")
        model, tokenizer = load_hf(args.hf, args.device)
    else:
        model, tokenizer = load_run(args.run, args.checkpoint, args.device)
    stops = stop_ids(tokenizer, args.hf if args.hf is not None else run_of(find_checkpoint(args.run, args.checkpoint)))
    shown = [template.render([{"role": "user", "content": p}], add_generation_prompt=True) if template else p
             for p in args.prompt]
    start = time.perf_counter()
    results = generate_texts(model, tokenizer, shown, s, stops, tuple(args.stop))   # one batch (KV cache)
    seconds = time.perf_counter() - start
    for prompt, (text, _) in zip(args.prompt, results):
        print((prompt + "\n" if template else prompt) + text)
    batch = f", {len(results)} prompts in one batch" if len(results) > 1 and s.use_cache else ""
    print(f"generated {sum(n for _, n in results)} tokens in {seconds:.2f} s "
          f"({'KV cache' if s.use_cache else 'no cache'}{batch}, {next(model.parameters()).device})", file=sys.stderr)
    return 0
