"""One micro-batch of one rank, as one value: `MicroBatch(tokens, targets, documents, loss_tokens, keys)`.

The trainer cuts this rank's share of a step's batch into micro-batches (after every dimension has taken
its slice of the tokens: `Dimension.shard_batch`), and every forward reads them the same way: the direct
loop (parallelize.py) and the pipeline's actions (pipeline/runtime.py). `documents`: the packed documents
(model/documents.py) with train.document_mask, else None. `loss_tokens`: the global count of targets
that count (the whole global batch's, a loss mask's fewer), which each micro-batch's summed token loss is
divided by, so the losses of every micro-batch on every rank add up to the batch's mean. `keys`: the
step-global key of each token (model/random_routing.py), sharded like the tokens, under random routing
in training; else None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..model.documents import Documents

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (logits, targets) -> the summed token loss


@dataclass(frozen=True)
class MicroBatch:
    tokens: torch.Tensor                  # (b, s) this rank's tokens
    targets: torch.Tensor                 # (b, s) the next tokens (IGNORE_INDEX where the loss skips one)
    documents: Documents | None = None    # train.document_mask: positions and document ids
    loss_tokens: int = 1                  # the global batch's targets that count: the loss's divisor
    keys: torch.Tensor | None = None      # (b, s) the tokens' step-global keys: random routing's draws

    def loss(self, loss_sum: LossSum, logits_bsv: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the step's mean token loss."""
        return loss_sum(logits_bsv, self.targets) / self.loss_tokens


def cut(tokens_bs: torch.Tensor, targets_bs: torch.Tensor, count: int, loss_tokens: int,
        documents: Documents | None = None, keys_bs: torch.Tensor | None = None) -> list[MicroBatch]:
    """A rank's rows cut into `count` micro-batches along the batch."""
    docs = documents.chunk(count) if documents is not None else [None] * count
    keys = keys_bs.chunk(count) if keys_bs is not None else [None] * count
    return [MicroBatch(x, y, d, loss_tokens, k)
            for x, y, d, k in zip(tokens_bs.chunk(count), targets_bs.chunk(count), docs, keys)]
