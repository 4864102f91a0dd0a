"""Each pipeline schedule at PP(2) against FSDP(2) on the same model and global batch, and each rank's measured idle
time inside the pipeline against the schedule's theoretical bubble.

    python benchmarks/pipeline.py                      # world 2, ~2 minutes on 2 CPU cores
    python benchmarks/pipeline.py --layers 8 --hidden 512 --intermediate 1536 --seq-len 256 --batch 8

Every mode is a titanlite Trainer (config -> mesh -> parallel/ -> Trainer.train_step) fed the same global batch of
2 x --batch sequences: FSDP(2) gives each rank half of it; PP(2) gives both ranks all of it, split into one pipeline
microbatch per sequence. The modes run interleaved (rotated order) and repeated; the table gives the step time,
median (min-max) over the repetitions, and the ratio to FSDP(2) (median of back-to-back ratios). Idle: the share
of the time inside the schedule's step that a rank does not spend in its stages' forward or backward (torch's
PipelineStage.forward_one_chunk / backward_one_chunk / backward_weight_one_chunk), averaged over the two ranks;
bubble: (pp - 1) / (stages per rank x microbatches + pp - 1), zero for ZBVZeroBubble in theory (forward, input
backward and weight backward of equal cost). On CPU the FSDP(2) ranks compute at once on the two cores, so a rank
idling in a bubble leaves a core unused: the ratio to FSDP(2) shows what the bubble costs, not what the pipeline
saves in all-gathers across nodes.
"""

from __future__ import annotations

import argparse
import os
import time

import torch.distributed as dist

import common

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
MODES = ("fsdp", *SCHEDULES)


def _pp(schedule: str) -> tuple[str, ...]:
    return ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule)


class _Busy:
    """Seconds a rank spends in its stages' compute, and inside the schedule's step."""

    def __init__(self, pipeline):
        self.busy = self.inside = 0.0
        for stage in pipeline.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name), "busy"))
        pipeline.schedule.step = self._timed(pipeline.schedule.step, "inside")

    def _timed(self, fn, counter: str):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)

        return call


def _run_world(opts, device_type: str) -> dict | None:
    from titanlite.parallel.pp import bubble_fraction

    rank = int(os.environ["RANK"])
    dtype = common.param_dtype(opts.dtype, device_type)
    with common.job_folder() as dump:
        trainers = {
            m: common.build_trainer(
                opts,
                dump,
                local_batch_size=opts.batch if m == "fsdp" else 2 * opts.batch,
                accumulation=1,
                replicate=1,
                dtype=dtype,
                extra=() if m == "fsdp" else _pp(m),
            )
            for m in opts.modes
        }
    any_trainer = next(iter(trainers.values()))
    device, vocab = any_trainer.device, any_trainer.model_args.vocab_size
    whole = common.random_microbatches([2 * opts.batch], opts.seq_len, vocab, seed=0)  # the global batch
    half = [tuple(t[rank * opts.batch : (rank + 1) * opts.batch] for t in whole[0])]
    batches = {m: half if m == "fsdp" else whole for m in opts.modes}
    busy = {}  # counted after the warm-up (whose first step also infers the stages' shapes)

    def count_busy():
        busy.update({m: _Busy(t.pipeline) for m, t in trainers.items() if t.pipeline is not None})

    times = common.time_modes(trainers, batches, opts, device, after_warmup=count_busy)
    idle = {}
    for m, b in busy.items():
        mine = [1 - b.busy / b.inside]
        both = [None] * dist.get_world_size()
        dist.all_gather_object(both, mine)
        p = trainers[m].pipeline
        idle[m] = (sum(x[0] for x in both) / len(both), bubble_fraction(m, 2, p.n_microbatches, len(p.stages)))
    return dict(times=times, idle=idle, device=str(device), dtype=dtype) if rank == 0 else None


def report(opts, res: dict) -> str:
    out = [
        f"\nworld 2, global batch {2 * opts.batch} x {opts.seq_len} tokens ({2 * opts.batch} pipeline microbatches at "
        f"PP(2)); {opts.reps} reps x {opts.steps} steps, {res['device']}, {res['dtype']}"
    ]
    base = res["times"].get("fsdp")
    rows = []
    for m, times in res["times"].items():
        med, lo, hi = common.summary(times)
        ratio = common.median_ratio(times, base) if base and m != "fsdp" else None
        idle, bubble = res["idle"].get(m, (None, None))
        rows.append(
            [
                "FSDP(2)" if m == "fsdp" else f"PP(2) {m}",
                f"{med * 1e3:.1f}",
                f"{lo * 1e3:.1f}-{hi * 1e3:.1f}",
                f"x{ratio:.2f}" if ratio else "-",
                f"{idle:.1%}" if idle is not None else "-",
                f"{bubble:.1%}" if bubble is not None else "-",
            ]
        )
    out.append(common.format_table(["mode", "step ms", "(min-max)", "time vs FSDP(2)", "idle", "bubble"], rows))
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=4, hidden=256, intermediate=768, seq_len=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per FSDP rank (global batch: 2x)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    common.add_repetition_args(p, reps=4)
    opts = p.parse_args(argv)
    device = common.device_type(opts.device, 2)
    print(common.machine_line(device))
    print(f"model: {opts.layers} layers, hidden {opts.hidden}, intermediate {opts.intermediate}, seq {opts.seq_len}")
    res = common.spawn(_run_world, 2, device, opts, device)[0]
    print(report(opts, res), flush=True)


if __name__ == "__main__":
    main()
