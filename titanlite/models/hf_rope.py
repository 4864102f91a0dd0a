"""RoPE settings between a HuggingFace config.json and ModelArgs (no torch): rope_theta and the scaling
transformers applies (llama3, linear, yarn), read as transformers 5 reads them, and written back in both spellings.

A config.json may hold rope_parameters (transformers 5), rope_scaling (transformers 4, or added by hand as model
cards tell users: Qwen3's YaRN recipe) or both; transformers 5 takes a non-empty rope_scaling over rope_parameters.
"""

from __future__ import annotations

import math

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs, RopeScaling
from titanlite.models.config_fields import (
    POSITIVE_INT,
    POSITIVE_NUMBER,
    REQUIRED,
    field,
    is_int,
    is_number_at_least_0,
    is_positive_number,
)

ROPE_TYPES = ("default", "llama3", "linear", "yarn")


def rope_block(config: dict, file: str) -> tuple[dict, str]:
    """(the RoPE block transformers applies, its key) of a config.json that may hold rope_parameters, rope_scaling
    or both.

    transformers 5 takes a non-empty rope_scaling over rope_parameters, whole, with rope_theta from it or the
    top-level rope_theta (else 10000, whatever rope_parameters says). Where that drops a setting rope_parameters
    holds (its rope_theta, or a scaling of its own), the folder is refused: it would be lost without a word.
    """
    expected = 'an object such as {"rope_type": "llama3", "factor": 8.0, ...}, or null'
    for key in ("rope_parameters", "rope_scaling"):
        field(config, key, file, None, lambda v: isinstance(v, dict), expected)
    params, scaling = config.get("rope_parameters") or {}, config.get("rope_scaling") or {}
    if not scaling:
        return params, "rope_parameters"
    top_theta = config.get("rope_theta", 10000.0)
    ours, applied = _settings(params, top_theta), _settings(scaling, top_theta)
    lost = [] if "rope_theta" not in params else ["rope_theta"]
    if ours["rope_type"] != "default":
        lost = sorted(ours.keys() | applied.keys())
    differ = [f"{k} {ours.get(k)!r} vs {applied.get(k)!r}" for k in lost if ours.get(k) != applied.get(k)]
    if params and differ and applied["rope_type"] in ROPE_TYPES:  # else refused by its type
        raise ConfigError(
            f"{file} holds both rope_parameters and rope_scaling, and transformers would apply rope_scaling alone "
            f"(with rope_theta from it or the top-level rope_theta, else 10000), losing what rope_parameters says "
            f"(rope_parameters vs what would apply: {', '.join(differ)}); put the whole RoPE setting in one of "
            f"them (a rope_scaling block added by hand: move it into rope_parameters, keeping its rope_theta) and "
            f"delete the other"
        )
    return scaling, "rope_scaling"


def _settings(block: dict, top_theta) -> dict:
    """A RoPE block as comparable settings: its type under one name, its rope_theta as transformers resolves it."""
    settings = {k: v for k, v in block.items() if k not in ("type", "rope_type", "rope_theta")}
    settings["rope_type"] = block.get("rope_type", block.get("type", "default"))
    settings["rope_theta"] = block.get("rope_theta", top_theta)
    return {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in settings.items()}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` times longer (transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_from_config(config: dict, file: str, context: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and the RoPE scaling of a config.json whose max_position_embeddings is `context`, as transformers
    5 resolves them (where a scaling block leaves original_max_position_embeddings out, it is `context`)."""
    top_theta = field(config, "rope_theta", file, 10000.0, is_positive_number, POSITIVE_NUMBER)
    scaling, key = rope_block(config, file)
    prefix = f"{key}."
    theta = float(field(scaling, "rope_theta", file, top_theta, is_positive_number, POSITIVE_NUMBER, prefix))
    type_key = "rope_type" if "rope_type" in scaling else "type"
    kind = field(scaling, type_key, file, "default", lambda v: isinstance(v, str), "a string", prefix)
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{file}: {prefix}{type_key} = {kind!r}; titanlite implements {', '.join(map(repr, ROPE_TYPES))}"
        )

    def number(name, default=REQUIRED):
        return field(scaling, name, file, default, is_positive_number, POSITIVE_NUMBER, prefix)

    original = config.get("original_max_position_embeddings")  # a top-level one wins (Phi3), as in transformers
    if not (is_int(original) and original > 0):
        original = field(
            scaling, "original_max_position_embeddings", file, context, lambda v: is_int(v) and v > 0, POSITIVE_INT,
            prefix,
        )  # fmt: skip
    if kind == "linear":
        return theta, RopeScaling(factor=float(number("factor")), rope_type="linear")
    if kind == "yarn":
        factor = float(number("factor", context / original))
        attention = number("attention_factor", None)
        # 0 is transformers' "not set": no softmax scaling, attention_factor from factor alone
        mscale, mscale_all = (
            field(scaling, k, file, None, is_number_at_least_0, "a number >= 0", prefix)
            for k in ("mscale", "mscale_all_dim")
        )
        if attention is None:
            attention = (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                if mscale and mscale_all
                else yarn_mscale(factor)
            )
        truncate = field(scaling, "truncate", file, True, lambda v: isinstance(v, bool), "true or false", prefix)
        return theta, RopeScaling(
            factor=factor,
            original_max_position_embeddings=original,
            rope_type="yarn",
            beta_fast=float(number("beta_fast", 32.0)),
            beta_slow=float(number("beta_slow", 1.0)),
            attention_factor=float(attention),
            truncate=truncate,
            mscale_all_dim=float(mscale_all or 0.0),
        )
    low = float(number("low_freq_factor", 1.0))
    high = float(
        field(scaling, "high_freq_factor", file, 4.0, lambda v: is_positive_number(v) and v > low, f"> {low}", prefix)
    )
    return theta, RopeScaling(
        factor=float(number("factor")),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def rope_to_config(args: ModelArgs) -> dict:
    """config.json's RoPE keys for these arguments, in both spellings: rope_theta + rope_scaling (transformers 4,
    vLLM) and rope_parameters (transformers 5)."""
    rope = {"rope_type": "default"}
    s = args.rope_scaling
    if s is not None and s.rope_type == "linear":
        rope = {"rope_type": "linear", "factor": s.factor}
    elif s is not None and s.rope_type == "yarn":
        rope = {
            "rope_type": "yarn",
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "attention_factor": s.attention_factor,
            "truncate": s.truncate,
        }
        if s.mscale_all_dim:  # DeepSeek's: transformers scales the MLA softmax by it
            rope["mscale_all_dim"] = s.mscale_all_dim
    elif s is not None:
        rope = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return {
        "rope_theta": args.rope_theta,
        "rope_scaling": rope if s is not None else None,
        "rope_parameters": {**rope, "rope_theta": args.rope_theta},
    }
