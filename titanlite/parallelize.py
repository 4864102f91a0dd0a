"""Apply FSDP2 to a model: the only module that calls `fully_shard`; and, before it, tensor parallelism (the
family's plan), activation checkpointing and torch.compile of the transformer blocks.

Each group the model names gets its own `fully_shard` with the configured MixedPrecisionPolicy,
reshard policy and optional CPU offload; the root is sharded last. A 1-D mesh gives FSDP; a 2-D
("dp_replicate", "dp_shard") mesh gives HSDP (or plain replication when the shard size is 1).
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titanlite.compat import cpp_compiler_error, has_triton
from titanlite.dtypes import TORCH_DTYPES
from titanlite.models.registry import tp_plan

logger = logging.getLogger("titanlite")


def reshard_after_forward_policy(value: str, num_groups: int) -> list[bool | int]:
    """The `reshard_after_forward` argument for each group and then the root (num_groups + 1 values).

    default: reshard every group except the last one run in forward and the root (backward needs
    their parameters again at once); always / never: the same for all; an int N: after forward,
    keep the parameters sharded over groups of N ranks (a smaller all-gather in backward).
    """
    if value == "always":
        return [True] * (num_groups + 1)
    if value == "never":
        return [False] * (num_groups + 1)
    if value == "default":
        return [True] * (num_groups - 1) + [False, False]
    return [int(value)] * (num_groups + 1)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: str = "bfloat16",
    reduce_dtype: str = "float32",
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
) -> int:
    """Shard each group from `model.shard_groups()` and then the root; returns the number of groups."""
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[reduce_dtype])
    # Pinned host memory needs an accelerator; on a CPU-only mesh offloading is a no-op anyway.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    groups = model.shard_groups()
    policy = reshard_after_forward_policy(reshard_after_forward, len(groups))
    for modules, reshard in zip(groups, policy):
        target = modules[0] if len(modules) == 1 else modules
        fully_shard(target, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=policy[-1])
    return len(groups)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, family: str, sequence_parallel: bool, loss_parallel: bool):
    """Tensor parallelism over tp_mesh by the family's plan (models/<family>/); call before AC, compile and FSDP."""
    tp_plan(family)(model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    # The split embedding returns a view; FSDP warns that an in-place op on it would skip its backward hook. The
    # decoder adds to the residual stream out of place, so the warning would only alarm.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")


def describe(num_groups: int, mesh: DeviceMesh, dims, parallelism=None) -> list[str]:
    """The start-up log lines about the sharding (num_groups as returned by apply_fsdp; parallelism: the config
    section, for the TP line)."""
    lines = [
        dims.describe(),
        f"Sharded {num_groups} modules + root on mesh {tuple(mesh.mesh_dim_names)} {tuple(mesh.shape)}",
    ]
    if parallelism is not None and (
        tp := dims.describe_tp(parallelism.enable_sequence_parallel, parallelism.enable_loss_parallel)
    ):
        lines.insert(1, tp)
    return lines


# The FSDPModule setter that each gradient_sync mode turns off before the last microbatch.
_SYNC_SETTERS = {"delay_all_reduce": "set_requires_all_reduce", "last_microbatch_only": "set_requires_gradient_sync"}


def gradient_sync_plan(mode: str, dims, grad_accum: int) -> tuple[str, str | None]:
    """The gradient_sync mode that applies to this mesh and accumulation, and the log line saying so.

    delay_all_reduce needs replicas (data_parallel_replicate_degree > 1) and more than one
    microbatch; last_microbatch_only needs more than one microbatch (it works for FSDP too).
    Otherwise the mode falls back to every_microbatch, with a line that says why.
    """
    if mode == "delay_all_reduce":
        if dims.dp_replicate > 1 and grad_accum > 1:
            return mode, f"Delayed all-reduce: replicate all-reduce on the last of {grad_accum} microbatches"
        return "every_microbatch", (
            "parallelism.gradient_sync = delay_all_reduce (hsdp_delay_all_reduce) has no effect: it needs "
            f"data_parallel_replicate_degree > 1 and more than one microbatch (have replicate {dims.dp_replicate}, "
            f"{grad_accum} microbatch(es))"
        )
    if mode == "last_microbatch_only":
        if grad_accum > 1:
            return mode, (
                f"Gradient sync on the last of {grad_accum} microbatches only: unsharded gradients "
                "are held on every rank in between (ZeRO-2-like memory)"
            )
        return "every_microbatch", "parallelism.gradient_sync = last_microbatch_only has no effect with one microbatch"
    return mode, None


@contextmanager
def microbatch_sync(model: nn.Module, is_last: bool, mode: str):
    """Gradient synchronisation for one microbatch of an accumulated step, by gradient_sync mode.

    every_microbatch: FSDP's default (reduce-scatter, and across replicas all-reduce, on each
    microbatch). delay_all_reduce: the replicate-group all-reduce runs only on the last
    microbatch; the reduce-scatter inside the shard group still runs on every one.
    last_microbatch_only: no reduction at all before the last microbatch.
    """
    setter = _SYNC_SETTERS.get(mode) if isinstance(model, FSDPModule) else None
    if setter:
        getattr(model, setter)(is_last)  # recurses into every FSDP module
    try:
        yield
    finally:
        if setter:
            getattr(model, setter)(True)


# Selective "op" checkpointing keeps these outputs and recomputes everything else (norms, RoPE,
# activations, residual adds): the matmuls and attention are the expensive ops to run twice.
_AC_SAVE_OPS = [
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,  # a linear with a bias (Qwen2's q/k/v)
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
]


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _every_second_matmul_context():
    """TorchTitan's selective policy for one checkpointed call: keep attention and the 1st, 3rd, ... matmul of
    the block (in the decoder: q, v, the FFN gate and down projections), recompute the others and every cheap
    op. The recompute counts its matmuls the same way, so it keeps and recomputes the same ones."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func in _MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            keep = counts[key] % 2 == 1
        else:
            keep = func in _AC_SAVE_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


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
            context_fn = partial(create_selective_checkpoint_contexts, _AC_SAVE_OPS)
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


def compile_problem(compile_cfg, device_type: str) -> str | None:
    """Why `[compile]` cannot work on this machine for `device_type`, or None when it can (or is off)."""
    if not compile_cfg.enable or compile_cfg.backend != "inductor":
        return None
    if device_type == "cpu":
        error = cpp_compiler_error()
        if error is not None:
            return (
                f"compile.enable = true with compile.backend = 'inductor' needs a C++ compiler on CPU and none "
                f"was found ({type(error).__name__}); install g++ or set CXX, use compile.backend = 'aot_eager', "
                f"or set compile.enable = false"
            )
    elif device_type == "cuda" and not has_triton():
        return (
            "compile.enable = true with compile.backend = 'inductor' needs triton on GPUs and it is not "
            "installed; pip install triton, or set compile.enable = false"
        )
    return None


def apply_compile(model: nn.Module, compile_cfg) -> int:
    """torch.compile each block of `model.layers` in place (after apply_ac, before fully_shard); returns the count.

    `Module.compile` keeps the module and its parameter names; identical blocks share one compiled graph.
    """
    if not compile_cfg.enable:
        return 0
    for block in model.layers:
        block.compile(backend=compile_cfg.backend, fullgraph=True)
    return len(model.layers)
