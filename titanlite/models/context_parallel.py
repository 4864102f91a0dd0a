"""Context parallelism inside the model: each of the cp ranks of a sequence holds two of its 2 x cp chunks, one
from each end (rank r: chunks r and 2cp - 1 - r), so that every rank does the same share of causal attention's
work; attention gathers every rank's keys and values (in sequence order) and each rank's queries attend over them
with the mask of their own global positions, so any mask (causal, block-causal across documents that cross the
chunk boundaries) and grouped-query attention stay exact. RoPE positions and labels travel with their tokens.

Gathering K and V (Llama 3's approach) rather than a ring: one all-gather per layer, any mask, and a backward that is
one reduce-scatter; the gathered keys and values are what each rank keeps beyond its own tokens.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from titanlite.compat import all_gather_autograd, compiled_create_block_mask
from titanlite.models.rope_attention import block_causal_kernel, document_ids


@lru_cache(maxsize=16)
def _chunk_order(seq_len: int, cp: int) -> torch.Tensor:
    """Global token indices of every rank's tokens, rank after rank (rank r: chunks r and 2cp - 1 - r)."""
    chunk = seq_len // (2 * cp)
    order = []
    for r in range(cp):
        for c in (r, 2 * cp - 1 - r):
            order.extend(range(c * chunk, (c + 1) * chunk))
    return torch.tensor(order)


@lru_cache(maxsize=16)
def local_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global indices of the tokens cp rank `rank` holds, in its order."""
    per_rank = seq_len // cp
    return _chunk_order(seq_len, cp)[rank * per_rank : (rank + 1) * per_rank].to(device)


@lru_cache(maxsize=16)
def inverse_order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Where each global token index sits among the ranks' tokens stacked rank after rank."""
    return torch.argsort(_chunk_order(seq_len, cp)).to(device)


def gather_sequence(x: torch.Tensor, group, inverse: torch.Tensor) -> torch.Tensor:
    """Every cp rank's part of x (batch, local seq, ...) joined in sequence order (batch, seq, ...); inverse from
    inverse_order. Its gradient is reduce-scattered back (functional collectives: traceable by torch.compile)."""
    gathered = all_gather_autograd(x.transpose(0, 1).contiguous(), group)  # ranks' tokens along dim 0
    return gathered.index_select(0, inverse).transpose(0, 1)


def _cp_mask_mod(q_index: torch.Tensor, docs: torch.Tensor | None):
    def mask_mod(b, h, q_idx, kv_idx):
        q = q_index[q_idx]
        causal = q >= kv_idx
        return causal if docs is None else causal & (docs[b, q] == docs[b, kv_idx])

    return mask_mod


def cp_attention_mask(index: torch.Tensor, seq_len: int, positions: torch.Tensor | None, kernel: str = "auto"):
    """The mask of this rank's queries (global indices `index`) over the whole sequence's keys: causal, and with
    positions (block-causal, a position of 0 starting a document) within each document. A FlexAttention BlockMask
    on CUDA (or kernel 'flex'), else a boolean SDPA mask (batch or 1, 1, local, seq_len)."""
    device = index.device
    docs = document_ids(positions) if positions is not None else None
    if block_causal_kernel(kernel, device.type) == "flex":
        b = docs.shape[0] if docs is not None else 1
        create = compiled_create_block_mask() if device.type == "cuda" else _eager_create_block_mask()
        return create(_cp_mask_mod(index, docs), b, None, index.numel(), seq_len, device=device)
    keys = torch.arange(seq_len, device=device)
    mask = keys[None, :] <= index[:, None]
    if docs is not None:
        mask = mask & (docs[:, index][:, :, None] == docs[:, None, :])
    return mask[:, None] if mask.dim() == 3 else mask[None, None]


def _eager_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask  # lazy: FlexAttention pulls in the compiler

    return create_block_mask
