"""Model families by name: their flavors, the arguments for a [model] config, and the model class.

Importing this module does not import torch (the config loader uses it to check model.flavor); the
torch module of a family is imported by name when `model_class` is first called. A family is a folder
under models/ (see models/family.py) and one entry in FAMILIES.
"""

from __future__ import annotations

import importlib
import logging
import os
import pathlib

from titanlite.errors import ConfigError
from titanlite.models import deepseek_v3, glm4_moe, gpt_oss, llama3, mistral, mixtral, qwen2, qwen3, qwen3_moe
from titanlite.models.args import ModelArgs, RopeScaling
from titanlite.models.family import BACKEND, Family
from titanlite.models.hf_config import (
    CONFIG,
    architecture_of,
    args_from_config,
    holds_lm_head,
    mismatches,
    read_config,
)
from titanlite.models.hf_rope import yarn_mscale

logger = logging.getLogger("titanlite")

HF_FLAVOR = "hf"  # the shape comes from a HuggingFace folder's config.json
BACKEND_MODEL = "titanlite.models.transformers_backend.model:BackendModel"

# One line per family: its folder's FAMILY.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        llama3.FAMILY,
        qwen3.FAMILY,
        qwen2.FAMILY,
        mistral.FAMILY,
        qwen3_moe.FAMILY,
        mixtral.FAMILY,
        deepseek_v3.FAMILY,
        glm4_moe.FAMILY,
        gpt_oss.FAMILY,
    )
}


def flavors(name: str) -> list[str]:
    """The flavor names of a model family (the transformers backend's: hf only)."""
    if name == BACKEND:
        return [HF_FLAVOR]
    family = FAMILIES.get(name)
    return [*family.flavors, HF_FLAVOR] if family else []


def model_class(name: str) -> type:
    """The nn.Module class of a model family or of the transformers backend (imports torch)."""
    module, _, cls = (BACKEND_MODEL if name == BACKEND else FAMILIES[name].model).partition(":")
    return getattr(importlib.import_module(module), cls)


def tp_plan(name: str):
    """The function that applies a family's tensor-parallel plan to its model (imports torch)."""
    module, _, function = FAMILIES[name].tp_plan.partition(":")
    return getattr(importlib.import_module(module), function)


def family_of_config(config: dict, source: str) -> Family:
    """The family whose HF architecture a config.json describes, by its model_type as transformers loads it (and
    its architectures, when it names them); ConfigError naming the supported ones."""
    model_type, archs = architecture_of(config, source)
    file = pathlib.Path(source) / CONFIG
    by_type = [f for f in FAMILIES.values() if model_type in (f.hf.model_type, *f.hf.model_type_aliases)]
    if by_type:
        family = by_type[0]
        if archs is None or family.hf.architecture in archs:
            return family
        raise ConfigError(
            f"{file} says model_type {model_type!r} (titanlite's {family.name} family, {family.hf.architecture}) "
            f"but architectures {archs}; the two must name one model: correct one of them"
        )
    supported = ", ".join(f"{f.hf.architecture} (model_type {f.hf.model_type!r})" for f in FAMILIES.values())
    named = f" {archs}" if archs else ""
    raise ConfigError(
        f"{file} describes model_type {model_type!r}{named}, which titanlite does not implement; supported: {supported}"
    )


def hf_args(folder) -> ModelArgs:
    """The shape of a HuggingFace model folder, from its config.json."""
    config = read_config(folder)
    family = family_of_config(config, str(folder))
    return args_from_config(config, str(folder), family.hf, family.name)


def family_of_folder(folder) -> str:
    """The family name of a HuggingFace model folder."""
    return family_of_config(read_config(folder), str(folder)).name


def _check_tie_override(tie: bool | None, args: ModelArgs, folder) -> None:
    """ConfigError when model.tie_embeddings contradicts a HF folder's weights: tying would throw away the
    folder's own lm_head.weight, or untying would need an lm_head.weight the folder does not hold."""
    if tie is None or tie == args.tie_embeddings:
        return
    if tie:
        raise ConfigError(
            f"model.tie_embeddings = true, but {folder} holds its own lm_head.weight (untied in its {CONFIG}): tying "
            f"would throw that output projection away; leave model.tie_embeddings unset to take the folder's "
            f"setting (or, if its lm_head equals the embedding, set tie_word_embeddings to true in {CONFIG})"
        )
    if not holds_lm_head(folder):
        raise ConfigError(
            f"model.tie_embeddings = false, but {folder} has no lm_head.weight: its output projection is its "
            f"embedding (tie_word_embeddings in its {CONFIG}); leave model.tie_embeddings unset to take the "
            f"folder's setting"
        )


def model_label(model_cfg, args) -> str:
    """The model as log lines name it: 'qwen3 8B', or 'transformers (qwen3_5_text)' for the backend."""
    if args.family == BACKEND:
        return f"{BACKEND} ({args.hf_config.get('model_type', '?')})"
    return f"{model_cfg.name} {model_cfg.flavor}"


def native_family(folder) -> bool:
    """Whether a HuggingFace folder's config.json is of a model_type one of titanlite's families implements."""
    return _is_native(architecture_of(read_config(folder), str(folder))[0])


def _is_native(model_type: str) -> bool:
    return any(model_type in (f.hf.model_type, *f.hf.model_type_aliases) for f in FAMILIES.values())


def goes_to_backend(model_cfg, hf_folder) -> bool:
    """Whether the model is built by the transformers backend: model.name = 'transformers', or a HuggingFace folder
    whose model_type no family implements (logged)."""
    if model_cfg.name == BACKEND:
        return True
    if hf_folder is None:
        return False
    model_type, _ = architecture_of(read_config(hf_folder), str(hf_folder))  # (config.json read once)
    if _is_native(model_type):
        return False
    if os.environ.get("RANK", "0") == "0":
        logger.info(
            f"{hf_folder}/config.json: model_type {model_type!r} is not one of titanlite's families: built as "
            f"transformers' own class (model.name = {BACKEND!r}, docs/model_families.md)"
        )
    return True


def model_args(model_cfg, tokenizer_vocab_size: int, seq_len: int, hf_folder=None) -> ModelArgs:
    """The arguments for a [model] config section, with the vocabulary sized for the tokenizer.

    hf_folder: a HuggingFace model folder the weights come from; with flavor "hf" its config.json gives
    the shape, with any other flavor every field the weights depend on must agree with it. (The transformers
    backend's: models/resolve.py.)
    """
    if model_cfg.name == BACKEND:
        raise ValueError("the transformers backend's arguments come from models.resolve.resolved_model_args")
    if model_cfg.flavor == HF_FLAVOR:
        if hf_folder is None:
            raise ConfigError(
                "model.flavor = 'hf' takes the model's shape from a HuggingFace folder's config.json: "
                "set checkpoint.initial_load_path to that folder, or choose a built-in flavor"
            )
        args = hf_args(hf_folder)
        _check_tie_override(model_cfg.tie_embeddings, args, hf_folder)
        if args.family != model_cfg.name:
            raise ConfigError(
                f"model.name = {model_cfg.name!r}, but {hf_folder}/config.json describes a "
                f"{FAMILIES[args.family].hf.architecture}, the {args.family!r} family: set model.name = "
                f"{args.family!r}"
            )
    else:
        args = FAMILIES[model_cfg.name].flavors[model_cfg.flavor]
        if hf_folder is not None:
            hf = hf_args(hf_folder)
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
    return _rope_override(model_cfg, args).with_overrides(
        attention=model_cfg.attention,
        vocab_size=vocab,
        tie_embeddings=args.tie_embeddings if model_cfg.tie_embeddings is None else model_cfg.tie_embeddings,
        max_seq_len=max(args.max_seq_len, seq_len),
    )


def _rope_override(model_cfg, args: ModelArgs) -> ModelArgs:
    """The arguments with [model] rope_scaling applied over the flavor's or the folder's ('' leaves them)."""
    kind = getattr(model_cfg, "rope_scaling", "")
    _refuse_unused_rope_keys(model_cfg, kind)
    if kind == "":
        return args
    if kind == "none":
        return args.with_overrides(rope_scaling=None)
    if not model_cfg.rope_factor:
        raise ConfigError(
            f"model.rope_scaling = {kind!r} needs model.rope_factor: how many times the pretraining context to reach "
            f"(a number >= 1, e.g. 4.0)"
        )
    factor = float(model_cfg.rope_factor)
    if kind == "linear":
        return args.with_overrides(rope_scaling=RopeScaling(factor=factor, rope_type="linear"))
    original = model_cfg.rope_original_context or args.pretraining_context or args.context_length
    return args.with_overrides(
        rope_scaling=RopeScaling(
            factor=factor,
            original_max_position_embeddings=original,
            rope_type="yarn",
            attention_factor=yarn_mscale(factor),
        )
    )


def _refuse_unused_rope_keys(model_cfg, kind: str) -> None:
    """ConfigError for a rope key that the chosen model.rope_scaling would silently ignore."""
    factor, original = getattr(model_cfg, "rope_factor", 0), getattr(model_cfg, "rope_original_context", 0)
    if factor and kind in ("", "none"):
        raise ConfigError(
            f"model.rope_factor = {factor} does nothing with model.rope_scaling = {kind!r}; set model.rope_scaling "
            f"= 'yarn' or 'linear' to scale RoPE by it, or leave model.rope_factor at 0"
        )
    if original and kind != "yarn":
        raise ConfigError(
            f"model.rope_original_context = {original} is read by model.rope_scaling = 'yarn' only (it is "
            f"{kind!r}); set model.rope_scaling = 'yarn', or leave model.rope_original_context at 0"
        )
