"""Process group, device and seeding: nccl on cuda, gloo on cpu; the same code for both."""

from __future__ import annotations

import datetime
import logging
import os
import random
import re
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.errors import ConfigError
from titanlite.runtime.run_control import die_with_launcher


@dataclass(frozen=True)
class Env:
    """Where this process runs: its rank, the world, and the device it computes on."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 when run without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(local_rank: int) -> torch.device:
    """cuda:<local_rank> when GPUs are visible, else cpu (TITANLITE_DEVICE=cpu forces the CPU)."""
    if os.environ.get("TITANLITE_DEVICE", "") != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def too_few_gpus(processes: int, gpus: int) -> str:
    """The message for more processes on a node than GPUs (NCCL needs a GPU of its own for each)."""
    return (
        f"NGPU={processes} processes on this node, but {gpus} GPU(s) are visible: each process needs a GPU of its "
        f"own; set NGPU to at most {gpus}, or TITANLITE_DEVICE=cpu to run {processes} CPU processes with gloo"
    )


def init_distributed(hang_timeout_s: float = 0.0) -> Env:
    """Join (or, without torchrun, create a one-process) process group for this device. Its collectives time
    out after torch's default, or later than hang_timeout_s (titanlite.runtime.hang_watch reports a hang first). Under
    torchrun, this process dies with its launcher (run_control.die_with_launcher)."""
    die_with_launcher()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device.type == "cuda" and local_world > torch.cuda.device_count():
        raise ConfigError(too_few_gpus(local_world, torch.cuda.device_count()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # gloo too, for CPU-side collectives (async checkpoint staging)
    else:
        backend = "gloo"
    if not dist.is_initialized():
        timeout = None
        if hang_timeout_s > 0:
            timeout = max(datetime.timedelta(minutes=30), datetime.timedelta(seconds=hang_timeout_s + 120))
        # Without torchrun, a group of one on a port of its own; the environment is left alone, so that a process
        # running several jobs (the tests) never hands a port that may still be bound to its subprocesses.
        alone = (
            {}
            if "MASTER_ADDR" in os.environ
            else dict(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        )
        dist.init_process_group(
            backend=backend, device_id=device if device.type == "cuda" else None, timeout=timeout, **alone
        )
    return Env(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), device=device)


def shutdown(wait_for_peers: bool = False) -> None:
    """Leave the process group if one exists; after a clean run, first wait until every rank is done.

    Waiting matters with gloo: a rank that tears its groups down while a peer still exchanges data
    with it can abort the peer.
    """
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int):
    """End the process with `code` once everything is written, skipping the interpreter's teardown.

    gloo's worker threads release the tensors of the last collectives (a barrier holds on to the ones
    before it) on their own schedule. When that happens while the interpreter is finalizing, the thread
    cannot take the GIL, is unwound inside a noexcept destructor, and the whole process aborts
    ("terminate called without an active exception", SIGABRT; about 1 run in 40 at world 2 here). Files,
    checkpoints, TensorBoard and logs are closed before this is called, so the teardown has nothing to do.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def set_seed(seed: int, deterministic: bool = False) -> None:
    """The same seed on every rank (replicas must start identical)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace for reproducible matmuls (read when its first handle is made).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def gather_objects(obj) -> list:
    """Every rank's obj, in rank order ([obj] without a process group); a collective every rank calls."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a one-machine rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a collective raises when the process at the other end is gone (gloo: "Read error [10.0.0.2]:41234: Connection
# reset by peer", "Connection closed by peer [10.0.0.2]:41234"; NCCL: a remote error).
_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|remote process exited|ncclRemoteError")
_PEER = re.compile(r"\[([0-9A-Za-z.:_-]+)\]:\d+")


def lost_peer(error: BaseException) -> str | None:
    """When a collective failed because another rank's process is gone (its node ended or cannot be reached), that
    peer's address (or "another node" when the backend does not say); else None."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not _LOST.search(text):
        return None
    found = _PEER.search(text)
    return found.group(1) if found else "another node"


def nodes_from_env() -> int:
    """How many nodes the job spans, as torchrun set it (WORLD_SIZE / LOCAL_WORLD_SIZE)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return max(1, world_size_from_env() // local) if local else 1
