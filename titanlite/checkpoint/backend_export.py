"""The HF export of a saved transformers-backend checkpoint (python -m titanlite.checkpoint export --format hf): the
model built from its model_args.json, its weights read from the checkpoint in one process, written as transformers
saves its class."""

from __future__ import annotations

import torch

from titanlite.checkpoint.hf_io import save_hf_sharded
from titanlite.checkpoint.safe_reading import safe_dcp_load
from titanlite.models.transformers_backend.args import saved_backend_args
from titanlite.models.transformers_backend.model import BackendModel


def backend_from_saved(saved_args: dict) -> BackendModel:
    """The backend model of a checkpoint's model_args.json, on the CPU (weights unset)."""
    with torch.device("meta"):
        model = BackendModel(saved_backend_args(saved_args))
    model.to_empty(device="cpu")
    model.init_buffers()
    return model


def export_backend(step, prefix: str, out, saved_args: dict, dtype: torch.dtype | None, tokenizer,
                   max_file_bytes: int, started_from: str = "") -> int:  # fmt: skip
    """Write step folder `step`'s model (its DCP state under `prefix`) as a HuggingFace folder `out`, with the run's
    tokenizer files and the tensors of the folder it `started_from` that it does not train; the tensors written."""
    model = backend_from_saved(saved_args)
    state = model.state_dict()
    safe_dcp_load({"model": state} if prefix else state, step, no_dist=True)
    dtype = dtype or next(iter(state.values())).dtype
    return save_hf_sharded(model, out, dtype, tokenizer, max_file_bytes, started_from=started_from)
