"""GShard's random routing (Lepikhin et al. 2020, §2.2 and Algorithm 1): with top-2 gating, a token's
first expert always receives it; its second expert receives it only with probability 2·g2, where
g2 = w2 / (w1 + w2) is the second expert's share of the two gate weights. A token whose second weight is
small mostly skips that expert, saving its dispatch and its capacity; a token split evenly between two
experts (g2 = 1/2) always reaches both. `model.random_routing` turns it on (top_k = 2, a softmax router:
the gating GShard describes). No communication of its own: it decides which rows the dispatch sends.

What happens to a skipped second choice is what happens to a capacity drop (model/moe.py): expert -1,
weight 0, and the other weight is not renormalised, so the token carries w1·E1(x) (as GShard's combine
tensor does). The draw comes before capacity: a skipped choice takes no place in its expert's queue.

Layout-invariant draws. Every token of a step has a key, its place in the step's global batch:

    key = (step · global_batch + row) · seq_len + position

(row: the sequence's index in the global batch, position: the token's index in it). The trainer computes
the keys beside the tokens and every dimension slices them as it slices the tokens (data and context
parallelism in `Dimension.shard_batch`; tensor parallelism's row split or sequence shard at the MoE layer,
`keys_view`). The uniform draw of a token at MoE layer `layer` is a hash of (seed, layer, key) computed
with integer tensor ops (`uniform`), so any rank, on any device, in any layout, draws the same number for
the same token: a layout equals the single-process run with random routing as without. A forward re-run
for recomputation draws the same, without touching a random stream.

Where no keys are given (evaluation, generation, a model called directly) both experts are used, as the
router chose them.

Expected load. A token sends 1 + 2·g2 assignments on average instead of 2; with an untrained router
(g1 ≈ g2) almost 2, with a confident one near 1. The experts' load and the dispatch's bytes per step are
measured (metrics' tokens per expert; the ledger's all-to-all bytes in dropless mode). The planner plans
top_k = 2 rows a token: in capacity mode that is exactly what moves (the buffers are E·C rows whatever
the draws), in dropless mode an upper bound of the dispatch's bytes (docs/training.md).
"""
from __future__ import annotations

import torch

_MASK = (1 << 31) - 1   # 31-bit lanes: every product below stays under 2**62, so int64 never overflows


def _mix(x):
    """A bijective 31-bit integer mix (xor-shift, multiply, in the style of the murmur3 / lowbias
    finalisers); works on Python ints and int64 tensors alike."""
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & _MASK
    x = x ^ (x >> 13)
    x = (x * 0x297A2D39) & _MASK
    return x ^ (x >> 16)


def token_keys(step: int, global_batch: int, first_row: int, rows: int, seq_len: int) -> torch.Tensor:
    """(rows, seq_len) int64: the keys of rows [first_row, first_row + rows) of step `step`'s global batch."""
    row_b = torch.arange(first_row, first_row + rows, dtype=torch.int64) + step * global_batch
    return row_b[:, None] * seq_len + torch.arange(seq_len, dtype=torch.int64)[None, :]


def uniform(keys: torch.Tensor, seed: int, layer: int) -> torch.Tensor:
    """A float64 draw in [0, 1) for each key, a function of (seed, layer, key) only."""
    salt = _mix(_mix((seed & _MASK) ^ 0x5BD1E995) ^ (layer & _MASK))
    low, high = keys & _MASK, (keys >> 31) & _MASK
    return _mix(_mix(low ^ salt) ^ high).to(torch.float64) / float(1 << 31)


def second_sent(weights_tk: torch.Tensor, uniform_t: torch.Tensor) -> torch.Tensor:
    """(t,) bool: whether each token's second choice is dispatched: u < 2·w2 / (w1 + w2)."""
    w = weights_tk.to(torch.float64)
    return uniform_t < 2 * w[:, 1] / (w[:, 0] + w[:, 1])


def skip_seconds(experts_tk: torch.Tensor, weights_tk: torch.Tensor, uniform_t: torch.Tensor):
    """(experts_tk, weights_tk) with each second choice not drawn set to expert -1, weight 0."""
    skip_t = ~second_sent(weights_tk, uniform_t.to(weights_tk.device))
    skip_tk = torch.stack([torch.zeros_like(skip_t), skip_t], dim=1)
    return experts_tk.masked_fill(skip_tk, -1), weights_tk.masked_fill(skip_tk, 0.0)
