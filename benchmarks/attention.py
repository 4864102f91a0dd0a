"""Step time of block-causal attention against causal, on the same packed chat batches.

    python benchmarks/attention.py [--flavor debugmodel] [--seq-len 512] [--batch 4] [--reps 8] [--world 1]

Two titanlite Trainers with the same model, data (the built-in chat dataset, conversations packed
into sequences) and seed, one with model.attention = "causal", one "block_causal"; their
`train_step`s run on the same microbatches, interleaved (A B A B ...). Prints the median step time
of each and the median of the per-repetition ratios. On the CPU the block-causal kernel is SDPA with
a boolean mask; on a GPU it is FlexAttention with a block mask.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import common


def _run(opts, device: str, dump: str):
    from titanlite.config import load
    from titanlite.trainer import Trainer

    def trainer(attention):
        return Trainer(
            load(
                [
                    "--model.flavor",
                    opts.flavor,
                    "--training.dataset",
                    "builtin_chat",
                    "--data.format",
                    "chat",
                    "--model.attention",
                    attention,
                    "--training.seq_len",
                    str(opts.seq_len),
                    "--training.local_batch_size",
                    str(opts.batch),
                    "--training.global_batch_size",
                    str(opts.batch * opts.world),
                    "--training.mixed_precision_param",
                    common.param_dtype(opts.dtype, device),
                    "--training.steps",
                    "1000000",
                    "--metrics.log_freq",
                    "1000000",
                    "--job.dump_folder",
                    dump,
                    "--data.prefetch",
                    "0",
                ]
            )
        )

    trainers = {"causal": trainer("causal"), "block_causal": trainer("block_causal")}
    steps = [trainers["causal"].dataloader.next_step() for _ in range(opts.reps + 1)]
    times = {name: [] for name in trainers}
    for i, step in enumerate(steps):
        order = list(trainers) if i % 2 == 0 else list(reversed(trainers))
        for name in order:
            seconds = common.time_steps(
                lambda t=trainers[name], s=step: t.train_step(s.microbatches, s.global_valid_tokens),
                1,
                trainers[name].device,
            )
            if i:  # the first step warms up
                times[name].append(seconds)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    opts = p.parse_args()
    device = common.device_type(opts.device, opts.world)
    with tempfile.TemporaryDirectory() as dump:
        times = common.spawn(_run, opts.world, device, opts, device, dump)[0]
    print(common.machine_line(device))
    print(
        f"model {opts.flavor}, {opts.world} rank(s), {opts.batch} x {opts.seq_len} tokens per rank per step, "
        f"packed chat data, {opts.reps} reps, {common.param_dtype(opts.dtype, device)}"
    )
    rows = []
    for name, values in times.items():
        med, lo, hi = common.summary(values)
        rows.append([name, f"{med * 1e3:.1f}", f"{lo * 1e3:.1f}-{hi * 1e3:.1f}"])
    print(common.format_table(["attention", "step ms", "(min-max)"], rows))
    ratios = [b / c for b, c in zip(times["block_causal"], times["causal"])]
    print(f"block_causal / causal: {statistics.median(ratios):.3f} median of the per-repetition ratios")


if __name__ == "__main__":
    main()
