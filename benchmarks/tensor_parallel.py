"""TP(2) against FSDP(2) on the same model and global batch, and the collectives tensor parallelism issues per block.

    python benchmarks/tensor_parallel.py                 # world 2, ~1 minute on 2 CPU cores
    python benchmarks/tensor_parallel.py --layers 4 --hidden 1024 --intermediate 2816 --seq-len 512 --batch 4

Every mode is a titanlite Trainer (config -> mesh -> parallel/ -> Trainer.train_step) fed the same global
batch: FSDP(2) gives each rank half of it, TP(2) gives both ranks all of it and splits every block's matmuls.
The modes run interleaved (rotated order) and repeated; the table gives the step time, median (min-max) over
the repetitions, and the ratio to FSDP(2) (median over repetitions of back-to-back ratios). The collectives
are counted with torch's CommDebugMode over one forward and backward of the TP model: DTensor's own
collectives (FSDP's, over the data-parallel ranks, are not DTensor ops and are not in these counts).
"""

from __future__ import annotations

import argparse
import os

import common

TP2 = ("--parallelism.tensor_parallel_degree", "2")
NO_SP = ("--parallelism.enable_sequence_parallel", "false", "--parallelism.enable_loss_parallel", "false")
MODES = {  # name -> (label, extra overrides)
    "fsdp": ("FSDP(2)", ()),
    "tp": ("TP(2), sequence + loss parallel", TP2),
    "tp_plain": ("TP(2), no sequence / loss parallel", TP2 + NO_SP),
}


def _collectives(trainer, microbatch) -> dict:
    """{(module, pass): {collective: count}} of one forward and backward, for the first block and the whole model."""
    from torch.distributed.tensor.debug import CommDebugMode

    from titanlite.loss import loss_parallel_context, microbatch_loss

    mode = CommDebugMode()
    with mode, loss_parallel_context(trainer.loss_parallel):
        loss, _ = microbatch_loss(trainer.model, microbatch, trainer.device)
        loss.backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    out = {}
    for fqn, passes in mode.comm_module_counts.items():
        where = "model" if fqn == "Global" else "one block" if fqn.split(".")[-2:] == ["layers", "0"] else None
        if where:
            for name in ("forward", "backward"):
                counts = {str(op).split(".")[-1]: n for op, n in passes.get(name, {}).items() if n}
                out[(where, name)] = counts
    return out


def _run_world(opts, device_type: str) -> dict | None:
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
                extra=MODES[m][1],
            )
            for m in opts.modes
        }
    any_trainer = next(iter(trainers.values()))
    device, vocab = any_trainer.device, any_trainer.model_args.vocab_size
    whole = common.random_microbatches([2 * opts.batch], opts.seq_len, vocab, seed=0)  # the global batch
    half = [tuple(t[rank * opts.batch : (rank + 1) * opts.batch] for t in whole[0])]
    batches = {m: half if m == "fsdp" else whole for m in opts.modes}
    times = common.time_modes(trainers, batches, opts, device)
    counts = {m: _collectives(trainers[m], whole[0]) for m in opts.modes if m != "fsdp"}
    return dict(times=times, counts=counts, device=str(device), dtype=dtype) if rank == 0 else None


def report(opts, res: dict) -> str:
    out = [
        f"\nworld 2, global batch {2 * opts.batch} x {opts.seq_len} tokens; {opts.reps} reps x {opts.steps} steps, "
        f"{res['device']}, {res['dtype']}"
    ]
    base = res["times"].get("fsdp")
    rows = []
    for m, times in res["times"].items():
        med, lo, hi = common.summary(times)
        ratio = common.median_ratio(times, base) if base else None
        rows.append(
            [MODES[m][0], f"{med * 1e3:.1f}", f"{lo * 1e3:.1f}-{hi * 1e3:.1f}", f"x{ratio:.2f}" if ratio else "-"]
        )
    out.append(common.format_table(["mode", "step ms", "(min-max)", "time vs FSDP(2)"], rows))
    for m, counts in res["counts"].items():
        out.append(f"\ncollectives of {MODES[m][0]}, one forward + backward (CommDebugMode):")
        for (where, name), c in counts.items():
            shown = ", ".join(f"{op} {n}" for op, n in sorted(c.items())) or "none"
            out.append(f"  {where:<10} {name:<9} {shown}")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=2, hidden=256, intermediate=768, seq_len=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank (global batch: 2x)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    common.add_repetition_args(p, reps=6)
    opts = p.parse_args(argv)
    device = common.device_type(opts.device, 2)
    print(common.machine_line(device))
    print(f"model: {opts.layers} layers, hidden {opts.hidden}, intermediate {opts.intermediate}, seq {opts.seq_len}")
    res = common.spawn(_run_world, 2, device, opts, device)[0]
    print(report(opts, res), flush=True)


if __name__ == "__main__":
    main()
