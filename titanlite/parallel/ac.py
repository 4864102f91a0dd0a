"""Activation checkpointing of the transformer blocks: full, every k-th block, or selective by op."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

# Selective "op" checkpointing keeps these outputs and recomputes everything else (norms, RoPE,
# activations, residual adds): the matmuls and attention are the expensive ops to run twice.
AC_SAVE_OPS = [
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,  # a linear with a bias (Qwen2's q/k/v)
    torch.ops.aten._grouped_mm.default,  # an MoE's experts
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
]


# FSDP runs its hooks under record_function; a unit inside a checkpointed block (an MoE block's experts) runs them a
# different number of times in the recompute than in forward, and selective checkpointing replays ops by count
# (torch 2.13). Annotations are not computation: selective checkpointing leaves them alone.
SAC_IGNORED_OPS.update(
    getattr(getattr(torch.ops.profiler, name), overload)
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
    for overload in getattr(torch.ops.profiler, name).overloads()
)

AC_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten._grouped_mm.default)


def _every_second_matmul_context():
    """TorchTitan's selective policy for one checkpointed call: keep attention and the 1st, 3rd, ... matmul of
    the block (in the decoder: q, v, the FFN gate and down projections), recompute the others and every cheap
    op. The recompute counts its matmuls the same way, so it keeps and recomputes the same ones."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func in AC_MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            keep = counts[key] % 2 == 1
        else:
            keep = func in AC_SAVE_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def problem(cfg, dims, args, device_type: str | None = None, inference: bool = False) -> str | None:
    """Why [activation_checkpoint] cannot run on this model, or None (generation checkpoints nothing)."""
    ac = cfg.activation_checkpoint
    if inference or ac.mode != "selective" or ac.selective_ac_option == "op":
        return None
    if int(ac.selective_ac_option) > args.n_layers:
        return (
            f"activation_checkpoint.selective_ac_option = {ac.selective_ac_option!r} checkpoints no "
            f"block of the {args.n_layers}; valid: 'op' or an integer from 1 to {args.n_layers}"
        )
    return None


def checkpointed_blocks(num_blocks: int, ac_cfg) -> list[int]:
    """Indices of the transformer blocks that activation checkpointing wraps.

    full or selective 'op': every block; selective k: every k-th block (k-1, 2k-1, ... as in TorchTitan).
    """
    if ac_cfg.mode == "none":
        return []
    if ac_cfg.mode == "full" or ac_cfg.selective_ac_option == "op":
        return list(range(num_blocks))
    k = int(ac_cfg.selective_ac_option)
    return [i for i in range(num_blocks) if (i + 1) % k == 0]


def ac_label(ac_cfg) -> str:
    """The AC mode as the log and the dry run print it: none, full, selective op, selective every k-th."""
    if ac_cfg.mode != "selective":
        return ac_cfg.mode
    if ac_cfg.selective_ac_option != "op":
        return f"selective every {ac_cfg.selective_ac_option}"
    every_second = getattr(ac_cfg, "selective_op_policy", "all_matmuls") == "every_second_matmul"
    return "selective op, half the matmuls" if every_second else "selective op"


def describe_ac_compile(ac_cfg, ac_blocks: list[int], compiled: int, num_blocks: int) -> str:
    """The start-up log line about activation checkpointing and compile."""
    where = f" on {len(ac_blocks)} of {num_blocks} blocks" if ac_blocks else ""
    return f"Activation checkpointing: {ac_label(ac_cfg)}{where}; compiled {compiled} of {num_blocks} blocks"


def apply_ac(model: nn.Module, ac_cfg) -> list[int]:
    """Activation checkpointing of `model.layers` per `[activation_checkpoint]`; call before fully_shard.

    Returns the indices of the wrapped blocks. Each block's forward is wrapped in place, so module
    structure, parameter names and state-dict keys are those of the model without checkpointing.
    """
    wrapped = checkpointed_blocks(len(model.layers), ac_cfg)
    context_fn = None
    if ac_cfg.mode == "selective" and ac_cfg.selective_ac_option == "op":
        if getattr(ac_cfg, "selective_op_policy", "all_matmuls") == "every_second_matmul":
            context_fn = _every_second_matmul_context
        else:
            context_fn = partial(create_selective_checkpoint_contexts, AC_SAVE_OPS)
    for i in wrapped:
        _checkpoint_forward(model.layers[i], context_fn)
    return wrapped


def _checkpoint_forward(block: nn.Module, context_fn) -> None:
    inner = block.forward
    extra = {} if context_fn is None else {"context_fn": context_fn}

    # An instance attribute, not a wrapper module: a wrapper (checkpoint_wrapper) would insert
    # `_checkpoint_wrapped_module.` into every parameter name, and init seeds and checkpoints use names.
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward
