"""QLoRA's frozen base (lora.base_dtype = "nf4"): the blocks' linear weights held as torchao's NF4 tensors (4-bit
NormalFloat codes, one int8 scale per block of weights, those scales double-quantized per block of scales).

FSDP2 shards an NF4 weight by rows and all-gathers its packed codes and scales through the tensor's own
fsdp_pre_all_gather / fsdp_post_all_gather hooks; each linear dequantizes its gathered weight to the input's dtype
in forward and again in backward (torchao's LinearNF4: no weight gradient). One full-precision weight is quantized
whole and then split, so every topology holds the same codes (the double quantization subtracts the mean of all the
weight's scales: quantizing each shard alone would give another one per shard).
"""

from __future__ import annotations

import importlib
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import ConfigError

_NF4_TENSOR = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
_NOT_QUANTIZED = ("router",)  # a router's few weights decide the routing: kept in full precision, as its bias


def nf4_api():
    """torchao's NF4 module (to_nf4, NF4Tensor); ConfigError when torchao is not installed."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "lora.base_dtype = 'nf4' needs torchao, which is not installed: pip install torchao (or pip install -e "
            "'.[qlora]'), or set lora.base_dtype = 'bfloat16' or 'float32'"
        )
    noisy = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in noisy]
    for log in noisy:  # torchao's import warns about GPU kernels it cannot load and a deprecated pytree call
        log.setLevel(logging.ERROR)
    try:
        return importlib.import_module(_NF4_TENSOR)
    finally:
        for log, level in zip(noisy, levels):
            log.setLevel(level)


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Qualified name -> every linear in the model's blocks that an NF4 base holds in 4 bits (routers excepted)."""
    out = {}
    for i, block in enumerate(model.layers):
        for path, m in block.named_modules():
            if isinstance(m, nn.Linear) and not path.endswith(_NOT_QUANTIZED) and not is_lora_factor(path):
                out[f"layers.{i}.{path}"] = m
    return out


def is_lora_factor(path: str) -> bool:
    """Whether a module path is an adapter's A or B (they train: never quantized)."""
    return path.endswith(("lora_a", "lora_b"))


def quantize_base(model: nn.Module, block_size: int, scaler_block_size: int, dtype: torch.dtype) -> int:
    """Replace the weight of every quantized_linears() linear with a frozen NF4 parameter of `dtype` (its scales and
    the dtype it dequantizes to); call on the meta device before FSDP. Returns the weights quantized."""
    to_nf4 = nf4_api().to_nf4
    linears = quantized_linears(model)
    for linear in linears.values():
        w = linear.weight.detach().to(dtype)
        linear.weight = nn.Parameter(to_nf4(w, block_size, scaler_block_size), requires_grad=False)
    return len(linears)


def local_nf4(t: torch.Tensor):
    """The NF4 tensor t holds (itself, or a DTensor's local shard), or None."""
    local = t._local_tensor if isinstance(t, DTensor) else t  # to_local() would give a view: another NF4 object
    return local if type(local).__name__ == "NF4Tensor" else None


def materialize_nf4(model: nn.Module) -> None:
    """After to_empty: give each NF4 shard its own scale mean and code table on the device (empty_like allocates
    only the tensors FSDP splits; the other two would stay on the meta device)."""
    for p in model.parameters():
        if (nf4 := local_nf4(p)) is not None and nf4.nf4.is_meta:
            device = nf4.quantized_data.device
            nf4.scaler_mean = torch.empty((), dtype=nf4.scaler_mean.dtype, device=device)
            nf4.nf4 = torch.empty(nf4.nf4.shape, dtype=nf4.nf4.dtype, device=device)


@torch.no_grad()
def write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a full-precision tensor into an NF4 parameter (whole, or a DTensor split by rows): the whole tensor is
    quantized, then this rank keeps its rows."""
    nf4 = local_nf4(param)
    quantized = nf4_api().to_nf4(full.to(param.device, param.dtype), nf4.block_size, nf4.scaler_block_size)
    if isinstance(param, DTensor):
        splits = [d for d, p in enumerate(param.placements) if p.is_shard()]
        if [param.placements[d].dim for d in splits] not in ([], [0]):
            raise NotImplementedError(f"an NF4 weight split as {param.placements} (only rows over one mesh dimension)")
        if splits:
            mesh = param.device_mesh
            quantized = torch.chunk(quantized, mesh.size(splits[0]), dim=0)[mesh.get_local_rank(splits[0])]
    nf4.copy_(quantized)


def nf4_problem(model: nn.Module, shards: int, block_size: int, scaler_block_size: int) -> str | None:
    """Why an NF4 base cannot hold this model's linears split by rows over `shards` ranks, or None: each rank's rows
    must hold whole scaler blocks (block_size * scaler_block_size weights)."""
    unit = block_size * scaler_block_size
    for name, linear in quantized_linears(model).items():
        rows, cols = linear.weight.shape
        if rows % shards or (rows // shards * cols) % unit:
            return (
                f"{name}.weight [{rows} x {cols}] split by rows over {shards} FSDP rank(s) gives "
                f"{rows * cols / shards:g} weights per rank, not a multiple of lora.nf4_block_size * "
                f"lora.nf4_scaler_block_size = {block_size} * {scaler_block_size} = {unit}: choose block sizes whose "
                "product divides every weight's share (smaller ones, e.g. 64 and 64), or another "
                "data_parallel_shard_degree (the replicate degree does not split weights)"
            )
    return None
