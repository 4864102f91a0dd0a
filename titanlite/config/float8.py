"""The [float8] section: float8 matmuls for the dense linear layers through torchao (docs/performance.md). No torch
here."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.fields import one_of, setting

FLOAT8_RECIPES = ("tensorwise", "rowwise")


@dataclass
class Float8:
    enable: bool = setting(
        False,
        "train the blocks' dense linear layers with float8 matmuls (torchao, an optional extra; CUDA GPUs of compute "
        "capability 8.9 or newer); the embedding, the output projection and MoE routers and experts stay as they are",
    )
    recipe: str = setting(
        "tensorwise",
        "float8 scaling: tensorwise (one scale per tensor, the fastest) or rowwise (one per row: closer to bf16)",
        one_of(*FLOAT8_RECIPES),
        " or ".join(FLOAT8_RECIPES),
    )
    fsdp_float8_all_gather: bool = setting(
        True,
        "tensorwise only: FSDP all-gathers the weights in float8 (half bf16's bytes), their scales computed "
        "whenever the weights change (optimizer step, load, heal)",
    )
