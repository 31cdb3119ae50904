"""Document-aware packing (train.document_mask; Llama 3 §3.2): a packed sequence holds several documents,
and attention must not cross their boundaries.

A micro-batch then carries its `Documents`: `ids_bS`, the document id of every token of each whole
sequence in sequence order (0 for the first document of a row, +1 at each start; non-decreasing), and
`positions_bs`, the RoPE position of each token this rank holds (0 at its document's start, or at the
row's first token). `ids_bS` is always the whole sequence — under context parallelism every rank holds
it, because every cp rank reads the same rows — so any rank computes, locally, the ids of any other
rank's tokens (the ring's K/V blocks) and nothing extra crosses the network.

Query i sees key j iff j <= i (sequence order) and ids[j] == ids[i]: causal attention, block-diagonal
over the documents (`document_mask`). A micro-batch holds its Documents (parallel/microbatch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    positions_bs: torch.Tensor   # RoPE positions of this rank's tokens (int64)
    ids_bS: torch.Tensor         # document id of every token of the whole sequence (int64)

    def chunk(self, n: int) -> list["Documents"]:
        """Split along the batch, as micro-batches split the rows."""
        return [Documents(p, d) for p, d in zip(self.positions_bs.chunk(n), self.ids_bS.chunk(n))]

    def to(self, device) -> "Documents":
        return Documents(self.positions_bs.to(device), self.ids_bS.to(device))


def document_positions(ids_bS: torch.Tensor) -> torch.Tensor:
    """(b, S) position of each token within its document: its index minus its document's first index."""
    index_bS = torch.arange(ids_bS.shape[1], device=ids_bS.device).expand_as(ids_bS)
    starts_bS = torch.ones_like(ids_bS, dtype=torch.bool)
    starts_bS[:, 1:] = ids_bS[:, 1:] != ids_bS[:, :-1]
    first_bS = torch.where(starts_bS, index_bS, torch.zeros_like(index_bS)).cummax(dim=1).values
    return index_bS - first_bS


def document_mask(ids_q_bs: torch.Tensor, ids_k_bt: torch.Tensor, causal_st: torch.Tensor | None) -> torch.Tensor:
    """(b, 1, s, t) bool: query sees key when both are in the same document (and `causal_st` allows it)."""
    same_bst = ids_q_bs[:, :, None] == ids_k_bt[:, None, :]
    return (same_bst if causal_st is None else same_bst & causal_st)[:, None]
