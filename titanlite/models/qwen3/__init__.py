"""Qwen3 dense (0.6B-32B): per-head q/k RMSNorm before RoPE, a head_dim of its own (128), tied embeddings up
to 4B, RoPE theta 1e6; the Qwen3ForCausalLM architecture."""

from __future__ import annotations

from titanlite.models.args import ModelArgs
from titanlite.models.family import Family, HFArchitecture
from titanlite.models.sliding_window import refuse_qwen_sliding_window

_QWEN3 = dict(
    family="qwen3",
    explicit_head_dim=128,
    qk_norm=True,
    vocab_size=151936,
    norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_seq_len=8192,
    context_length=40960,
    pretraining_context=32768,  # Qwen's YaRN recipe: original_max_position_embeddings 32768
    release="3",
)


def _published(dim: int, n_layers: int, n_heads: int, ffn: int, tied: bool) -> ModelArgs:
    return ModelArgs(
        **_QWEN3, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, intermediate_size=ffn, tie_embeddings=tied
    )


# Shapes from the released config.json files (Qwen/Qwen3-<size>, April 2025).
QWEN3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        family="qwen3",
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        explicit_head_dim=64,
        qk_norm=True,
        intermediate_size=768,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_embeddings=True,
    ),  # fmt: skip
    "tiny": ModelArgs(
        family="qwen3",
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        explicit_head_dim=32,
        qk_norm=True,
        intermediate_size=160,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_embeddings=True,
    ),  # fmt: skip
    "0.6B": _published(1024, 28, 16, 3072, tied=True),
    "1.7B": _published(2048, 28, 16, 6144, tied=True),
    "4B": _published(2560, 36, 32, 9728, tied=True),
    "8B": _published(4096, 36, 32, 12288, tied=False),
    "14B": _published(5120, 40, 40, 17408, tied=False),
    "32B": _published(5120, 64, 64, 25600, tied=False),
}

FAMILY = Family(
    name="qwen3",
    flavors=QWEN3_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        qk_norm=True,
        default_head_dim=128,
        check=refuse_qwen_sliding_window,
        export_extras={"use_sliding_window": False, "sliding_window": None},
        pretraining_contexts={40960: 32768},  # Qwen's YaRN recipe: original_max_position_embeddings 32768
    ),
)
