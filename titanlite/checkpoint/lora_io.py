"""LoRA adapters in and out: peft adapter folders (adapter_config.json + adapter_model.safetensors) read into a
run's adapters and written from a LoRA checkpoint, the merged HF export, and the checks that keep a LoRA
checkpoint on its own base (checkpoint/base_identity.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titanlite.checkpoint.base_identity import check_same_base
from titanlite.checkpoint.base_identity import read as read_base
from titanlite.checkpoint.catalog import read_metadata
from titanlite.checkpoint.consolidated import read_in_this_process
from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.lora import adapter_names, from_peft, is_adapter, peft_config, resolve_targets, to_peft

logger = logging.getLogger("titanlite")

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def check_lora_resume(path: Path, lora_enabled: bool, identity: dict | None) -> None:
    """ConfigError when a checkpoint and the run disagree about LoRA, or when its adapters were trained on another
    base than the run's (base_identity.check_same_base)."""
    saved = read_base(path)
    if lora_enabled and saved is None:
        raise ConfigError(
            f"{path} holds a full-weight checkpoint, not LoRA adapters; lora.enable = true resumes only LoRA "
            "checkpoints: give the LoRA run its own job.dump_folder (or checkpoint.folder), or set lora.enable = false"
        )
    if not lora_enabled and saved is not None:
        raise ConfigError(
            f"{path} holds only LoRA adapters (trained on the base {saved.get('path')}); resume it with "
            "lora.enable = true and the [lora] settings it was trained with, or export it merged with "
            "python -m titanlite.checkpoint export --format hf"
        )
    if lora_enabled:
        check_same_base(saved, identity, str(path))


def _read_peft_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / PEFT_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"lora.initial_adapter_path = {str(folder)!r}: no readable {PEFT_CONFIG} ({type(e).__name__}: {e}); "
            f"expected a peft adapter folder ({PEFT_CONFIG} + {PEFT_WEIGHTS})"
        ) from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ConfigError(
            f"lora.initial_adapter_path = {str(folder)!r}: {PEFT_CONFIG} has peft_type "
            f"{config.get('peft_type') if isinstance(config, dict) else None!r}; only LORA adapters can be read"
        )
    return config


def check_peft_folder(folder: Path, lora_cfg, args: ModelArgs) -> None:
    """ConfigError naming the setting where a peft adapter folder does not match the run's [lora]."""
    config = _read_peft_config(folder)
    roles = resolve_targets(list(lora_cfg.targets), args)
    theirs = config.get("target_modules")
    theirs = sorted(theirs) if isinstance(theirs, list) else theirs
    for key, ours, saved in (
        ("rank", lora_cfg.rank, config.get("r")),
        ("alpha", lora_cfg.alpha, config.get("lora_alpha")),
        ("targets", sorted(roles), theirs),
    ):
        if ours != saved:
            raise ConfigError(
                f"lora.initial_adapter_path = {str(folder)!r} was trained with {key} {saved!r} ({PEFT_CONFIG}) but "
                f"lora.{key} gives {ours!r}; set lora.{key} to {saved!r}"
            )
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
                 "layers_to_transform"):  # fmt: skip
        if config.get(flag):
            raise ConfigError(
                f"lora.initial_adapter_path = {str(folder)!r}: {PEFT_CONFIG} sets {flag} = {config[flag]!r}, which "
                "titanlite's LoRA does not support (one rank and alpha on every targeted projection of every block)"
            )
    if not (folder / PEFT_WEIGHTS).is_file():
        raise ConfigError(f"lora.initial_adapter_path = {str(folder)!r} has no {PEFT_WEIGHTS}")


def load_peft_adapter(model: torch.nn.Module, folder: str | Path, lora_cfg) -> None:
    """Start the (sharded) model's adapters from a peft adapter folder; every rank keeps its shards."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    check_peft_folder(folder, lora_cfg, model.args)
    try:
        full = from_peft(load_file(str(folder / PEFT_WEIGHTS)), adapter_names(model), model.args)
    except ValueError as e:
        raise ConfigError(f"lora.initial_adapter_path = {str(folder)!r}: {PEFT_WEIGHTS} does not fit: {e}") from None
    model_sd = {k: v for k, v in get_model_state_dict(model).items() if is_adapter(k)}
    for name, t in full.items():
        if tuple(t.shape) != tuple(model_sd[name].shape):
            raise ConfigError(
                f"lora.initial_adapter_path = {str(folder)!r}: {name} has shape {tuple(t.shape)} there but "
                f"{tuple(model_sd[name].shape)} in the model; was it trained on another base?"
            )
    set_model_state_dict(
        model, {k: v.float() for k, v in full.items()}, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    logger.info(f"Started the adapters from {folder} (lora.initial_adapter_path)")


def saved_adapters(step: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The full adapter tensors of a LoRA checkpoint (read in this process)."""
    metadata = read_metadata(step).state_dict_metadata
    dest = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in metadata.items()
        if k.startswith(prefix) and isinstance(md, TensorStorageMetadata) and is_adapter(k)
    }
    if not dest:
        raise ConfigError(f"--checkpoint {step} holds no LoRA adapters")
    read_in_this_process(dest, step)
    return {k[len(prefix) :]: v for k, v in dest.items()}


def write_peft(out: Path, adapters: dict[str, torch.Tensor], args: ModelArgs, lora_cfg, base: str, dtype=None) -> int:
    """Write a peft adapter folder; returns the number of tensors."""
    from safetensors.torch import save_file

    tensors = to_peft({k: v.to(dtype) if dtype is not None else v for k, v in adapters.items()}, args)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
    roles = resolve_targets(list(lora_cfg.targets), args)
    config = peft_config(roles, lora_cfg.rank, lora_cfg.alpha, lora_cfg.dropout, base)
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return len(tensors)
