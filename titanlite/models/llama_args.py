"""Llama 3 shapes (no torch): the arguments of one model, the published flavors and their releases."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1+ RoPE frequency scaling (HF `rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaArgs:
    """Shape of a Llama 3 model."""

    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None  # None = n_heads (no grouped-query attention)
    vocab_size: int = 0  # 0 = take the tokenizer's size
    multiple_of: int = 256  # FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    intermediate_size: int | None = None  # the FFN hidden size itself (HF configs); None = from the two above
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048  # positions the RoPE table covers
    context_length: int = 8192  # the release's published context length
    tie_embeddings: bool = False
    release: str = ""  # the Llama release of a published flavor: 3, 3.1, 3.2 or 3.3
    attention: str = "causal"  # causal, or block_causal (attend within each document only)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def with_overrides(self, **kw) -> LlamaArgs:
        return replace(self, **kw)


_VOCAB = 128256
_SCALE_31 = RopeScaling(factor=8.0)  # Llama 3.1 and 3.3
_SCALE_32 = RopeScaling(factor=32.0)  # Llama 3.2
_1B = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256)
_3B = dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256)
_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024)
_70B = dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096)
_405B = dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096)


def _published(release: str, shape: dict, scaling: RopeScaling | None, tied: bool = False) -> LlamaArgs:
    return LlamaArgs(
        **shape,
        vocab_size=_VOCAB,
        rope_scaling=scaling,
        tie_embeddings=tied,
        max_seq_len=8192,
        context_length=131072 if scaling else 8192,
        release=release,
    )


LLAMA3_FLAVORS: dict[str, LlamaArgs] = {
    "debugmodel": LlamaArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, multiple_of=256),
    "tiny": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32),
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


def args_to_dict(args: LlamaArgs) -> dict:
    """The arguments as plain JSON-able values (saved next to checkpoints as model_args.json)."""
    out = {k: getattr(args, k) for k in args.__dataclass_fields__}
    if args.rope_scaling is not None:
        out["rope_scaling"] = dict(args.rope_scaling.__dict__)
    return out


def args_from_dict(data: dict) -> LlamaArgs:
    """The inverse of args_to_dict (unknown keys are an error)."""
    data = dict(data)
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
    return LlamaArgs(**data)
