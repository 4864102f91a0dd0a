"""The output projection and the cross-entropy in chunks of tokens: the vocabulary-sized logits of the whole
microbatch never exist, in either pass.

Forward projects `chunk` tokens at a time, takes the fp32 cross-entropy of each chunk and keeps only the
sum; backward recomputes each chunk's logits and turns them into the gradients of the hidden states and of
the weight right away. Peak memory is one chunk's logits (in the compute dtype, an fp32 copy and its
softmax) instead of the whole microbatch's; the result is the plain loss's (the same per-token values in
the same dtypes, summed in another order), and so are the gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over counted labels of cross_entropy(hidden @ weight.T, labels), `chunk` rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, ignore_index: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start : start + chunk], weight).float()
            total += F.cross_entropy(logits, labels[start : start + chunk], reduction="sum", ignore_index=ignore_index)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)  # in the weight's dtype, as the plain path's gradient
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[start : start + ctx.chunk], labels[start : start + ctx.chunk]
            probs = torch.softmax(F.linear(h, weight).float(), dim=-1)  # d loss / d logits = softmax - one-hot
            counted = (y != ctx.ignore_index).unsqueeze(1)
            # minus one at each counted label, then masked rows to zero: no boolean indexing (a host sync on GPUs)
            probs.scatter_add_(1, torch.where(counted, y.unsqueeze(1), 0), -counted.to(probs.dtype))
            grad_logits = (probs * counted * grad_total).type_as(hidden)
            grad_hidden[start : start + ctx.chunk] = grad_logits @ weight
            grad_weight.addmm_(grad_logits.t(), h)
        return grad_hidden, grad_weight, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, ignore_index: int
) -> torch.Tensor:
    """The summed fp32 cross-entropy of hidden (..., dim) projected by weight (vocab, dim) against labels (...)."""
    return ChunkedLinearCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.flatten(), chunk, ignore_index)
