"""Model families by name: their flavors, the arguments for a [model] config, and the model class.

Importing this module does not import torch (the config loader uses it to check model.flavor); the
torch module of a family is imported by name when `model_class` is first called.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from titanlite.errors import ConfigError
from titanlite.models.llama_args import LLAMA3_FLAVORS, LlamaArgs


@dataclass(frozen=True)
class Family:
    """A model family: its published shapes and where its nn.Module lives ("module:Class")."""

    flavors: dict[str, LlamaArgs]
    model: str


FAMILIES: dict[str, Family] = {"llama3": Family(flavors=LLAMA3_FLAVORS, model="titanlite.models.llama:Transformer")}


def flavors(name: str) -> list[str]:
    """The flavor names of a model family."""
    family = FAMILIES.get(name)
    return list(family.flavors) if family else []


def model_class(name: str) -> type:
    """The nn.Module class of a model family (imports torch)."""
    module, _, cls = FAMILIES[name].model.partition(":")
    return getattr(importlib.import_module(module), cls)


def model_args(model_cfg, tokenizer_vocab_size: int, seq_len: int) -> LlamaArgs:
    """The arguments for a [model] config section, with the vocabulary sized for the tokenizer."""
    args = FAMILIES[model_cfg.name].flavors[model_cfg.flavor]
    vocab = model_cfg.vocab_size or args.vocab_size or tokenizer_vocab_size
    if vocab < tokenizer_vocab_size:
        raise ConfigError(
            f"model.vocab_size = {vocab} (flavor {model_cfg.flavor}) is smaller than the tokenizer's "
            f"{tokenizer_vocab_size} tokens; set model.vocab_size >= {tokenizer_vocab_size} or 0"
        )
    return args.with_overrides(
        vocab_size=vocab,
        tie_embeddings=model_cfg.tie_embeddings or args.tie_embeddings,
        max_seq_len=max(args.max_seq_len, seq_len),
    )
