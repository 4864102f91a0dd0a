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


def layer_masks(args: ModelArgs, mask, queries: torch.Tensor, n_keys: int, dtype: torch.dtype | None):
    """The mask each block gets, from the full-attention mask of queries at global positions `queries` (1-D) over
    keys 0 .. n_keys - 1 (None: causal, or every key for one query of a cache): that mask for a model without
    sliding-window blocks, else LayerMasks. dtype: a boolean mask becomes additive in it (None: kept boolean)."""
    sliding = None
    if args.sliding_layers and n_keys > args.sliding_window:  # some query has more keys than its window
        keys = torch.arange(n_keys, device=queries.device)[None, :]
        near = (keys <= queries[:, None]) & (keys > queries[:, None] - args.sliding_window)
        sliding = near[None, None] if mask is None else mask & near
    if args.attention_sinks:
        mask, sliding = sink_column(mask), sink_column(sliding)
    mask, sliding = additive_mask(mask, dtype), additive_mask(sliding, dtype)
    if not args.sliding_layers:
        return mask
    return LayerMasks(mask, mask if sliding is None else sliding)


def needs_sdpa_masks(args: ModelArgs) -> bool:
    """Whether the masks must be SDPA's boolean ones (sliding windows and sinks are added to them), not FlexAttention
    block masks."""
    return bool(args.sliding_layers) or args.attention_sinks


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
