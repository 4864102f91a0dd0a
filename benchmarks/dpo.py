"""DPO's reference models against each other: step time of the same LoRA policy at FSDP(2) with dpo.reference = base
(the policy with its adapters switched off), copy (a frozen sharded copy of the initial weights) and precomputed
(a table computed once before the first step), and what the table costs up front.

    python benchmarks/dpo.py                     # about 2 minutes on 2 CPU cores
    python benchmarks/dpo.py --device cuda --layers 8 --hidden 2048 --intermediate 5632 --seq-len 2048

Three Trainers of one shape start from the same random base (a consolidated file) with the same adapters, on the
same synthetic preference pairs (byte tokens: a prompt and two responses of random words, filling about
--seq-len). Step time: Trainer.train_step on one batch of pairs from the loader, timed interleaved (A B C, rotated),
the slowest rank's; the medians and the median of the back-to-back ratios against copy. The copy and base
references run one more forward per microbatch (without gradients) than precomputed, which looks the values up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import common

REFERENCES = ("copy", "base", "precomputed")


def _pairs_file(opts, path: str) -> str:
    """Synthetic pairs whose prompt and responses fill about seq_len byte tokens together."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "tensor", "shard", "rank", "token", "batch"]

    def text(chars: int) -> str:
        out = []
        while sum(len(w) + 1 for w in out) < chars:
            out.append(rng.choice(words))
        return " ".join(out)

    budget = opts.seq_len - 64  # the template's markers and the end-of-turn tokens
    with open(path, "w") as f:
        for _ in range(opts.pairs):
            prompt, response = text(budget // 3), 2 * budget // 3
            f.write(json.dumps({"prompt": prompt, "chosen": text(response), "rejected": text(response)}) + "\n")
    return path


def _time_world(opts) -> dict:
    """The three references' step times, interleaved; the precomputed table's one-time cost."""
    from titanlite.preference.reference import Precomputed

    precompute, compute = [], Precomputed.compute

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        compute(self, *args, **kwargs)
        precompute.append(time.perf_counter() - t0)

    Precomputed.compute = timed
    lora = ("--lora.enable", "true", "--lora.rank", str(opts.rank), "--checkpoint.initial_load_path", opts.base)
    data = ("--training.dataset", opts.data, "--data.format", "preference", "--dpo.enable", "true")
    trainers = {}
    with common.job_folder() as dump:
        for i, reference in enumerate(REFERENCES):
            extra = (*lora, *data, "--dpo.reference", reference, "--data.store_folder", f"{dump}/stores")
            trainers[reference] = common.build_trainer(
                opts, f"{dump}/{i}", local_batch_size=opts.batch, accumulation=1, replicate=1,
                dtype=common.param_dtype(opts.dtype, opts.device_type), extra=extra,
            )  # fmt: skip
    batch = trainers["copy"].dataloader.next_step().microbatches
    device = trainers["copy"].device
    times = common.time_modes(trainers, {r: batch for r in REFERENCES}, opts, device)
    return {"times": times, "precompute": precompute}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=4, hidden=512, intermediate=1408, seq_len=512)
    common.add_repetition_args(p, reps=6)
    p.add_argument("--vocab", type=int, default=256 + 2, help="model vocabulary (the byte tokenizer's)")
    p.add_argument("--batch", type=int, default=2, help="pairs per rank per step (2 sequences each)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the policy's adapters")
    p.add_argument("--pairs", type=int, default=64, help="pairs in the synthetic dataset (the table's size)")
    opts = p.parse_args(argv)
    opts.device_type = common.device_type(opts.device, 2)
    print(common.machine_line(opts.device_type))
    opts.base = common.lora_base(opts, opts.vocab)
    opts.data = _pairs_file(opts, os.path.join(os.path.dirname(opts.base), f"titanlite-dpo-pairs-{opts.seq_len}.jsonl"))
    run = common.spawn(_time_world, 2, opts.device_type, opts)[0]
    copy = run["times"]["copy"]
    rows = []
    for reference, t in run["times"].items():
        rows.append([reference, f"{statistics.median(t) * 1e3:.0f}", f"x{common.median_ratio(t, copy):.2f}"])
    print(
        f"shape: Llama, {opts.layers} layers, hidden {opts.hidden}, FFN {opts.intermediate}; LoRA r={opts.rank}; "
        f"FSDP(2), {opts.batch} pairs x 2 x {opts.seq_len} tokens per rank per step; {opts.reps} x {opts.steps} timed "
        f"steps each, interleaved"
    )
    print(common.format_table(["dpo.reference", "step ms", "vs copy"], rows))
    print(f"precomputed: the table of {opts.pairs} pairs took {run['precompute'][0]:.2f} s before step 1 (rank 0)")


if __name__ == "__main__":
    main()
