"""Attention: rotary position embeddings ("rotate half", as Hugging Face's Llama), the attention core
(causal scaled-dot-product attention, K/V heads repeated for grouped-query attention, a document mask,
a narrower value head), the KV cache of generation, and the grouped-query `Attention` layer.

Shapes: b batch, s sequence (S: the whole sequence), n query heads, k kv heads, d head dim, t cached tokens.
The layer knows nothing of process groups: tensor parallelism shards its projections, context parallelism
swaps its `core`, selective recompute checkpoints it.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .documents import document_mask
from .layers import Enter, RMSNorm


def rope_cos_sin(positions, head_dim: int, theta: float, device=None, offset: int = 0,
                 dtype: torch.dtype = torch.float32):
    """cos, sin of shape (s, d) for `positions`: a 1-D tensor of position ids (any order: context
    parallelism gives a rank non-contiguous ones), or a length s for offset..offset+s-1; of shape
    (b, s, d) for (b, s) position ids, one row each (documents: model/documents.py). Computed in fp32,
    then cast once to `dtype`, the activations' dtype: every layer's rotation then multiplies (and saves
    for its backward) these two tensors, not a cast copy of its own (126 layers' copies were 0.8 GiB of a
    405B pipeline stage's saved activations)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if isinstance(positions, int):
        pos = torch.arange(offset, offset + positions, dtype=torch.float32, device=device)
    else:
        pos = positions.to(device=device, dtype=torch.float32)
    freqs_sd2 = torch.outer(pos, inv_freq) if pos.dim() == 1 else pos[..., None] * inv_freq
    emb_sd = torch.cat((freqs_sd2, freqs_sd2), dim=-1)
    return emb_sd.cos().to(dtype), emb_sd.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_bnsd: torch.Tensor, cos_sd: torch.Tensor, sin_sd: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_sd.to(x_bnsd.dtype), sin_sd.to(x_bnsd.dtype)
    if cos.dim() == 3:   # (b, s, d): positions per row, the same for every head
        cos, sin = cos[:, None], sin[:, None]
    return x_bnsd * cos + rotate_half(x_bnsd) * sin


FLASH_MAX_HEAD_DIM = 256   # the largest head dim SDPA's CUDA flash kernel takes


def kernel_reads_kv_heads(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    """Whether SDPA is given the k kv heads as they are (`enable_gqa=True`) rather than repeated to the n
    query heads. On the CPU always: its fused kernel and its math path both take them. On CUDA only
    where the flash kernel runs, the one CUDA kernel that reads grouped heads itself: bf16 (which needs
    an Ampere or newer GPU, as flash does), no mask, head dim at most 256. Elsewhere (fp32 and fp16,
    which take the memory-efficient kernel, or a mask) `enable_gqa` would send SDPA to its math path,
    which holds the whole (s, s) score matrix, so the heads are repeated first instead. Seen on an H200
    before this rule (the heads were always repeated on CUDA): the peak held 2 bytes × (n − k) × head
    dim × 2 more per layer per token than the plan (1.94 GiB at hidden 2048, 16 layers, 32,768 tokens)."""
    if device_type != "cuda":
        return True
    return dtype == torch.bfloat16 and not masked and head_dim <= FLASH_MAX_HEAD_DIM


def attention_core(q_bnsd, k_bksd, v_bksd, causal: bool = True, past: int = 0,
                   documents_bS: torch.Tensor | None = None, pad_b: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (or full) attention; query head i uses kv head i // (n/k). Where the kernel reads the k kv
    heads itself (`kernel_reads_kv_heads`: SDPA's `enable_gqa`), only they are saved for the backward, as
    the planner counts them; elsewhere they are repeated to n heads first, and the backward keeps the
    repeated copies (n/k times the keys and values). With `past` > 0 (a KV cache) the keys are the `past` cached tokens followed by the
    queries' own s tokens, and query i sees keys 0..past+i. Training passes no mask (is_causal, no
    dropout), so on CUDA SDPA takes the flash kernel (bf16/fp16) or the memory-efficient one (fp32).
    `documents_bS` (b, s): the document id of each token, queries and keys being the same tokens
    (model/documents.py); a query then sees only keys of its own document (block-diagonal, causal
    inside each block), through an explicit mask. `pad_b` (b,): a batch of prompts left-padded to one length
    (generation, `KVCache(pad_b=...)`): row i's first pad_b[i] keys are padding, which no query sees but
    its own (a padding query attends to itself alone, so nothing is all-masked)."""
    if v_bksd.shape[-1] != q_bnsd.shape[-1] and q_bnsd.device.type == "cpu":
        return narrow_value_attention(q_bnsd, k_bksd, v_bksd, causal, past, documents_bS, pad_b)
    n, k = q_bnsd.shape[1], k_bksd.shape[1]
    masked = documents_bS is not None or pad_b is not None or bool(past and causal)
    gqa = n != k and kernel_reads_kv_heads(q_bnsd.device.type, q_bnsd.dtype, q_bnsd.shape[-1], masked)
    if n != k and not gqa:
        k_bksd = k_bksd.repeat_interleave(n // k, dim=1)
        v_bksd = v_bksd.repeat_interleave(n // k, dim=1)
    sdpa = partial(F.scaled_dot_product_attention, enable_gqa=True) if gqa else F.scaled_dot_product_attention
    if documents_bS is not None:
        s = q_bnsd.shape[2]
        causal_st = torch.ones(s, s, dtype=torch.bool, device=q_bnsd.device).tril() if causal else None
        mask_b1st = document_mask(documents_bS, documents_bS, causal_st)
        return sdpa(q_bnsd, k_bksd, v_bksd, attn_mask=mask_b1st)
    if pad_b is not None:
        s, t, dev = q_bnsd.shape[2], k_bksd.shape[2], q_bnsd.device
        q_s, k_t = torch.arange(past, past + s, device=dev)[:, None], torch.arange(t, device=dev)
        real_bt = k_t >= pad_b.to(dev)[:, None]
        mask_bst = ((q_s >= k_t) if causal else torch.ones(s, t, dtype=torch.bool, device=dev)) & real_bt[:, None, :]
        mask_bst = mask_bst | (q_s == k_t)      # padding queries see themselves: no row is all -inf
        return sdpa(q_bnsd, k_bksd, v_bksd, attn_mask=mask_bst[:, None])
    if past and causal:
        s, t = q_bnsd.shape[2], k_bksd.shape[2]
        mask_st = torch.arange(past, past + s, device=q_bnsd.device)[:, None] >= torch.arange(t, device=q_bnsd.device)
        return sdpa(q_bnsd, k_bksd, v_bksd, attn_mask=mask_st)
    return sdpa(q_bnsd, k_bksd, v_bksd, is_causal=causal)


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _pad_to(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


class _NarrowValueAttention(torch.autograd.Function):
    """Causal (or full) attention with values of another head dim than queries and keys (latent attention:
    v_head_dim 128, q/k 192) through the CPU's fused flash kernel, which takes one head dim: the narrower
    side is zero-padded for the kernel only (zero value columns give zero output columns; zero q/k columns
    add nothing to the scores, whose scale stays 1/sqrt(q's dim)) and the results cut back. Like the
    kernel for equal dims it saves q, k, v, the output (unpadded) and the fp32 log-sum-exp, so a
    narrow-value layer stores what the planner counts, not the (s, s) scores of SDPA's math fallback."""

    @staticmethod
    def forward(ctx, q_bnsd, k_bnsd, v_bnsd, causal: bool):
        d, dv = q_bnsd.shape[-1], v_bnsd.shape[-1]
        wide, scale = max(d, dv), d ** -0.5
        o_bnsw, lse_bns = _FLASH(_pad_to(q_bnsd, wide), _pad_to(k_bnsd, wide), _pad_to(v_bnsd, wide), 0.0, causal,
                                 scale=scale)
        # laid out (b, s, n, d) in memory, as the kernel's own output: the o-projection's input (the
        # heads side by side per token) is then a view of it, not a second saved copy
        o_bnsd = o_bnsw[..., :dv].transpose(1, 2).contiguous().transpose(1, 2)
        v_bnsd = v_bnsd.contiguous()   # a view of the up-projection's output would keep all of it alive
        ctx.save_for_backward(q_bnsd, k_bnsd, v_bnsd, o_bnsd, lse_bns)
        ctx.causal, ctx.scale, ctx.wide = causal, scale, wide
        return o_bnsd

    @staticmethod
    def backward(ctx, do_bnsd):
        q_bnsd, k_bnsd, v_bnsd, o_bnsd, lse_bns = ctx.saved_tensors
        w = ctx.wide
        dq, dk, dv = _FLASH_BACKWARD(_pad_to(do_bnsd.contiguous(), w), _pad_to(q_bnsd, w), _pad_to(k_bnsd, w),
                                     _pad_to(v_bnsd, w), _pad_to(o_bnsd, w), lse_bns, 0.0, ctx.causal,
                                     scale=ctx.scale)
        d, dvd = q_bnsd.shape[-1], v_bnsd.shape[-1]
        return dq[..., :d], dk[..., :d], dv[..., :dvd], None


def narrow_value_attention(q_bnsd, k_bksd, v_bksd, causal: bool = True, past: int = 0,
                           documents_bS: torch.Tensor | None = None, pad_b: torch.Tensor | None = None) -> torch.Tensor:
    """`attention_core` on the CPU when v's head dim differs from q's: training's causal attention through
    `_NarrowValueAttention`; a KV cache or document mask through SDPA with v zero-padded to q's dim
    (the output cut back)."""
    n, k = q_bnsd.shape[1], k_bksd.shape[1]
    if n != k:
        k_bksd, v_bksd = k_bksd.repeat_interleave(n // k, dim=1), v_bksd.repeat_interleave(n // k, dim=1)
    if past == 0 and documents_bS is None and pad_b is None and _FLASH is not None:
        return _NarrowValueAttention.apply(q_bnsd, k_bksd, v_bksd, causal)
    d, dv = q_bnsd.shape[-1], v_bksd.shape[-1]
    wide = max(d, dv)
    o_bnsw = attention_core(_pad_to(q_bnsd, wide) * (wide / d) ** 0.5, _pad_to(k_bksd, wide), _pad_to(v_bksd, wide),
                            causal, past, documents_bS, pad_b)
    return o_bnsw[..., :dv]


class LayerKV:
    """One layer's cached keys and values, (b, k, t, d) for the t tokens seen so far; `pad_b`: each row's
    left padding (a batch of prompts of different lengths), or None."""

    def __init__(self, pad_b: torch.Tensor | None = None):
        self.k_bktd: torch.Tensor | None = None
        self.v_bktd: torch.Tensor | None = None
        self.pad_b = pad_b

    @property
    def length(self) -> int:
        return 0 if self.k_bktd is None else self.k_bktd.shape[2]

    def extend(self, k_bksd: torch.Tensor, v_bksd: torch.Tensor):
        """Append s new tokens' keys and values: (all keys, all values, how many were cached before)."""
        past = self.length
        if past:
            k_bksd, v_bksd = torch.cat([self.k_bktd, k_bksd], dim=2), torch.cat([self.v_bktd, v_bksd], dim=2)
        self.k_bktd, self.v_bktd = k_bksd, v_bksd
        return k_bksd, v_bksd, past


class KVCache:
    """Keys and values of the tokens already run, per layer, for decoding a few tokens at a time:
    `model(tokens_bs, cache=cache)` places its tokens after the cached ones (positions length..), attends
    to them and to itself, and appends its own. Inference only (under torch.no_grad); single process.
    `pad_b` (b,): prompts left-padded to one length, row i by pad_b[i] tokens: row i's positions start
    after its padding (position 0 is its first real token) and no real token attends to the padding."""

    def __init__(self, layers: int, pad_b: torch.Tensor | None = None):
        self.pad_b = pad_b
        self.layers = [LayerKV(pad_b) for _ in range(layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.enter = Enter()  # tensor parallelism puts its input op here (f, or the SP all-gather)
        bias = cfg.qkv_bias   # Qwen2 / Qwen2-MoE: q, k, v projections with biases
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=bias, device=device)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=bias, device=device)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=bias, device=device)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False, device=device)
        # Qwen3: each head's q and k normalised (RMSNorm over the head dim, one weight shared by the heads)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device) if cfg.qk_norm else None
        self.core = attention_core  # selective recompute swaps in a checkpointed version (parallel/recompute.py)

    def forward(self, x_bsh: torch.Tensor, cos_sd, sin_sd, kv: LayerKV | None = None,
                documents_bS: torch.Tensor | None = None) -> torch.Tensor:
        """`documents_bS`: the document ids of the whole sequences (model/documents.py), handed to the
        core, which knows which of those tokens its queries and keys are."""
        q_bsf, k_bsf, v_bsf = self.enter(x_bsh, self.wq, self.wk, self.wv)
        b, s, _ = q_bsf.shape
        d = self.head_dim
        # head counts come from the projections' widths, so a tensor-parallel shard works unchanged
        q_bnsd = q_bsf.view(b, s, -1, d).transpose(1, 2)
        k_bksd = k_bsf.view(b, s, -1, d).transpose(1, 2)
        v_bksd = v_bsf.view(b, s, -1, d).transpose(1, 2)
        if self.q_norm is not None:
            q_bnsd, k_bksd = self.q_norm(q_bnsd), self.k_norm(k_bksd)
        q_bnsd, k_bksd = apply_rope(q_bnsd, cos_sd, sin_sd), apply_rope(k_bksd, cos_sd, sin_sd)
        return self.wo(attend(self.core, q_bnsd, k_bksd, v_bksd, kv, documents_bS))


def attend(core, q_bnsd, k_bksd, v_bksd, kv: LayerKV | None = None, documents_bS: torch.Tensor | None = None):
    """The attention of one layer's heads, (b, s, heads · v's head dim) with the heads side by side per
    token (the o-projection's input): `core` in training (the layer's own: context parallelism and
    selective recompute swap it), with the document mask when there is one; with a KV cache the cached
    tokens' keys and values first, through `attention_core`."""
    b, s = q_bnsd.shape[0], q_bnsd.shape[2]
    if kv is None and documents_bS is not None:
        o_bnsd = core(q_bnsd, k_bksd, v_bksd, documents_bS=documents_bS)
    elif kv is None:
        o_bnsd = core(q_bnsd, k_bksd, v_bksd)
    else:
        k_bktd, v_bktd, past = kv.extend(k_bksd, v_bksd)
        o_bnsd = attention_core(q_bnsd, k_bktd, v_bktd, past=past, pad_b=kv.pad_b)
    return o_bnsd.transpose(1, 2).reshape(b, s, -1)
