"""QLoRA's frozen base (lora.base_dtype = "nf4"): the blocks' linear weights held as torchao's NF4 tensors (4-bit
NormalFloat codes, one int8 scale per block of weights, those scales double-quantized per block of scales).

FSDP2 shards an NF4 weight by rows and all-gathers its packed codes and scales through the tensor's own
fsdp_pre_all_gather / fsdp_post_all_gather hooks; each linear dequantizes its gathered weight to the input's dtype
in forward and again in backward (torchao's LinearNF4: no weight gradient). One full-precision weight is quantized
whole and then split, so every topology holds the same codes (the double quantization subtracts the mean of all the
weight's scales: quantizing each shard alone would give another one per shard).

Each weight's block sizes are chosen from its full shape alone (nf4_blocks), so that every topology quantizes it
alike: lora.nf4_block_size and nf4_scaler_block_size are the largest sizes, kept wherever they fit.
"""

from __future__ import annotations

import importlib
import logging
import math
import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import ConfigError
from titanlite.models.family import BACKEND
from titanlite.models.registry import model_class

_NF4_TENSOR = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
# A router's few weights decide the routing: kept in full precision, as its bias (transformers' names: router, gate,
# and a shared expert's one-row shared_expert_gate).
_BACKEND_NOT_QUANTIZED = re.compile(r"\.(router|gate|shared_expert_gate)$")
# Every FSDP degree that is a power of two up to this and divides a weight's rows gives each rank whole scaler blocks.
SPLIT_DEGREES = 64


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
    """Qualified name -> every linear in the model's blocks that an NF4 base holds in 4 bits (routers excepted; of a
    transformers backend model, its decoder layers' linears that train, their routers and gates excepted)."""
    args = getattr(model, "args", None)
    if getattr(args, "family", None) == BACKEND:  # its trained linears (args.linears), by their own names
        trained = set(args.linears)
        return {
            name: m for name, m in model.named_modules()
            if name in trained and not _BACKEND_NOT_QUANTIZED.search(name)
        }  # fmt: skip
    out = {}
    for i, block in enumerate(model.layers):
        for path, m in block.named_modules():
            if isinstance(m, nn.Linear) and not path.endswith("router") and not is_lora_factor(path):
                out[f"layers.{i}.{path}"] = m
    return out


def is_lora_factor(path: str) -> bool:
    """Whether a module path is an adapter's A or B (they train: never quantized)."""
    return path.endswith(("lora_a", "lora_b"))


def nf4_blocks(rows: int, cols: int, block_size: int, scaler_block_size: int) -> tuple[int, int] | None:
    """The (block size, scaler block size) a [rows x cols] weight is quantized with: the largest even block size <=
    block_size that divides its weights, then the largest scaler block size <= scaler_block_size that divides its
    blocks into a number of scaler blocks that every power-of-two FSDP degree up to SPLIT_DEGREES dividing its rows
    divides (fewer such degrees where none does); None when no even block size divides it. The full shape alone
    decides: the same codes at any topology."""
    numel = rows * cols
    block = next((b for b in range(block_size - block_size % 2, 0, -2) if numel % b == 0), None)
    if block is None:
        return None
    blocks, degrees = numel // block, math.gcd(rows, SPLIT_DEGREES)
    while True:  # degrees = 1 ends it: a scaler block of 1 divides any count
        for scaler in range(min(scaler_block_size, blocks), 0, -1):
            if blocks % scaler == 0 and blocks // scaler % degrees == 0:
                return block, scaler
        degrees //= 2


def nf4_block_table(model: nn.Module, block_size: int, scaler_block_size: int) -> dict[str, list[int]]:
    """Weight name -> [block size, scaler block size] of each weight an NF4 base quantizes (nf4_blocks of its shape;
    a model whole, on any device)."""
    table = {}
    for name, linear in quantized_linears(model).items():
        blocks = nf4_blocks(*linear.weight.shape, block_size, scaler_block_size)
        if blocks is None:
            raise ConfigError(_no_block(name, linear.weight.shape, block_size))
        table[f"{name}.weight"] = list(blocks)
    return table


def _no_block(name: str, shape, block_size: int) -> str:
    rows, cols = shape
    return (
        f"{name}.weight [{rows} x {cols}] holds {rows * cols} weights, which no even block size <= "
        f"lora.nf4_block_size = {block_size} divides (NF4 packs two 4-bit codes per byte); set lora.base_dtype = "
        "'bfloat16' for this model"
    )


def quantize_base(model: nn.Module, block_size: int, scaler_block_size: int, dtype: torch.dtype) -> int:
    """Replace the weight of every quantized_linears() linear with a frozen NF4 parameter of `dtype` (its scales and
    the dtype it dequantizes to), in the block sizes nf4_blocks chooses for its shape; call on the meta device
    before FSDP. Returns the weights quantized."""
    to_nf4 = nf4_api().to_nf4
    table = nf4_block_table(model, block_size, scaler_block_size)
    for name, linear in quantized_linears(model).items():
        w = linear.weight.detach().to(dtype)
        linear.weight = nn.Parameter(to_nf4(w, *table[f"{name}.weight"]), requires_grad=False)
    return len(table)


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
    """Why an NF4 base cannot hold this model's linears split by rows over `shards` ranks, or None: each rank holds
    whole rows and whole scaler blocks of the block sizes nf4_blocks chooses."""
    for name, linear in quantized_linears(model).items():
        rows, cols = linear.weight.shape
        blocks = nf4_blocks(rows, cols, block_size, scaler_block_size)
        if blocks is None:
            return _no_block(name, linear.weight.shape, block_size)
        count = rows * cols // (blocks[0] * blocks[1])
        if rows % shards or count % shards:
            what = f"{rows} rows" if rows % shards else f"{count} scaler blocks"
            return (
                f"{name}.weight [{rows} x {cols}], quantized in {count} scaler blocks of {blocks[1]} blocks of "
                f"{blocks[0]} weights (the largest its shape allows within lora.nf4_block_size = {block_size} and "
                f"lora.nf4_scaler_block_size = {scaler_block_size}), cannot be split by rows over {shards} FSDP "
                f"ranks: its {what} do not divide by {shards}, and each rank must hold whole rows and whole scaler "
                f"blocks; valid: a data_parallel_shard_degree dividing {math.gcd(rows, count)} (the replicate degree "
                "does not split weights), or a smaller lora.nf4_scaler_block_size"
            )
    return None


def qlora_problem(cfg, dims, args, installed: bool = True) -> str | None:
    """Why lora.base_dtype = 'nf4' cannot hold this run's base, or None: no torchao (installed=False: not asked, as
    of the dry run, which sizes it without), CPU offload, a partial reshard, tensor parallelism, an odd block size, or
    a weight whose blocks the FSDP degree cannot split (nf4_problem). dims: the run's ParallelDims."""
    lora = cfg.lora
    if not (lora.enable and lora.base_dtype == "nf4"):
        return None
    if installed:
        try:
            nf4_api()
        except ConfigError as e:
            return str(e)
    if cfg.training.enable_cpu_offload:
        return (
            "lora.base_dtype = 'nf4' with training.enable_cpu_offload = true is not supported: FSDP leaves the 4-bit "
            "weights alone on a shard group of one rank, where offloading would leave them on the host, and the "
            "offloaded NF4 path has not run on a GPU; set enable_cpu_offload = false (the 4-bit base is small)"
        )
    reshard = cfg.parallelism.fsdp_reshard_after_forward
    if reshard.isdigit() and 1 < int(reshard) < dims.fsdp_size:
        return (
            f"lora.base_dtype = 'nf4' with parallelism.fsdp_reshard_after_forward = {reshard!r} is not supported: "
            "FSDP2 reshards to a smaller group only the weights it gathers as one tensor, and an NF4 weight is "
            "gathered as three; use 'default', 'always' or 'never'"
        )
    if dims.tp > 1:
        return (
            f"lora.base_dtype = 'nf4' with parallelism.tensor_parallel_degree = {dims.tp} is not supported: "
            "torchao's NF4 tensor is split by rows for FSDP only (a row-parallel projection splits its columns); "
            "set tensor_parallel_degree = 1, or lora.base_dtype = 'bfloat16'"
        )
    if lora.nf4_block_size % 2:
        return (
            f"lora.nf4_block_size = {lora.nf4_block_size}: NF4 packs two 4-bit codes per byte, so a block holds an "
            "even number of weights; valid: an even number > 0 (QLoRA's 64)"
        )
    with torch.device("meta"):
        model = model_class(args.family)(args)
    return nf4_problem(model, dims.fsdp_size, lora.nf4_block_size, lora.nf4_scaler_block_size)
