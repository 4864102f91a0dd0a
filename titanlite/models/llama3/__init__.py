"""Llama 3 (3, 3.1, 3.2, 3.3): the published shapes and the LlamaForCausalLM architecture."""

from __future__ import annotations

from titanlite.models.args import ModelArgs, RopeScaling
from titanlite.models.family import Family, HFArchitecture

_VOCAB = 128256
_SCALE_31 = RopeScaling(factor=8.0)  # Llama 3.1 and 3.3
_SCALE_32 = RopeScaling(factor=32.0)  # Llama 3.2
_1B = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256)
_3B = dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256)
_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024)
_70B = dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096)
_405B = dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096)


def _published(release: str, shape: dict, scaling: RopeScaling | None, tied: bool = False) -> ModelArgs:
    return ModelArgs(
        **shape,
        vocab_size=_VOCAB,
        rope_scaling=scaling,
        tie_embeddings=tied,
        max_seq_len=8192,
        context_length=131072 if scaling else 8192,
        release=release,
    )


LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, multiple_of=256),
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32),
    # Llama 3 (April 2024): no RoPE scaling, 8K context
    "8B": _published("3", _8B, None),
    "70B": _published("3", _70B, None),
    # Llama 3.1 (July 2024), 3.2 (September 2024, 1B and 3B with tied embeddings), 3.3 (December 2024): 128K
    "3.1-8B": _published("3.1", _8B, _SCALE_31),
    "3.1-70B": _published("3.1", _70B, _SCALE_31),
    "3.1-405B": _published("3.1", _405B, _SCALE_31),
    "3.2-1B": _published("3.2", _1B, _SCALE_32, tied=True),
    "3.2-3B": _published("3.2", _3B, _SCALE_32, tied=True),
    "3.3-70B": _published("3.3", _70B, _SCALE_31),
}
# The short names of the sizes that were only published in one 3.x release.
LLAMA3_FLAVORS.update(
    {"1B": LLAMA3_FLAVORS["3.2-1B"], "3B": LLAMA3_FLAVORS["3.2-3B"], "405B": LLAMA3_FLAVORS["3.1-405B"]}
)

FAMILY = Family(
    name="llama3",
    flavors=LLAMA3_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(architecture="LlamaForCausalLM", model_type="llama"),
)
