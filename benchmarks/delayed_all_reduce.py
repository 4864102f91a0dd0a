"""HSDP with and without the delayed all-reduce, and FSDP over the world, on (in)homogeneous microbatches.

    python benchmarks/delayed_all_reduce.py                 # world 2 (2x1) and 4 (2x2), ~1 minute on 2 CPU cores
    python benchmarks/delayed_all_reduce.py --layers 8 --hidden 4096 --intermediate 14336 --seq-len 2048

Every mode is a titanlite Trainer (config -> mesh -> parallel/ -> Trainer.train_step) fed the same
microbatches. Inhomogeneous: replica group 0 gets batch sizes (b, r*b, b, ...) and group 1 gets
(r*b, b, r*b, ...), so on each microbatch one replica waits for the other unless the all-reduce is
delayed; homogeneous: every rank gets (b, r*b, b, ...). The modes run interleaved (rotated order) and
repeated; the tables give the slowest rank's step time and tokens/s per rank, median (min-max) over
the repetitions, and the speedup against plain HSDP: the median over repetitions of the ratio of
step times measured back to back (robust to load that comes and goes).
"""

from __future__ import annotations

import argparse
import os

import common

MODES = {  # name -> (label, uses replicas, gradient_sync)
    "hsdp": ("HSDP {R}x{S}", True, "every_microbatch"),
    "hsdp_delay": ("HSDP {R}x{S} + delayed all-reduce", True, "delay_all_reduce"),
    "fsdp": ("FSDP over the world ({W})", False, "every_microbatch"),
    "hsdp_last_only": ("HSDP {R}x{S} + sync on last microbatch only", True, "last_microbatch_only"),
}
KINDS = ("inhomogeneous", "homogeneous")


def batch_sizes(kind: str, replica_group: int, accumulation: int, batch: int, ratio: int) -> list[int]:
    """This rank's microbatch sizes: alternating b, r*b, shifted by one on odd replica groups if inhomogeneous."""
    shift = replica_group % 2 if kind == "inhomogeneous" else 0
    return [batch * ratio if (i + shift) % 2 else batch for i in range(accumulation)]


def bound(accumulation: int, batch: int, ratio: int) -> float:
    """Best speedup of the delayed all-reduce on compute-bound inhomogeneous steps (cost ~ batch size).

    Without it every microbatch waits for the bigger one; with it each replica waits once, at the end.
    """
    per_replica = [batch_sizes("inhomogeneous", g, accumulation, batch, ratio) for g in (0, 1)]
    without = sum(max(sizes) for sizes in zip(*per_replica))
    return without / max(sum(s) for s in per_replica)


def _run_world(opts, device_type: str) -> dict | None:
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    shard = world // opts.replicate
    dtype = common.param_dtype(opts.dtype, device_type)
    with common.job_folder() as dump:
        trainers = {
            m: common.build_trainer(
                opts,
                dump,
                local_batch_size=1,
                accumulation=opts.accumulation,
                replicate=opts.replicate if MODES[m][1] else 1,
                gradient_sync=MODES[m][2],
                dtype=dtype,
            )
            for m in opts.modes
        }
    any_trainer = next(iter(trainers.values()))
    device, vocab = any_trainer.device, any_trainer.model_args.vocab_size
    results = {}
    for kind in opts.kinds:
        sizes = batch_sizes(kind, rank // shard, opts.accumulation, opts.batch, opts.ratio)
        microbatches = common.random_microbatches(sizes, opts.seq_len, vocab, seed=rank)
        for t in trainers.values():  # warm up: allocations, first-step overheads
            for _ in range(opts.warmup):
                t.train_step(microbatches)
        times = {m: [] for m in opts.modes}
        for rep in range(opts.reps):
            order = opts.modes[rep % len(opts.modes) :] + opts.modes[: rep % len(opts.modes)]
            for m in order:
                step = lambda t=trainers[m], mbs=microbatches: t.train_step(mbs)
                times[m].append(common.time_steps(step, opts.steps, device))
        tokens = [sum(sizes) * opts.seq_len]
        all_tokens = [None] * world
        dist.all_gather_object(all_tokens, tokens[0])
        results[kind] = dict(
            times=times,
            tokens_per_rank=sum(all_tokens) / world,
            sizes={g: batch_sizes(kind, g, opts.accumulation, opts.batch, opts.ratio) for g in range(opts.replicate)},
        )
    return dict(results=results, shard=shard, device=str(device), dtype=dtype) if rank == 0 else None


def speedup(base: list[float] | None, times: list[float]) -> str:
    """Median over repetitions of base time / this mode's time (the runs of a repetition are back to back)."""
    if not base:
        return "-"
    return f"x{common.median_ratio(base, times):.2f}"


def report(world: int, opts, res: dict) -> str:
    """The tables of one world size."""
    out = []
    R, S, W = opts.replicate, res["shard"], world
    for kind, r in res["results"].items():
        groups = "  ".join(f"replica {g}: {','.join(map(str, s))}" for g, s in r["sizes"].items())
        out.append(
            f"\nworld {W} (replicate {R} x shard {S}), {kind} microbatches [{groups}] x {opts.seq_len} "
            f"tokens; {opts.reps} reps x {opts.steps} steps, {res['device']}, {res['dtype']}"
        )
        base = r["times"].get("hsdp")
        rows = []
        for m, times in r["times"].items():
            med, lo, hi = common.summary(times)
            tps = [r["tokens_per_rank"] / t for t in times]
            t_med, t_lo, t_hi = common.summary(tps)
            rows.append(
                [
                    MODES[m][0].format(R=R, S=S, W=W),
                    f"{med * 1e3:.1f}",
                    f"{lo * 1e3:.1f}-{hi * 1e3:.1f}",
                    f"{t_med:,.0f}",
                    f"{t_lo:,.0f}-{t_hi:,.0f}",
                    speedup(base, times),
                ]
            )
        out.append(common.format_table(["mode", "step ms", "(min-max)", "tokens/s/rank", "(min-max)", "vs HSDP"], rows))
        if kind == "inhomogeneous":
            limit = bound(opts.accumulation, opts.batch, opts.ratio)
            out.append(f"compute-bound limit of the delayed all-reduce: x{limit:.2f}")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=2, hidden=256, intermediate=768, seq_len=128)
    p.add_argument(
        "--worlds", type=int, nargs="+", default=[2, 4], help="world sizes to run (each a multiple of --replicate)"
    )
    p.add_argument("--replicate", type=int, default=2, help="replica groups of the HSDP modes")
    p.add_argument("--accumulation", type=int, default=2, help="microbatches per step")
    p.add_argument("--batch", type=int, default=1, help="sequences in a small microbatch")
    p.add_argument("--ratio", type=int, default=2, help="a big microbatch has ratio x --batch sequences")
    p.add_argument("--modes", nargs="+", default=["hsdp", "hsdp_delay", "fsdp"], choices=list(MODES))
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--reps", type=int, default=8, help="repetitions of each mode (interleaved)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    opts = p.parse_args(argv)
    for w in opts.worlds:
        if w % opts.replicate:
            p.error(f"--worlds {w} is not a multiple of --replicate {opts.replicate}")
    device = common.device_type(opts.device, max(opts.worlds))
    print(common.machine_line(device))
    print(
        f"model: {opts.layers} layers, hidden {opts.hidden}, intermediate {opts.intermediate}, "
        f"seq {opts.seq_len}; {opts.accumulation} microbatches of {opts.batch} or {opts.batch * opts.ratio} sequences"
    )
    for w in opts.worlds:
        res = common.spawn(_run_world, w, device, opts, device)[0]
        print(report(w, opts, res), flush=True)


if __name__ == "__main__":
    main()
