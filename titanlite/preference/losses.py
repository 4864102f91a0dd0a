"""The DPO family's losses on sequence log-probabilities: DPO (sigmoid, with cDPO's label smoothing), IPO (on the
per-token log-ratio margin, as TRL computes it) and SimPO (reference-free, on mean log-probabilities)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanlite.loss import IGNORE_INDEX


def model_sequence_logps(model, inputs, extra: list, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """sequence_logps of the model's rows: from its output projection in chunks of tokens when it computes them
    (loss_chunk_tokens > 0; no logits tensor of the whole microbatch), else from its logits."""
    if getattr(model, "loss_chunk_tokens", 0) > 0:
        per_token = model(inputs, *extra, labels=labels)
        return per_token.view(labels.shape).sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)
    return sequence_logps(model(inputs, *extra), labels)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p(label) over each row's counted labels, fp32; counted labels per row) of logits (rows, L, vocab);
    vocabulary-split logits (loss parallel) are never gathered."""
    per_token = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    )
    if isinstance(per_token, DTensor):  # replicated over the tp ranks
        per_token = per_token.full_tensor()
    return -per_token.view(labels.shape).sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)


def pair_losses(
    kind: str,
    beta: float,
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    counts: torch.Tensor,
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair. policy, reference: log-probabilities of 2b rows (the b chosen,
    then the b rejected); counts: counted tokens per row; reference None for simpo."""
    chosen, rejected = policy.chunk(2)
    n_chosen, n_rejected = counts.to(policy.dtype).clamp(min=1).chunk(2)
    if kind == "simpo":
        chosen, rejected = chosen / n_chosen, rejected / n_rejected
        margin = beta * (chosen - rejected) - gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
        return losses, beta * chosen.detach(), beta * rejected.detach()
    ref_chosen, ref_rejected = reference.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if kind == "sigmoid":
        margin = beta * (chosen_ratio - rejected_ratio)
        losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    elif kind == "ipo":
        losses = (chosen_ratio / n_chosen - rejected_ratio / n_rejected - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
