"""FSDP2 and HSDP: the only module that calls `fully_shard`, and gradient synchronisation with accumulation.

Each group the model names gets its own `fully_shard` with the configured MixedPrecisionPolicy,
reshard policy and optional CPU offload; the root is sharded last. A 1-D mesh gives FSDP; a 2-D
("dp_replicate", "dp_shard") mesh gives HSDP (or plain replication when the shard size is 1).
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titanlite.dtypes import TORCH_DTYPES
from titanlite.models.nf4 import local_nf4
from titanlite.parallel.ep import expert_fsdp_mesh


def problem(cfg, dims, args=None, device_type: str | None = None, inference: bool = False) -> str | None:
    """Why FSDP cannot shard this mesh with the configured reshard policy, or None (inference reshards always)."""
    raf = cfg.parallelism.fsdp_reshard_after_forward
    if not inference and raf.isdigit() and dims.dp_shard % int(raf):
        return (
            f"parallelism.fsdp_reshard_after_forward = {raf} must divide the shard degree "
            f"{dims.dp_shard}; valid: default, always, never or a divisor of {dims.dp_shard}"
        )
    return None


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
    expert_mesh: DeviceMesh | None = None,
) -> int:
    """Shard each MoE block's experts (`model.expert_units()`, on expert_mesh: parallel/ep.py), each group from
    `model.shard_groups()`, and then the root; returns the number of fully_shard units besides the root."""
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[reduce_dtype])
    # Pinned host memory needs an accelerator; on a CPU-only mesh offloading is a no-op anyway.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    groups = model.shard_groups()
    policy = reshard_after_forward_policy(reshard_after_forward, len(groups))
    experts = model.expert_units() if hasattr(model, "expert_units") else []
    for unit in experts:  # before its block's fully_shard, which then leaves the experts' parameters to it
        reshard = next(r for modules, r in zip(groups, policy) if any(unit in m.modules() for m in modules))
        fully_shard(
            unit, mesh=expert_fsdp_mesh(expert_mesh, mesh), mp_policy=mp, offload_policy=offload,
            reshard_after_forward=reshard,
        )  # fmt: skip
    # QLoRA's 4-bit weights on a shard group of one rank: torch 2.13's FSDP2 then copies only the first of an
    # all-gather extension's inputs, so FSDP leaves them alone (frozen: nothing to reduce either).
    ignored = {p for p in model.parameters() if local_nf4(p) is not None} if mesh.size(mesh.ndim - 1) == 1 else None
    for modules, reshard in zip(groups, policy):
        target = modules[0] if len(modules) == 1 else modules
        fully_shard(
            target, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard,
            ignored_params=ignored,
        )  # fmt: skip
    fully_shard(
        model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=policy[-1],
        ignored_params=ignored,
    )  # fmt: skip
    return len(groups) + len(experts)


def describe(num_groups: int, mesh: DeviceMesh, dims, parallelism=None, roots: int = 1) -> list[str]:
    """The start-up log lines about the sharding (num_groups as returned by apply_fsdp, summed over the roots: this
    rank's pipeline stages, or the model; parallelism: the config section, for the TP line)."""
    root = "root" if roots == 1 else f"{roots} stage roots"
    lines = [
        dims.describe(),
        f"Sharded {num_groups} modules + {root} on mesh {tuple(mesh.mesh_dim_names)} {tuple(mesh.shape)}",
    ]
    if parallelism is not None and (
        tp := dims.describe_tp(parallelism.enable_sequence_parallel, parallelism.enable_loss_parallel)
    ):
        lines.insert(1, tp)
    if getattr(dims, "ep", 1) > 1:
        lines.insert(-1, f"EP: expert_parallel_size={dims.ep}, experts FSDP-sharded over {dims.expert_fsdp} rank(s)")
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
        if getattr(dims, "pp", 1) > 1:
            return "every_microbatch", (
                "parallelism.gradient_sync = last_microbatch_only has no effect with pipeline parallelism: each "
                "stage already reduces its gradients once per local batch, after its last pipeline microbatch"
            )
        if grad_accum > 1:
            return mode, (
                f"Gradient sync on the last of {grad_accum} microbatches only: unsharded gradients "
                "are held on every rank in between (ZeRO-2-like memory)"
            )
        return "every_microbatch", "parallelism.gradient_sync = last_microbatch_only has no effect with one microbatch"
    return mode, None


@contextmanager
def microbatch_sync(model: nn.Module | list[nn.Module], is_last: bool, mode: str):
    """Gradient synchronisation for one microbatch of an accumulated step, by gradient_sync mode (model: the FSDP
    root, or a list of them: pipeline stages).

    every_microbatch: FSDP's default (reduce-scatter, and across replicas all-reduce, on each
    microbatch). delay_all_reduce: the replicate-group all-reduce runs only on the last
    microbatch; the reduce-scatter inside the shard group still runs on every one.
    last_microbatch_only: no reduction at all before the last microbatch.
    """
    roots = [m for m in (model if isinstance(model, (list, tuple)) else [model]) if isinstance(m, FSDPModule)]
    setter = _SYNC_SETTERS.get(mode)
    for root in roots if setter else []:
        getattr(root, setter)(is_last)  # recurses into every FSDP module
    try:
        yield
    finally:
        for root in roots if setter else []:
            getattr(root, setter)(True)
