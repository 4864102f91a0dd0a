"""The weights a new run starts from (checkpoint.initial_load_path): a HuggingFace folder, a DCP folder
(a step-N checkpoint or plain model keys) or a consolidated state-dict file; model only."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titanlite.checkpoint.catalog import read_metadata
from titanlite.checkpoint.consolidated import (
    check_model_fits,
    load_consolidated,
    model_prefix,
    model_shapes,
    saved_shapes,
    unreadable,
)
from titanlite.checkpoint.hf_io import load_hf_weights
from titanlite.checkpoint.nf4_loading import load_quantized, quantized_weights
from titanlite.checkpoint.safe_reading import safe_dcp_load
from titanlite.errors import ConfigError
from titanlite.models.hf_config import is_hf_folder
from titanlite.models.lora import is_adapter
from titanlite.storage import is_remote

logger = logging.getLogger("titanlite")


def load_initial_weights(model: torch.nn.Module, path: Path) -> None:
    """Fill the (sharded) model's weights from `path`; each rank reads or keeps only its shards."""
    t0 = time.perf_counter()
    quantized = quantized_weights(model)  # QLoRA's 4-bit weights: read whole, one block at a time
    if hasattr(model, "load_hf_folder"):  # the transformers backend: transformers' own names and loader
        model.load_hf_folder(path)
    elif not is_remote(path) and is_hf_folder(path):  # a remote one was copied here before launch (remote_inputs)
        load_hf_weights(model, path)
    elif path.is_dir():
        try:
            metadata = read_metadata(
                path, committed=False, key="checkpoint.initial_load_path"
            )  # a DCP folder any tool wrote
        except ConfigError:
            raise  # object storage that cannot be asked
        except ValueError as e:
            raise ConfigError(
                f"checkpoint.initial_load_path = {str(path)!r} is not a readable DCP checkpoint: {e}"
            ) from None
        model_sd = _base_state(model)
        prefix = model_prefix(metadata)
        check_model_fits(
            _every_stage(model, model_sd), saved_shapes(metadata, prefix), str(path), _hint(metadata, prefix)
        )
        for name in quantized:
            del model_sd[name]
        try:
            safe_dcp_load({"model": model_sd} if prefix else model_sd, path)
            # each rank reads its own blocks' weights whole (pipeline stages differ): no collectives
            load_quantized(quantized, lambda d: safe_dcp_load({"model": d} if prefix else d, path, no_dist=True))
        except CheckpointException as e:
            raise unreadable(path, e) from None
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=False))
    else:
        model_sd = _base_state(model)
        full = load_consolidated(path)
        check_model_fits(_every_stage(model, model_sd), {k: tuple(v.shape) for k, v in full.items()}, str(path))
        load_quantized(quantized, lambda d: [t.copy_(full.pop(n)) for n, t in d.items()])
        # Every rank maps the file and keeps its own shard of each tensor.
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
    logger.info(
        f"Loaded initial model weights from {path} in {time.perf_counter() - t0:.1f} s (checkpoint.initial_load_path)"
    )


def _base_state(model: torch.nn.Module) -> dict:
    """The model's state dict without LoRA adapters (a base holds none; they start new or from their own folder)."""
    return {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}


def _every_stage(model: torch.nn.Module, model_sd: dict) -> dict[str, tuple]:
    """The shapes the whole model has (a pipeline rank's model holds its stages only)."""
    return model_shapes(model_sd, getattr(model, "pipeline_part", False))


def _hint(metadata, prefix: str) -> str | None:
    """A LoRA checkpoint's adapters given as a base: say what it is."""
    if any(is_adapter(k[len(prefix) :]) for k in metadata.state_dict_metadata if k.startswith(prefix)):
        return (
            "; it is a LoRA checkpoint (adapters, no base): give its base as checkpoint.initial_load_path and the "
            "adapters as lora.initial_adapter_path (export them with --format peft), or export it merged (--format hf)"
        )
    return None
