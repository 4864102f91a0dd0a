"""Context parallelism on the CPU: CP(2) against one process on the same sequences, and the attention work per rank
with and without the balanced split.

    python benchmarks/context_parallel.py               # about 2 minutes on 2 CPU cores
    python benchmarks/context_parallel.py --seq-len 8192 --rounds 3

time: Trainer.train_step of a llama of the given shape on one sequence of --seq-len tokens per step, in one process
(every core) and at CP(2) (two processes, each two chunks of the sequence, with its share of the cores), as
alternating rounds (one, CP(2), one, CP(2), ...) of --steps timed steps each after a warm-up step; the table gives
the median step time, tokens per second per process and the speed-up of a step at CP(2).

work: for causal attention at --seq-len, the (query, key) pairs each cp rank computes when it takes two chunks, one
from each end (titanlite's split), and when it takes one contiguous block; the busiest rank's pairs over the mean
(1.00 = every rank the same work).
"""

from __future__ import annotations

import argparse
import statistics

import common


def _time(opts, cp: int) -> list[float]:
    from titanlite.trainer import Trainer

    common.register_shape(opts.layers, opts.hidden, opts.intermediate, opts.head_dim, opts.seq_len)
    with common.job_folder() as dump:
        settings = dict(local_batch_size=1, accumulation=1, replicate=1, dtype="float32")
        extra = ("--parallelism.context_parallel_degree", str(cp), "--model.vocab_size", str(opts.vocab))
        cfg = common.trainer_config(opts, dump, cp, **settings, extra=extra)
        cfg.training.global_batch_size = 1  # one sequence per step, whatever the cp degree
        trainer = Trainer(cfg)
    batch = common.random_microbatches([1], opts.seq_len, opts.vocab, seed=0)
    trainer.train_step(batch)  # warm-up
    return [common.time_steps(lambda: trainer.train_step(batch), 1, trainer.device) for _ in range(opts.steps)]


def _pairs(seq_len: int, cp: int, balanced: bool) -> list[int]:
    """Causal (query, key) pairs each cp rank computes: query at global position i sees i + 1 keys."""
    chunk = seq_len // (2 * cp)
    out = []
    for r in range(cp):
        chunks = (r, 2 * cp - 1 - r) if balanced else (2 * r, 2 * r + 1)
        out.append(sum(i + 1 for c in chunks for i in range(c * chunk, (c + 1) * chunk)))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=2, hidden=512, intermediate=1408, seq_len=4096)
    p.add_argument("--vocab", type=int, default=8192, help="model vocabulary")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (one process, CP(2))")
    opts = p.parse_args(argv)
    if opts.device == "cuda":
        raise SystemExit("--device cuda: this script times CPU runs")
    print(common.machine_line("cpu"))
    times = {1: [], 2: []}
    for _ in range(opts.rounds):
        for cp in (1, 2):
            times[cp] += common.spawn(_time, cp, "cpu", opts, cp)[0]
    rows = []
    for cp, t in times.items():
        step = statistics.median(t)
        name = "one process" if cp == 1 else "CP(2), 2 processes"
        speedup = statistics.median(times[1]) / step
        rows.append([name, f"{step * 1e3:.0f}", f"{opts.seq_len / step / cp:,.0f}", f"x{speedup:.2f}"])
    print(
        f"\ntime: {opts.layers} blocks, hidden {opts.hidden}, FFN {opts.intermediate}, vocab {opts.vocab}, one "
        f"sequence of {opts.seq_len} tokens per step, fp32, causal; {opts.rounds} alternating rounds of {opts.steps} "
        "steps"
    )
    print(common.format_table(["run", "step ms", "tokens/s per process", "step speed-up"], rows))
    print(f"\nwork: causal attention (query, key) pairs per rank at seq {opts.seq_len} (millions)")
    work_rows = []
    for cp in (2, 4, 8):
        for balanced in (True, False):
            pairs = _pairs(opts.seq_len, cp, balanced)
            split = "two chunks, one from each end" if balanced else "one contiguous block"
            busiest = max(pairs) / statistics.mean(pairs)
            work_rows.append([str(cp), split, " ".join(f"{x / 1e6:.2f}" for x in pairs), f"{busiest:.2f}"])
    print(common.format_table(["cp", "split", "pairs per rank", "busiest / mean"], work_rows))


if __name__ == "__main__":
    main()
