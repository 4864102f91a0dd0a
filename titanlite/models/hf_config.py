"""HuggingFace Llama config.json <-> LlamaArgs (no torch): read a model folder's shape, check it against a
flavor, and write config.json / generation_config.json for an export."""

from __future__ import annotations

import json
import pathlib

from titanlite.errors import ConfigError
from titanlite.models.llama_args import LlamaArgs, RopeScaling

CONFIG = "config.json"
# LlamaArgs field -> config.json key, for the fields a checkpoint's weights depend on.
SHAPE_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "ffn_hidden_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "tie_embeddings": "tie_word_embeddings",
}


def is_hf_folder(path: str | pathlib.Path) -> bool:
    """A folder with config.json and safetensors weights (a HuggingFace model folder)."""
    p = pathlib.Path(path).expanduser()
    return p.is_dir() and (p / CONFIG).is_file() and any(p.glob("*.safetensors"))


def hf_folder(initial_load_path: str) -> pathlib.Path | None:
    """checkpoint.initial_load_path when it names a HuggingFace model folder (one with *.safetensors)."""
    path = pathlib.Path(initial_load_path).expanduser() if initial_load_path else None
    return path if path is not None and path.is_dir() and any(path.glob("*.safetensors")) else None


def read_config(folder: str | pathlib.Path) -> dict:
    """config.json of a model folder; ConfigError naming the file when it is missing or unreadable."""
    path = pathlib.Path(folder).expanduser() / CONFIG
    if not path.is_file():
        raise ConfigError(
            f"{path.parent} has no {CONFIG}: not a HuggingFace model folder (it needs config.json "
            f"and model.safetensors or *.safetensors with model.safetensors.index.json)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def args_from_config(config: dict, source: str) -> LlamaArgs:
    """The LlamaArgs of a HuggingFace LlamaForCausalLM config; ConfigError naming a missing or foreign field."""

    def get(key, default=None):
        if key not in config and default is None:
            raise ConfigError(f"{source}: config.json has no {key!r}, which a Llama config needs")
        return config.get(key, default)

    archs = config.get("architectures") or ["LlamaForCausalLM"]
    if config.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in archs:
        raise ConfigError(
            f"{source}: config.json describes {config.get('model_type')!r} {archs}, not a Llama "
            f"(model_type 'llama', LlamaForCausalLM)"
        )
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ConfigError(f"{source}: config.json has {key} = true; titanlite's Llama has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: config.json has hidden_act = {config['hidden_act']!r}; Llama uses 'silu'")
    dim, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    if config.get("head_dim") not in (None, dim // heads):
        raise ConfigError(
            f"{source}: config.json has head_dim = {config['head_dim']}, not hidden_size / "
            f"num_attention_heads = {dim // heads}"
        )
    # transformers 4 writes rope_theta and rope_scaling; transformers 5 writes both into rope_parameters.
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(scaling.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    rope_scaling = None
    if kind != "default":
        if kind != "llama3":
            raise ConfigError(
                f"{source}: config.json has rope_scaling of type {kind!r}; titanlite implements 'llama3' (Llama 3.1+)"
            )
        rope_scaling = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    context = int(config.get("max_position_embeddings", 8192))
    return LlamaArgs(
        dim=dim,
        n_layers=int(get("num_hidden_layers")),
        n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(get("vocab_size")),
        intermediate_size=int(get("intermediate_size")),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_seq_len=min(context, 8192),
        context_length=context,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def mismatches(args: LlamaArgs, hf: LlamaArgs) -> list[str]:
    """'field: flavor value vs config.json key value' for every field the weights or the math depend on."""
    out = [
        f"{field} {getattr(args, field)} vs {key} {getattr(hf, field)}"
        for field, key in SHAPE_KEYS.items()
        if getattr(args, field) != getattr(hf, field)
    ]
    if args.rope_theta != hf.rope_theta:
        out.append(f"rope_theta {args.rope_theta} vs rope_theta {hf.rope_theta}")
    if args.rope_scaling != hf.rope_scaling:
        out.append(f"rope_scaling {args.rope_scaling} vs rope_scaling {hf.rope_scaling}")
    if args.norm_eps != hf.norm_eps:
        out.append(f"norm_eps {args.norm_eps} vs rms_norm_eps {hf.norm_eps}")
    return out


def config_from_args(args: LlamaArgs, dtype: str, bos_id: int | None, eos_ids: list[int]) -> dict:
    """A LlamaForCausalLM config.json for these arguments."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": max(args.context_length, args.max_seq_len),
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
    }
    # Both spellings: rope_theta + rope_scaling (transformers 4, vLLM) and rope_parameters (transformers 5).
    rope = {"rope_type": "default"}
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    config["rope_scaling"] = rope if args.rope_scaling is not None else None
    config["rope_parameters"] = {**rope, "rope_theta": args.rope_theta}
    return config


def generation_config(bos_id: int | None, eos_ids: list[int]) -> dict:
    """generation_config.json: the ids a generator starts with and stops at."""
    return {"bos_token_id": bos_id, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids, "do_sample": False}
