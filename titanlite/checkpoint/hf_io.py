"""HuggingFace safetensors model folders in and out, with the model kept sharded.

Import: torch.distributed.checkpoint's HuggingFaceStorageReader reads, on every rank, only the slices
its shards need (q/k weights are read column-sharded, so that each rank holds whole rows to permute,
then resharded by rows). Export from a run: every rank writes its shards (HuggingFaceStorageWriter) and
every rank then stitches some of the output files together on disk; nobody gathers the model. Export
of a saved checkpoint: one process, one output file's tensors in memory at a time.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import pathlib
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import empty as dtensor_empty

from titanlite.checkpoint.consolidated import read_in_this_process
from titanlite.checkpoint.export_target import shown
from titanlite.checkpoint.hf_carried import carry_backend_tensors, carry_into_export
from titanlite.checkpoint.hf_folder import (
    INDEX,
    check_hf_weights,
    safetensors_module,
    save_safetensors,
)
from titanlite.checkpoint.hf_fused_experts import fused_export_state, interleave, load_fused_experts
from titanlite.checkpoint.nf4_loading import load_quantized, quantized_weights
from titanlite.checkpoint.safe_reading import load_metadata
from titanlite.compat import consolidate_hf_safetensors, local_rows
from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.hf_config import config_from_args, generation_config
from titanlite.models.hf_names import (
    expert_hf_names,
    fused_hf_names,
    half_split_to_interleaved,
    hf_shapes,
    interleaved_to_half_split,
    is_fused_expert,
    is_grouped_experts,
    is_routing_bias,
    rope_heads,
    stored_in_hf,
    to_hf_name,
)
from titanlite.models.registry import FAMILIES

logger = logging.getLogger("titanlite")

DEFAULT_MAX_FILE_BYTES = 5 * 1024**3  # HF's default shard size
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _whole_rows(t: DTensor) -> list:
    """Placements of t that give every rank whole rows: split over columns, or replicated when t is 1-D. When
    FSDP splits a tensor-parallel shard again (a strided shard, which DTensor does not move to columns), the
    data-parallel dimensions replicate and "tp" keeps its split by rows: whole heads on each tp rank."""
    strided = any(_splits(p) and not p.is_shard() for p in t.placements)
    names = t.device_mesh.mesh_dim_names or ()
    out = []
    for name, p in zip(names, t.placements):
        if not _splits(p):
            out.append(p)
        elif strided:
            out.append(p if name == "tp" and p.is_shard(0) else Replicate())
        else:
            out.append(Shard(1) if t.dim() > 1 else Replicate())
    return out


def _splits(placement) -> bool:
    """Whether a placement splits the tensor: Shard, or FSDP's strided shard of a tensor-parallel shard."""
    return not placement.is_replicate() and not placement.is_partial()


def _column_sharded(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor like t, but with whole rows on every rank (see _whole_rows)."""
    if not isinstance(t, DTensor):
        return torch.empty_like(t)
    return dtensor_empty(t.shape, dtype=t.dtype, device_mesh=t.device_mesh, placements=_whole_rows(t))


def _permute_rows(t: torch.Tensor, heads: int, fn, placements=None) -> torch.Tensor:
    """fn (a row permutation of `heads` heads) applied to t; a DTensor is moved to whole rows (of whole heads)
    first and, with `placements`, resharded to them afterwards."""
    if not isinstance(t, DTensor):
        return fn(t, heads)
    cols = t.redistribute(placements=_whole_rows(t))
    row_splits = math.prod(cols.device_mesh.size(i) for i, p in enumerate(cols.placements) if p.is_shard(0))
    out = DTensor.from_local(
        fn(cols.to_local(), heads // row_splits), cols.device_mesh, cols.placements, shape=t.shape, stride=t.stride()
    )
    if placements is None:
        return out
    if not any(_splits(p) for p in out.placements):  # whole on every rank: keep this rank's shard
        return distribute_tensor(out.to_local(), out.device_mesh, placements, src_data_rank=None)
    return out.redistribute(placements=placements)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, folder: str | pathlib.Path) -> None:
    """Load a HF folder's weights into the (sharded or plain) model; each rank reads only its slices."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # needs safetensors: checked above
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    folder = pathlib.Path(folder).expanduser()
    args = model.args
    found = check_hf_weights(folder, args)
    quantized = quantized_weights(model)  # QLoRA's 4-bit weights: read whole, one block at a time (below)
    sd = {k: v for k, v in get_model_state_dict(model).items() if k not in quantized}
    dest, permuted, grouped = {}, {}, {}
    for name, t in sd.items():
        if not stored_in_hf(name, args) or is_fused_expert(name, args):  # fused: read below
            continue
        if is_grouped_experts(name):  # this rank reads only the experts it holds (whole ones, HF's [out, in])
            first, count = local_rows(t)
            names = expert_hf_names(name, args)[first : first + count]
            local = t.to_local() if isinstance(t, DTensor) else t
            dest.update({hf: torch.empty(local.shape[2], local.shape[1], dtype=t.dtype) for hf in names})
            grouped[name] = names
            continue
        heads = rope_heads(name, args)
        dest[to_hf_name(name, args)] = t if heads is None else _column_sharded(t)
        if heads is not None:
            permuted[name] = (dest[to_hf_name(name, args)], heads)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(dest, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=not dist.is_initialized())
    if fused_hf_names(args):
        load_fused_experts(sd, folder, args, found)
    for name, names in grouped.items():
        local = sd[name].to_local() if isinstance(sd[name], DTensor) else sd[name]
        for j, hf in enumerate(names):
            local[j].copy_(dest[hf].T)
    for name, (loaded, heads) in permuted.items():
        target = sd[name]
        value = _permute_rows(
            loaded,
            heads,
            functools.partial(half_split_to_interleaved, rotary=args.rope_dim),
            target.placements if isinstance(target, DTensor) else None,
        )
        (target.to_local() if isinstance(target, DTensor) else target).copy_(
            value.to_local() if isinstance(value, DTensor) else value
        )
    set_model_state_dict(model, sd, options=StateDictOptions(strict=not quantized))
    load_quantized(quantized, functools.partial(_read_whole, folder, args))


def _read_whole(folder: pathlib.Path, args: ModelArgs, dest: dict[str, torch.Tensor]) -> None:
    """Fill whole tensors (by titanlite name) from a HF folder in this process alone, q/k rows in titanlite's order."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            {to_hf_name(n, args): t for n, t in dest.items()},
            storage_reader=HuggingFaceStorageReader(str(folder)),
            no_dist=True,
        )
    for name, t in dest.items():
        if (heads := rope_heads(name, args)) is not None:
            t.copy_(half_split_to_interleaved(t, heads, rotary=args.rope_dim))


def warn_dropped_routing_bias(biases: dict[str, torch.Tensor], out: pathlib.Path, stored: bool = False) -> None:
    """Warn when an MoE's routing bias (moved by [moe] load_balance = "aux_free") is not zero: the HF architecture
    has none, so the exported model chooses its experts without it; stored: the architecture has one (DeepSeek-V3's
    correction bias), but a peft adapter does not carry it."""
    if any(bool((b.to_local() if isinstance(b, DTensor) else b).abs().max() > 0) for b in biases.values()):
        if not dist.is_initialized() or dist.get_rank() == 0:
            if stored:
                logger.warning(
                    f"{shown(out)}: a peft adapter holds no routing bias: peft on the base folder routes with the "
                    f"base's e_score_correction_bias, not the one this run trained on; export the merged model "
                    f"(--format hf, merged into its base) to keep it (docs/moe.md)"
                )
                return
            logger.warning(
                f"{shown(out)}: the routing bias learned with [moe] load_balance = 'aux_free' is not part of the HF "
                f"architecture and is left out: the exported model chooses experts without it (docs/moe.md)"
            )


def file_mapping(args: ModelArgs, itemsize: int, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> dict[str, int]:
    """HF tensor name -> output file index (1..N), in model order, each file at most max_file_bytes."""
    mapping, index, used = {}, 1, 0
    for name, shape in hf_shapes(args).items():
        size = math.prod(shape) * itemsize
        if used and used + size > max_file_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


def write_metadata(out: pathlib.Path, args: ModelArgs, dtype: str, tokenizer) -> None:
    """config.json, generation_config.json and, for a HF tokenizer, its files."""
    bos = getattr(tokenizer, "bos_id", None)
    eos_ids = list(getattr(tokenizer, "stop_ids", None) or [tokenizer.eos_id])
    config = config_from_args(args, FAMILIES[args.family].hf, dtype, bos, eos_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(bos, eos_ids), indent=2) + "\n")
    copy_tokenizer_files(tokenizer, out)


def copy_tokenizer_files(tokenizer, out: pathlib.Path) -> None:
    """A HF tokenizer's files (tokenizer.json, its config, special tokens) into the folder `out`."""
    tok_path = getattr(tokenizer, "path", None)
    if tok_path is not None:
        for name in TOKENIZER_FILES:
            if (pathlib.Path(tok_path).parent / name).is_file():
                shutil.copyfile(pathlib.Path(tok_path).parent / name, pathlib.Path(out) / name)


def _write_index(out: pathlib.Path, mapping: dict[str, int], state: dict[str, torch.Tensor]) -> None:
    """model.safetensors.index.json for the files of `mapping` (HF name -> file index)."""
    files = max(mapping.values())
    weight_map = {name: f"model-{i:05d}-of-{files:05d}.safetensors" for name, i in mapping.items()}
    total = sum(state[name].numel() * state[name].element_size() for name in mapping)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


@torch.no_grad()
def save_hf_sharded(
    model: torch.nn.Module,
    out: str | pathlib.Path,
    dtype: torch.dtype,
    tokenizer,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    started_from: str = "",
) -> int:
    """Write the model as a HF folder from every rank of the job (call on all ranks), with the tensors it carries
    from the folder the run `started_from` (checkpoint.initial_load_path; hf_carried.py); returns the number of
    tensors the folder holds (on rank 0; the others count the model's only). A transformers-backend model is written
    as transformers saves its class."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter  # needs safetensors: checked below
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if hasattr(model, "save_hf_folder"):
        written = model.save_hf_folder(out, dtype, max_shard_size=max_file_bytes)
        if not dist.is_initialized() or dist.get_rank() == 0:
            copy_tokenizer_files(tokenizer, pathlib.Path(out))
            set_aside = list(getattr(model.hf, "_keys_to_ignore_on_load_unexpected", None) or [])
            written += carry_backend_tensors(pathlib.Path(out), set_aside, started_from, max_file_bytes)
        return written
    safetensors_module()
    out = pathlib.Path(out)
    args = model.args
    state = {}
    model_state = get_model_state_dict(model)
    warn_dropped_routing_bias(
        {n: t for n, t in model_state.items() if is_routing_bias(n) and not stored_in_hf(n, args)}, out
    )
    state.update(fused_export_state(model_state, args, dtype))
    for name, t in model_state.items():
        if not stored_in_hf(name, args) or is_fused_expert(name, args):
            continue
        t = t.detach().to(torch.float32 if is_routing_bias(name) else dtype)  # fp32 as the HF classes keep it
        if is_grouped_experts(name):  # each rank writes the experts it holds, one HF tensor each
            first, count = local_rows(t)
            local = t.to_local() if isinstance(t, DTensor) else t
            for j, hf in enumerate(expert_hf_names(name, args)[first : first + count]):
                state[hf] = local[j].T.contiguous()
            continue
        heads = rope_heads(name, args)
        to_hf = functools.partial(interleaved_to_half_split, rotary=args.rope_dim)
        state[to_hf_name(name, args)] = t if heads is None else _permute_rows(t, heads, to_hf)
    mapping = file_mapping(args, dtype.itemsize, max_file_bytes)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sharded, carried = out / "sharded", 0
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        sharded.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    writer = HuggingFaceStorageWriter(str(sharded), fqn_to_index_mapping=mapping, save_distributed=True)
    dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
    consolidate_hf_safetensors()(str(sharded), str(out), mapping)
    if rank == 0:
        shutil.rmtree(sharded)
        if not (out / INDEX).is_file():  # DCP writes the index only when a process group gathers the files
            _write_index(out, mapping, state)
        write_metadata(out, args, str(dtype).removeprefix("torch."), tokenizer)
        carried = carry_into_export(out, args, started_from, max_file_bytes)
    if dist.is_initialized():
        dist.barrier()
    return len(mapping) + carried


@torch.no_grad()
def export_hf(
    checkpoint: pathlib.Path,
    prefix: str,
    out: pathlib.Path,
    args: ModelArgs,
    dtype: torch.dtype | None,
    tokenizer,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    started_from: str = "",
) -> int:
    """Write a DCP checkpoint's model as a HF folder, one output file's tensors in memory at a time (one
    process), with the tensors it carries from the folder the run `started_from` (hf_carried.py); returns the
    number of tensors."""
    safetensors_module()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = load_metadata(checkpoint).state_dict_metadata
    saved = {
        k[len(prefix) :]: md
        for k, md in metadata.items()
        if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if not saved:
        raise ConfigError(f"--checkpoint {checkpoint} holds no model tensors")
    try:  # HF name -> (saved name, expert or None)
        names = {}
        for n in saved:
            if stored_in_hf(n, args) and not is_fused_expert(n, args):
                if is_grouped_experts(n):
                    names.update({hf: (n, e) for e, hf in enumerate(expert_hf_names(n, args))})
                else:
                    names[to_hf_name(n, args)] = (n, None)
        fused = fused_hf_names(args).items()  # each from several saved tensors
        names.update({hf: (parts, None) for hf, parts in fused if all(p in saved for p in parts)})
    except KeyError as e:
        raise ConfigError(
            f"{checkpoint} holds a tensor that no HF architecture of titanlite has ({e.args[0]})"
        ) from None
    biases = {
        prefix + n: torch.empty(md.size, dtype=md.properties.dtype)
        for n, md in saved.items()
        if is_routing_bias(n) and not stored_in_hf(n, args)
    }
    if biases:
        read_in_this_process(biases, checkpoint)
        warn_dropped_routing_bias(biases, out)
    itemsize = (dtype or next(iter(saved.values())).properties.dtype).itemsize
    mapping = file_mapping(args, itemsize, max_file_bytes)
    missing, extra = sorted(set(mapping) - set(names)), sorted(set(names) - set(mapping))
    if missing or extra:
        what = f"missing {missing[:5]}" if missing else f"it also holds {[names[n][0] for n in extra[:5]]}"
        raise ConfigError(f"{checkpoint} does not hold the model its model_args.json describes: {what}")
    for name, shape in args.parameter_shapes().items():
        if name in saved and tuple(saved[name].size) != shape:
            raise ConfigError(
                f"{checkpoint} does not hold the model its model_args.json describes: {name} has shape "
                f"{tuple(saved[name].size)} in the checkpoint but {shape} by model_args.json"
            )
    out.mkdir(parents=True, exist_ok=True)
    files = max(mapping.values())
    weight_map, total = {}, 0
    for index in range(1, files + 1):
        group = [hf for hf, i in mapping.items() if i == index]
        needed = {n for hf in group for n in _tuple(names[hf][0])}  # a grouped expert weight may be read for two files
        dest = {prefix + n: torch.empty(saved[n].size, dtype=saved[n].properties.dtype) for n in needed}
        read_in_this_process(dest, checkpoint)
        tensors = {}
        for hf in group:
            name, expert = names[hf]
            if isinstance(name, tuple):  # a fused expert tensor
                t, name = interleave([dest[prefix + n] for n in name]), name[0]
            else:
                t = dest[prefix + name] if expert is None else dest[prefix + name][expert].T
            t = t.to(dtype) if dtype is not None and t.is_floating_point() and not is_routing_bias(name) else t
            heads = rope_heads(name, args)
            tensors[hf] = (interleaved_to_half_split(t, heads, args.rope_dim) if heads else t).contiguous()
        file_name = f"model-{index:05d}-of-{files:05d}.safetensors"
        save_safetensors(tensors, out / file_name)
        for hf, t in tensors.items():
            weight_map[hf] = file_name
            total += t.numel() * t.element_size()
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    write_metadata(
        out, args, str(dtype or next(iter(saved.values())).properties.dtype).removeprefix("torch."), tokenizer
    )
    return len(weight_map) + carry_into_export(out, args, started_from, max_file_bytes)


def _tuple(names) -> tuple:
    return names if isinstance(names, tuple) else (names,)
