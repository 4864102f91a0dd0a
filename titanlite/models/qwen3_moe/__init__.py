"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm, head_dim 128) with a Mixture of Experts in
every block (128 experts, top-8, renormalised top-k weights; a folder may make some blocks dense: mlp_only_layers,
decoder_sparse_step); the Qwen3MoeForCausalLM architecture."""

from __future__ import annotations

import json

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.config_fields import POSITIVE_INT, field, is_int
from titanlite.models.family import Family, HFArchitecture, HFExperts
from titanlite.models.sliding_window import refuse_qwen_sliding_window

_QWEN3_MOE = dict(
    family="qwen3_moe",
    explicit_head_dim=128,
    qk_norm=True,
    vocab_size=151936,
    norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_seq_len=8192,
    context_length=40960,
    pretraining_context=32768,  # Qwen's YaRN recipe: original_max_position_embeddings 32768
    n_experts=128,
    top_k=8,
    n_kv_heads=4,
    release="3",
)
_SMALL = dict(family="qwen3_moe", qk_norm=True, norm_eps=1e-6, rope_theta=1_000_000.0)
_DECISIVE = dict(router_init_std=0.5)  # tiny, the parity tests' flavor: no routing ties that float noise could flip

# Shapes from the released config.json files (Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B, April 2025): 30.5B and
# 235B parameters, 3.3B and 22B active (tests/test_moe.py checks the counts).
QWEN3_MOE_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_SMALL, dim=256, n_layers=6, n_heads=8, n_kv_heads=4, explicit_head_dim=64,
                            intermediate_size=768, n_experts=8, top_k=2, moe_hidden_dim=256),
    "tiny": ModelArgs(**_SMALL, **_DECISIVE, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, explicit_head_dim=32,
                      intermediate_size=160, n_experts=8, top_k=2, moe_hidden_dim=64),
    "30B-A3B": ModelArgs(**_QWEN3_MOE, dim=2048, n_layers=48, n_heads=32, intermediate_size=6144, moe_hidden_dim=768),
    "235B-A22B": ModelArgs(**_QWEN3_MOE, dim=4096, n_layers=94, n_heads=64, intermediate_size=12288,
                           moe_hidden_dim=1536),
}  # fmt: skip


def refuse_unsupported(config: dict, file: str) -> None:
    """What Qwen3MoeForCausalLM can say that titanlite does not implement: a sliding window."""
    refuse_qwen_sliding_window(config, file)


def dense_layer_args(config: dict, file: str) -> dict:
    """The dense blocks among the MoE ones: those mlp_only_layers names, and with decoder_sparse_step = n every block
    but each n-th (transformers' rule: block i has experts when i + 1 is a multiple of n and i is not listed)."""
    step = field(config, "decoder_sparse_step", file, 1, lambda v: is_int(v) and v > 0, POSITIVE_INT)
    layers = config.get("num_hidden_layers")
    dense = config.get("mlp_only_layers") or []
    valid = is_int(layers) and isinstance(dense, list) and all(is_int(i) and 0 <= i < layers for i in dense)
    if not valid:
        raise ConfigError(
            f"{file}: mlp_only_layers = {json.dumps(dense)[:60]} is not valid; expected a list of block indices "
            f"from 0 to num_hidden_layers - 1 = {layers - 1 if is_int(layers) else '?'}"
        )
    every = set(dense) | {i for i in range(layers) if (i + 1) % step}
    if len(every) == layers:
        raise ConfigError(
            f"{file}: mlp_only_layers = {json.dumps(dense)[:60]} with decoder_sparse_step = {step} leave no block "
            f"with experts; a model without experts is a Qwen3ForCausalLM (model_type 'qwen3')"
        )
    return {"dense_layers": tuple(sorted(every))}


def dense_layer_keys(args: ModelArgs) -> dict:
    """config.json's keys for these arguments' dense blocks (each one listed; decoder_sparse_step 1)."""
    return {"decoder_sparse_step": 1, "mlp_only_layers": list(args.dense_layers)}


FAMILY = Family(
    name="qwen3_moe",
    flavors=QWEN3_MOE_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        qk_norm=True,  # no default_head_dim: Qwen3MoeConfig has no head_dim field (hidden_size / heads without one)
        check=refuse_unsupported,
        extra_args=dense_layer_args,
        extra_keys=dense_layer_keys,
        pretraining_contexts={40960: 32768},  # Qwen's YaRN recipe: original_max_position_embeddings 32768
        export_extras={
            "use_sliding_window": False,
            "sliding_window": None,
            "output_router_logits": False,
        },
        experts=HFExperts(
            count_keys=("num_experts", "num_local_experts"),
            hidden_key="moe_intermediate_size",
            norm_topk_key="norm_topk_prob",
            router="mlp.gate.weight",
            weights={
                "w1": "mlp.experts.{e}.gate_proj.weight",
                "w3": "mlp.experts.{e}.up_proj.weight",
                "w2": "mlp.experts.{e}.down_proj.weight",
            },
        ),
    ),
)
