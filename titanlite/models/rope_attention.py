"""RoPE (with Llama 3.1, linear and YaRN frequency scaling) and attention: causal, block-causal within each document, or
the new positions of a KV cache over its filled prefix.

Block-causal attention lets a token attend only to earlier tokens of its own document; documents are
found from per-token positions (a position of 0 starts a document), and RoPE then uses those
positions. Kernels: on CUDA, FlexAttention with a block mask built once per batch; elsewhere SDPA with
a boolean mask, which is exact and is what the CPU tests run (`kernel="flex"` runs FlexAttention on
the CPU too, for checking one against the other).
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F

from titanlite.compat import compiled_create_block_mask
from titanlite.models.args import RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Rotation frequency of each feature pair (float64), scaled by the RopeScaling's rope_type as transformers
    scales them (llama3, linear or yarn)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return freqs
    if scaling.rope_type == "linear":
        return freqs / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(freqs, head_dim, theta, scaling)
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / scaling.factor, freqs)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(freqs: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: the feature pairs that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those that turn more than beta_fast times are kept, with a linear ramp between."""

    def pair_turning(rotations: float) -> float:  # the pair index that turns this many times over the context
        context = scaling.original_max_position_embeddings
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as it is), 0: interpolate
    return freqs / scaling.factor * (1 - keep) + freqs * keep


def rope_table(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None, device=None
) -> torch.Tensor:
    """Complex rotations e^{i m w_j} for positions m < max_seq_len, shape (max_seq_len, head_dim // 2); with YaRN
    of magnitude attention_factor (transformers scales cos and sin by it)."""
    freqs = rope_frequencies(head_dim, theta, scaling).to(device)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float64), freqs)
    magnitude = scaling.attention_factor if scaling is not None and scaling.rope_type == "yarn" else 1.0
    return torch.polar(torch.full_like(angles, magnitude), angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs of x (batch, seq, heads, head_dim): rope is the table (positions 0..seq-1 used)
    or per-token rotations (batch, seq, rotated // 2). A table narrower than head_dim / 2 rotates the first
    features of each head and passes the rest (partial rotary: GLM-4.5)."""
    b, s = x.shape[:2]
    rope = rope[:s].view(1, s, 1, -1) if rope.dim() == 2 else rope.view(b, s, 1, -1)
    rotated = 2 * rope.shape[-1]
    part = x if rotated == x.shape[-1] else x[..., :rotated]
    xc = torch.view_as_complex(part.float().reshape(*part.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * rope).flatten(3).type_as(x)
    return out if rotated == x.shape[-1] else torch.cat([out, x[..., rotated:]], dim=-1)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Per-token document number (batch, seq): a new document wherever the position is 0."""
    return torch.cumsum(positions == 0, dim=1)


def _document_mask_mod(docs: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    return mask_mod


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention  # lazy: FlexAttention pulls in the compiler

    return torch.compile(flex_attention, dynamic=False)


def block_causal_kernel(kernel: str, device_type: str) -> str:
    """'flex' or 'sdpa': the kernel block-causal attention runs on this device (kernel: auto, flex or sdpa)."""
    return "flex" if kernel == "flex" or (kernel == "auto" and device_type == "cuda") else "sdpa"


def describe_attention(attention: str, kernel: str, device_type: str) -> str:
    """What attention runs, as the start-up log says it: 'causal (SDPA)' or 'block_causal via ...'."""
    if attention != "block_causal":
        return "causal (SDPA)"
    return "block_causal via " + (
        "FlexAttention" if block_causal_kernel(kernel, device_type) == "flex" else "masked SDPA"
    )


def block_causal_mask(positions: torch.Tensor, kernel: str = "auto"):
    """The block-causal mask of a batch, built once and shared by every layer: a FlexAttention BlockMask
    (CUDA, or kernel='flex') or a boolean SDPA mask (batch, 1, seq, seq)."""
    docs = document_ids(positions)
    b, s = docs.shape
    if block_causal_kernel(kernel, positions.device.type) == "flex":
        if positions.device.type == "cuda":
            create_block_mask = compiled_create_block_mask()
        else:  # eager on the CPU, where FlexAttention is only checked against SDPA
            from torch.nn.attention.flex_attention import create_block_mask  # lazy: see _compiled_flex
        return create_block_mask(_document_mask_mod(docs), b, None, s, s, device=positions.device)
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


def cached_attention_mask(offset: int, n: int, device=None) -> torch.Tensor | None:
    """The mask of n new queries at positions offset.. over the offset + n keys of a KV cache: None when
    none is needed (a prefill from an empty cache is causal, one query sees every key), else a boolean
    SDPA mask (1, 1, n, offset + n) letting query i see keys up to offset + i."""
    if offset == 0 or n == 1:
        return None
    keys = torch.arange(offset + n, device=device)
    queries = torch.arange(offset, offset + n, device=device)
    return (keys[None, :] <= queries[:, None])[None, None]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) q over k, v (fewer KV heads: grouped-query; v may have another
    head_dim). mask None: causal, or over every key when causal is False (one new query of a KV cache); else
    block-causal or cache-offset causal with a mask from block_causal_mask or cached_attention_mask. scale: the
    logits' (None: 1 / sqrt(head_dim))."""
    value_dim, qk_dim = v.shape[-1], q.shape[-1]
    if value_dim != qk_dim:  # flash kernels take one head_dim: zero-padded to the wider (dot products unchanged)
        width, scale = max(value_dim, qk_dim), qk_dim**-0.5 if scale is None else scale
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        return attend(q, k, v, mask, causal, scale)[..., :value_dim]
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, scale=scale)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    if q.device.type == "cuda":
        return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale)
    with warnings.catch_warnings():  # eager FlexAttention off the GPU is for checking, not speed: say nothing
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        return _eager_flex()(q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale)


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention  # lazy: see _compiled_flex

    return flex_attention
