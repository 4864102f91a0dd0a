"""Qwen2 and Qwen2.5: biases on the q, k and v projections; the Qwen2ForCausalLM architecture.

Its published checkpoints come in through model.flavor = "hf" (their config.json gives the shape); the
built-in flavors are small ones for trying the family out.
"""

from __future__ import annotations

from titanlite.models.args import ModelArgs
from titanlite.models.family import Family, HFArchitecture
from titanlite.models.sliding_window import refuse_qwen_sliding_window

_SMALL = dict(family="qwen2", qkv_bias=True, norm_eps=1e-6, rope_theta=1_000_000.0, tie_embeddings=True)

QWEN2_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_SMALL, dim=256, n_layers=6, n_heads=8, n_kv_heads=2, intermediate_size=768),
    "tiny": ModelArgs(**_SMALL, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=160),
}

FAMILY = Family(
    name="qwen2",
    flavors=QWEN2_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        qkv_bias=True,
        check=refuse_qwen_sliding_window,
        export_extras={"use_sliding_window": False, "sliding_window": None},
    ),
)
