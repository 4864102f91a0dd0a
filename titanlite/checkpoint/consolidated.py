"""Model weights as one file: export a checkpoint's model to a consolidated state dict, read one back,
and check that saved weights fit a model (shapes and names) before anything is loaded."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanlite.checkpoint.catalog import newest_usable, read_metadata, step_folders
from titanlite.checkpoint.export_target import write_atomically
from titanlite.checkpoint.integrity import rank_problems
from titanlite.checkpoint.safe_reading import UnsafeCheckpointError, blocked_global, safe_dcp_load
from titanlite.dtypes import TORCH_DTYPES
from titanlite.errors import ConfigError
from titanlite.models.hf_config import is_hf_folder
from titanlite.storage import is_remote, location


def saved_shapes(metadata, prefix: str) -> dict[str, tuple | None]:
    """Full shapes of the saved keys under prefix (None for a non-tensor value), prefix removed."""
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            out[key[len(prefix) :]] = tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
    return out


def model_prefix(metadata) -> str:
    """ "model." for a titanlite checkpoint (top-level parts), "" for a plain model state dict."""
    return "model." if any(k.startswith("model.") for k in metadata.state_dict_metadata) else ""


def model_shapes(model_sd: dict, every_rank: bool = False) -> dict[str, tuple]:
    """Each tensor's full shape, by name; every_rank: those of every rank's model together (a collective: the ranks
    of a pipeline-parallel job each hold some stages of the model)."""
    mine = {k: tuple(v.shape) for k, v in model_sd.items()}
    if not every_rank:
        return mine
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def check_model_fits(model_sd: dict, saved: dict[str, tuple | None], source: str, hint: str | None = None) -> None:
    """ConfigError naming the first key whose saved shape differs from the model's (or is missing); `hint`
    ("; ...") says what to do instead."""
    hint = hint or "; was it saved with another model.flavor, model.vocab_size or model.tie_embeddings?"
    for name, value in model_sd.items():
        model_shape = tuple(getattr(value, "shape", value))  # a tensor, or a shape
        if name not in saved:
            raise ConfigError(
                f"{source} does not fit the model: '{name}' (shape {model_shape} in the model) is "
                f"not in the checkpoint{hint}"
            )
        if saved[name] != model_shape:
            raise ConfigError(
                f"{source} does not fit the model: '{name}' has shape {saved[name]} in the "
                f"checkpoint but {model_shape} in the model{hint}"
            )
    extra = [k for k in saved if k not in model_sd]
    if extra:
        raise ConfigError(
            f"{source} does not fit the model: the checkpoint has '{extra[0]}' (shape "
            f"{saved[extra[0]]}), which the model does not{hint}"
        )


def read_in_this_process(dest: dict, checkpoint: Path) -> None:
    """Fill dest ({saved name: tensor}) from a DCP checkpoint in this one process; ConfigError naming the
    damaged files when they cannot be read."""
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            safe_dcp_load(dest, checkpoint, no_dist=True)
    except CheckpointException as e:
        raise unreadable(checkpoint, e) from None


def unreadable(path: Path, error: BaseException) -> ConfigError:
    """The ConfigError for a DCP checkpoint whose files could not be read (error: DCP's exception, which
    gathers each rank's failure), naming the damaged files when its manifest shows them."""
    failures = getattr(error, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else error
    text = str(cause).strip().splitlines()
    detail = type(cause).__name__ + (f": {text[0][:200]}" if text else "")
    damaged = rank_problems(path, 0, 1)  # sizes and checksums of every file its manifest lists
    files = f"; {'; '.join(damaged[:3])}" if damaged else ""
    return ConfigError(
        f"{path} cannot be read ({detail}){files}: the checkpoint is damaged or incomplete; use another step"
    )


def load_consolidated(path: Path) -> dict[str, torch.Tensor]:
    """A consolidated state-dict file ({fqn: tensor}, or {"model": {...}}), memory-mapped."""
    try:
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"checkpoint.initial_load_path = {str(path)!r} holds {blocked_global(e)}, which is not a tensor or a plain "
            "container: refused without running it (.pt files are read with torch.load(weights_only=True))"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"checkpoint.initial_load_path = {str(path)!r} is not a readable state-dict file ({type(e).__name__}: {e})"
        ) from None
    if isinstance(sd, dict) and isinstance(sd.get("model"), dict):
        sd = sd["model"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConfigError(f"checkpoint.initial_load_path = {str(path)!r} does not hold a state dict of tensors")
    return sd


def resolve_step(checkpoint: Path) -> Path:
    """A step-N folder as given, or the newest complete one in a checkpoint folder; ConfigError otherwise."""
    checkpoint = location(checkpoint, "--checkpoint")
    valid = "valid: a step-N checkpoint folder, or the checkpoint folder holding them (the newest is used)"
    if (checkpoint / ".metadata").exists():
        if is_remote(checkpoint):  # only a committed step folder (a save cut short has .metadata too)
            try:
                read_metadata(checkpoint, key="--checkpoint")
            except ConfigError:
                raise
            except ValueError as e:
                raise ConfigError(f"--checkpoint {checkpoint} is not a usable checkpoint: {e}") from None
        return checkpoint
    if steps := step_folders(checkpoint):
        info = newest_usable(checkpoint, {"model"})
        if info is None:
            names = ", ".join(p.name for _, p in sorted(steps.items()))
            raise ConfigError(f"--checkpoint {checkpoint} holds no complete checkpoint with a model ({names}); {valid}")
        return info.path
    if not checkpoint.exists():
        raise ConfigError(f"--checkpoint {checkpoint} does not exist; {valid}")
    if is_hf_folder(checkpoint):
        raise ConfigError(
            f"--checkpoint {checkpoint} is a HuggingFace model folder, not a titanlite checkpoint: it needs no "
            f"export (use it as checkpoint.initial_load_path, or with generate --checkpoint); {valid}"
        )
    return checkpoint  # read_metadata says what is missing


def export(checkpoint: Path, output: Path, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """Write the model of a DCP checkpoint (step-N, or the newest in a checkpoint folder) as one
    consolidated file {fqn: tensor}, optionally cast to dtype; returns the state dict. One process."""
    checkpoint = resolve_step(checkpoint)
    try:
        metadata = read_metadata(checkpoint)
    except (ValueError, OSError) as e:
        raise ConfigError(f"--checkpoint {checkpoint} is not a usable DCP checkpoint: {e}") from None
    prefix = model_prefix(metadata)
    flat = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if not flat:
        raise ConfigError(f"--checkpoint {checkpoint} holds no model tensors")
    read_in_this_process(flat, checkpoint)
    cast = TORCH_DTYPES[dtype] if dtype else None
    sd = {k[len(prefix) :]: (v.to(cast) if cast and v.is_floating_point() else v) for k, v in flat.items()}
    write_atomically(Path(output), False, lambda tmp: torch.save(sd, tmp))
    return sd
