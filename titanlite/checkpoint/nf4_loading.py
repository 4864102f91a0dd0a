"""Loading a QLoRA base: every rank reads one block's NF4 weights at a time whole, in full precision, quantizes each
whole (the same codes at any topology: models/nf4.py) and keeps its rows. No rank holds more than one block of the
base in full precision."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import torch

from titanlite.models.nf4 import local_nf4, write_full

ReadFull = Callable[[dict[str, torch.Tensor]], None]  # fills whole float32 tensors, by state-dict name


def quantized_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State-dict name -> parameter, for the model's NF4 weights."""
    return {n: p for n, p in model.named_parameters() if local_nf4(p) is not None}


def load_quantized(weights: dict[str, torch.Tensor], read: ReadFull) -> None:
    """Fill the NF4 `weights` block by block: read(dest) gives each whole weight in float32, then it is quantized."""
    for names in _by_block(list(weights)):
        dest = {n: torch.empty(weights[n].shape, dtype=torch.float32) for n in names}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            read(dest)
        for n in names:
            write_full(weights[n], dest.pop(n))


def _by_block(names: list[str]) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for n in names:
        m = re.match(r"layers\.\d+\.", n)
        groups.setdefault(m.group(0) if m else n, []).append(n)
    return list(groups.values())
