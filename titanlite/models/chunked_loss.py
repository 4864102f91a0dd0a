"""The output projection and the cross-entropy in chunks of tokens: the vocabulary-sized logits of the whole
microbatch never exist.

Forward projects `chunk` tokens at a time, takes the fp32 cross-entropy of each chunk, and turns the chunk's
logits into its gradients right away (softmax minus one-hot: the gradient of the hidden states, and the
weight's gradient accumulated over chunks); backward only scales them by the incoming gradient. So no matmul
runs twice (the same FLOPs as the plain loss), and peak memory holds one chunk's logits, their fp32 copy and
softmax, plus the weight's gradient (which the plain loss makes too, at the start of backward) instead of the
whole microbatch's logits. The loss is the plain loss's value (the same per-token values in the same dtypes,
summed in another order), and so are the gradients. Without gradients (validation) only the loss is computed.

With tensor parallelism the weight is split over the vocabulary across a process group: each rank projects
onto its rows, and the softmax's max and sum, the target logits and the hidden states' gradient are reduced
over the group, per chunk; every rank gets the same loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over counted labels of cross_entropy(hidden @ weight.T, labels), `chunk` rows at a time; with `group`,
    weight holds the vocabulary rows vocab_start.. of a weight split over the group's ranks."""

    @staticmethod
    def forward(
        ctx, hidden, weight, labels, chunk: int, ignore_index: int, group=None, vocab_start: int = 0, in_place=True
    ):
        ctx.in_place = in_place
        need_hidden, need_weight = ctx.needs_input_grad[:2]  # a frozen weight (LoRA) gets no gradient
        need_grads = need_hidden or need_weight
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None  # in the weight's dtype, as the plain path's
        rows = weight.shape[0]
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            logits = F.linear(h, weight).float()
            counted = (y != ignore_index).unsqueeze(1)
            local = y.unsqueeze(1) - vocab_start
            mine = counted & (local >= 0) & (local < rows)  # the label is one of this rank's rows
            target = torch.where(mine, local, 0)  # no boolean indexing: a host sync per chunk on GPUs
            # softmax, not exp(log_softmax): exp of its tails is slow (denormals); its largest entry is 1 / sum
            probs = torch.softmax(logits, dim=-1)
            row_max = logits.amax(dim=-1, keepdim=True)
            target_logit = logits.gather(1, target) * mine
            del logits
            row_sum = probs.amax(dim=-1, keepdim=True).reciprocal()  # of exp(logits - row_max)
            if group is not None:  # the whole vocabulary's max and sum of exp, and the label's logit
                local_max = row_max
                row_max = local_max.clone()
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
                local_sum = row_sum * torch.exp(local_max - row_max)
                row_sum = local_sum.clone()
                dist.all_reduce(row_sum, group=group)
                dist.all_reduce(target_logit, group=group)
                probs.mul_(local_sum / row_sum)
            total += ((row_max + row_sum.log() - target_logit) * counted).sum()
            if need_grads:  # d loss / d logits = softmax - one-hot, zero where the label does not count
                probs.scatter_add_(1, target, -mine.to(probs.dtype)).mul_(counted)
                grad_logits = probs.type_as(hidden)
                del probs
                if need_hidden:
                    partial = grad_logits @ weight  # with a group: this rank's rows' share of the hidden gradient
                    if group is not None:
                        dist.all_reduce(partial, group=group)
                    grad_hidden[start : start + chunk] = partial
                if need_weight:
                    grad_weight.addmm_(grad_logits.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        # In place: a second copy of the output's gradient would sit beside every block's activations at the
        # step's peak. Autograd's version check refuses a second backward through this node (retain_graph).
        # The fp32 scalar multiplies in fp32 and rounds once (a low-precision copy of it would bias every element).
        # A backward split into input and weight parts (a zero-bubble pipeline schedule) runs this node twice.
        scale = torch.Tensor.mul_ if ctx.in_place else torch.mul
        grads = [scale(g, grad_total) if g is not None else None for g in (grad_hidden, grad_weight)]
        return *grads, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    ignore_index: int,
    group=None,
    vocab_start: int = 0,
    in_place: bool = True,
) -> torch.Tensor:
    """The summed fp32 cross-entropy of hidden (..., dim) projected by weight (vocab, dim) against labels (...);
    with group, weight is this rank's rows (from vocab_start) of a weight split over the group. in_place=False:
    backward may run more than once (it then makes new gradient tensors)."""
    return ChunkedLinearCrossEntropy.apply(
        hidden.flatten(0, -2), weight, labels.flatten(), chunk, ignore_index, group, vocab_start, in_place
    )


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(label) of every token of hidden (N, dim) projected by weight (vocab rows, dim), `chunk` rows at a time;
    0 where the label does not count. Backward projects each chunk again (the logits are never kept): the gradient
    of each token's value scales its own softmax, so it cannot be folded into forward as the summed loss's is."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, ignore_index: int, group=None, vocab_start: int = 0):
        out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.zeros_like(out)  # each row's log-sum-exp over the whole vocabulary, for backward
        rows = weight.shape[0]
        for start in range(0, hidden.shape[0], chunk):
            y = labels[start : start + chunk]
            logits = F.linear(hidden[start : start + chunk], weight).float()
            counted = y != ignore_index
            local = y - vocab_start
            mine = counted & (local >= 0) & (local < rows)
            target = logits.gather(1, torch.where(mine, local, 0).unsqueeze(1)).squeeze(1) * mine
            row_max = logits.amax(dim=-1)
            if group is not None:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            row_sum = torch.exp(logits - row_max.unsqueeze(1)).sum(dim=-1)
            if group is not None:
                dist.all_reduce(row_sum, group=group)
                dist.all_reduce(target, group=group)
            lse[start : start + chunk] = row_max + row_sum.log()
            out[start : start + chunk] = (target - lse[start : start + chunk]) * counted
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.ignore_index, ctx.group, ctx.vocab_start = chunk, ignore_index, group, vocab_start
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        rows, group = weight.shape[0], ctx.group
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[start : start + ctx.chunk], labels[start : start + ctx.chunk]
            g = grad_out[start : start + ctx.chunk].float() * (y != ctx.ignore_index)
            # d log p(y) / d logits = one-hot(y) - softmax: scaled by each token's incoming gradient
            probs = torch.exp(F.linear(h, weight).float() - lse[start : start + ctx.chunk].unsqueeze(1))
            local = y - ctx.vocab_start
            mine = (local >= 0) & (local < rows)
            grad_logits = probs.mul_(-g.unsqueeze(1))
            grad_logits.scatter_add_(1, torch.where(mine, local, 0).unsqueeze(1), (g * mine).unsqueeze(1))
            grad_logits = grad_logits.type_as(hidden)
            if need_hidden:
                partial = grad_logits @ weight
                if group is not None:
                    dist.all_reduce(partial, group=group)
                grad_hidden[start : start + ctx.chunk] = partial
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), h)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    ignore_index: int,
    group=None,
    vocab_start: int = 0,
) -> torch.Tensor:
    """log p(label) of each token (fp32, flattened; 0 where the label does not count) of hidden (..., dim) projected
    by weight (vocab, dim); with group, weight is this rank's rows (from vocab_start) of a weight split over it."""
    return ChunkedTokenLogprobs.apply(hidden.flatten(0, -2), weight, labels.flatten(), chunk, ignore_index, group,
                                      vocab_start)  # fmt: skip
