"""The loss in chunks against the whole-microbatch loss: step time and the activation peak of a real training step.

    python benchmarks/loss_chunks.py                  # 1 process; hidden 512, 2 layers, seq 2048, vocab 32768
    python benchmarks/loss_chunks.py --vocab 128256 --seq-len 1024 --chunks 0 512 2048

Each setting is a titanlite Trainer (one process, FSDP over one rank, fp32) fed the same microbatch. Step
times run interleaved (rotated order) and repeated: median (min-max) and the median ratio of back-to-back
steps to the first setting. The peak is torch's MemTracker over one train_step (forward, backward, clip,
optimizer step): its Activation + Temp bytes at the peak, next to the dry run's activation estimate.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import common


def _run(opts, device_type: str) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    from titanlite.sizing.memory import activation_bytes

    trainers = {}
    with tempfile.TemporaryDirectory() as dump:
        for chunk in opts.chunks:
            extra = ("--training.loss_chunk_tokens", str(chunk), "--model.vocab_size", str(opts.vocab))
            trainers[chunk] = common.build_trainer(
                opts, dump, local_batch_size=opts.batch, accumulation=1, replicate=1, extra=extra
            )
    t0 = next(iter(trainers.values()))
    batch = common.random_microbatches([opts.batch], opts.seq_len, opts.vocab, seed=0)
    out = {"times": {c: [] for c in opts.chunks}, "peak": {}, "estimate": {}}
    for chunk, t in trainers.items():
        t.train_step(batch)  # warm up
        tracker = MemTracker()
        tracker.track_external(t.model, t.optimizer)
        with tracker:
            t.train_step(batch)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        out["peak"][chunk] = sum(v for k, v in peak.items() if k != "Total" and k.value in ("Activation", "Temp"))
        args = t.model_args
        est = activation_bytes(args, opts.batch * opts.seq_len, 4, [], False, loss_chunk_tokens=chunk)
        out["estimate"][chunk] = est["total"]
    for rep in range(opts.reps):
        order = opts.chunks[rep % len(opts.chunks) :] + opts.chunks[: rep % len(opts.chunks)]
        for chunk in order:
            step = lambda t=trainers[chunk]: t.train_step(batch)
            out["times"][chunk].append(common.time_steps(step, opts.steps, t0.device))
    return out if int(os.environ["RANK"]) == 0 else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=2, hidden=512, intermediate=1536, seq_len=2048)
    p.add_argument("--vocab", type=int, default=32768, help="model vocabulary (embedding and output rows)")
    p.add_argument("--batch", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 1024], help="loss_chunk_tokens settings; 0 = whole")
    p.add_argument("--reps", type=int, default=6, help="repetitions of each setting (interleaved)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    opts = p.parse_args(argv)
    device = common.device_type(opts.device, 1)
    print(common.machine_line(device))
    print(
        f"model: {opts.layers} layers, hidden {opts.hidden}, intermediate {opts.intermediate}, vocab {opts.vocab}; "
        f"{opts.batch} x {opts.seq_len} tokens per step, fp32"
    )
    res = common.spawn(_run, 1, device, opts, device)[0]
    base = res["times"][opts.chunks[0]]
    rows = []
    for chunk in opts.chunks:
        times = res["times"][chunk]
        med, lo, hi = common.summary(times)
        ratio = common.median_ratio(times, base)
        mib = 1024**2
        rows.append(
            [
                str(chunk) if chunk else "0 (whole)",
                f"{med * 1e3:.0f}",
                f"{lo * 1e3:.0f}-{hi * 1e3:.0f}",
                f"x{ratio:.3f}",
                f"{res['peak'][chunk] / mib:.1f}",
                f"{res['estimate'][chunk] / mib:.1f}",
            ]
        )
    header = ["loss_chunk_tokens", "step ms", "(min-max)", "time vs first", "peak act. MiB", "estimate MiB"]
    print(common.format_table(header, rows))


if __name__ == "__main__":
    main()
