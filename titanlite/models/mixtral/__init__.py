"""Mixtral (8x7B, 8x22B): Mistral's attention with a Mixture of Experts in every block (8 experts, top-2, the top-2
weights always renormalised); the MixtralForCausalLM architecture.

Its published checkpoints come in through model.flavor = "hf"; the built-in flavors are small ones.
"""

from __future__ import annotations

import json

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.family import Family, HFArchitecture, HFExperts

_SMALL = dict(family="mixtral", norm_eps=1e-5, rope_theta=1_000_000.0, router_aux_loss_coef=0.02)
_DECISIVE = dict(router_init_std=0.5)  # tiny, the parity tests' flavor: no routing ties that float noise could flip

MIXTRAL_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_SMALL, dim=256, n_layers=6, n_heads=8, n_kv_heads=2, intermediate_size=512,
                            n_experts=8, top_k=2, moe_hidden_dim=512),
    "tiny": ModelArgs(**_SMALL, **_DECISIVE, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                      n_experts=4, top_k=2, moe_hidden_dim=96),
}  # fmt: skip


def refuse_unsupported(config: dict, file: str) -> None:
    """What MixtralForCausalLM can say that titanlite does not implement: a sliding window, router jitter."""
    window = config.get("sliding_window")
    if window is not None:
        raise ConfigError(
            f"{file}: sliding_window = {json.dumps(window)[:40]}; titanlite implements full causal attention only, "
            f"so it needs sliding_window = null (Mixtral 8x7B v0.1 and 8x22B have none)"
        )
    jitter = config.get("router_jitter_noise", 0.0)
    if jitter not in (0, 0.0, None):
        raise ConfigError(
            f"{file}: router_jitter_noise = {json.dumps(jitter)[:40]}; titanlite routes without jitter: expected 0"
        )


FAMILY = Family(
    name="mixtral",
    flavors=MIXTRAL_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(
        architecture="MixtralForCausalLM",
        model_type="mixtral",
        check=refuse_unsupported,
        export_extras={"sliding_window": None, "router_jitter_noise": 0.0, "output_router_logits": False},
        experts=HFExperts(
            count_keys=("num_local_experts", "num_experts"),  # transformers' attribute_map alias
            hidden_key="intermediate_size",
            norm_topk_key=None,
            router="block_sparse_moe.gate.weight",
            weights={
                "w1": "block_sparse_moe.experts.{e}.w1.weight",
                "w3": "block_sparse_moe.experts.{e}.w3.weight",
                "w2": "block_sparse_moe.experts.{e}.w2.weight",
            },
        ),
    ),
)
