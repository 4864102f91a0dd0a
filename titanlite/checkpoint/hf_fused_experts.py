"""HF tensors that hold every expert of a layer (gpt-oss: mlp.experts.gate_up_proj [experts, dim, 2 x hidden] with
the gate and up columns interleaved, its bias, down_proj and its bias) <-> titanlite's grouped expert weights, each
rank reading and writing only the experts it holds; and the MXFP4 form in which gpt-oss is published
(<name>_blocks / <name>_scales), dequantized on import to the training dtype."""

from __future__ import annotations

import pathlib

import torch
from torch.distributed.tensor import DTensor

from titanlite.checkpoint.hf_folder import safetensors_module
from titanlite.compat import local_rows
from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.hf_names import MXFP4_GROUP, fused_hf_names

# The 16 values of a 4-bit e2m1 float, by its bits (sign, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An MXFP4 weight as gpt-oss stores it, blocks [experts, out, groups, 16] uint8 (two values a byte, the low
    bits first) and scales [experts, out, groups] uint8 (a power of two, biased by 127, per group of 32 values), as
    the [experts, in, out] tensor it encodes (in = groups x 32)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).to(dtype)
    return values.flatten(-2).transpose(1, 2).contiguous()


def interleave(parts: list[torch.Tensor]) -> torch.Tensor:
    """The tensors side by side along their last dimension, alternating (one: itself)."""
    return parts[0] if len(parts) == 1 else torch.stack(parts, dim=-1).flatten(-2)


def _locals(state: dict, names: tuple[str, ...]) -> list[torch.Tensor]:
    return [state[n].to_local() if isinstance(state[n], DTensor) else state[n] for n in names]


@torch.no_grad()
def load_fused_experts(state: dict, folder: pathlib.Path, args: ModelArgs, found: dict) -> None:
    """Fill the grouped expert tensors of a model state dict (plain or sharded over experts) from a folder's fused
    tensors (found: read_hf_tensors' name -> (file, shape)), reading this rank's experts only."""
    st = safetensors_module()
    for hf, names in fused_hf_names(args).items():
        first, count = local_rows(state[names[0]])
        targets = _locals(state, names)
        if hf in found:
            with st.safe_open(str(folder / found[hf][0]), framework="pt") as f:
                value = f.get_slice(hf)[first : first + count]
        else:
            value = _read_mxfp4(st, folder, hf, found, first, count, targets[0].dtype)
        for j, t in enumerate(targets):
            t.copy_(value[..., j :: len(targets)])


def _read_mxfp4(st, folder: pathlib.Path, hf: str, found: dict, first: int, count: int, dtype) -> torch.Tensor:
    parts = []
    for suffix in ("_blocks", "_scales"):
        with st.safe_open(str(folder / found[hf + suffix][0]), framework="pt") as f:
            parts.append(f.get_slice(hf + suffix)[first : first + count])
    if parts[0].dtype != torch.uint8 or parts[1].dtype != torch.uint8:
        raise ConfigError(
            f"{folder}: {hf}_blocks and {hf}_scales are {parts[0].dtype} and {parts[1].dtype}; MXFP4 stores both as "
            f"uint8 (U8): the folder is not a gpt-oss MXFP4 checkpoint"
        )
    return dequantize_mxfp4(parts[0], parts[1], dtype)


def fused_export_state(state: dict, args: ModelArgs, dtype: torch.dtype) -> dict:
    """HF name -> this rank's part of each fused expert tensor (a DTensor split over the experts as the weights are;
    a plain tensor for a plain model), in `dtype`."""
    out = {}
    for hf, names in fused_hf_names(args).items():
        local = interleave([t.to(dtype) for t in _locals(state, names)]).contiguous()
        t = state[names[0]]
        if isinstance(t, DTensor):
            shape = (*t.shape[:-1], t.shape[-1] * len(names))
            local = DTensor.from_local(local, t.device_mesh, t.placements, shape=shape, stride=_contiguous(shape))
        out[hf] = local
    return out


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
