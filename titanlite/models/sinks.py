"""Attention sinks (gpt-oss): each head has a learned logit that every query attends to beside its keys, with a zero
value, so that a query may give part of its attention to nothing. transformers appends the sink to the softmax's
logits; here SDPA computes it exactly, on any device and kernel, from one virtual key: q gets one more feature (the
head's sink / scale), every key a 0 there and the virtual key a 1 (its logit is then the sink), with a zero value.
The extra features are padded to 8 (the flash kernels' head dims are multiples of 8)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titanlite.models.rope_attention import attend

_EXTRA = 8  # features added to q and k: the sink's, then zeros


def sink_column(mask):
    """A mask over [the virtual sink key] + the keys, from one over the keys (None stays None): every query sees the
    sink. A boolean mask gets True, an additive one 0, in a first column."""
    if mask is None:
        return None
    first = torch.ones if mask.dtype == torch.bool else torch.zeros
    return torch.cat([first(*mask.shape[:-1], 1, dtype=mask.dtype, device=mask.device), mask], dim=-1)


def attend_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask=None, causal: bool = True, scale=None
) -> torch.Tensor:
    """attend (models/rope_attention.py) with a sink logit per head of q (sinks: (heads,)); mask, when given, is over
    [the sink] + the keys (sink_column). Causal without a mask: a virtual query is put first, so that query i still
    sees keys up to its own (SDPA's causal mask is aligned to the first key), and its output dropped."""
    b, h, n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    sink = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, n, 1)
    q = torch.cat([q, sink, q.new_zeros(b, h, n, _EXTRA - 1)], dim=-1)
    kv_heads = k.shape[1]
    virtual = torch.zeros(b, kv_heads, 1, d + _EXTRA, dtype=k.dtype, device=k.device)
    virtual[..., d] = 1.0
    k = torch.cat([virtual, F.pad(k, (0, _EXTRA))], dim=2)
    v = torch.cat([v.new_zeros(b, kv_heads, 1, v.shape[-1]), v], dim=2)
    if mask is None and causal:
        q = torch.cat([q.new_zeros(b, h, 1, d + _EXTRA), q], dim=2)
        return attend(q, k, v, None, True, scale)[:, :, 1:]
    return attend(q, k, v, mask, causal, scale)
