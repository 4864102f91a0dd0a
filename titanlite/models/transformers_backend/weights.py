"""A backend model's weights: drawn from (seed, module name) by the model's own initialisation, read from a
HuggingFace folder into this rank's shards, written as transformers saves them.

Initialisation holds one unit (a decoder layer, then the rest) at a time as full, plain tensors, runs the model's
`_init_weights` on each of its modules (children before their parent, as transformers does) with the random generator
seeded by (seed, module name), and keeps this rank's shard: the weights do not depend on the sharding.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import pathlib
import re
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.compat import transformers_load
from titanlite.errors import ConfigError
from titanlite.models.lora import adapter_init, is_adapter
from titanlite.models.nf4 import local_nf4, write_full

logger = logging.getLogger("titanlite")


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@torch.no_grad()
def init_by_name(hf: nn.Module, seed: int) -> None:
    """Initialise every parameter and persistent buffer of the transformers model `hf` (sharded or not) by its own
    `_init_weights`, seeded by (seed, module name), one unit at a time."""
    layers = [f"model.layers.{i}" for i in range(len(hf.model.layers))]
    untouched = []
    for unit in layers:
        untouched += _init_unit(hf, lambda n, u=unit: _in(n, [u]), seed)
    untouched += _init_unit(hf, lambda n: not _in(n, layers), seed)
    if untouched:
        raise ConfigError(
            f"{type(hf).__name__}._init_weights leaves {', '.join(untouched[:5])} unset (set in its constructor): the "
            "transformers backend cannot draw this model's weights from the seed yet; start from a folder with its "
            "weights"
        )


def _init_unit(hf: nn.Module, inside, seed: int) -> list[str]:
    """Initialise the modules whose names `inside` accepts on full tensors; the names of tensors left unset."""
    modules = [(n, m) for n, m in hf.named_modules() if inside(n)]
    full_of: dict[int, tuple[torch.Tensor, torch.Tensor, str]] = {}  # id(original) -> (original, full, name)
    swapped = []
    for name, module in modules:
        stores = [(module._parameters, set())] + [(module._buffers, module._non_persistent_buffers_set)]
        for store, skipped in stores:
            for attr, t in list(store.items()):
                if t is None or attr in skipped:
                    continue
                if id(t) not in full_of:
                    full = torch.empty(t.shape, dtype=t.dtype, device=_local(t).device)
                    full.fill_(float("nan")) if full.is_floating_point() else full.zero_()
                    if isinstance(t, nn.Parameter):
                        full = nn.Parameter(full, requires_grad=t.requires_grad)
                    full_of[id(t)] = (t, full, f"{name}.{attr}".lstrip("."))
                swapped.append((store, attr, t))
                store[attr] = full_of[id(t)][1]
    for name, module in reversed(modules):  # children before their parent: a parent may set a child's weight
        device = next((full.device for _, full, _ in full_of.values()), torch.device("cpu"))
        with torch.random.fork_rng(devices=[device] if device.type != "cpu" else []):
            torch.manual_seed(_name_seed(seed, name))
            hf._init_weights(module)
    untouched = []
    for original, full, name in full_of.values():
        if full.is_floating_point() and torch.isnan(full).any():
            untouched.append(name)
        if isinstance(original, DTensor):  # every rank drew the same full tensor: keep the local shard, no comms
            full = distribute_tensor(full.detach(), original.device_mesh, original.placements, src_data_rank=None)
        original.copy_(full.detach())
    for store, attr, original in swapped:
        store[attr] = original
    return untouched


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Every LoRA adapter parameter drawn as peft draws it (A Kaiming-uniform, B zero) from (seed, its name), on its
    full shape: the same adapters at any topology."""
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        full = torch.empty(p.shape, dtype=p.dtype, device=_local(p).device)
        adapter_init(name)(full, torch.Generator(device=full.device).manual_seed(_name_seed(seed, name)))
        if isinstance(p, DTensor):
            full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(full)


@torch.no_grad()
def init_buffers(hf: nn.Module) -> None:
    """The non-persistent buffers (rotary frequencies, embedding scales) from the model's `_init_weights`, its
    parameters left as they are."""
    params = list(hf.parameters())
    for p in params:
        p._is_hf_initialized = True
    try:
        for _, module in hf.named_modules():
            if module._non_persistent_buffers_set:
                hf._init_weights(module)
    finally:
        for p in params:
            del p._is_hf_initialized
    head, embedding = hf.lm_head, hf.model.embed_tokens  # (a pipeline stage may hold neither)
    if getattr(hf.config, "tie_word_embeddings", False) and head is not None and embedding is not None:
        if head.weight is not embedding.weight:
            head.weight = embedding.weight  # to_empty unties a plain (unsharded) model


@torch.no_grad()
def load_folder(hf: nn.Module, folder, part: bool = False) -> None:
    """This rank's shards from a HuggingFace folder, by transformers' loader (its renamings and fused experts); the
    parameter objects stay those the optimizer and FSDP hold. ConfigError naming the weights the folder lacks.
    part: the model holds this rank's pipeline stages only."""
    folder = pathlib.Path(folder)
    files = sorted(glob.glob(str(folder / "*.safetensors")))
    if not files:
        logger.info(f"{folder} holds a config.json and no weights: the model's weights are drawn from training.seed")
        return
    before = dict(hf.named_parameters(remove_duplicate=False))
    before.update(dict(hf.named_buffers(remove_duplicate=False)))
    quantized = {n: p for n, p in before.items() if local_nf4(p) is not None}
    with _read_whole(hf, quantized):  # QLoRA's 4-bit weights: each read whole, quantized, this rank's rows kept
        info = transformers_load(hf, str(folder), files, take={n: partial(write_full, p) for n, p in quantized.items()})
    for name, original in before.items():
        owner_name, _, attr = name.rpartition(".")
        owner = hf.get_submodule(owner_name)
        loaded = getattr(owner, attr)
        if loaded is original:
            continue
        src, dst = _local(loaded), _local(original)
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)
        (owner._parameters if attr in owner._parameters else owner._buffers)[attr] = original
    tied = set(getattr(hf, "all_tied_weights_keys", {}) or {})
    missing = sorted(k for k in info.missing_keys if k not in tied and not is_adapter(k))
    if missing:
        raise ConfigError(
            f"checkpoint.initial_load_path = {str(folder)!r} lacks {len(missing)} of the model's weights "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); is it a folder of this model?"
        )
    mismatched = sorted(getattr(info, "mismatched_keys", ()) or ())
    if mismatched:
        raise ConfigError(f"checkpoint.initial_load_path = {str(folder)!r}: weights of other shapes: {mismatched[:3]}")
    # (a pipeline stage's rank leaves the other stages' parts to their ranks: not the text model's extras)
    elsewhere = re.compile(r"^(model\.(layers\.\d+|embed_tokens|norm)|lm_head)\.") if part else re.compile("$^")
    extra = sorted(k for k in info.unexpected_keys if not elsewhere.match(k))
    if extra and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            f"{folder}: {len(extra)} tensors that the text model does not hold are left out (e.g. {extra[0]}; a "
            "vision tower or multi-token-prediction layers): not trained; HF exports carry those the model's class "
            "sets aside on load, and all of a multimodal folder's (its export keeps the folder's layout)"
        )
    init_buffers(hf)


@contextmanager
def _read_whole(hf: nn.Module, quantized: dict[str, torch.Tensor]):
    """Each NF4 weight set aside for a placeholder of its full shape and dtype on the meta device while transformers'
    loader runs (which then reads it whole, as a plain tensor); put back after."""
    owners = {n: hf.get_submodule(n.rpartition(".")[0]) for n in quantized}
    for n, owner in owners.items():
        owner._parameters[n.rpartition(".")[2]] = nn.Parameter(
            torch.empty(quantized[n].shape, dtype=quantized[n].dtype, device="meta"), requires_grad=False
        )
    try:
        yield
    finally:
        for n, owner in owners.items():
            owner._parameters[n.rpartition(".")[2]] = quantized[n]


def save_folder(model: nn.Module, out, dtype: torch.dtype, max_shard_size: str | int = "5GB") -> int:
    """Write `model` (a BackendModel, sharded or not) as transformers saves its class: its names, config.json and
    sharded safetensors with an index; the number of tensors written. Every rank gathers the full weights to the
    CPU; rank 0 writes."""
    if dist.is_initialized():
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:  # (an export of a saved checkpoint, in one process)
        state = model.state_dict()
    if dist.is_initialized() and dist.get_rank() != 0:
        return sum(1 for k in state if not is_adapter(k))
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    state = {  # buffers keep their dtype; adapters are merged into their weights before (lora_export) or not written
        k: v.to(dtype) if k in params and v.is_floating_point() else v for k, v in state.items() if not is_adapter(k)
    }
    config, before = model.hf.config, (model.hf.config.use_cache, getattr(model.hf.config, "dtype", None))
    config.use_cache, config.dtype = True, dtype  # as transformers' own folders say (titanlite trains without one)
    try:
        model.hf.save_pretrained(str(out), state_dict=state, max_shard_size=max_shard_size)
    finally:
        config.use_cache, config.dtype = before
    return len(state)
