"""Context parallelism: split every sequence over the cp ranks; only attention needs the other tokens.

Three modes (`parallel.cp_mode`), one layout. A step's sequences are cut so that each of the N = cp
ranks holds s/N tokens of every sequence; everything but attention (norms, MLP, the loss) works on
those tokens alone. Attention is replaced by one of:

- **Ulysses** (Jacobs et al. 2023, "DeepSpeed Ulysses"). An all-to-all turns q, k, v from (all heads,
  s/N tokens) into (heads/N, all s tokens); ordinary causal attention runs on them; a second all-to-all
  returns the output to (all heads, s/N tokens) (comm/autograd.py seq_to_heads / heads_to_seq).
  GQA: K/V heads are split when kv_heads (after tp) divides by N, otherwise each is repeated just enough
  (to lcm(kv_heads, N)) before the all-to-all, so a rank's query heads find their K/V heads locally.
  Traffic per layer and micro-batch: 4 all-to-alls forward (q, k, v, o) and 4 backward, each sending
  (N-1)/N of the local tensor. Needs heads/tp % N; the all-to-all wants the fast (NVLink) domain.
- **Ring** (Liu et al. 2023, "Ring Attention"; zig-zag balance of Megatron-CP / torchtitan). K/V blocks
  travel round the ring while each rank attends its queries to the block it holds (ring.py). With the
  zig-zag split rank i holds chunks i and 2N-1-i of 2N, so causal work is equal on every rank. Traffic
  per layer and micro-batch: N-1 sends of the local K,V forward, N-1 of K,V and N-1 of dK,dV backward,
  each overlapped with a block's attention: ring suits slower links. Needs seq % 2N.
- **Hybrid** (USP, Fang & Zhao 2024). Ulysses over u inner, consecutive ranks (`parallel.ulysses`, or the
  largest divisor of cp dividing heads/tp) and ring over the N/u outer ones: the sequence is cut into
  2N/u zig-zag chunks for the ring ranks and each ring rank's share is split contiguously among its u
  Ulysses ranks, so after the all-to-all a ring rank holds its whole share for heads/u heads. The mesh
  makes the two groups ("cp_ulysses", "cp_ring"); placed innermost, the all-to-all stays in the fast
  domain and only the ring's sends cross slower links.

Positions: a rank's tokens are not contiguous (zig-zag), so the model gets their position ids
(`Transformer.forward(tokens, positions)`); the ring masks by them. Packed documents
(train.document_mask, model/documents.py): every rank holds the document ids of the whole sequences and
indexes the ids of the tokens it attends (its Ulysses-gathered share, each ring rank's block) itself,
so masking adds no traffic. Gradients of every (dense) parameter
are summed over dp × cp (`placement.reduce = "dp_cp"`), and the loss, each rank's share of the
global-token mean, is summed over dp × cp.
"""
from __future__ import annotations

from math import lcm

import numpy as np
import torch
from torch import nn

from .. import rules
from ..comm.autograd import heads_to_seq, seq_to_heads
from ..model.attention import attention_core
from .dimension import Dimension
from .placement import place
from .ring import ring_attention, zigzag_host


def token_indices_host(seq: int, cp: int, ulysses: int) -> np.ndarray:
    """(cp, seq/cp) int64 host data: the token positions cp rank c holds, c = ring rank · ulysses +
    Ulysses rank. Ring ranks take zig-zag shares (the whole sequence when the ring has one rank); each
    share is split contiguously among its Ulysses ranks, in their order (so their all-to-all gathers it
    in order)."""
    ring = cp // ulysses
    shares_rs = np.arange(seq, dtype=np.int64).reshape(1, seq) if ring == 1 else zigzag_host(seq, ring)
    return shares_rs.reshape(cp, seq // cp)


def token_indices(seq: int, cp: int, ulysses: int) -> torch.Tensor:
    """`token_indices_host` as a tensor."""
    return torch.from_numpy(token_indices_host(seq, cp, ulysses))


class ContextAttention(nn.Module):
    """The attention core of one layer under context parallelism (it replaces `Attention.core`):
    (q, k, v) of this rank's tokens for its heads -> attention output for the same tokens and heads."""

    def __init__(self, ulysses, ring, ring_host_rs: np.ndarray, causal: bool = True):
        super().__init__()
        self.ulysses, self.ring = ulysses, ring   # Groups (size 1 when the mode has no such part)
        self.causal = causal
        self.ring_host_rs = ring_host_rs          # every ring rank's positions, as data (the ring's plan)
        self.register_buffer("ring_positions_rs", torch.from_numpy(ring_host_rs), persistent=False)
        self.inner = attention_core   # causal attention on whole sequences (selective recompute wraps it)

    def forward(self, q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor,
                documents_bS: torch.Tensor | None = None) -> torch.Tensor:
        """`documents_bS` (b, S): the document ids of the whole sequences (model/documents.py); every cp
        rank holds them, so each ring rank's ids are indexed here and never sent."""
        u = self.ulysses.size
        if u > 1:
            k_bksd, v_bksd = self.kv_for_ulysses(k_bksd), self.kv_for_ulysses(v_bksd)
            q_bnsd, k_bksd, v_bksd = (seq_to_heads(t, self.ulysses) for t in (q_bnsd, k_bksd, v_bksd))
        documents_brs = None if documents_bS is None else documents_bS[:, self.ring_positions_rs]
        if self.ring.size > 1:
            o_bnsd = ring_attention(q_bnsd, k_bksd, v_bksd, self.ring_positions_rs, self.ring, self.causal,
                                    documents_brs, host_positions_rs=self.ring_host_rs)
        elif documents_brs is not None:   # Ulysses alone: this rank's heads of the whole sequence, in order
            o_bnsd = self.inner(q_bnsd, k_bksd, v_bksd, self.causal, documents_bS=documents_brs[:, 0])
        else:
            o_bnsd = self.inner(q_bnsd, k_bksd, v_bksd, self.causal)
        return heads_to_seq(o_bnsd, self.ulysses) if u > 1 else o_bnsd

    def kv_for_ulysses(self, x_bksd: torch.Tensor) -> torch.Tensor:
        """K or V heads made divisible by the Ulysses degree: each repeated lcm(kv, u)/kv times (kept in
        GQA order, so query head i still uses kv head i // (heads/kv))."""
        kv, u = x_bksd.shape[1], self.ulysses.size
        return x_bksd if kv % u == 0 else x_bksd.repeat_interleave(lcm(kv, u) // kv, dim=1)


class ContextParallelism(Dimension):
    """The context-parallel dimension (the contract: dimension.py): swaps every attention core, slices
    each micro-batch to this rank's tokens and gives their position ids, and sums dense gradients over
    dp × cp."""

    name = "cp"

    def __init__(self, mesh, cfg):
        p, m, t = cfg.parallel, cfg.model, cfg.train
        self.mesh = mesh
        self.ulysses_degree, self.ring_degree = rules.cp_degrees(p.cp_mode, p.cp, m.heads, p.tp, p.ulysses)
        indices = token_indices_host(t.seq_len, p.cp, self.ulysses_degree)
        self.positions = torch.from_numpy(indices[mesh.coords["cp"]])      # this rank's tokens
        self.ring_host_rs = indices.reshape(self.ring_degree, -1)          # every ring rank's share

    def apply(self, model: nn.Module) -> nn.Module:
        for block in model.layers:
            block.attn.core = ContextAttention(self.mesh["cp_ulysses"], self.mesh["cp_ring"], self.ring_host_rs)
        for param in model.parameters():
            place(param, reduce="dp_cp")
        return model   # MoE layers sum their per-sequence statistics over cp (parallelize.configure_moe)

    def shard_batch(self, *tensors_bs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's tokens of every sequence, of each (b, S) tensor given: tokens, their next-token
        targets (and, with documents, their positions)."""
        index = self.positions.to(tensors_bs[0].device)
        return tuple(t_bs[:, index] for t_bs in tensors_bs)
