"""titanlite's training step against a bare hand-written FSDP2 loop: same model, mesh and batch.

    python benchmarks/overhead.py                      # FSDP over 2 ranks, ~1 minute on 2 CPU cores
    python benchmarks/overhead.py --world 4 --replicate 2 --accumulation 2

titanlite: `Trainer.train_step` (global token count, per-token-sum loss, gradient sync policy,
clipping, AdamW, lr schedule), with the model built and sharded from a config. Bare: the same
Transformer class and init, `fully_shard` by hand on the same units (token embedding, each block,
norm + output, then the root), mean cross-entropy, backward,
`clip_grad_norm_`, AdamW, nothing else. Both run the same microbatches, interleaved and repeated;
the table gives the slowest rank's step time, median (min-max), and titanlite / bare as the median
of the ratios of back-to-back repetitions (robust to load that comes and goes) and as the ratio of
the medians.
"""

from __future__ import annotations

import argparse
import os

import common

GOAL = 1.03  # titanlite within 3% of the bare loop


def bare_fsdp_step(model_args, mesh, device, dtype: str, lr: float, seed: int):
    """A hand-written FSDP2 training step on the titanlite Transformer; returns step(microbatches)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from titanlite.models.decoder import Transformer

    with torch.device("meta"):
        model = Transformer(model_args)
    mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    # The same units as titanlite shards (TorchTitan's plan), written out by hand.
    fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp_policy)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard([model.norm, model.output], mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    model.to_empty(device=device)
    model.init_weights(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def step(microbatches):
        for inputs, labels in microbatches:
            inputs, labels = inputs.to(device), labels.to(device)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / len(microbatches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _run(opts, device_type: str) -> dict | None:
    rank = int(os.environ["RANK"])
    dtype = common.param_dtype(opts.dtype, device_type)
    with common.job_folder() as dump:
        trainer = common.build_trainer(
            opts,
            dump,
            local_batch_size=opts.batch,
            accumulation=opts.accumulation,
            replicate=opts.replicate,
            dtype=dtype,
        )
    bare = bare_fsdp_step(
        trainer.model_args,
        trainer.dims.build_mesh(trainer.device.type),
        trainer.device,
        dtype,
        trainer.cfg.optimizer.lr,
        trainer.cfg.training.seed,
    )
    microbatches = common.random_microbatches(
        [opts.batch] * opts.accumulation, opts.seq_len, trainer.model_args.vocab_size, seed=rank
    )
    # As in Trainer.train: packed batches have every label valid, so the loader knows the global count.
    global_tokens = opts.batch * opts.accumulation * opts.seq_len * trainer.dims.dp_degree
    steps = {
        "titanlite": lambda: trainer.train_step(microbatches, global_tokens),
        "bare FSDP2 loop": lambda: bare(microbatches),
    }
    for fn in steps.values():
        for _ in range(opts.warmup):
            fn()
    times = {name: [] for name in steps}
    for rep in range(opts.reps):
        for name in list(steps) if rep % 2 == 0 else list(steps)[::-1]:
            times[name].append(common.time_steps(steps[name], opts.steps, trainer.device))
    return (
        dict(times=times, describe=trainer.dims.describe(), device=str(trainer.device), dtype=dtype)
        if rank == 0
        else None
    )


def report(opts, res: dict) -> str:
    """The comparison table."""
    tokens = opts.batch * opts.accumulation * opts.seq_len
    rows = []
    for name, times in res["times"].items():
        med, lo, hi = common.summary(times)
        rows.append([name, f"{med * 1e3:.1f}", f"{lo * 1e3:.1f}-{hi * 1e3:.1f}", f"{tokens / med:,.0f}"])
    (ti, _, _), (ba, _, _) = (common.summary(t) for t in res["times"].values())
    paired = common.summary([a / b for a, b in zip(*res["times"].values())])
    verdict = "met" if paired[0] <= GOAL else "NOT met"
    return "\n".join(
        [
            f"{res['describe']}; {opts.accumulation} microbatch(es) of {opts.batch} x {opts.seq_len} tokens per rank; "
            f"{opts.reps} reps x {opts.steps} steps, {res['device']}, {res['dtype']}",
            common.format_table(["step", "step ms", "(min-max)", "tokens/s/rank"], rows),
            f"titanlite / bare: {paired[0]:.3f} median of the per-repetition ratios ({paired[1]:.3f}-{paired[2]:.3f}), "
            f"{ti / ba:.3f} ratio of the medians; goal <= {GOAL:.2f}: {verdict}",
        ]
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=2, hidden=256, intermediate=768, seq_len=128)
    p.add_argument("--world", type=int, default=2, help="ranks")
    p.add_argument("--replicate", type=int, default=1, help="replica groups (1 = FSDP over the world)")
    p.add_argument("--batch", type=int, default=2, help="sequences per microbatch per rank")
    p.add_argument("--accumulation", type=int, default=1, help="microbatches per step")
    p.add_argument("--reps", type=int, default=20, help="repetitions of each (interleaved)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    opts = p.parse_args(argv)
    if opts.world % opts.replicate:
        p.error(f"--world {opts.world} is not a multiple of --replicate {opts.replicate}")
    device = common.device_type(opts.device, opts.world)
    print(common.machine_line(device))
    print(f"model: {opts.layers} layers, hidden {opts.hidden}, intermediate {opts.intermediate}, seq {opts.seq_len}")
    print(report(opts, common.spawn(_run, opts.world, device, opts, device)[0]))


if __name__ == "__main__":
    main()
