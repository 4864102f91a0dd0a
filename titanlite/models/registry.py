"""Model families by name: their flavors, the arguments for a [model] config, and the model class.

Importing this module does not import torch (the config loader uses it to check model.flavor); the
torch module of a family is imported by name when `model_class` is first called.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from titanlite.errors import ConfigError
from titanlite.models.hf_config import args_from_config, mismatches, read_config
from titanlite.models.llama_args import LLAMA3_FLAVORS, LlamaArgs

HF_FLAVOR = "hf"  # the shape comes from a HuggingFace folder's config.json


@dataclass(frozen=True)
class Family:
    """A model family: its published shapes and where its nn.Module lives ("module:Class")."""

    flavors: dict[str, LlamaArgs]
    model: str


FAMILIES: dict[str, Family] = {"llama3": Family(flavors=LLAMA3_FLAVORS, model="titanlite.models.llama:Transformer")}


def flavors(name: str) -> list[str]:
    """The flavor names of a model family."""
    family = FAMILIES.get(name)
    return [*family.flavors, HF_FLAVOR] if family else []


def model_class(name: str) -> type:
    """The nn.Module class of a model family (imports torch)."""
    module, _, cls = FAMILIES[name].model.partition(":")
    return getattr(importlib.import_module(module), cls)


def model_args(model_cfg, tokenizer_vocab_size: int, seq_len: int, hf_folder=None) -> LlamaArgs:
    """The arguments for a [model] config section, with the vocabulary sized for the tokenizer.

    hf_folder: a HuggingFace model folder the weights come from; with flavor "hf" its config.json gives
    the shape, with any other flavor every field the weights depend on must agree with it.
    """
    if model_cfg.flavor == HF_FLAVOR:
        if hf_folder is None:
            raise ConfigError(
                "model.flavor = 'hf' takes the model's shape from a HuggingFace folder's config.json: "
                "set checkpoint.initial_load_path to that folder, or choose a built-in flavor"
            )
        args = args_from_config(read_config(hf_folder), str(hf_folder))
    else:
        args = FAMILIES[model_cfg.name].flavors[model_cfg.flavor]
        if hf_folder is not None:
            hf = args_from_config(read_config(hf_folder), str(hf_folder))
            diff = mismatches(
                args.with_overrides(
                    vocab_size=model_cfg.vocab_size or args.vocab_size or tokenizer_vocab_size,
                    tie_embeddings=args.tie_embeddings
                    if model_cfg.tie_embeddings is None
                    else model_cfg.tie_embeddings,
                ),
                hf,
            )
            if diff:
                raise ConfigError(
                    f"model.flavor = {model_cfg.flavor!r} does not match {hf_folder}/config.json: "
                    f"{'; '.join(diff)}; use model.flavor = 'hf' to take the folder's shape"
                )
    vocab = model_cfg.vocab_size or args.vocab_size or tokenizer_vocab_size
    if vocab < tokenizer_vocab_size:
        where = (
            f"model.vocab_size = {vocab}"
            if model_cfg.vocab_size
            else f"vocab_size = {vocab} in {hf_folder}/config.json"
            if model_cfg.flavor == HF_FLAVOR
            else f"model.vocab_size = {vocab} (flavor {model_cfg.flavor})"
        )
        raise ConfigError(
            f"{where} is smaller than the tokenizer's {tokenizer_vocab_size} tokens (model.tokenizer_path = "
            f"{model_cfg.tokenizer_path!r}); use that model's own tokenizer, or set model.vocab_size >= "
            f"{tokenizer_vocab_size}"
        )
    return args.with_overrides(
        attention=model_cfg.attention,
        vocab_size=vocab,
        tie_embeddings=args.tie_embeddings if model_cfg.tie_embeddings is None else model_cfg.tie_embeddings,
        max_seq_len=max(args.max_seq_len, seq_len),
    )
