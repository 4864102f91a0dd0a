"""What the fault-tolerance benchmarks share (benchmarks/fault_tolerance.py, benchmarks/ft_chaos.py): the tiny run's
arguments, torchrun and replica-group command lines, a lighthouse, the step lines of a log, a worker's pid and a
checkpoint's tensors."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"step: +(\d+)  loss: +([\d.]+)  grad_norm: +([\d.]+).*?(?:replicas: (\d)/\d)?  elapsed")
PACE = ROOT / "tests" / "faults"  # its sitecustomize paces steps (TITANLITE_STEP_PAUSE); test-only, like here


def run_env(pause: float = 0.0) -> dict:
    path = [str(PACE)] if pause else []
    env = {**os.environ, "TITANLITE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(path + [str(ROOT), os.environ.get("PYTHONPATH", "")])
    if pause:
        env["TITANLITE_STEP_PAUSE"] = str(pause)
    return env


def torchrun(nproc: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", "localhost:0", "-m", "titanlite.train", *args]  # fmt: skip


def train_argv(dump: Path, steps: int, *extra) -> list[str]:
    return ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", str(steps),
            "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps",
            "2", "--training.global_batch_size", "8", "--training.local_batch_size", "2", "--job.dump_folder",
            str(dump), "--checkpoint.enable", "--checkpoint.interval", str(steps), *extra]  # fmt: skip


def ft_args(group: int, lighthouse: str, *extra, groups: int = 2) -> list[str]:
    return ["--fault_tolerance.enable", "true", "--fault_tolerance.group_count", str(groups),
            "--fault_tolerance.replica_id", str(group), "--fault_tolerance.lighthouse", lighthouse,
            "--fault_tolerance.timeout_seconds", "3", *extra]  # fmt: skip


def start_lighthouse():
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50, heartbeat_timeout_ms=1500
    )


def flat(tree, prefix="") -> dict:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}.{key}").items()}
    return {}


def tensors(folder: Path, part: str) -> dict:
    """One part ("model", "optimizer") of a DCP checkpoint, every tensor by its dotted name, loaded here."""
    sd: dict = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)  # fmt: skip
    return flat(sd[part])


def step_lines(text: str) -> list[tuple]:
    return [(int(s), loss, norm, int(r or 0)) for s, loss, norm, r in STEP.findall(text)]


def worker_of(pid: int) -> int:
    for _ in range(200):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        if kids:
            return kids[-1]
        time.sleep(0.05)
    raise SystemExit("no worker started")
