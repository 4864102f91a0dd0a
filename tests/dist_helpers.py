"""Run a function in N gloo processes on CPU and collect what each rank returns."""

from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, kwargs, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TITANLITE_DEVICE="cpu")
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        result = fn(*args, **kwargs)
        if dist.is_initialized():
            dist.barrier()  # leave together (see titanlite.train.main)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_distributed(fn, world_size: int, *args, **kwargs) -> list:
    """fn(*args, **kwargs) on world_size spawned ranks (env as torchrun sets it); returns each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, _free_port(), fn, args, kwargs, out_dir), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
