"""The training loss: the sum of token cross-entropies over the labels that count (not IGNORE_INDEX)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a label that does not count in the loss (padding, prompt tokens)


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over counted labels of -log softmax(logits)[label], computed in fp32; logits (..., vocab)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def counted_labels(labels: torch.Tensor) -> torch.Tensor:
    """How many labels count in the loss."""
    return (labels != IGNORE_INDEX).sum()
