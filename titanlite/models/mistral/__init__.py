"""Mistral (7B v0.3 and later dense models without a sliding window): Llama's block with its own RoPE theta
and, for some releases, a head_dim of its own; the MistralForCausalLM architecture.

Its published checkpoints come in through model.flavor = "hf"; the built-in flavors are small ones.
"""

from __future__ import annotations

from titanlite.models.args import ModelArgs
from titanlite.models.family import Family, HFArchitecture
from titanlite.models.sliding_window import refuse_mistral_sliding_window

_SMALL = dict(family="mistral", norm_eps=1e-5, rope_theta=1_000_000.0)

MISTRAL_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_SMALL, dim=256, n_layers=6, n_heads=8, n_kv_heads=2, intermediate_size=896),
    "tiny": ModelArgs(**_SMALL, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=224),
}

FAMILY = Family(
    name="mistral",
    flavors=MISTRAL_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(
        architecture="MistralForCausalLM",
        model_type="mistral",
        check=refuse_mistral_sliding_window,
        export_extras={"sliding_window": None},
    ),
)
