"""Where HuggingFace weights meet titanlite's, for every built-in family (all use HF's Llama naming and layout for
attention and dense blocks; an MoE family names its router and experts, models/<family>/): parameter names, one HF
tensor per expert for titanlite's grouped [experts, in, out] weights, and the q/k row permutation between HF's
half-split RoPE layout and titanlite's interleaved pairs (Meta's layout).

In titanlite a head's rows of wq/wk (and their biases) hold the rotated pairs side by side (x0, x1),
(x2, x3), ...; HF keeps the first halves of all pairs, then the second halves. Both compute the same
attention once the rows are permuted; so does a per-head q/k norm's weight (Qwen3), permuted as one
head. Every other tensor is the same up to its name. A tied output projection is not stored by HF
(lm_head is the embedding).
"""

from __future__ import annotations

import functools
import re

import torch

from titanlite.models.args import ModelArgs
from titanlite.models.registry import FAMILIES

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.q_a_proj.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.q_b_proj.weight": "self_attn.q_b_proj.weight",
    "attention.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
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
EMBEDDING, OUTPUT = _TOP_NAMES["tok_embeddings.weight"], _TOP_NAMES["output.weight"]


def _expert_names(args: ModelArgs) -> dict[str, str]:
    """A MoE family's layer names: the router's, and each grouped expert weight's per-expert name (with {e})."""
    experts = FAMILIES[args.family].hf.experts if args.moe else None
    if experts is None:
        return {}
    names = {"feed_forward.router.weight": experts.router}
    names.update({f"feed_forward.experts.{w}": hf for w, hf in experts.weights.items()})
    if experts.routing_bias:
        names["feed_forward.expert_bias"] = experts.routing_bias
    if experts.router_bias:
        names["feed_forward.router.bias"] = experts.router_bias
    return names


def to_hf_name(name: str, args: ModelArgs | None = None) -> str:
    """titanlite parameter name -> HF name (for a grouped expert weight, the per-expert name with {e} left in)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    layer_names = _LAYER_NAMES | (_expert_names(args) if args is not None else {})
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
    raise KeyError(f"no HuggingFace name for parameter {name!r}")


def is_routing_bias(name: str) -> bool:
    """Whether a state-dict entry is an MoE block's routing bias (a buffer; stored in HF folders of the
    architectures that have one: DeepSeek-V3's and GLM-4.5's e_score_correction_bias)."""
    return name.endswith("feed_forward.expert_bias")


def routing_bias_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The routing biases a HF folder of this shape stores, by state-dict name (none when its class has none)."""
    experts = FAMILIES[args.family].hf.experts if args.moe else None
    if experts is None or not experts.routing_bias:
        return {}
    return {f"layers.{i}.feed_forward.expert_bias": (args.n_experts,) for i in args.moe_layers}


def fused_experts(args: ModelArgs) -> dict[str, tuple[str, ...]]:
    """A family whose HF tensors each hold every expert of a layer (gpt-oss): HF name inside a layer -> the titanlite
    expert tensors it interleaves (HFExperts.fused); empty for the others."""
    return FAMILIES[args.family].hf.experts.fused if args.moe else {}


def fused_hf_names(args: ModelArgs) -> dict[str, tuple[str, ...]]:
    """HF name -> the state-dict names it interleaves, for every fused expert tensor of the model (none when the
    family stores one tensor per expert)."""
    fused = fused_experts(args)
    return {
        f"model.layers.{i}.{hf}": tuple(f"layers.{i}.feed_forward.experts.{p}" for p in parts)
        for i in args.moe_layers
        for hf, parts in fused.items()
    }


def is_fused_expert(name: str, args: ModelArgs) -> bool:
    """Whether a state-dict entry is part of a fused HF expert tensor (gpt-oss's experts and their biases)."""
    return bool(fused_experts(args)) and ".feed_forward.experts." in name


MXFP4_GROUP = 32  # values per scale of an MXFP4 tensor (16 bytes of two 4-bit values)


def quantized_variants(expected: dict, found: dict, args: ModelArgs) -> dict:
    """The tensors a folder should hold: `expected`, but where the folder stores a fused expert weight in MXFP4
    (published gpt-oss: <name>_blocks [experts, out, in / 32, 16] uint8 and <name>_scales [experts, out, in / 32]),
    those two in its place."""
    out = dict(expected)
    for hf in fused_hf_names(args):
        shape = expected[hf]
        if len(shape) == 3 and hf + "_blocks" in found:
            e, rows, cols = shape
            del out[hf]
            groups = rows // MXFP4_GROUP
            out[hf + "_blocks"], out[hf + "_scales"] = (e, cols, groups, MXFP4_GROUP // 2), (e, cols, groups)
    return out


def is_grouped_experts(name: str) -> bool:
    """Whether a parameter holds every expert of a layer, [experts, in, out] (HF keeps one [out, in] per expert)."""
    return ".feed_forward.experts.w" in name


def expert_hf_names(name: str, args: ModelArgs) -> list[str]:
    """The HF names of the experts a grouped expert weight holds, expert 0 first."""
    template = to_hf_name(name, args)
    return [template.format(e=e) for e in range(args.n_experts)]


def hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of this shape holds, with its shape (no lm_head when tied; one tensor per
    expert)."""
    out = {}
    shapes = args.parameter_shapes() | routing_bias_shapes(args)
    for hf, parts in fused_hf_names(args).items():  # their last dimensions side by side
        first = shapes[parts[0]]
        out[hf] = (*first[:-1], first[-1] * len(parts))
    for name, shape in shapes.items():
        if name in args.tied_copies() or is_fused_expert(name, args):
            continue
        if is_grouped_experts(name):
            out.update({hf: (shape[2], shape[1]) for hf in expert_hf_names(name, args)})
        else:
            out[to_hf_name(name, args)] = shape
    return out


def stored_in_hf(name: str, args: ModelArgs) -> bool:
    """Whether a HF folder stores this state-dict entry (a tied output projection is not stored, nor a buffer other
    than the routing bias of an architecture that has one)."""
    return name not in args.tied_copies() and name in _parameter_names(args)


@functools.lru_cache(maxsize=8)
def _parameter_names(args: ModelArgs) -> frozenset[str]:
    return frozenset(args.parameter_shapes() | routing_bias_shapes(args))


def rope_heads(name: str, args: ModelArgs) -> int | None:
    """Heads whose rows a q/k tensor holds (its rows are permuted between layouts; a q/k norm weight is one
    head); None for other tensors, and for multi-head latent attention (its published layout rotates adjacent
    pairs, as titanlite: transformers' rope_interleave)."""
    if args.mla:
        return None
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return args.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return args.kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def interleaved_to_half_split(w: torch.Tensor, heads: int, rotary: int | None = None) -> torch.Tensor:
    """Rows of a q/k weight (heads * head_dim, ...) from titanlite's layout to HF's; any number of columns. rotary:
    the rows of each head that RoPE rotates, its first ones (partial rotary; None: all)."""
    return _permute_rotated(w, heads, rotary, to_hf=True)


def half_split_to_interleaved(w: torch.Tensor, heads: int, rotary: int | None = None) -> torch.Tensor:
    """Rows of a q/k weight from HF's layout to titanlite's."""
    return _permute_rotated(w, heads, rotary, to_hf=False)


def _permute_rotated(w: torch.Tensor, heads: int, rotary: int | None, to_hf: bool) -> torch.Tensor:
    rows, rest = w.shape[0], w.shape[1:]
    per_head = rows // heads
    rot = min(rotary or per_head, per_head)
    w = w.reshape(heads, per_head, *rest)
    pairs = (heads, rot // 2, 2) if to_hf else (heads, 2, rot // 2)
    part = w[:, :rot].reshape(*pairs, *rest).transpose(1, 2).reshape(heads, rot, *rest)
    return (part if rot == per_head else torch.cat([part, w[:, rot:]], dim=1)).reshape(rows, *rest)
