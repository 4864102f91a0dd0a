"""Sizing a job per rank without GPUs or a real process group (the dry run's report).

It builds the device mesh over a fake process group (as rank 0), the model on the meta device with
activation checkpointing, compile and FSDP applied as the Trainer does, and reports each rank's
parameter, gradient, optimizer, FSDP buffer and activation bytes against a GPU's memory (formulas in
titanlite.memory_estimate). `python -m titanlite.dry_run` is its CLI.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlite import memory_estimate as me
from titanlite.dtypes import dtype_bytes
from titanlite.model_builder import build_model
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallelize import ac_label, compile_problem, describe, describe_ac_compile

DEFAULT_GPU_MEM_GIB = 80.0
# Kept free for the CUDA context, NCCL's buffers and the caching allocator's fragmentation.
RESERVE_FRACTION = 0.10
GIB = 1024**3


def report(cfg, plan, world_size: int, where: str, gpu_mem_gib: float) -> tuple[list[str], bool]:
    """Build the sharded meta model over a fake process group and return (report lines, fits)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = plan.dims.build_mesh("cpu")  # the same plan as on GPUs; the fake group does no communication
        built = build_model(cfg, plan.model_args, mesh)
        # As the Trainer does next (allocates nothing: Adam's state appears at the first step).
        build_lr_scheduler(build_optimizer(built.model, cfg.optimizer), cfg.lr_scheduler, cfg.training.steps)
        state = me.sharded_state_bytes(built.model)
        units = me.unit_numels(built.model)
        total_params = sum(p.numel() for p in built.model.parameters())
        lines = describe(built.num_sharded, mesh, plan.dims)
    finally:
        dist.destroy_process_group()

    t, args = cfg.training, plan.model_args
    pbytes = dtype_bytes(t.mixed_precision_param)
    rbytes = dtype_bytes(t.mixed_precision_reduce)
    ac = cfg.activation_checkpoint
    tokens = t.local_batch_size * t.seq_len
    act = me.activation_bytes(
        args, tokens, pbytes, built.ac_blocks, ac.mode == "selective" and ac.selective_ac_option == "op"
    )
    buffers = me.fsdp_buffer_bytes(units, pbytes, rbytes, cfg.parallelism.fsdp_reshard_after_forward)
    on_cpu = t.enable_cpu_offload
    gpu_total = buffers + act["total"] + (0 if on_cpu else state.params + state.grads + state.optimizer)
    usable = gpu_mem_gib * (1 - RESERVE_FRACTION)
    fits = gpu_total / GIB <= usable
    where_state = "CPU (offloaded)" if on_cpu else "GPU"
    p_dtype = t.mixed_precision_param

    def row(name, what, nbytes):
        return f"  {name:<14}{what:<46}{nbytes / GIB:9.2f}"

    lines = (
        [
            f"titanlite dry run: {cfg.job.config_file or 'defaults'}",
            f"world: {world_size} ranks = {where}; no GPU and no real process group used",
        ]
        + lines
        + [
            f"model: {cfg.model.name} {cfg.model.flavor}, {total_params / 1e9:.2f}B parameters, "
            f"{args.n_layers} blocks; "
            f"per rank {t.local_batch_size} x {t.seq_len} tokens per microbatch, {plan.grad_accum} microbatch(es) "
            f"per step",
            describe_ac_compile(ac, built.ac_blocks, built.compiled, args.n_layers),
            "",
            "memory per rank (rank 0 holds the largest shard)                     GiB",
            row("parameters", f"fp32 shards on {where_state}", state.params),
            row("gradients", f"fp32 shards on {where_state}", state.grads),
            row("optimizer", f"{cfg.optimizer.name}, 2 x fp32 per parameter on {where_state}", state.optimizer),
            row("FSDP buffers", f"gathered units + unsharded grads ({p_dtype})", buffers),
            row("activations", f"{tokens} tokens, {p_dtype}, {ac_label(ac)}", act["total"]),
        ]
        + [row("", f"  {k}", v) for k, v in act.items() if k != "total"]
        + [
            row("total on GPU", "", gpu_total),
            f"  GPU memory    {gpu_mem_gib:.2f} GiB, {usable:.2f} usable ({RESERVE_FRACTION:.0%} kept for the CUDA "
            f"context, NCCL and fragmentation)",
            f"fits: {'yes' if fits else 'no'} ({gpu_total / GIB:.2f} of {usable:.2f} GiB usable)",
        ]
    )
    problem = compile_problem(cfg.compile, "cuda")
    if problem:
        lines.append(f"note: not checked here, but the GPU run will need it: {problem}")
    return lines, fits
