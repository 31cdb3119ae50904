"""Multi-head latent attention (MLA): DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model" (arXiv 2405.04434, 2024), §2.1; as used by DeepSeek-V3 (§2.1.1).

Keys and values come from one narrow latent per token instead of per-head projections of x:

    c_q  = RMSNorm(x W_qa)                       q_lora_rank wide (or none: q = x W_q, DeepSeek-V2-Lite)
    q    = c_q W_qb  -> per head [q_nope, q_pe]  qk_nope_dim + qk_rope_dim
    [c_kv, k_pe] = x W_kva                       kv_lora_rank + qk_rope_dim: k_pe is ONE rope key shared
    c_kv = RMSNorm(c_kv)                         by every head
    [k_nope, v] = c_kv W_kvb, per head           qk_nope_dim + v_head_dim
    k    = [k_nope, RoPE(k_pe)],  q = [q_nope, RoPE(q_pe)]
    o    = softmax(q kᵀ / sqrt(nope + rope)) v,  out = o W_o   (heads · v_head_dim -> hidden)

It matches Hugging Face's `DeepseekV3Attention` (transformers 5.x) weight for weight: q_a_proj, q_a_layernorm,
q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj are our q_a, q_norm, q_b (q_proj),
kv_a, kv_norm, kv_b, wo (model/hf.py). The latent norms use eps 1e-6, as Hugging Face's (its config's
rms_norm_eps is the block norms' only). RoPE rotates only the rope part; with `rope_interleave` (DeepSeek's
checkpoints, Hugging Face's default) its dims are pairs (x0, x1), (x2, x3), ..., which is rotate-half RoPE
after de-interleaving (evens, then odds), as Hugging Face computes it.

Tensor parallelism (parallel/tensor.py) splits q_b (or q_proj) and kv_b by heads and wo by its input;
the down-projections q_a, kv_a and the latent norms stay whole on every rank. It enters the
tensor-parallel region on the latents rather than on x: `enter_latent` receives (c_q, c_kv, k_pe) of this
rank's tokens and returns them for all the tokens the heads attend to (f without sequence parallelism,
an all-gather of the narrow latents with it, as Megatron-Core's MLA); `enter` is the input op of q_proj
when there is no q latent. A KV cache (generate) holds the per-head keys and values.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import LayerKV, apply_rope, attend, attention_core
from .layers import RMSNorm

LATENT_NORM_EPS = 1e-6   # Hugging Face's DeepseekV3RMSNorm default, used by q_a_layernorm and kv_a_layernorm


class Latents(nn.Module):
    """The identity on (c_q, c_kv, k_pe): where tensor parallelism enters its region (module docstring)."""

    def forward(self, c_q_bsr, c_kv_bsr, k_pe_bsd):
        return c_q_bsr, c_kv_bsr, k_pe_bsd


def deinterleave(x_bnsd: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rope pairs (x0, x1), (x2, x3), ... as rotate-half's halves (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((x_bnsd[..., 0::2], x_bnsd[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """MLA (module docstring): x (b, s, h) -> (b, s, h). Head counts come from the up-projections' widths,
    so a tensor-parallel shard runs unchanged."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        h, n = cfg.hidden, cfg.heads
        self.q_lora, self.kv_lora = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
        self.interleave = cfg.rope_interleave
        self.enter = nn.Identity()       # tensor parallelism: q_proj's input op (no q latent)
        self.enter_latent = Latents()    # tensor parallelism: f, or the SP all-gather of the latents
        if self.q_lora:
            self.q_a = nn.Linear(h, self.q_lora, bias=False, device=device)
            self.q_norm = RMSNorm(self.q_lora, LATENT_NORM_EPS, device)
            self.q_b = nn.Linear(self.q_lora, n * cfg.qk_head_dim, bias=False, device=device)
        else:
            self.q_proj = nn.Linear(h, n * cfg.qk_head_dim, bias=False, device=device)
        self.kv_a = nn.Linear(h, self.kv_lora + self.rope, bias=False, device=device)
        self.kv_norm = RMSNorm(self.kv_lora, LATENT_NORM_EPS, device)
        self.kv_b = nn.Linear(self.kv_lora, n * (self.nope + self.v_dim), bias=False, device=device)
        self.wo = nn.Linear(n * self.v_dim, h, bias=False, device=device)
        self.core = attention_core   # selective recompute and context parallelism swap it

    def latents(self, x_bsh: torch.Tensor):
        """(c_q normed or None, c_kv normed, k_pe before RoPE) of these tokens."""
        c_q_bsr = self.q_norm(self.q_a(x_bsh)) if self.q_lora else None
        c_kv_bsr, k_pe_bsd = self.kv_a(x_bsh).split([self.kv_lora, self.rope], dim=-1)
        return c_q_bsr, self.kv_norm(c_kv_bsr), k_pe_bsd

    def rotate(self, x_bnsd: torch.Tensor, cos_sd, sin_sd) -> torch.Tensor:
        return apply_rope(deinterleave(x_bnsd) if self.interleave else x_bnsd, cos_sd, sin_sd)

    def qkv(self, x_bsh: torch.Tensor, cos_sd, sin_sd):
        """Per-head q (b, n, s, nope+rope), k (b, n, s, nope+rope), v (b, n, s, v_head_dim)."""
        c_q_bsr, c_kv_bsr, k_pe_bsd = self.enter_latent(*self.latents(x_bsh))
        b, s, _ = c_kv_bsr.shape
        q_bsq = self.q_b(c_q_bsr) if self.q_lora else self.q_proj(self.enter(x_bsh))
        q_nope_bnsd, q_pe_bnsd = q_bsq.view(b, s, -1, self.nope + self.rope).transpose(1, 2).split(
            [self.nope, self.rope], dim=-1)
        k_nope_bnsd, v_bnsd = self.kv_b(c_kv_bsr).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2).split(
            [self.nope, self.v_dim], dim=-1)
        k_pe_b1sd = self.rotate(k_pe_bsd.view(b, s, 1, self.rope).transpose(1, 2), cos_sd, sin_sd)
        q_bnsd = torch.cat((q_nope_bnsd, self.rotate(q_pe_bnsd, cos_sd, sin_sd)), dim=-1)
        k_bnsd = torch.cat((k_nope_bnsd, k_pe_b1sd.expand(-1, k_nope_bnsd.shape[1], -1, -1)), dim=-1)
        return q_bnsd, k_bnsd, v_bnsd

    def forward(self, x_bsh: torch.Tensor, cos_sd, sin_sd, kv: LayerKV | None = None,
                documents_bS: torch.Tensor | None = None) -> torch.Tensor:
        q_bnsd, k_bnsd, v_bnsd = self.qkv(x_bsh, cos_sd, sin_sd)
        return self.wo(attend(self.core, q_bnsd, k_bnsd, v_bnsd, kv, documents_bS))
