"""The one table from the dtype names used in configs to torch dtypes."""

from __future__ import annotations

import torch

from titanlite.config.fields import DTYPE_NAMES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype given by its config name."""
    return TORCH_DTYPES[name].itemsize
