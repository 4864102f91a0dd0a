"""LoRA and QLoRA against full fine-tuning on the CPU: step time and per-rank memory of the same model at FSDP(2).

    python benchmarks/lora.py                     # about 3 minutes on 2 CPU cores
    python benchmarks/lora.py --rank 64 --reps 8

Two Trainers of one shape (wide and shallow, as benchmarks/memory_estimate.py's) start from the same base weights
(a random consolidated file): full fine-tuning (every weight trains, AdamW over all of them), LoRA (rank --rank
on every projection, the base frozen in the compute dtype) and QLoRA (the same adapters, the blocks' linears of the
base in NF4: lora.base_dtype = "nf4"). Step time: Trainer.train_step on the same random batch,
timed interleaved (A B A B), the slowest rank's; the median of each and the median of the back-to-back ratios.
Memory: torch's FSDPMemTracker over one step after a first one (so AdamW's state exists), rank 0: the step's peak
and the parameters, gradients and optimizer state held at it.
"""

from __future__ import annotations

import argparse
import os
import statistics

import common

MiB = 1024**2


def _modes(opts) -> dict[str, tuple[str, ...]]:
    lora = ("--lora.enable", "true", "--lora.rank", str(opts.rank), "--lora.alpha", str(2 * opts.rank))
    base = "bfloat16" if opts.dtype == "bfloat16" else "float32"
    return {
        "full fine-tuning": ("--checkpoint.initial_load_path", opts.base),
        f"LoRA r={opts.rank}": ("--checkpoint.initial_load_path", opts.base, *lora, "--lora.base_dtype", base),
        f"QLoRA r={opts.rank}": (
            "--checkpoint.initial_load_path",
            opts.base,
            *lora,
            "--lora.base_dtype",
            "nf4",
            "--lora.nf4_block_size",
            str(opts.nf4_block),
            "--lora.nf4_scaler_block_size",
            str(opts.nf4_scaler_block),
        ),  # fmt: skip
    }


def _tracked(trainer, batch) -> dict[str, int]:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
    tracker.track_inputs(tuple(batch[0]))
    with tracker:
        trainer.train_step(batch)
    peak = {k.value: v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items() if k != "Total"}
    grads = 0  # the most gradient bytes held at any moment of the step (at its end, before the optimizer step)
    for stats in tracker.memory_tracking.values():
        for snaps in stats.snapshots.values():
            for snap in snaps:
                for by_kind in snap.values():
                    grads = max(grads, sum(v for k, v in by_kind.items() if "Grad" in getattr(k, "value", "")))
    return {
        "peak": sum(peak.values()),
        "params": peak.get("Sharded Param", 0),
        "grads": grads,
        "optimizer": peak.get("OptState", 0),
    }


def _trainer(opts, dump: str, extra: tuple[str, ...]):
    from titanlite.trainer import Trainer

    common.register_shape(opts.layers, opts.hidden, opts.intermediate, opts.head_dim, opts.seq_len)
    dtype = "float32" if opts.dtype == "auto" else opts.dtype
    settings = dict(local_batch_size=opts.batch, accumulation=1, replicate=1, dtype=dtype)
    extra = ("--model.vocab_size", str(opts.vocab), *extra)
    return Trainer(common.trainer_config(opts, dump, 2, **settings, extra=extra))


def _memory_world(opts, name: str) -> dict:
    """One mode's memory (a world of its own: one FSDPMemTracker per process) and its parameter counts."""
    rank = int(os.environ["RANK"])
    with common.job_folder() as dump:
        t = _trainer(opts, dump, _modes(opts)[name])
    batch = common.random_microbatches([opts.batch], opts.seq_len, opts.vocab, seed=rank)
    t.train_step(batch)  # AdamW's state appears in the first step
    out = _tracked(t, batch)
    out["trained"] = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
    out["total"] = t.model_args.param_counts()["total"]
    return out


def _time_world(opts) -> dict:
    """Every mode's step times, interleaved (A B C C B A ...)."""
    rank = int(os.environ["RANK"])
    with common.job_folder() as dump:
        trainers = {name: _trainer(opts, f"{dump}/{i}", extra) for i, (name, extra) in enumerate(_modes(opts).items())}
    batch = common.random_microbatches([opts.batch], opts.seq_len, opts.vocab, seed=rank)
    for t in trainers.values():
        t.train_step(batch)
    times = {name: [] for name in trainers}
    for rep in range(opts.reps):
        for name in list(trainers) if rep % 2 == 0 else list(reversed(trainers)):
            times[name].append(
                common.time_steps(lambda t=trainers[name]: t.train_step(batch), 1, trainers[name].device)
            )
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=2, hidden=1024, intermediate=2816, seq_len=512)
    p.add_argument("--vocab", type=int, default=32768, help="model vocabulary (embedding and output rows)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--reps", type=int, default=6, help="timed steps of each mode (interleaved)")
    p.add_argument("--nf4-block", type=int, default=64, help="QLoRA: lora.nf4_block_size (small shapes need less)")
    p.add_argument("--nf4-scaler-block", type=int, default=256, help="QLoRA: lora.nf4_scaler_block_size")
    opts = p.parse_args(argv)
    if opts.device == "cuda":
        raise SystemExit("--device cuda: this script measures CPU runs (FSDPMemTracker)")
    opts.base = common.lora_base(opts)
    print(common.machine_line("cpu"))
    memory = {name: common.spawn(_memory_world, 2, "cpu", opts, name)[0] for name in _modes(opts)}
    times = common.spawn(_time_world, 2, "cpu", opts)[0]
    full = next(iter(times))
    rows = []
    for name, t in times.items():
        m = memory[name]
        trained, total = m["trained"], m["total"]
        rows.append([
            name, f"{trained / 1e6:.2f}M of {total / 1e6:.1f}M", f"{statistics.median(t) * 1e3:.0f}",
            f"x{common.median_ratio(t, times[full]):.2f}", f"{m['peak'] / MiB:.0f}", f"{m['params'] / MiB:.0f}",
            f"{m['grads'] / MiB:.0f}", f"{m['optimizer'] / MiB:.0f}",
        ])  # fmt: skip
    dtype = "float32" if opts.dtype == "auto" else opts.dtype
    print(
        f"shape: {opts.layers} blocks, hidden {opts.hidden}, FFN {opts.intermediate}, vocab {opts.vocab}; FSDP(2), "
        f"{opts.batch} x {opts.seq_len} tokens per rank per step, {dtype}; {opts.reps} timed steps each, interleaved; "
        f"memory: FSDPMemTracker on rank 0 (MiB: the step's peak, the parameters and optimizer state at it, "
        f"the most gradient bytes held)"
    )
    header = ["mode", "trained params", "step ms", "vs full", "peak", "params", "grads", "optimizer"]
    print(common.format_table(header, rows))


if __name__ == "__main__":
    main()
