"""Refusals for config.json files that ask for sliding-window attention, which titanlite does not implement
(every layer attends to the whole causal prefix)."""

from __future__ import annotations

import json

from titanlite.errors import ConfigError


def refuse_mistral_sliding_window(config: dict, file: str) -> None:
    """MistralForCausalLM: sliding_window must be null (MistralConfig's default, when the key is absent, is 4096)."""
    window = config.get("sliding_window", 4096)
    if window is not None:
        shown = json.dumps(window)[:40] + (
            " (absent: MistralConfig's default)" if "sliding_window" not in config else ""
        )
        raise ConfigError(
            f"{file}: sliding_window = {shown}; titanlite implements full causal attention only, so it needs "
            f"sliding_window = null (Mistral 7B v0.3 and later); a model trained with a window would compute "
            f"other attention here"
        )


def refuse_qwen_sliding_window(config: dict, file: str) -> None:
    """Qwen2 / Qwen3: use_sliding_window must be false and every entry of layer_types 'full_attention'."""
    if config.get("use_sliding_window") not in (None, False):
        raise ConfigError(
            f"{file}: use_sliding_window = {json.dumps(config['use_sliding_window'])[:40]}; titanlite implements "
            f"full causal attention only: expected false"
        )
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ConfigError(f"{file}: layer_types = {json.dumps(layer_types)[:60]}; expected a list of strings")
        other = sorted({str(t) for t in layer_types} - {"full_attention"})
        if other:
            raise ConfigError(f"{file}: layer_types holds {other}; titanlite implements 'full_attention' layers only")
