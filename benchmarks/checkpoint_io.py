"""Checkpoint save and load throughput to a local disk and to an S3 endpoint, through titanlite's own storage path
(titanlite.storage.dcp_writer, the manifest's checksums, safe_dcp_load), sync and async; and how long an async save
blocks the training step (DCP's staging copy, after which the step goes on).

    python benchmarks/checkpoint_io.py [--models debug 1B] [--targets local s3] [--reps 2]

The debug model's state is a training checkpoint: its weights and AdamW's two moments, fp32 (the Llama 3 shape of
train_configs/debug_model.toml). The 1B's is Llama 3.2 1B's weights in bf16 (2.3 GiB, what its model-only save
holds); fp32 weights with moments (14 GiB) do not fit moto's in-memory store on a 24 GiB machine. s3 is moto's server
on this machine (`pip install 'moto[server]'`), reached through s3fs as a real endpoint would be; without
AWS_ENDPOINT_URL set the script starts one. Runs are interleaved (local, s3, local, s3,
...) and the median of --reps is printed; one process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from titanlite.checkpoint.integrity import write_rank_manifest  # noqa: E402
from titanlite.checkpoint.safe_reading import safe_dcp_load  # noqa: E402
from titanlite.storage import dcp_writer, location, remove_tree  # noqa: E402

VOCAB = {"debug": None, "1B": 128256}  # None: the built-in byte tokenizer's
FLAVOR = {"debug": "debugmodel", "1B": "3.2-1B"}


def model_state(name: str) -> dict:
    """Random tensors shaped as the model's checkpoint: fp32 weights and AdamW's moments (debug), bf16 weights (1B)."""
    from titanlite.config import load
    from titanlite.data.tokenizers import build_tokenizer
    from titanlite.models.registry import model_args, model_class

    cfg = load(["--model.flavor", FLAVOR[name]])
    args = model_args(cfg.model, VOCAB[name] or build_tokenizer("").vocab_size, cfg.training.seq_len)
    with torch.device("meta"):
        shapes = {k: p.shape for k, p in model_class(cfg.model.name)(args).named_parameters()}
    dtype = torch.float32 if name == "debug" else torch.bfloat16
    state = {"model": {k: torch.randn(s, dtype=dtype) for k, s in shapes.items()}}
    if name == "debug":
        state["optimizer"] = {k: {"exp_avg": torch.randn(s), "exp_avg_sq": torch.rand(s)} for k, s in shapes.items()}
    return state


def nbytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return sum(nbytes(v) for v in state.values())


def start_s3() -> subprocess.Popen | None:
    """moto's server on a free port with a bucket "bench" (the tests' moto_server), unless AWS_ENDPOINT_URL names an
    endpoint already."""
    if os.environ.get("AWS_ENDPOINT_URL"):
        return None
    import boto3

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import moto_server

    server, url = moto_server()
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="bench")
    return server


def save(state: dict, folder, mode: str) -> tuple[float, float]:
    """(seconds the caller was blocked, seconds until the save and its manifest were complete)."""
    t0 = time.perf_counter()
    crcs: dict[str, int] = {}  # the CRC-32s of the objects, computed as they are uploaded
    if mode == "sync":
        dcp.save(state, storage_writer=dcp_writer(folder, crcs))
        write_rank_manifest(folder, 0, crcs)
        done = time.perf_counter() - t0
        return done, done
    future = dcp.async_save(state, storage_writer=dcp_writer(folder, crcs))
    blocked = time.perf_counter() - t0
    future.result()
    write_rank_manifest(folder, 0, crcs)
    return blocked, time.perf_counter() - t0


def load_back(state: dict, folder) -> float:
    target = {k: {n: torch.empty_like(t) for n, t in v.items()} if k == "model" else v for k, v in state.items()}
    t0 = time.perf_counter()
    safe_dcp_load(target, folder)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["debug", "1B"], choices=list(FLAVOR))
    p.add_argument("--targets", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    p.add_argument("--reps", type=int, default=2)
    opts = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)  # async_save's collectives
    server = start_s3() if "s3" in opts.targets else None
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-io-"))
    rows = []
    try:
        for name in opts.models:
            state = model_state(name)
            mib = nbytes(state) / 2**20
            times: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
            for rep in range(opts.reps):
                for mode in ("sync", "async"):
                    for target in opts.targets:  # interleaved: local, s3, local, s3
                        where = f"s3://bench/{uuid.uuid4().hex[:8]}" if target == "s3" else str(scratch / f"r{rep}")
                        folder = location(where)
                        blocked, total = save(state, folder, mode)
                        loaded = load_back(state, folder)
                        times.setdefault((target, mode), []).append((blocked, total, loaded))
                        remove_tree(folder)
                        print(f"{name} {target} {mode} rep {rep}: save {total:.2f} s, load {loaded:.2f} s",
                              file=sys.stderr, flush=True)  # fmt: skip
            for (target, mode), runs in times.items():
                blocked, total, loaded = (statistics.median(r[i] for r in runs) for i in range(3))
                rows.append(f"| {name} | {mib:,.0f} | {target} | {mode} | {total:.2f} | {mib / total:,.0f} | "
                            f"{blocked:.2f} | {loaded:.2f} | {mib / loaded:,.0f} |")  # fmt: skip
            del state
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if server is not None:
            server.terminate()
        dist.destroy_process_group()
    print(f"median of {opts.reps}, one process, {os.cpu_count()} CPUs; s3 = moto's server on this machine")
    print("| model | MiB | target | mode | save s | save MiB/s | step blocked s | load s | load MiB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
