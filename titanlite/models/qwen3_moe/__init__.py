"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm, head_dim 128) with a Mixture of Experts in
every block (128 experts, top-8, renormalised top-k weights); the Qwen3MoeForCausalLM architecture."""

from __future__ import annotations

import json

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
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
    """What Qwen3MoeForCausalLM can say that titanlite does not implement: dense blocks among the MoE ones
    (decoder_sparse_step other than 1, mlp_only_layers), a sliding window."""
    step = config.get("decoder_sparse_step", 1)
    if step != 1:
        raise ConfigError(
            f"{file}: decoder_sparse_step = {json.dumps(step)[:40]}; titanlite puts the experts in every block: "
            f"expected 1"
        )
    dense = config.get("mlp_only_layers") or []
    if dense:
        raise ConfigError(
            f"{file}: mlp_only_layers = {json.dumps(dense)[:60]}; titanlite puts the experts in every block (no dense "
            f"layers among them): expected []"
        )
    refuse_qwen_sliding_window(config, file)


FAMILY = Family(
    name="qwen3_moe",
    flavors=QWEN3_MOE_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        qk_norm=True,  # no default_head_dim: Qwen3MoeConfig has no head_dim field (hidden_size / heads without one)
        check=refuse_unsupported,
        pretraining_contexts={40960: 32768},  # Qwen's YaRN recipe: original_max_position_embeddings 32768
        export_extras={
            "use_sliding_window": False,
            "sliding_window": None,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
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
