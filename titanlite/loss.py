"""The training loss: the sum of token cross-entropies over the labels that count (not IGNORE_INDEX)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

IGNORE_INDEX = -100  # a label that does not count in the loss (padding, prompt tokens)


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over counted labels of -log softmax(logits)[label], computed in fp32; logits (..., vocab)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def loss_parallel_context(enabled: bool):
    """The context in which forward and backward compute the loss on vocabulary-split logits (tensor parallelism
    with loss parallelism), without gathering them; a no-op context otherwise."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def training_loss(compiled: bool):
    """summed_cross_entropy, or its torch.compile'd form: one fused kernel that reads the low-precision logits
    and never holds a full fp32 copy of them (nor of log_softmax) for the whole microbatch."""
    return torch.compile(summed_cross_entropy) if compiled else summed_cross_entropy


def counted_labels(labels: torch.Tensor) -> torch.Tensor:
    """How many labels count in the loss."""
    return (labels != IGNORE_INDEX).sum()


def takes_positions(model: torch.nn.Module) -> bool:
    """Whether the model attends block-causally: its forward takes the positions that mark where documents start."""
    return getattr(getattr(model, "args", None), "attention", "causal") == "block_causal"


def microbatch_loss(
    model: torch.nn.Module, microbatch, device: torch.device, loss_fn=summed_cross_entropy
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, labels on the device) of one microbatch (inputs, labels[, positions]).

    A model with block-causal attention also gets the positions, which mark where documents start. A model
    whose loss_chunk_tokens is set computes the loss itself, in chunks (no full logits); else loss_fn takes
    its logits.
    """
    inputs = microbatch[0].to(device, non_blocking=True)
    labels = microbatch[1].to(device, non_blocking=True)
    args = []
    if len(microbatch) > 2 and takes_positions(model):
        args.append(microbatch[2].to(device, non_blocking=True))
    if getattr(model, "loss_chunk_tokens", 0) > 0 and loss_fn is summed_cross_entropy:
        return model(inputs, *args, labels=labels), labels
    loss = loss_fn(model(inputs, *args), labels)
    if isinstance(loss, DTensor):  # from vocabulary-split logits (loss parallel): the same value on every tp rank
        loss = loss.full_tensor()
    return loss, labels


class TokenLoss:
    """The token cross-entropy as the trainer's and validator's objective: the summed loss of a microbatch, what it
    counts for (its counted labels), and no statistics of its own (preference/objective.py is the other one)."""

    def __init__(self, loss_fn=summed_cross_entropy):
        self.loss_fn = loss_fn

    def begin(self) -> None:
        """(nothing to reset)"""

    def __call__(self, model: torch.nn.Module, microbatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed cross-entropy, labels on the device) of one microbatch."""
        return microbatch_loss(model, microbatch, device, self.loss_fn)

    counted = staticmethod(counted_labels)

    def report(self) -> None:
        """(no statistics)"""
        return None
