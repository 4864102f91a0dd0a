"""The one place where HuggingFace Llama weights meet titanlite's: parameter names, and the q/k row
permutation between HF's half-split RoPE layout and titanlite's interleaved pairs (Meta's layout).

In titanlite a head's rows of wq/wk hold the rotated pairs side by side (x0, x1), (x2, x3), ...; HF
keeps the first halves of all pairs, then the second halves. Both compute the same attention once
the rows are permuted; every other tensor is the same up to its name. A tied output projection is
not stored by HF (lm_head is the embedding).
"""

from __future__ import annotations

import re

import torch

from titanlite.models.llama_args import LlamaArgs

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def to_hf_name(name: str) -> str:
    """titanlite parameter name -> HF LlamaForCausalLM name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise KeyError(f"no HuggingFace name for parameter {name!r}")


def hf_shapes(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of this shape holds, with its shape (no lm_head when tied)."""
    hd, ffn = args.head_dim, args.ffn_hidden_dim
    per_layer = {
        "attention.wq.weight": (args.n_heads * hd, args.dim),
        "attention.wk.weight": (args.kv_heads * hd, args.dim),
        "attention.wv.weight": (args.kv_heads * hd, args.dim),
        "attention.wo.weight": (args.dim, args.n_heads * hd),
        "feed_forward.w1.weight": (ffn, args.dim),
        "feed_forward.w3.weight": (ffn, args.dim),
        "feed_forward.w2.weight": (args.dim, ffn),
        "attention_norm.weight": (args.dim,),
        "ffn_norm.weight": (args.dim,),
    }
    out = {"model.embed_tokens.weight": (args.vocab_size, args.dim), "model.norm.weight": (args.dim,)}
    if not args.tie_embeddings:
        out["lm_head.weight"] = (args.vocab_size, args.dim)
    for i in range(args.n_layers):
        for name, shape in per_layer.items():
            out[to_hf_name(f"layers.{i}.{name}")] = shape
    return out


def rope_heads(name: str, args: LlamaArgs) -> int | None:
    """Heads whose rows a q/k weight holds (its rows are permuted between layouts); None for other tensors."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def interleaved_to_half_split(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k weight (heads * head_dim, ...) from titanlite's layout to HF's; any number of columns."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def half_split_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k weight from HF's layout to titanlite's."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(rows, *rest)
