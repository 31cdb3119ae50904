"""Every rule a model and a parallel layout must obey, once, torch-free.

Each rule is a plain function that returns nothing when the rule holds and raises `ConfigError` with one
line naming the rule and the nearest valid values when it does not. `Config.validate`, the mesh, the
runtime and the planner (`plan/layout.py:check`) call these same functions, so a layout the planner
accepts is one the runtime runs, with the same message when it is not.

The choices a field can take are `Literal` types (`ZeroStage`, `SpMode`, `CpMode`, `ScheduleKind`,
`Recompute`, `PartitionKind`, `Dtype`, `Device`, `Dim`, `RouterKind`, `Offload`); `choices(T)` lists them, for argparse and for
`check_choice`.
"""
from __future__ import annotations

import fnmatch

from math import gcd, isfinite
from typing import Literal, get_args

ZeroStage = Literal[0, 1, 2, 3]
SpMode = Literal["none", "megatron"]                  # Megatron sequence parallelism inside tp
CpMode = Literal["ulysses", "ring", "hybrid"]         # how context parallelism splits attention
ScheduleKind = Literal["gpipe", "1f1b", "interleaved", "zb"]   # pipeline schedules (parallel/pipeline/schedules.py)
Recompute = Literal["none", "selective", "full"]      # activation checkpointing
PartitionKind = Literal["even", "llama3"]             # named layer splits; a list "3,5,5,3" is the third kind
Dtype = Literal["fp32", "bf16", "fp64"]               # fp64 for exactness checks
Device = Literal["auto", "cpu", "cuda"]
Records = Literal["stream", "padded", "packed"]   # how record data fills rows (train/data.py RecordBatches)
RecordOverflow = Literal["truncate", "drop"]      # a record longer than a row
LrSchedule = Literal["cosine", "linear", "constant", "wsd",   # after the warmup (train/optim.py lr_at)
                     "hf_linear", "hf_cosine", "constant_with_warmup"]   # transformers' (step 0 at lr 0, to 0)
Dim = Literal["tp", "cp", "ep", "dp", "pp"]           # the grid's dimensions
RouterKind = Literal["softmax_topk_norm", "softmax_topk", "sigmoid_bias"]   # Mixtral, Qwen2-MoE, DeepSeek-V3
Offload = Literal["none", "cpu", "nvme"]             # where ZeRO's optimizer state lives (parallel/zero/offload.py)

# The schedule names, from the Literal: code compares against these, never against a spelt-out string.
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZB = get_args(ScheduleKind)
# Schedules the planner models but the runtime does not run: DeepSeek-V3's bidirectional DualPipe
# (plan/dualpipe.py). `fivefold plan --schedule` takes these too; `fivefold train` refuses them.
PlannedScheduleKind = Literal[ScheduleKind, "dualpipe"]
DUALPIPE = get_args(PlannedScheduleKind)[-1]


class ConfigError(ValueError):
    """A configuration breaks a rule; the message names the rule and suggests valid values."""


def install_hint(extra: str) -> str:
    """How to install an optional extra: fivefold is not on a package index, so from the checkout."""
    return f"pip install -e '.[{extra}]' from the fivefold checkout"


def choices(kind) -> tuple:
    """The values a Literal type allows, in declaration order."""
    return get_args(kind)


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, from its prime factors (instant for any 64-bit n; a scan up to n
    would take minutes for n = 2**31)."""
    out = [1]
    for p, k in sorted(prime_factors(n).items()):
        out = [d * p**i for d in out for i in range(k + 1)]
    return sorted(out)


def prime_factors(n: int) -> dict[int, int]:
    """{prime: exponent} of n >= 1: trial division by small primes, then Pollard's rho (Brent) for the rest."""
    if n < 1:
        raise ValueError(f"prime_factors needs n >= 1, got {n}")
    out: dict[int, int] = {}
    for p in _SMALL_PRIMES:
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if is_prime(m):
            out[m] = out.get(m, 0) + 1
            continue
        root, k = _perfect_power(m)
        if k > 1:
            stack += [root] * k
        else:
            d = _rho(m)
            stack += [d, m // d]
    return out


def _perfect_power(n: int) -> tuple[int, int]:
    """(r, k) with r**k == n and k largest (k = 1 when n is no perfect power): Pollard's rho is slow on p**k."""
    for k in range(n.bit_length(), 1, -1):
        r = _int_root(n, k)
        if r > 1 and r**k == n:
            return r, k
    return n, 1


def _int_root(n: int, k: int) -> int:
    """floor(n ** (1/k)) in integers (Newton's method)."""
    r = 1 << -(-n.bit_length() // k)      # above the root
    while True:
        s = ((k - 1) * r + n // r ** (k - 1)) // k
        if s >= r:
            return r
        r = s


_SMALL_PRIMES = [p for p in range(2, 1000) if all(p % q for q in range(2, int(p**0.5) + 1))]


def is_prime(n: int) -> bool:
    """Miller-Rabin with the first 12 primes as bases: exact for n < 3.3e24."""
    if n < 2:
        return False
    for p in _SMALL_PRIMES[:12]:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _SMALL_PRIMES[:12]:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _rho(n: int) -> int:
    """A non-trivial factor of the odd composite n (Pollard's rho, Brent's cycle search)."""
    for c in range(1, n):
        y, r, q, g = 2, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(128, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = gcd(q, n)
                k += 128
            r *= 2
        if g == n:   # the batch overshot: step one at a time from the saved point
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = gcd(abs(x - ys), n)
        if g != n:
            return g
    raise ValueError(f"no factor found for {n}")


def nearest(value: int, candidates: list[int], k: int = 3) -> list[int]:
    """The k candidates closest to value, in ascending order."""
    return sorted(sorted(candidates, key=lambda c: (abs(c - value), c))[:k])


def _multiples(of: int, around: int) -> list[int]:
    """The multiples of `of` nearest `around` (candidates for a value that must divide by `of`): a few, not
    every one up to `around` (which for --gpus 2**31 would be billions)."""
    q = around // of
    return [k * of for k in range(max(1, q - 2), q + 3)]


# -- numbers given on a command line -----------------------------------------------------------------
def check_count(name: str, value, low: int = 1, high: int | None = None) -> None:
    """An integer in low..high (no upper bound when high is None)."""
    valid = _count_span(low, high)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}; valid: {valid}")
    if value < low or (high is not None and value > high):
        rule = f">= {low}" if high is None else f"between {low} and {high}"
        raise ConfigError(f"{name} must be {rule}, got {value}; valid: {valid}")


def _count_span(low: int, high: int | None) -> str:
    if high is None:
        return f"{low}, {low + 1}, {low + 2}, ..."
    if high - low <= 5:
        return ", ".join(str(v) for v in range(low, high + 1))
    return f"{low}..{high}"


def check_real(name: str, value, low: float, high: float | None = None, low_open: bool = True,
               meaning: str = "") -> None:
    """A finite number above low (or at least low when not low_open) and at most high (when given);
    `meaning` (e.g. " (the fraction of peak reached)") follows the rule in the message."""
    rule = (f"> {low:g}" if low_open else f">= {low:g}") + ("" if high is None else f" and <= {high:g}")
    valid = ("(" if low_open else "[") + f"{low:g}, " + ("inf)" if high is None else f"{high:g}]")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number {rule}{meaning}, got {value!r}; valid: {valid}")
    bad = not isfinite(value) or (value <= low if low_open else value < low) or (high is not None and value > high)
    if bad:
        raise ConfigError(f"{name} must be a finite number {rule}{meaning}, got {value}; valid: {valid}")


# -- LoRA (model/lora.py) -------------------------------------------------------------------------------
LORA_TARGETS = ("wq", "wk", "wv", "wo", "gate", "up", "down")   # a block's linear layers, our names
HF_LORA_TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                   "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}   # Hugging Face's (PEFT's) names


LORA_ADAPTERS = ("lora_A", "lora_B")   # an adapted layer's two low-rank parameters, beside its weight


def is_adapter(name: str) -> bool:
    """Whether parameter (or checkpoint key) `name` is a LoRA adapter (…lora_A or …lora_B)."""
    return name.rsplit(".", 1)[-1] in LORA_ADAPTERS


def trains_a_subset(train) -> bool:
    """LoRA (train.lora_rank) or train.freeze: which parameters train depends on the model's names, so the
    runtime checks them on a meta model before any rank starts (trainer.supported)."""
    return bool(train.lora_rank or train.freeze)


def lora_scale(alpha: float, rank: int) -> float:
    """What the adapters' output is multiplied by (LoRA's alpha / r; the merged export uses it too)."""
    return alpha / rank


def frozen_by(name: str, patterns) -> bool:
    """Whether parameter `name` matches one of train.freeze's fnmatch `patterns` (the runtime's
    model/lora.py `freeze` and the planner's plan/units.py `is_frozen` both ask this)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def check_lora_targets(targets) -> tuple[str, ...]:
    """Our names for LoRA `targets` (either spelling); ConfigError naming the valid ones otherwise."""
    ours = tuple(dict.fromkeys(HF_LORA_TARGETS.get(t, t) for t in targets))
    bad = [t for t in targets if HF_LORA_TARGETS.get(t, t) not in LORA_TARGETS]
    if bad or not ours:
        raise ConfigError(f"train.lora_targets must name linear layers of a block, got {list(targets)}; valid: "
                          f"{', '.join(LORA_TARGETS)} (or {', '.join(HF_LORA_TARGETS)})")
    return ours


# -- fields ------------------------------------------------------------------------------------------
def check_choice(name: str, value, kind) -> None:
    """value is one of the Literal `kind`'s values."""
    ok = choices(kind)
    if value not in ok or type(value) is not type(ok[0]):
        raise ConfigError(f"{name} must be one of {', '.join(map(str, ok))}, got {value!r}")


def check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")


# -- model ---------------------------------------------------------------------------------------------
def check_attention(hidden: int, heads: int, kv_heads: int, head_dim: int = 0) -> None:
    """hidden splits into heads of even size (RoPE rotates pairs), or `head_dim` (when set: Qwen3's width of
    its own) is even; heads split into kv_heads groups (GQA)."""
    if head_dim:
        if head_dim % 2:
            raise ConfigError(f"model.attn_head_dim ({head_dim}) must be even for RoPE; valid: an even width, or 0 "
                              f"(hidden / heads)")
    elif hidden % heads:
        raise ConfigError(f"model.hidden ({hidden}) must divide by model.heads ({heads}); "
                          f"valid heads: {nearest(heads, divisors(hidden))} (or set model.attn_head_dim)")
    elif (hidden // heads) % 2:
        raise ConfigError(f"head dim hidden/heads = {hidden // heads} must be even for RoPE; valid heads: "
                          f"{nearest(heads, [d for d in divisors(hidden) if (hidden // d) % 2 == 0])}")
    if heads % kv_heads:
        raise ConfigError(f"model.heads ({heads}) must divide by model.kv_heads ({kv_heads}) for GQA; "
                          f"valid kv_heads: {nearest(kv_heads, divisors(heads))}")


def check_seq_len(seq_len: int, max_seq: int, what: str = "train.seq_len", whose: str = "the model",
                  limit: str = "model.max_seq") -> None:
    """A sequence fits the model's positions: seq_len <= max_seq (ModelConfig.max_seq; a Hugging Face
    config.json's max_position_embeddings, or n_positions). Past it rotary or learned positions were never
    trained. fivefold has no RoPE scaling: a longer context is a model whose max_seq covers it (a fivefold
    TOML's model.max_seq, or a config.json whose max_position_embeddings a RoPE-scaled checkpoint such as
    Llama 3.1's already raised)."""
    if seq_len > max_seq:
        raise ConfigError(f"{what} ({seq_len}) is beyond the position limit of {whose}: it must be <= {limit} = "
                          f"{max_seq}; valid: 1..{max_seq} (fivefold has no RoPE scaling: a longer context needs a "
                          f"model whose max_seq, or config.json max_position_embeddings, covers it)")


# -- tensor parallel -----------------------------------------------------------------------------------
def kv_replicas(tp: int, kv_heads: int) -> int:
    """Consecutive tp ranks that hold the same K/V head: tp/kv_heads when tp > kv_heads, else 1."""
    return tp // kv_heads if tp > kv_heads else 1


def valid_tp(heads: int, kv_heads: int | None, widths: dict[str, int] | None = None) -> list[int]:
    """tp degrees that split the heads, split the K/V heads or replicate them evenly (skipped when
    kv_heads is None, e.g. for latent attention), and split every MLP width."""
    return [d for d in divisors(heads)
            if (kv_heads is None or kv_heads % d == 0 or d % kv_heads == 0)
            and all(w % d == 0 for w in (widths or {}).values())]


def check_tensor_parallel(tp: int, heads: int, kv_heads: int | None, widths: dict[str, int] | None = None) -> None:
    """Megatron TP gives each rank whole attention heads and a column/row slice of every MLP width;
    K/V heads are split, or replicated over tp/kv_heads ranks each."""
    if tp == 1:
        return
    broken = [f"heads ({heads}) must divide by tp ({tp}): each tp rank computes whole heads"] if heads % tp else []
    if kv_heads is not None and kv_heads % tp and tp % kv_heads:
        broken.append(f"tp ({tp}) must divide kv_heads ({kv_heads}) or be a multiple of it")
    broken += [f"{name} ({w}) must divide by tp ({tp})" for name, w in (widths or {}).items() if w % tp]
    if broken:
        raise ConfigError(f"{broken[0]}; valid tp: {nearest(tp, valid_tp(heads, kv_heads, widths))}")


def check_sequence_parallel(sp_mode: str, tp: int, seq_len: int) -> None:
    """Megatron SP splits the sequence between blocks over the tp ranks."""
    if sp_mode == "megatron" and tp > 1 and seq_len % tp:
        raise ConfigError(f"sequence parallelism splits the sequence over tp: seq_len ({seq_len}) must divide by "
                          f"tp ({tp}); valid seq_len: {nearest(seq_len, _multiples(tp, seq_len))}")


# -- context parallel ----------------------------------------------------------------------------------
def cp_degrees(cp_mode: str, cp: int, heads: int, tp: int = 1, ulysses: int = 0) -> tuple[int, int]:
    """(Ulysses degree, ring degree) whose product is cp. Ulysses: (cp, 1); ring: (1, cp); hybrid (USP,
    Fang & Zhao 2024): all-to-all over `ulysses` inner, contiguous ranks (0: the largest divisor of cp
    that divides the heads of a tp rank), ring attention over the cp/ulysses outer ranks."""
    if cp_mode == "ulysses":
        return cp, 1
    if cp_mode == "ring":
        return 1, cp
    u = ulysses or gcd(cp, heads // tp if heads % tp == 0 else 1)
    return u, cp // u


def check_context_parallel(cp_mode: str, cp: int, tp: int, heads: int, seq_len: int, ulysses: int = 0) -> None:
    """Ulysses gives each of its ranks whole heads of the full sequence: heads/tp % cp and seq % cp.
    Ring attention splits the sequence into 2·cp zig-zag chunks (causal load balance): seq % (2·cp).
    Hybrid: Ulysses over its inner degree (whole heads: heads/tp % ulysses), the 2·cp chunks of the ring."""
    if cp == 1:
        return
    per_tp = heads // tp if heads % tp == 0 else heads
    if cp_mode == "ulysses":
        if per_tp % cp:
            raise ConfigError(f"Ulysses gives each cp rank whole heads: heads/tp = {heads}/{tp} = {per_tp} must "
                              f"divide by cp ({cp}); valid cp: {nearest(cp, divisors(per_tp))}, or cp_mode ring/hybrid")
        if seq_len % cp:
            raise ConfigError(f"Ulysses splits the sequence over cp: seq_len ({seq_len}) must divide by cp ({cp}); "
                              f"valid cp: {nearest(cp, divisors(seq_len))}")
        return
    if cp_mode == "hybrid" and ulysses and (cp % ulysses or per_tp % ulysses):
        ok = [d for d in divisors(cp) if per_tp % d == 0]
        raise ConfigError(f"hybrid context parallelism runs Ulysses over parallel.ulysses ranks: it must divide cp "
                          f"({cp}) and heads/tp ({per_tp}), got {ulysses}; valid ulysses: {ok} (0: the largest)")
    if seq_len % (2 * cp):
        what = "ring attention" if cp_mode == "ring" else "hybrid context parallelism (its ring)"
        raise ConfigError(f"{what} splits the sequence into 2*cp zig-zag chunks: seq_len ({seq_len}) must divide "
                          f"by 2*cp = {2 * cp}; valid seq_len: {nearest(seq_len, _multiples(2 * cp, seq_len))}; "
                          f"valid cp: {nearest(cp, [d for d in divisors(seq_len) if seq_len % (2 * d) == 0])}")


# -- expert parallel -----------------------------------------------------------------------------------
def expert_data_parallel(tp: int, cp: int, dp: int, ep: int, etp: int = 1) -> int:
    """The expert-data-parallel degree: how many ranks of a stage hold the same expert piece, tp·cp·dp /
    (etp·ep) (MoE parallel folding: the experts' etp × ep × edp grid re-cuts the ranks that attention's
    tp × cp × dp grid uses)."""
    return tp * cp * dp // (ep * etp)


def check_expert_grid(ep: int, dp: int, cp: int, tp: int = 1, etp: int = 1) -> None:
    """MoE parallel folding (Megatron-Core; Liu et al. 2025): the expert layers cut the same tp·cp·dp ranks
    of a stage into etp × ep × edp, so etp·ep must divide tp·cp·dp."""
    ranks = tp * cp * dp
    if ranks % (ep * etp):
        valid = [d for d in divisors(ranks) if (ranks // d) % etp == 0]
        raise ConfigError(f"etp x ep ({etp} x {ep}) must divide tp*cp*dp ({ranks}): the experts fold over the ranks "
                          f"attention's tp x cp x dp use; valid ep with etp {etp}: {nearest(ep, valid)}")


def check_expert_parallel(ep: int, dp: int, cp: int, experts: int, tp: int = 1, etp: int = 1,
                          expert_ffn: int = 0) -> None:
    """`check_expert_grid`, and each ep rank holds experts/ep whole experts; ep > 1 or etp > 1 needs a
    mixture-of-experts model; etp splits every routed expert's width (`check_expert_tensor_parallel`)."""
    check_expert_grid(ep, dp, cp, tp, etp)
    check_experts(ep, experts, tp * cp * dp // etp)
    check_expert_tensor_parallel(etp, experts, expert_ffn)


def check_expert_tensor_parallel(etp: int, experts: int, expert_ffn: int) -> None:
    """Expert tensor parallelism slices each routed expert's gate/up by columns and its down by rows over
    etp ranks: a MoE model whose expert width divides by etp."""
    if etp == 1:
        return
    if not experts:
        raise ConfigError(f"etp ({etp}) splits routed experts: it needs a mixture-of-experts model (experts > 0); "
                          f"this model is dense: valid etp: [1]")
    if expert_ffn % etp:
        raise ConfigError(f"the expert width ({expert_ffn}: model.moe_ffn, or ffn) must divide by etp ({etp}): each etp rank holds a slice "
                          f"of every routed expert's width; valid etp: {nearest(etp, divisors(expert_ffn))}")


def experts_on_expert_grid(ep: int, etp: int) -> bool:
    """Whether the routed experts are laid out by the expert grid (parallel/expert.py ExpertParallelism:
    ep and etp shards, gradients summed over "edp"): ep > 1 or etp > 1. Otherwise they are dense weights,
    whole on every rank (under tp: partial gradients summed over tp, as the router's; reduced over dp, or
    dp × cp), and the expert grid is not used."""
    return ep > 1 or etp > 1


def check_experts(ep: int, experts: int, ranks: int = 0) -> None:
    """ep > 1 needs a mixture-of-experts model, and each ep rank holds experts/ep whole experts (the valid ep
    also divide `ranks`, tp*cp*dp/etp, when it is known)."""
    if ep > 1 and experts == 0:
        raise ConfigError(f"ep ({ep}) needs a mixture-of-experts model (experts > 0); this model is dense: valid ep: [1]")
    if experts and experts % ep:
        raise ConfigError(f"experts ({experts}) must divide by ep ({ep}); valid ep: "
                          f"{nearest(ep, [d for d in divisors(experts) if not ranks or ranks % d == 0])}")


# -- pipeline ------------------------------------------------------------------------------------------
def check_pipeline_layers(layers: int, pp: int, vpp: int = 1) -> None:
    """Every (virtual) pipeline stage needs at least one layer: layers >= pp·vpp."""
    check_positive("pp", pp)
    check_positive("vpp", vpp)
    check_positive("model.layers", layers)
    if layers < pp * vpp:
        other = (f"or vpp <= {layers // pp} at pp={pp}" if layers >= pp
                 else f"no vpp works at pp={pp} (more stages than layers)")
        raise ConfigError(f"model.layers ({layers}) must be >= pp*vpp = {pp}*{vpp} = {pp * vpp}: every (virtual) "
                          f"pipeline stage needs at least one layer; valid: pp <= {layers // vpp} at vpp={vpp}, {other}")


def parse_counts(value) -> list[int]:
    """Layer counts per (virtual) stage from "7,9,9,7" or a sequence of integers."""
    if isinstance(value, str):
        try:
            return [int(x) for x in value.replace(" ", "").split(",") if x]
        except ValueError:
            raise ConfigError(f"a layer split is a comma-separated list of integers, e.g. '7,9,9,7'; got {value!r}") from None
    return [int(x) for x in value]


def check_counts(counts: list[int], layers: int, pp: int, vpp: int = 1, hint: str = "") -> None:
    """A user's split: one count per (virtual) stage, each >= 1, summing to the layers."""
    chunks = pp * vpp
    hint = hint or f"e.g. {' or '.join(map(repr, choices(PartitionKind)))}"
    if len(counts) != chunks:
        raise ConfigError(f"a layer split lists one count per (virtual) stage: pp*vpp = {pp}*{vpp} = {chunks} "
                          f"counts, got {len(counts)} ({list(counts)}); {hint}")
    if min(counts) < 1:
        bad = [i for i, n in enumerate(counts) if n < 1]
        raise ConfigError(f"every (virtual) stage needs at least one layer; stage(s) {bad} of {list(counts)} "
                          f"have none; {hint}")
    if sum(counts) != layers:
        raise ConfigError(f"a layer split must cover every layer once: {list(counts)} sums to {sum(counts)}, "
                          f"the model has {layers} layers; {hint}")


def check_partition(layers: int, pp: int, vpp: int, partition: str) -> None:
    """`parallel.partition` names a split (even, llama3) or lists layer counts per (virtual) stage.
    Both named splits exist whenever every stage can have a layer (`partition.llama3_counts` gives a
    too-short model one layer per stage)."""
    check_pipeline_layers(layers, pp, vpp)
    if partition in choices(PartitionKind):
        return
    if not any(ch.isdigit() for ch in partition):
        raise ConfigError(f"parallel.partition must be one of {', '.join(choices(PartitionKind))} or layer counts "
                          f"like '3,5,5,3', got {partition!r}")
    check_counts(parse_counts(partition), layers, pp, vpp)


# Memory traffic of the runtime's eager optimizer step (train/optim.py), per element this rank owns, in
# accesses of one master-precision element: AdamW's decay 2, lerp 3, mul 2, addcmul 4, sqrt 2, divide 2,
# add eps 2, addcdiv 4. The global gradient norm reads each owned gradient once and writes and reads its
# fp64 copy (a dot product: 16 bytes), one slice of STEP_CHUNK elements at a time. A fused optimizer reads
# and writes each state once.
EAGER_ADAMW_ACCESSES = 21
EAGER_GRAD_NORM_BYTES = 16

# Elements per pass of the optimizer step (train/optim.py: one multi-tensor AdamW call, one slice of the
# gradient norm; larger tensors are cut into flat slices). What the step holds beyond the states is
# bounded by it: AdamW's fp32 denominators (+ an fp32 copy of low-precision gradients) of one call, or
# the norm's fp64 copy of one slice (plan/buffers.py `step_scratch`).
STEP_CHUNK = 1 << 22

# glibc's mmap threshold a rank that shards its model state fixes (train/malloc.py, `pins_mmap_threshold`): a
# host block of at least this many bytes is a mapping of its own, unmapped when freed, so the next such block
# is fresh pages the kernel faults in on first touch (plan/time.py `first_touch_bytes` charges ZeRO's at the
# accelerator's `fresh_bandwidth`).
MMAP_THRESHOLD_BYTES = 2 << 20


def pins_mmap_threshold(tp: int, pp: int, ep: int, zero: int) -> bool:
    """Whether a rank fixes glibc's mmap threshold (train/malloc.py): where it holds pieces of the model and
    gathers, frees and makes again large blocks of them (ZeRO, tensor, pipeline or expert parallelism), the
    blocks glibc would keep resident once freed. A rank that holds the whole model state (one rank, plain
    DDP, context parallelism) keeps glibc's own dynamic threshold: there the fixed one cost a fifth of a
    step in page faults on fresh activation blocks (benchmarks/one_rank.py) for no memory it had to give back."""
    return zero > 0 or tp > 1 or pp > 1 or ep > 1


def block_units(zero: int, pp: int, reduce_each_microbatch: bool) -> bool:
    """Whether ZeRO's flat units are whole blocks plus a root unit (embedding, final norm, head) rather
    than buckets of bucket_mb: ZeRO-3 (a block is gathered as a whole), and ZeRO-2 under a pipeline that
    reduce-scatters every micro-batch (a unit must lie inside one chunk, whose backward completes it)."""
    return zero >= 3 or (zero == 2 and pp > 1 and reduce_each_microbatch)


def check_reduce_each_microbatch(reduce_each_microbatch: bool, zero: int) -> None:
    if reduce_each_microbatch and zero < 2:
        raise ConfigError(f"reduce_each_microbatch shards gradients, so it needs zero 2 or 3 (got zero {zero}); "
                          "valid: zero=2, zero=3, or reduce_each_microbatch=false")


def check_offload(offload: str, zero: int, offload_dir: str = "") -> None:
    """ZeRO-Offload / ZeRO-Infinity move each rank's ZeRO optimizer shards (fp32 masters, Adam moments)
    and its optimizer step to host memory ("cpu") or to files on a local disk ("nvme"): they need ZeRO's
    shards (zero 1, 2 or 3), and "nvme" needs the folder to keep the files in."""
    if offload != "none" and zero not in (1, 2, 3):
        raise ConfigError(f"parallel.offload = {offload!r} moves ZeRO's optimizer shards off the device, so it needs "
                          f"zero 1, 2 or 3 (got zero {zero}); valid: zero=1, zero=2, zero=3, or offload='none'")
    if offload == "nvme" and not str(offload_dir).strip():
        raise ConfigError("parallel.offload = 'nvme' keeps the optimizer state in files: it needs parallel.offload_dir "
                          "(a folder on a fast local disk); valid: offload_dir=PATH, or offload='cpu' or 'none'")


# -- pipeline schedule ---------------------------------------------------------------------------------
def check_schedule(kind: str, pp: int, vpp: int, microbatches: int, group: int = 0) -> None:
    """Every rule a run's (or a plan's) pipeline schedule obeys, one line naming the broken one:
    `check_schedule_lists` (the action lists exist), plus: vpp > 1 interleaves chunks over pp > 1 ranks,
    and 1F1B-like schedules (all but GPipe) keep pp micro-batches in flight to fill the pipeline."""
    check_schedule_lists(kind, pp, vpp, microbatches, group)
    check_virtual_stages(pp, vpp)
    if pp > 1 and kind != GPIPE and microbatches < pp:
        raise ConfigError(f"schedule {kind} needs microbatches >= pp ({pp}), got {microbatches}; "
                          f"valid: microbatches >= {pp}, or schedule {GPIPE}")


def check_dualpipe(pp: int, vpp: int, microbatches: int) -> None:
    """DualPipe (DeepSeek-V3 report, §3.2.1; deepseek-ai/DualPipe dualpipe.py's step() asserts): micro-batches
    enter from both ends, so pp is even, each direction takes half of an even count of at least 2·pp
    micro-batches, and each rank holds two stages (no virtual stages). At pp = 1 there is nothing to
    schedule."""
    if pp == 1:
        return   # no pipeline: nothing to schedule (as for every schedule)
    if pp % 2:
        raise ConfigError(f"schedule {DUALPIPE} feeds micro-batches from both ends of the pipeline: pp must be even, "
                          f"got pp = {pp}; valid: pp in {pp - 1}, {pp + 1}")
    if vpp != 1:
        raise ConfigError(f"schedule {DUALPIPE} places two stages on each rank itself: vpp must be 1, got {vpp}")
    if microbatches % 2 or microbatches < 2 * pp:
        low = max(2 * pp, microbatches + microbatches % 2)
        raise ConfigError(f"schedule {DUALPIPE} splits the micro-batches between its two directions: microbatches "
                          f"must be even and >= 2·pp ({2 * pp}), got {microbatches}; valid: {low}, {low + 2}, ...")


def check_virtual_stages(pp: int, vpp: int) -> None:
    """vpp > 1 interleaves model chunks over pp > 1 pipeline ranks."""
    if vpp > 1 and pp == 1:
        raise ConfigError(f"vpp > 1 interleaves model chunks over the pipeline ranks: it needs pp > 1, got pp = 1 "
                          f"and vpp = {vpp}; valid: vpp = 1 at pp = 1")


def check_vpp_schedule(kind: str, vpp: int) -> None:
    """vpp > 1 (model chunks per pipeline rank) only under the interleaved schedule."""
    if vpp != 1 and kind != INTERLEAVED:
        raise ConfigError(f"vpp > 1 needs the interleaved schedule; schedule {kind!r} takes vpp = 1, got vpp = {vpp}; "
                          f"valid: schedule {INTERLEAVED}, or vpp = 1")


def check_schedule_lists(kind: str, pp: int, vpp: int, microbatches: int, group: int = 0) -> None:
    """The rules without which schedule `kind` has no action lists (what the simulator accepts, for
    any pp and micro-batch count): a known kind; vpp > 1 only with the interleaved schedule; a
    micro-batch group only there; the interleaved schedule's micro-batches divisible by pp, or a
    group N that `check_microbatch_group` accepts."""
    check_choice("schedule", kind, ScheduleKind)
    if type(group) is not int or group < 0:
        raise ConfigError(f"microbatch_group must be an integer >= 0 (0: pp = {pp}), got {group!r}")
    check_vpp_schedule(kind, vpp)
    if group and not (kind == INTERLEAVED and vpp > 1):
        raise ConfigError(f"microbatch_group applies to the interleaved schedule with vpp > 1 (schedule {kind!r}, "
                          f"vpp {vpp}); got microbatch_group = {group!r}, valid: 0")
    if kind != INTERLEAVED or vpp == 1:
        return
    if not group and microbatches % pp:
        lower = microbatches // pp * pp
        valid = [n for n in (lower, lower + pp) if n > 0]
        raise ConfigError(f"the interleaved schedule needs microbatches divisible by pp: {microbatches} % {pp} "
                          f"!= 0; use microbatches in {valid}, or a microbatch_group")
    check_microbatch_group(pp, microbatches, group)


def check_microbatch_group(pp: int, microbatches: int, group: int) -> int:
    """The interleaved schedule's micro-batches per group N (0: pp), checked: Megatron-Core's rule
    p <= N <= m, and the last group (m % N micro-batches) empty or at least p long. A group shorter than
    p leaves a rank waiting for its first micro-batch to come round the ranks (dependency bubbles), and
    with the 1F1B warm-up below it can deadlock. Returns N."""
    if type(group) is not int or group < 0:
        raise ConfigError(f"microbatch_group must be an integer >= 0 (0: pp = {pp}), got {group!r}")
    n = group or pp
    valid = [k for k in range(pp, microbatches + 1) if microbatches % k == 0 or microbatches % k >= pp]
    if not pp <= n <= microbatches:
        raise ConfigError(f"microbatch_group {n} must lie between pp ({pp}, depth-first) and microbatches "
                          f"({microbatches}, breadth-first); valid: {valid or 'none (microbatches < pp)'}")
    if 0 < microbatches % n < pp:
        raise ConfigError(f"microbatch_group {n} leaves a last group of {microbatches} % {n} = {microbatches % n} "
                          f"micro-batches, fewer than pp ({pp}); valid: {valid}")
    return n


# -- batch and world -----------------------------------------------------------------------------------
def check_global_batch(global_batch: int, dp: int, per_rank: int, what: str = "microbatches") -> None:
    """The global batch (sequences) splits evenly over the dp ranks and then into micro-batches: it must
    divide by dp·microbatches (a count; the runtime's view) or dp·micro_batch (a size; the planner's)."""
    per = dp * per_rank
    if global_batch % per:
        raise ConfigError(f"global_batch ({global_batch}) must divide by dp*{what} = {dp}*{per_rank} = {per}; "
                          f"valid global batches: {nearest(global_batch, _multiples(per, global_batch))}")


def check_world_size(world: int, tp: int, cp: int, dp: int, pp: int) -> None:
    """Every rank is one point of the grid: world = tp·cp·dp·pp."""
    if world == tp * cp * dp * pp:
        return
    rest = tp * cp * pp
    fix = f"with the other degrees fixed dp = {world // rest}; " if world % rest == 0 else ""
    raise ConfigError(f"world size {world} must equal tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} = {tp * cp * dp * pp}; "
                      f"{fix}valid world sizes (multiples of tp*cp*pp = {rest}): {nearest(world, _multiples(rest, world))}")


def check_ranks_per_node(ranks_per_node: int, world: int) -> None:
    """parallel.ranks_per_node: ranks of one node (0: unknown, taken as one node). Nodes hold equal runs
    of consecutive ranks, as torchrun numbers them, so it must divide the world size."""
    if ranks_per_node < 0 or (ranks_per_node and world % ranks_per_node):
        raise ConfigError(f"parallel.ranks_per_node ({ranks_per_node}) must divide the world size {world} "
                          f"(nodes hold equal runs of consecutive ranks; 0: one node); valid: 0 or "
                          f"{', '.join(map(str, nearest(ranks_per_node, divisors(world), 4)))}")


def check_lora_rank(rank: int, hidden: int) -> None:
    """LoRA's rank is at most the model's width: A is (rank, in) and B (out, rank), and a rank above a layer's
    width adds parameters, not expressiveness (nor a sensible allocation: 1e308 was read as an integer)."""
    if rank > hidden:
        raise ConfigError(f"train.lora_rank ({rank:,}) must be <= model.hidden ({hidden:,}); typical: 8-64")


# -- what the runtime runs today -----------------------------------------------------------------------
def check_runtime_support(parallel, train, model=None) -> None:
    """Layouts the planner can estimate but the training runtime does not run (yet), named at start.
    `parallel`, `train`, `model`: a ParallelConfig, TrainConfig and ModelConfig (read by attribute)."""
    p, t = parallel, train
    experts = getattr(model, "experts", 0)
    if getattr(t, "lora_rank", 0) and getattr(model, "mla", False):
        raise ConfigError("train.lora_rank with latent attention (model.kv_lora_rank > 0) is not supported yet: its "
                          "projections are not LoRA targets; use train.freeze to train a part of it, or lora_rank = 0")
    split = moe_sequence_group(p.tp, p.sp_mode, p.cp) is not None
    if experts and split and model.capacity_factor > 0:
        raise ConfigError("MoE capacity mode needs whole sequences on a rank (capacity groups are sequences), which "
                          "cp and sequence parallelism split; use capacity_factor = 0 (dropless), or cp = 1 and "
                          "sp_mode none")
    sequences = t.global_batch // (p.dp * p.microbatches)
    if experts and p.tp > 1 and p.sp_mode != "megatron" and sequences % p.tp:
        raise ConfigError(f"MoE under tensor parallelism gives each tp rank 1/tp of a micro-batch's sequences: "
                          f"global_batch / (dp*microbatches) = {sequences} must divide by tp ({p.tp}); "
                          f"valid global_batch: multiples of {p.dp * p.microbatches * p.tp}, or sp_mode megatron")
    if splits_backward(p.pp, p.schedule) and p.tp > 1 and p.sp_mode == "megatron":
        raise ConfigError("the zb schedule with Megatron sequence parallelism is not supported (its weight-gradient "
                          "pass would repeat the reduce-scatter's backward all-gather); use 1f1b or sp_mode none")
    if splits_backward(p.pp, p.schedule) and p.zero == 3:
        raise ConfigError("the zb schedule with ZeRO-3 is not supported (its weight-gradient pass runs outside the "
                          "block whose parameters ZeRO-3 gathers); use 1f1b or interleaved, or zero <= 2")
    if p.pp > 1 and p.zero == 3 and not p.reshard_after_forward:
        raise ConfigError("ZeRO-3 with pp > 1 needs parallel.reshard_after_forward = true (a block kept gathered "
                          "across the schedule's interleaved micro-batches would send a schedule-dependent number of "
                          "all-gathers); set it to true")


MAX_PREFETCH = 16   # ZeRO-3's deepest prefetch: units gathered ahead of the one running


def check_zero_prefetch(depth) -> None:
    """ZeRO-3's prefetch depth (parallel.zero_prefetch): the slots gathered ahead of the one running
    (parallel/zero/order.py)."""
    if type(depth) is not int or not 0 <= depth <= MAX_PREFETCH:
        raise ConfigError(f"parallel.zero_prefetch = {depth!r}: ZeRO-3 gathers this many units ahead of the one "
                          f"running; valid: an integer 0 to {MAX_PREFETCH} (1: FSDP's default)")


def splits_backward(pp: int, schedule: str) -> bool:
    """Whether the pipeline runs each backward as I (input gradients) then W (weight gradients): the
    zero-bubble schedule with pp > 1 (parallel/pipeline/schedules.py)."""
    return pp > 1 and schedule == ZB


def block_recompute(recompute: str, pp: int, schedule: str) -> str:
    """The recompute each block gets (parallel/recompute.py), applied once after every dimension: the
    run's `train.recompute`, except full recompute under the zero-bubble schedule with a pipeline, whose
    split backward (I, then W) needs a chunk's whole graph: there the pipeline runtime re-runs whole
    chunks instead and the blocks keep no checkpoint of their own."""
    return "none" if splits_backward(pp, schedule) and recompute == "full" else recompute


def overlaps_tp_input(pp: int, schedule: str, on: bool = True) -> bool:
    """Whether tensor parallelism runs each part's input op (f, or the SP all-gather) fused with the part's
    column-parallel projections, its collectives overlapping their GEMMs (parallel/tensor_overlap.py;
    the planner's plan/time.py `tp_hidden`): where `parallel.tp_overlap` is on, except under the
    zero-bubble schedule with a pipeline, whose W pass replays each weight's own module from the output
    that module recorded."""
    return on and not splits_backward(pp, schedule)


def grad_norm_group(zero: int, only_dp: bool = True) -> str:
    """The group the global gradient norm's sum of squares is all-reduced over. ZeRO shards differ on
    every rank: "world". DDP gradients reduced over dp are replicated across it, so only the ranks that
    hold different pieces add: "mp" (tp × cp × pp); when some reduce over another group (dp × cp,
    expert-dp) each replicated gradient is counted by rank 0 of its group and the sum goes over "world"."""
    return "world" if zero or not only_dp else "mp"


# -- mixture of experts --------------------------------------------------------------------------------
def reduces_only_over_dp(cp: int, experts: int, ep: int, etp: int) -> bool:
    """Whether every gradient is summed over dp alone (then the DDP norm adds over "mp":
    `grad_norm_group`): no context parallelism (dp × cp) and no routed experts on the expert grid (edp)."""
    return cp == 1 and not (experts and experts_on_expert_grid(ep, etp))


def moe_capacity(capacity_factor: float, seq: int, top_k: int, experts: int) -> int:
    """GShard capacity: the assignments an expert accepts from one sequence (its capacity group),
    ceil(capacity_factor · seq · top_k / experts); 0 when capacity_factor is 0 (dropless)."""
    if capacity_factor <= 0:
        return 0
    return -(-int(round(capacity_factor * seq * top_k * 1_000_000)) // (experts * 1_000_000))


def moe_splits_rows(tp: int, sp_mode: str) -> bool:
    """Under tensor parallelism without sequence parallelism a MoE layer's input is replicated over tp:
    each tp rank routes its 1/tp of the micro-batch's whole sequences (parallel/tensor.py moe_rows:
    scatter the rows in, all-gather the outputs back). With Megatron SP it already holds 1/tp of every
    sequence's tokens."""
    return tp > 1 and sp_mode != "megatron"


def moe_sequence_group(tp: int, sp_mode: str, cp: int) -> str | None:
    """The mesh group over whose ranks each sequence's tokens are spread when a MoE layer routes them,
    so its per-sequence balance statistics are summed over it (model/moe.py load_balance_loss):
    "tp_cp" under Megatron SP with cp, "tp" under SP alone, "cp" under cp alone (also with tp but no SP,
    whose ranks route whole sequences: `moe_splits_rows`), None when every rank holds whole sequences.
    The runtime configures the MoE layers by it (parallel/parallelize.py configure_moe) and the planner
    counts its all-reduces by it (plan/traffic.py)."""
    sp = tp > 1 and sp_mode == "megatron"
    if sp:
        return "tp_cp" if cp > 1 else "tp"
    return "cp" if cp > 1 else None


def moe_sequence_parts(tp: int, sp_mode: str, cp: int) -> int:
    """How many ranks hold parts of one sequence in a MoE layer: the size of `moe_sequence_group`."""
    return {None: 1, "tp": tp, "cp": cp, "tp_cp": tp * cp}[moe_sequence_group(tp, sp_mode, cp)]


def check_random_routing(random_routing: bool, top_k: int, router: str) -> None:
    """GShard's random routing (model/random_routing.py) draws a token's second expert by its share of the
    two softmax gate weights: it needs top_k = 2 and a softmax router."""
    if not random_routing:
        return
    if top_k != 2:
        raise ConfigError(f"model.random_routing draws each token's second expert (GShard's top-2 gating): it needs "
                          f"model.top_k = 2, got {top_k}; valid: top_k = 2, or random_routing false")
    if router not in ("softmax_topk_norm", "softmax_topk"):
        raise ConfigError(f"model.random_routing weighs the second expert by its softmax gate: model.router "
                          f"{router!r} is not a softmax router; valid router: softmax_topk_norm, softmax_topk")


def check_moe_routing(experts: int, top_k: int, router_groups: int = 0, router_group_limit: int = 0) -> None:
    """A token picks top_k distinct experts: 1 <= top_k <= experts. Group-limited routing (DeepSeek-V3's
    node-limited routing) splits the experts into router_groups equal, consecutive groups and lets a
    token choose only among the experts of its router_group_limit best groups, so router_groups divides
    experts, 1 <= router_group_limit <= router_groups and top_k <= router_group_limit·experts/router_groups."""
    if not 1 <= top_k <= experts:
        raise ConfigError(f"model.top_k ({top_k}) must be between 1 and model.experts ({experts}); "
                          f"valid top_k: 1..{experts}")
    if router_groups == 0 and router_group_limit == 0:
        return
    if router_groups < 1 or experts % router_groups:
        raise ConfigError(f"model.router_groups ({router_groups}) must divide model.experts ({experts}) into equal "
                          f"groups (0: no group-limited routing); valid router_groups: "
                          f"{nearest(router_groups, [0] + divisors(experts))}")
    if not 1 <= router_group_limit <= router_groups:
        raise ConfigError(f"model.router_group_limit ({router_group_limit}) must be between 1 and model.router_groups "
                          f"({router_groups}) when group-limited routing is on; valid: 1..{router_groups}")
    reachable = router_group_limit * (experts // router_groups)
    if top_k > reachable:
        need = -(-top_k // (experts // router_groups))
        raise ConfigError(f"model.top_k ({top_k}) must be <= router_group_limit*experts/router_groups = "
                          f"{router_group_limit}*{experts}/{router_groups} = {reachable} (the experts a token may "
                          f"reach); valid router_group_limit: {need}..{router_groups}, or top_k <= {reachable}")
