"""The start-up summary: world, parameter counts in total and per rank, and a per-rank memory estimate."""

from __future__ import annotations

import math

from torch import nn

from titanlite.flops import flops_per_token, param_counts

# Adam and AdamW keep two fp32-shaped states per parameter (exp_avg, exp_avg_sq).
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2}


def sharded_numel(shape: tuple[int, ...], shard: int) -> int:
    """Elements of one rank's shard of a parameter sharded on dim 0 over `shard` ranks, padding included."""
    if not shape:
        return 1
    return math.ceil(shape[0] / shard) * math.prod(shape[1:])


def per_rank_bytes(model: nn.Module, shard: int, optimizer_states: int) -> dict[str, int]:
    """Estimated bytes on each rank for the sharded parameters, their gradients and the optimizer state.

    FSDP2 keeps each parameter as a dim-0 shard padded to ceil(rows / shard) rows, its gradient in the
    same dtype, and the optimizer keeps `optimizer_states` tensors shaped like each shard. Activations
    and the transient all-gathered (unsharded) copies of the blocks being computed are not included.
    """
    params = sum(sharded_numel(tuple(p.shape), shard) * p.element_size() for p in model.parameters())
    return {"parameters": params, "gradients": params, "optimizer": optimizer_states * params}


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def startup_lines(model: nn.Module, model_args, dims, cfg) -> list[str]:
    """Log lines describing the world, the model's size in total and per rank, and per-rank memory."""
    counts = param_counts(model_args)
    shard = dims.dp_shard
    local = sum(sharded_numel(tuple(p.shape), shard) for p in model.parameters())
    states = OPTIMIZER_STATES.get(cfg.optimizer.name, 2)
    mem = per_rank_bytes(model, shard, states)
    fpt = flops_per_token(model_args, cfg.training.seq_len)
    return [
        f"World size {dims.world_size}: data-parallel degree {dims.dp_degree} "
        f"(replicate {dims.dp_replicate} x shard {dims.dp_shard})",
        f"Model {cfg.model.name} {cfg.model.flavor}: {counts['total']:,} parameters "
        f"({counts['non_embedding']:,} non-embedding), {local:,} per rank (1/{shard} each, padding included)",
        f"Per-rank memory estimate: parameters {human_bytes(mem['parameters'])} + gradients "
        f"{human_bytes(mem['gradients'])} + optimizer {human_bytes(mem['optimizer'])} ({cfg.optimizer.name}, "
        f"{states} states) = {human_bytes(sum(mem.values()))}, plus activations and gathered blocks",
        f"FLOPs per token: {fpt:.4g} (6 x non-embedding parameters + 12 x layers x heads x head_dim x seq_len "
        f"{cfg.training.seq_len})",
    ]
