"""The attention masks of a forward, one per kind of block: full attention (causal, block-causal or a KV cache's) and,
for a model with sliding-window blocks (gpt-oss), the same mask limited to the last sliding_window positions of each
query (transformers' sliding_window: key > query - window). Built once per forward and shared by the blocks of a kind;
with attention sinks each mask has the sink's column first (models/sinks.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from titanlite.models.args import ModelArgs
from titanlite.models.sinks import sink_column


class LayerMasks(NamedTuple):
    """The masks of a model with sliding-window blocks: `full` for the others (None: causal), `sliding` for them."""

    full: object
    sliding: object


def layer_masks(args: ModelArgs, mask, offset: int, n: int, device, dtype: torch.dtype | None):
    """The mask each block gets, from the full-attention mask of n queries at positions offset.. over the offset + n
    keys (None: causal, or every key for one query of a cache): that mask for a model without sliding-window blocks,
    else LayerMasks. dtype: a boolean mask becomes additive in it (None: kept boolean)."""
    sliding = None
    if args.sliding_layers and offset + n > args.sliding_window:  # some query has more keys than its window
        queries = torch.arange(offset, offset + n, device=device)[:, None]
        keys = torch.arange(offset + n, device=device)[None, :]
        near = (keys <= queries) & (keys > queries - args.sliding_window)
        sliding = near[None, None] if mask is None else mask & near
    if args.attention_sinks:
        mask, sliding = sink_column(mask), sink_column(sliding)
    mask, sliding = additive_mask(mask, dtype), additive_mask(sliding, dtype)
    if not args.sliding_layers:
        return mask
    return LayerMasks(mask, mask if sliding is None else sliding)


def block_mask(masks, sliding: bool):
    """A block's mask from what layer_masks returned."""
    if isinstance(masks, LayerMasks):
        return masks.sliding if sliding else masks.full
    return masks


def additive_mask(mask, dtype: torch.dtype | None):
    """One additive mask for every layer: SDPA would convert a boolean one in each layer and keep every copy (dtype
    None: kept as it is)."""
    if dtype is not None and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask
