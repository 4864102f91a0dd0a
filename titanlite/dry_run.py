"""`python -m titanlite.dry_run`: check a job and size its memory per rank without GPUs or a real process group.

It runs the run's own checks for the configured world size, builds the device mesh over a fake
process group (as rank 0), the model on the meta device with activation checkpointing, compile and
FSDP applied as the Trainer does, and prints each rank's parameter, gradient, optimizer, FSDP buffer
and activation bytes against a GPU's memory (formulas in titanlite.memory_estimate).

    NGPU=8 NNODES=2 ./run_train.sh --config llama8b_hsdp --dry-run [--dry-run-gpu-mem-gib 80]
    (NGPU unset: the GPUs visible here, else 8 per node; NNODES unset: 1)
    python -m titanlite.dry_run --world-size 16 [--dry-run-gpu-mem-gib 80] --job.config_file X [overrides]

Exit status: 0 it fits, 1 it does not fit, 2 a configuration error (the message says which key).
"""

from __future__ import annotations

import os
import sys

from titanlite import config as config_mod
from titanlite.config import ConfigError

DEFAULT_GPUS_PER_NODE = 8
DEFAULT_GPU_MEM_GIB = 80.0
# Kept free for the CUDA context, NCCL's buffers and the caching allocator's fragmentation.
RESERVE_FRACTION = 0.10
GIB = 1024**3


def _take_option(argv: list[str], name: str) -> str | None:
    """Remove `name VALUE` or `name=VALUE` from argv and return VALUE (None when absent)."""
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value")
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if arg.startswith(name + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def _positive_number(name: str, value: str, kind=float):
    try:
        number = kind(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ConfigError(f"{name} = {value!r} is not valid; expected a number > 0")
    return number


def world_from_env(env=os.environ) -> tuple[int, int, int]:
    """(world size, GPUs per node, nodes) from NGPU and NNODES; NGPU defaults to the visible GPUs, else 8."""
    ngpu = _positive_number("NGPU", env.get("NGPU") or str(_visible_gpus() or DEFAULT_GPUS_PER_NODE), int)
    nnodes = _positive_number("NNODES", env.get("NNODES") or "1", int)
    return ngpu * nnodes, ngpu, nnodes


def _visible_gpus() -> int:
    import torch
    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    """Entry point: prints the plan and the memory table; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = [a for a in argv if a != "--dry-run"]
        gpu_mem = _take_option(argv, "--dry-run-gpu-mem-gib")
        gpu_mem_gib = _positive_number("--dry-run-gpu-mem-gib", gpu_mem) if gpu_mem else DEFAULT_GPU_MEM_GIB
        world = _take_option(argv, "--world-size")
        if world:
            world_size, where = _positive_number("--world-size", world, int), "--world-size"
        else:
            world_size, ngpu, nnodes = world_from_env()
            where = f"NNODES {nnodes} x NGPU {ngpu}" + ("" if os.environ.get("NGPU") else
                                                        " (NGPU unset: the visible GPUs, else 8)")
        cfg = config_mod.load(argv)
        from titanlite.train import validate_for_world
        plan = validate_for_world(cfg, world_size, rank=0, device_type=None)
        lines, fits = report(cfg, plan, world_size, where, gpu_mem_gib)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if fits else 1


def report(cfg, plan, world_size: int, where: str, gpu_mem_gib: float) -> tuple[list[str], bool]:
    """Build the sharded meta model over a fake process group and return (report lines, fits)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlite import memory_estimate as me
    from titanlite.optim import build_lr_scheduler, build_optimizer
    from titanlite.parallelize import ac_label, compile_problem, describe, describe_ac_compile
    from titanlite.train import build_model

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
    pbytes = me.DTYPE_BYTES[t.mixed_precision_param]
    rbytes = me.DTYPE_BYTES[t.mixed_precision_reduce]
    ac = cfg.activation_checkpoint
    tokens = t.local_batch_size * t.seq_len
    act = me.activation_bytes(args, tokens, pbytes, built.ac_blocks, ac.mode == "selective" and
                              ac.selective_ac_option == "op")
    buffers = me.fsdp_buffer_bytes(units, pbytes, rbytes, cfg.parallelism.fsdp_reshard_after_forward)
    on_cpu = t.enable_cpu_offload
    gpu_total = buffers + act["total"] + (0 if on_cpu else state.params + state.grads + state.optimizer)
    usable = gpu_mem_gib * (1 - RESERVE_FRACTION)
    fits = gpu_total / GIB <= usable
    where_state = "CPU (offloaded)" if on_cpu else "GPU"
    p_dtype = t.mixed_precision_param

    def row(name, what, nbytes):
        return f"  {name:<14}{what:<46}{nbytes / GIB:9.2f}"

    lines = [f"titanlite dry run: {cfg.job.config_file or 'defaults'}",
             f"world: {world_size} ranks = {where}; no GPU and no real process group used"] + lines + [
        f"model: {cfg.model.name} {cfg.model.flavor}, {total_params / 1e9:.2f}B parameters, {args.n_layers} blocks; "
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
    ] + [row("", f"  {k}", v) for k, v in act.items() if k != "total"] + [
        row("total on GPU", "", gpu_total),
        f"  GPU memory    {gpu_mem_gib:.2f} GiB, {usable:.2f} usable ({RESERVE_FRACTION:.0%} kept for the CUDA "
        f"context, NCCL and fragmentation)",
        f"fits: {'yes' if fits else 'no'} ({gpu_total / GIB:.2f} of {usable:.2f} GiB usable)",
    ]
    problem = compile_problem(cfg.compile, "cuda")
    if problem:
        lines.append(f"note: not checked here, but the GPU run will need it: {problem}")
    return lines, fits


if __name__ == "__main__":
    from titanlite.dry_run import main as _main  # the imported module, so ConfigError is the shared class
    raise SystemExit(_main())
