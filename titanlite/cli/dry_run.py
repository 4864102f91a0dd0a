"""`python -m titanlite.dry_run`: check a job and size its memory per rank without GPUs or a real process group.

    NGPU=8 NNODES=2 ./run_train.sh --config llama8b_hsdp --dry-run [--dry-run-gpu-mem-gib 80]
    (NGPU unset: the GPUs visible here, else 8 per node; NNODES unset: 1)
    python -m titanlite.dry_run --world-size 16 [--dry-run-gpu-mem-gib 80] --job.config_file X [overrides]

Exit status: 0 it fits, 1 it does not fit, 2 a configuration error (the message says which key).
"""

from __future__ import annotations

import os
import sys

import torch

from titanlite.config import load
from titanlite.errors import ConfigError
from titanlite.plan import validate_for_world
from titanlite.sizing.report import DEFAULT_GPU_MEM_GIB, report

DEFAULT_GPUS_PER_NODE = 8


def _take_option(argv: list[str], name: str) -> str | None:
    """Remove `name VALUE` or `name=VALUE` from argv and return VALUE (None when absent)."""
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value")
            value = argv[i + 1]
            del argv[i : i + 2]
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
            where = f"NNODES {nnodes} x NGPU {ngpu}" + (
                "" if os.environ.get("NGPU") else " (NGPU unset: the visible GPUs, else 8)"
            )
        cfg = load(argv)
        plan = validate_for_world(cfg, world_size, device_type=None)
        lines, fits = report(cfg, plan, world_size, where, gpu_mem_gib)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if fits else 1
