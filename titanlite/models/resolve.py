"""A [model] section's arguments: a native family's (registry.model_args), or the transformers backend's for
model.name = "transformers" and for a HuggingFace folder whose model_type no family implements."""

from __future__ import annotations

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.family import BACKEND
from titanlite.models.registry import HF_FLAVOR, goes_to_backend, model_args
from titanlite.models.transformers_backend.args import backend_args


def resolved_model_args(model_cfg, tokenizer_vocab_size: int, seq_len: int, hf_folder=None) -> ModelArgs:
    """The arguments of the model a [model] section builds (see registry.model_args; hf_folder: the HuggingFace
    folder of checkpoint.initial_load_path, for the backend also one with only a config.json)."""
    if model_cfg.name == BACKEND or (model_cfg.flavor == HF_FLAVOR and goes_to_backend(model_cfg, hf_folder)):
        return backend_model_args(model_cfg, tokenizer_vocab_size, seq_len, hf_folder)
    return model_args(model_cfg, tokenizer_vocab_size, seq_len, hf_folder)


def backend_model_args(model_cfg, tokenizer_vocab_size: int, seq_len: int, hf_folder) -> ModelArgs:
    """The shape of a transformers backend model, from its folder's config.json."""
    if hf_folder is None:
        raise ConfigError(
            f"model.name = {BACKEND!r} builds the model of a HuggingFace folder on this machine (config.json and "
            "*.safetensors, or a config.json alone: the weights are then drawn from training.seed), which "
            "checkpoint.initial_load_path must name (a titanlite DCP checkpoint is not one; a folder in object "
            "storage is copied here at launch, not in a dry run)"
        )
    for key, value, unset in (("vocab_size", model_cfg.vocab_size, 0), ("rope_scaling", model_cfg.rope_scaling, "")):
        if value != unset:
            raise ConfigError(
                f"model.{key} = {value!r}: the transformers backend takes it from {hf_folder}/config.json; leave "
                f"model.{key} unset (edit the config.json to change it)"
            )
    args = backend_args(hf_folder, tokenizer_vocab_size, seq_len, model_cfg.attention, model_cfg.tie_embeddings)
    if args.vocab_size > args.hf_config.get("vocab_size", args.vocab_size):
        raise ConfigError(
            f"vocab_size = {args.hf_config.get('vocab_size')} in {hf_folder}/config.json is smaller than the "
            f"tokenizer's {tokenizer_vocab_size} tokens (model.tokenizer_path = {model_cfg.tokenizer_path!r}); use "
            "that model's own tokenizer"
        )
    return args
