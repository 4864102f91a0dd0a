"""The KV cache of generation: every attention layer's keys and values of the positions seen so far.

A model's forward takes it (`model(tokens, cache=cache)`): each attention layer writes the keys and
values of the new tokens at the cache's offset and attends over everything filled so far, RoPE rotating
by the absolute positions offset .. offset + n - 1; the model then advances the offset by n. The first
call is the prefill (the prompt, causal from an empty cache), each later one usually decodes one token.

The buffers are preallocated for `max_len` positions: (batch, kv_heads, max_len, head_dim) per layer,
each allocated at the layer's first write in the dtype and on the device of its keys, which is the
dtype the model computes in (FSDP's param_dtype when sharded) unless `dtype` fixes it up front. The
head count is each attention module's own (`n_kv_heads`), so a plan that leaves a rank fewer heads
gets a cache of that many.

Inference builds never compile blocks, so generation runs this path eagerly; blocks compiled with
torch.compile take it too (a graph for the prefill, one for the decode steps; other prompt lengths or
cache sizes may compile again).
"""

from __future__ import annotations

import torch
from torch import nn


class LayerKV:
    """One attention layer's keys and values in a KVCache."""

    def __init__(self, owner: KVCache, kv_heads: int, head_dim: int, value_dim: int | None = None):
        self.owner, self.kv_heads, self.head_dim = owner, kv_heads, head_dim
        self.value_dim = value_dim or head_dim  # v's features per head (multi-head latent attention: its own)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def offset(self) -> int:
        """Positions already filled (the absolute position of the first new token)."""
        return self.owner.offset

    @property
    def causal(self) -> bool:
        """Whether this step attends causally from an empty cache (else over the filled prefix)."""
        return self.owner.causal

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions' k, v (batch, kv_heads, n, head_dim) at the offset; return the keys and
        values of every position filled so far, (batch, kv_heads, offset + n, head_dim)."""
        b, h, n, d = k.shape
        if (b, h, d) != (self.owner.batch, self.kv_heads, self.head_dim):
            raise ValueError(
                f"KV cache holds (batch {self.owner.batch}, {self.kv_heads} kv heads, head_dim {self.head_dim}) "
                f"but the layer wrote (batch {b}, {h} kv heads, head_dim {d})"
            )
        if self.k is None:
            self.k, self.v = (self.owner.allocate(t) for t in (k, v))
        end = self.offset + n
        self.k[:, :, self.offset : end] = k
        self.v[:, :, self.offset : end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every attention layer for `batch` sequences of up to `max_len` positions."""

    def __init__(self, layers: list[tuple[int, ...]], max_len: int, batch: int = 1, dtype=None, device=None):
        """layers: (kv_heads, head_dim) or (kv_heads, head_dim, value_dim) of each attention layer in order."""
        if max_len < 1 or batch < 1:
            raise ValueError(f"a KV cache needs max_len >= 1 and batch >= 1, not max_len {max_len}, batch {batch}")
        self.max_len, self.batch, self.dtype, self.device = max_len, batch, dtype, device
        self.offset = 0
        self.causal = True  # a plain bool set by begin(), not offset == 0 computed where compiled code sees it
        self.layers = [LayerKV(self, *shape) for shape in layers]
        if dtype is not None:
            for layer in self.layers:
                layer.k, layer.v = (
                    torch.empty((batch, layer.kv_heads, max_len, d), dtype=dtype, device=device)
                    for d in (layer.head_dim, layer.value_dim)
                )

    @classmethod
    def for_model(cls, model: nn.Module, max_len: int, batch: int = 1, dtype=None) -> KVCache:
        """An empty cache for `model` (a Transformer, sharded or not) of `max_len` <= args.max_seq_len positions,
        on the model's device, with each attention module's own kv head count and head_dim."""
        if max_len > model.args.max_seq_len:
            raise ValueError(
                f"a KV cache of {max_len} positions is longer than the model's max_seq_len = {model.args.max_seq_len}"
            )
        layers = [
            (a.n_kv_heads, a.head_dim, getattr(a, "value_dim", a.head_dim)) for a in (b.attention for b in model.layers)
        ]
        return cls(layers, max_len, batch, dtype, model.rope.device)

    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        """An empty (batch, kv_heads, max_len, head_dim) buffer in the dtype and on the device of `like`."""
        b, h, _, d = like.shape
        return torch.empty((b, h, self.max_len, d), dtype=like.dtype, device=like.device)

    def begin(self, n: int) -> int:
        """Start a forward of n new positions (ValueError unless they fit); returns the first one's position."""
        if self.offset + n > self.max_len:
            raise ValueError(f"KV cache full: {self.offset} of {self.max_len} positions filled, {n} more do not fit")
        self.causal = self.offset == 0
        return self.offset

    def advance(self, n: int) -> None:
        """Count n more positions as filled (the model calls this after every layer has written them)."""
        self.offset += n

    @property
    def nbytes(self) -> int:
        """Bytes held by the allocated buffers."""
        return sum(t.nbytes for layer in self.layers for t in (layer.k, layer.v) if t is not None)
