"""Bytes of parameters, gradients and optimizer state per rank, against total / shard degree.

    python benchmarks/memory.py                    # FSDP shard 1, 2, 4 and HSDP 2x2, debugmodel flavor
    python benchmarks/memory.py --flavor 1B --seq-len 32   # bigger model (needs the memory for it)

Each layout is a titanlite Trainer; after one forward/backward (default gradient sync) the gradients,
and after one optimizer step the AdamW state (exp_avg, exp_avg_sq), are counted as the bytes of each
rank's local shards. The table gives the largest rank's bytes and their ratio to total / shard degree
(above 1 only by the padding of dim-0 chunks that do not divide evenly).
"""

from __future__ import annotations

import argparse
import os

import common

LAYOUTS = [  # (label, world size, replicate degree)
    ("FSDP shard 1 (1 rank)", 1, 1),
    ("FSDP shard 2", 2, 1),
    ("FSDP shard 4", 4, 1),
    ("HSDP 2x2 (shard 2)", 4, 2),
]


def local_bytes(t) -> int:
    """Bytes of this rank's part of a tensor (its local shard for a DTensor)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _measure(opts, replicate: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from titanlite.config import load
    from titanlite.trainer import Trainer

    with common.job_folder() as dump:
        argv = [
            "--model.flavor",
            opts.flavor,
            "--training.seq_len",
            str(opts.seq_len),
            "--training.local_batch_size",
            "1",
            "--training.mixed_precision_param",
            "float32",
            "--parallelism.data_parallel_replicate_degree",
            str(replicate),
            "--job.dump_folder",
            dump,
        ]
        t = Trainer(load(argv))
    params = list(t.model.parameters())
    full = sum(p.numel() * p.element_size() for p in params)  # a DTensor's shape is the full shape
    mine = {"parameters": sum(local_bytes(p) for p in params)}
    inputs, labels, _ = t.dataloader.next_step().microbatches[0]
    F.cross_entropy(t.model(inputs.to(t.device)).flatten(0, 1), labels.to(t.device).flatten()).backward()
    mine["gradients"] = sum(local_bytes(p.grad) for p in params)
    t.optimizer.step()
    mine["optimizer state"] = sum(
        local_bytes(s[k]) for s in t.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")
    )
    expected = {"parameters": full, "gradients": full, "optimizer state": 2 * full}  # fp32 master, grads, 2 moments
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    worst = {k: max(g[k] for g in gathered) for k in mine}
    return dict(
        worst=worst,
        expected={k: v / t.dims.dp_shard for k, v in expected.items()},
        shard=t.dims.dp_shard,
        numel=sum(p.numel() for p in params),
        device=str(t.device),
    )


def _run(opts, replicates: list[int]) -> list[dict] | None:
    res = [_measure(opts, r) for r in replicates]
    return res if int(os.environ["RANK"]) == 0 else None


def unit_for(n: float) -> tuple[str, int]:
    """MiB, or KiB for small models."""
    return ("MiB", 2**20) if n >= 8 * 2**20 else ("KiB", 2**10)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="debugmodel", help="llama3 flavor")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence of the one backward")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    opts = p.parse_args(argv)
    device = common.device_type(opts.device, max(w for _, w, _ in LAYOUTS))
    print(common.machine_line(device))
    results = {}
    for world in dict.fromkeys(w for _, w, _ in LAYOUTS):  # one process group per world size
        replicates = [r for _, w, r in LAYOUTS if w == world]
        for r, res in zip(replicates, common.spawn(_run, world, device, opts, replicates)[0]):
            results[(world, r)] = res
    unit, scale = unit_for(max(r["expected"]["parameters"] for r in results.values()))
    rows = []
    for label, world, replicate in LAYOUTS:
        res = results[(world, replicate)]
        numel = res["numel"]
        row = [label, str(res["shard"])]
        for k in ("parameters", "gradients", "optimizer state"):
            row += [
                f"{res['worst'][k] / scale:.1f}",
                f"{res['expected'][k] / scale:.1f}",
                f"{res['worst'][k] / res['expected'][k]:.4f}",
            ]
        rows.append(row)
    print(f"llama3 {opts.flavor}: {numel:,} parameters, fp32; {unit} on the largest rank vs total / shard degree")
    header = ["layout", "shard"]
    for k in ("params", "grads", "optim"):
        header += [f"{k} {unit}", "total/shard", "ratio"]
    print(common.format_table(header, rows))


if __name__ == "__main__":
    main()
