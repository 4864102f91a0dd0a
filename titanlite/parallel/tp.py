"""Tensor parallelism: the family's plan (models/<family>/) applied over the "tp" mesh, before AC, compile and FSDP."""

from __future__ import annotations

import os
import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.models.family import BACKEND
from titanlite.models.hf_config import hf_folder
from titanlite.models.registry import tp_plan
from titanlite.models.transformers_backend.tp import parallelize_backend


def problem(cfg, dims, args, device_type: str | None = None, inference: bool = False) -> str | None:
    """Why parallelism.tensor_parallel_degree cannot split this model or sequence, or None. inference: generation's
    plan, without sequence parallelism."""
    tp = dims.tp
    if tp == 1:
        return None
    key = f"parallelism.tensor_parallel_degree = {tp}"
    folder = hf_folder(cfg.checkpoint.initial_load_path) if cfg.model.flavor == "hf" else None
    splits = [
        ("query heads", args.n_heads, "n_heads", "num_attention_heads"),
        ("KV heads", args.kv_heads, "n_kv_heads", "num_key_value_heads"),
        ("FFN hidden size", args.ffn_hidden_dim, "", "intermediate_size"),
    ]
    for what, n, flavor_field, hf_key in splits:
        if n % tp:
            valid = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)
            kv_note = "; KV heads are not replicated across tp ranks" if what == "KV heads" else ""
            if folder is not None:  # the shape is the HF folder's: only another degree helps
                where, other = f"{hf_key} in {folder / 'config.json'}{kv_note}", ""
            else:
                where = "model.flavor" + (f" (its {flavor_field}{kv_note})" if flavor_field else "")
                other = f", or a flavor whose {what} tp divides"
            return f"{key} does not divide the model's {n} {what} ({where}); valid: {valid}{other}"
    if args.vocab_size % tp:
        valid = ", ".join(str(d) for d in range(1, 65) if args.vocab_size % d == 0)
        return (
            f"{key} does not divide the vocabulary of {args.vocab_size} rows (the embedding and the output "
            f"projection are split over it, and checkpoints keep the real vocabulary); valid: {valid}"
        )
    p = cfg.parallelism
    if p.enable_sequence_parallel and not inference and cfg.training.seq_len % tp:
        return (
            f"{key} with parallelism.enable_sequence_parallel = true splits every sequence over the tp ranks, but "
            f"training.seq_len = {cfg.training.seq_len} is not a multiple of {tp}; valid: a multiple of {tp}, or "
            f"enable_sequence_parallel = false"
        )
    return None


def cross_node_warning(dims) -> str | None:
    """A warning when the tp degree is larger than a node's processes: every block's collectives would cross the
    network."""
    per_node = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("NGPU")
    if dims.tp > 1 and per_node and per_node.isdigit() and dims.tp > int(per_node):
        return (
            f"parallelism.tensor_parallel_degree = {dims.tp} is larger than the {per_node} processes per node: tensor "
            "parallelism across nodes runs every block's collectives over the network; keep tp within a node (FSDP "
            "or HSDP across nodes)"
        )
    return None


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    family: str,
    sequence_parallel: bool,
    loss_parallel: bool,
    inference: bool = False,
    float8_tensorwise: bool = False,
):
    """Tensor parallelism over tp_mesh by the family's plan (models/<family>/); call after [float8]'s conversion and
    before AC, compile and FSDP. float8_tensorwise: the float8 linears take torchao's float8 styles, which cast
    activations to float8 before their all-gathers."""
    plan = parallelize_backend if getattr(model.args, "family", "") == BACKEND else tp_plan(family)
    plan(
        model,
        tp_mesh,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        inference=inference,
        float8_tensorwise=float8_tensorwise,
    )
    # The split embedding returns a view; FSDP warns that an in-place op on it would skip its backward hook. The
    # decoder adds to the residual stream out of place, so the warning would only alarm.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")
