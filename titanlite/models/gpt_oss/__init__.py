"""gpt-oss (20B-A3.6B and 120B-A5.1B): grouped-query attention with biases on q/k/v/o and a learned sink per head
(models/sinks.py), sliding-window (128) and full-attention blocks alternating (models/layer_masks.py), YaRN, and
Mixture-of-Experts blocks whose router and experts have biases and whose experts use a clamped SwiGLU; the
GptOssForCausalLM architecture (model_type gpt_oss). Published folders store the experts in MXFP4, dequantized on
import (checkpoint/hf_fused_experts.py)."""

from __future__ import annotations

import json

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs, RopeScaling
from titanlite.models.config_fields import POSITIVE_INT, POSITIVE_NUMBER, field, is_int, is_positive_number
from titanlite.models.family import Family, HFArchitecture, HFExperts
from titanlite.models.hf_rope import yarn_mscale

LAYER_TYPES = ("sliding_attention", "full_attention")
GPT_OSS_EXPERTS = HFExperts(
    count_keys=("num_local_experts",),
    hidden_key="intermediate_size",
    norm_topk_key=None,  # softmax over the top-k logits: the top-k probabilities renormalised
    router="mlp.router.weight",
    router_bias="mlp.router.bias",
    weights={},
    fused={
        "mlp.experts.gate_up_proj": ("w1", "w3"),
        "mlp.experts.gate_up_proj_bias": ("b1", "b3"),
        "mlp.experts.down_proj": ("w2",),
        "mlp.experts.down_proj_bias": ("b2",),
    },
)


def _sliding(n_layers: int) -> tuple[int, ...]:
    """GptOssConfig's default layer_types: sliding-window first, then alternating."""
    return tuple(range(0, n_layers, 2))


_YARN = RopeScaling(factor=32.0, original_max_position_embeddings=4096, rope_type="yarn", beta_fast=32.0,
                    beta_slow=1.0, attention_factor=yarn_mscale(32.0), truncate=False)  # fmt: skip
_OSS = dict(family="gpt_oss", attention_sinks=True, qkv_bias=True, out_bias=True, expert_biases=True,
            swiglu_limit=7.0, norm_eps=1e-5, rope_theta=150000.0, rope_scaling=_YARN)  # fmt: skip
_BIG = dict(_OSS, dim=2880, n_heads=64, n_kv_heads=8, explicit_head_dim=64, intermediate_size=2880, top_k=4,
            moe_hidden_dim=2880, vocab_size=201088, sliding_window=128, router_aux_loss_coef=0.9, max_seq_len=8192,
            context_length=131072, pretraining_context=4096)  # fmt: skip

# Shapes from the released config.json files (openai/gpt-oss-20b and openai/gpt-oss-120b, August 2025); tests check
# the counts (20.9B and 3.6B active, 116.8B and 5.1B active).
GPT_OSS_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_OSS, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, explicit_head_dim=32,
                            intermediate_size=128, n_experts=8, top_k=2, moe_hidden_dim=128, sliding_window=64,
                            sliding_layers=_sliding(4)),
    "tiny": ModelArgs(**_OSS, router_init_std=0.5, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, explicit_head_dim=16,
                      intermediate_size=32, n_experts=4, top_k=2, moe_hidden_dim=32, sliding_window=4,
                      sliding_layers=_sliding(2)),
    "20B": ModelArgs(**_BIG, n_layers=24, n_experts=32, sliding_layers=_sliding(24)),
    "120B": ModelArgs(**_BIG, n_layers=36, n_experts=128, sliding_layers=_sliding(36)),
}  # fmt: skip


def gpt_oss_args(config: dict, file: str) -> dict:
    """The attention (biases, sinks, sliding windows) and expert (biases, clamped SwiGLU) fields of a gpt-oss
    config.json; ConfigError naming the key, its value and what is valid."""
    layers = config.get("num_hidden_layers")
    types = field(config, "layer_types", file, None, lambda v: isinstance(v, list), f"a list of {LAYER_TYPES}")
    if types is None:
        types = [LAYER_TYPES[i % 2] for i in range(layers)] if is_int(layers) else []
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise ConfigError(
                f"{file}: layer_types[{i}] = {json.dumps(kind)[:40]} is not valid; titanlite implements "
                f"{' and '.join(map(repr, LAYER_TYPES))} blocks"
            )
    if is_int(layers) and len(types) != layers:
        raise ConfigError(
            f"{file}: layer_types has {len(types)} entries; expected one per block (num_hidden_layers = {layers})"
        )
    window = field(config, "sliding_window", file, 0, lambda v: is_int(v) and v > 0, POSITIVE_INT + " or null")
    bias = field(config, "attention_bias", file, True, lambda v: isinstance(v, bool), "true or false")
    quant = config.get("quantization_config")
    if quant is not None and not (isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(
            f"{file}: quantization_config.quant_method = {json.dumps(method)[:40]}; titanlite reads gpt-oss's "
            f'experts in MXFP4 (dequantized on import) or unquantized: expected "mxfp4" or no quantization_config'
        )
    return dict(
        attention_sinks=True,
        qkv_bias=bias,
        out_bias=bias,
        expert_biases=True,
        sliding_window=window,
        sliding_layers=tuple(i for i, k in enumerate(types) if k == "sliding_attention") if window else (),
        swiglu_limit=float(field(config, "swiglu_limit", file, 7.0, is_positive_number, POSITIVE_NUMBER)),
        swiglu_alpha=float(field(config, "swiglu_alpha", file, 1.702, is_positive_number, POSITIVE_NUMBER)),
    )


def gpt_oss_keys(args: ModelArgs) -> dict:
    """config.json's keys for an export of these arguments (the inverse of gpt_oss_args)."""
    return {
        "layer_types": [LAYER_TYPES[0] if args.is_sliding_layer(i) else LAYER_TYPES[1] for i in range(args.n_layers)],
        "sliding_window": args.sliding_window or None,
        "attention_bias": args.out_bias,
        "swiglu_limit": args.swiglu_limit,
        "swiglu_alpha": args.swiglu_alpha,
    }


FAMILY = Family(
    name="gpt_oss",
    flavors=GPT_OSS_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(
        architecture="GptOssForCausalLM",
        model_type="gpt_oss",
        attention_bias_is_qkv=True,
        extra_args=gpt_oss_args,
        extra_keys=gpt_oss_keys,
        export_extras={"output_router_logits": False},
        experts=GPT_OSS_EXPERTS,
    ),
)
