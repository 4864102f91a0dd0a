"""DeepSeek-V3 / R1 / V3.1 (671B-A37B), Kimi K2 (1T-A32B) and Moonlight (16B-A3B): multi-head latent attention
(models/mla.py), dense first blocks, then Mixture-of-Experts blocks with a shared expert beside the routed ones,
sigmoid routing limited to the best expert groups, a correction bias that chooses experts (the folder's
e_score_correction_bias, which [moe] load_balance = "aux_free" moves) and a routed scaling factor; the
DeepseekV3ForCausalLM architecture (model_type deepseek_v3)."""

from __future__ import annotations

import json

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs, RopeScaling
from titanlite.models.config_fields import POSITIVE_INT, field, is_int
from titanlite.models.family import Family, HFArchitecture
from titanlite.models.hf_routing import SIGMOID_ROUTED_EXPERTS, note_mtp_layers, routing_args, routing_keys

MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")
# DeepseekV3Config's defaults (transformers 5) for keys a config.json leaves out
DEFAULTS = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3, n_shared_experts=1)

_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, score_func="sigmoid")
_SMALL = dict(family="deepseek_v3", score_func="sigmoid", norm_eps=1e-6, rope_theta=10000.0)
_DECISIVE = dict(router_init_std=0.5)  # tiny, the parity tests' flavor: no routing ties that float noise could flip


def _yarn(factor: float, beta_fast: float) -> RopeScaling:
    """DeepSeek's YaRN (mscale = mscale_all_dim = 1: rotations unscaled, the softmax scaled by yarn_mscale^2)."""
    return RopeScaling(factor=factor, original_max_position_embeddings=4096, rope_type="yarn", beta_fast=beta_fast,
                       beta_slow=1.0, attention_factor=1.0, mscale_all_dim=1.0)  # fmt: skip


# Shapes from the released config.json files: moonshotai/Moonlight-16B-A3B (Feb 2025), deepseek-ai/DeepSeek-V3 (Dec
# 2024; R1 and V3.1 share it), moonshotai/Kimi-K2-Instruct (Jul 2025). tests/test_deepseek.py checks the counts.
DEEPSEEK_V3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_SMALL, dim=256, n_layers=6, n_heads=8, q_lora_rank=128, kv_lora_rank=64,
                            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=768,
                            n_experts=8, top_k=2, moe_hidden_dim=128, n_shared_experts=1, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, dense_layers=(0,)),
    "tiny": ModelArgs(**_SMALL, **_DECISIVE, dim=64, n_layers=3, n_heads=4, q_lora_rank=32, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=160, n_experts=8,
                      top_k=2, moe_hidden_dim=32, n_shared_experts=1, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, dense_layers=(0,)),
    "16B-A3B": ModelArgs(family="deepseek_v3", **_MLA, dim=2048, n_layers=27, n_heads=16, intermediate_size=11264,
                         n_experts=64, top_k=6, moe_hidden_dim=1408, n_shared_experts=2, routed_scaling_factor=2.446,
                         dense_layers=(0,), vocab_size=163840, norm_eps=1e-5, rope_theta=50000.0, max_seq_len=8192,
                         context_length=8192),
    "671B": ModelArgs(family="deepseek_v3", **_MLA, dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536,
                      intermediate_size=18432, n_experts=256, top_k=8, moe_hidden_dim=2048, n_shared_experts=1,
                      n_group=8, topk_group=4, routed_scaling_factor=2.5, dense_layers=(0, 1, 2), vocab_size=129280,
                      norm_eps=1e-6, rope_theta=10000.0, rope_scaling=_yarn(40.0, 32.0), max_seq_len=8192,
                      context_length=163840, pretraining_context=4096),
    "kimi_k2": ModelArgs(family="deepseek_v3", **_MLA, dim=7168, n_layers=61, n_heads=64, q_lora_rank=1536,
                         intermediate_size=18432, n_experts=384, top_k=8, moe_hidden_dim=2048, n_shared_experts=1,
                         routed_scaling_factor=2.827, dense_layers=(0,), vocab_size=163840, norm_eps=1e-6,
                         rope_theta=50000.0, rope_scaling=_yarn(32.0, 1.0), max_seq_len=8192, context_length=131072,
                         pretraining_context=4096),
}  # fmt: skip


def _positive(config: dict, key: str, file: str, default: int) -> int:
    return field(config, key, file, default, lambda v: is_int(v) and v > 0, POSITIVE_INT)


def mla_args(config: dict, file: str) -> dict:
    """The multi-head latent attention, routing and block-layout fields of a DeepSeek-V3 config.json."""
    interleave = config.get("rope_interleave", True)
    if interleave is not True:
        raise ConfigError(
            f"{file}: rope_interleave = {json.dumps(interleave)}; titanlite rotates adjacent feature pairs (the "
            f"published DeepSeek-V3 layout, transformers' default): expected true or no such key"
        )
    for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        value = config.get(key, expected)
        if value != expected:
            raise ConfigError(
                f"{file}: {key} = {json.dumps(value)[:40]}; DeepseekV3ForCausalLM routes by sigmoid scores with "
                f"the correction bias (noaux_tc) whatever this key says: expected {expected!r} (a DeepSeek-V2 "
                f"folder's softmax routing is not this architecture)"
            )
    if config.get("quantization_config") is not None:
        method = json.dumps(config["quantization_config"].get("quant_method", "?"))
        raise ConfigError(
            f"{file}: quantization_config (quant_method {method}) says the weights are quantized; titanlite trains "
            f"from bf16 or fp32 weights: convert them first (for DeepSeek-V3's fp8 release, DeepSeek's "
            f"fp8_cast_bf16.py) and remove quantization_config"
        )
    q_rank = config.get("q_lora_rank", 1536)
    if q_rank is not None and not (is_int(q_rank) and q_rank > 0):
        raise ConfigError(f"{file}: q_lora_rank = {json.dumps(q_rank)[:40]} is not valid; expected {POSITIVE_INT} "
                          f"or null (one q projection)")  # fmt: skip
    rope = _positive(config, "qk_rope_head_dim", file, 64)
    if rope % 2:
        raise ConfigError(f"{file}: qk_rope_head_dim = {rope} is not valid; expected an even positive integer")
    note_mtp_layers(config, file, MTP_KEYS)
    return dict(
        q_lora_rank=q_rank or 0,
        kv_lora_rank=_positive(config, "kv_lora_rank", file, 512),
        qk_nope_head_dim=_positive(config, "qk_nope_head_dim", file, 128),
        qk_rope_head_dim=rope,
        v_head_dim=_positive(config, "v_head_dim", file, 128),
        **routing_args(config, file, DEFAULTS),
    )


def mla_keys(args: ModelArgs) -> dict:
    """config.json's keys for an export of these arguments (the inverse of mla_args)."""
    return {
        **routing_keys(args),
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "head_dim": args.qk_rope_head_dim,  # DeepseekV3Config's own meaning: the rotated features per head
        "rope_interleave": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
    }


FAMILY = Family(
    name="deepseek_v3",
    flavors=DEEPSEEK_V3_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(
        architecture="DeepseekV3ForCausalLM",
        model_type="deepseek_v3",
        model_type_aliases=("kimi_k2",),  # Kimi K2's folders (custom code of this architecture)
        extra_args=mla_args,
        extra_keys=mla_keys,
        mtp_keys=MTP_KEYS,
        export_extras={"output_router_logits": False},
        experts=SIGMOID_ROUTED_EXPERTS,
    ),
)
