"""Model families by name. Importing this package does not import torch."""

from __future__ import annotations

from titanlite.models.llama_args import LLAMA3_FLAVORS, LlamaArgs

_FAMILIES = {"llama3": LLAMA3_FLAVORS}


def flavors(name: str) -> list[str]:
    """The flavor names of a model family."""
    return list(_FAMILIES.get(name, {}))


def model_args(model_cfg, tokenizer_vocab_size: int, seq_len: int) -> LlamaArgs:
    """The LlamaArgs for a [model] config section, with the vocabulary sized for the tokenizer."""
    from titanlite.config import ConfigError

    args = _FAMILIES[model_cfg.name][model_cfg.flavor]
    vocab = model_cfg.vocab_size or args.vocab_size or tokenizer_vocab_size
    if vocab < tokenizer_vocab_size:
        raise ConfigError(
            f"model.vocab_size = {vocab} (flavor {model_cfg.flavor}) is smaller than the tokenizer's "
            f"{tokenizer_vocab_size} tokens; set model.vocab_size >= {tokenizer_vocab_size} or 0")
    return args.with_overrides(
        vocab_size=vocab,
        tie_embeddings=model_cfg.tie_embeddings or args.tie_embeddings,
        max_seq_len=max(args.max_seq_len, seq_len),
    )
