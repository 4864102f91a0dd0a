"""The same Llama folder through the native llama3 family and through the transformers backend: step time and
per-rank memory at FSDP(2).

    python benchmarks/backend.py                 # about 2 minutes on 2 CPU cores
    python benchmarks/backend.py --device cuda --layers 8 --hidden 2048 --intermediate 5632 --seq-len 2048

A random LlamaForCausalLM saved by transformers is the start of both Trainers (checkpoint.initial_load_path, flavor
hf): model.name = llama3 builds titanlite's own decoder from it, model.name = transformers builds transformers' class.
Both compute the same first loss on the same batch (checked, to 1e-4). Step time: Trainer.train_step on one random
batch, timed interleaved (A B B A ...), the slowest rank's; the medians and the median of the back-to-back ratios.
Memory: torch's FSDPMemTracker over one step after a first one (AdamW's state exists), rank 0 (CPU runs only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

import common

MiB = 1024**2
MODES = {"native llama3": "llama3", "transformers backend": "transformers"}


def _llama_folder(opts, folder: str) -> str:
    """A random transformers Llama of the benchmark's shape, saved in `folder`."""
    import transformers

    config = transformers.LlamaConfig(
            vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=opts.intermediate,
            num_hidden_layers=opts.layers, num_attention_heads=opts.hidden // opts.head_dim,
            num_key_value_heads=max(1, opts.hidden // opts.head_dim // 4), max_position_embeddings=opts.seq_len,
            bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _trainer(opts, dump: str, name: str, folder: str):
    from titanlite.config import load
    from titanlite.trainer import Trainer

    device = common.device_type(opts.device, int(os.environ["WORLD_SIZE"]))
    argv = [
        "--model.name", name, "--model.flavor", "hf", "--checkpoint.initial_load_path", folder,
        "--training.seq_len", str(opts.seq_len), "--training.local_batch_size", str(opts.batch),
        "--training.global_batch_size", str(opts.batch * int(os.environ["WORLD_SIZE"])),
        "--training.mixed_precision_param", common.param_dtype(opts.dtype, device), "--training.steps", "1000000",
        "--optimizer.lr", "1e-5", "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1000000",
        "--job.dump_folder", dump,
    ]  # fmt: skip
    return Trainer(load(argv))


def _memory_world(opts, mode: str) -> dict:
    """One mode's memory: a world of its own (one FSDPMemTracker per process)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    with common.job_folder() as dump:
        t = _trainer(opts, dump, MODES[mode], opts.folder)
    batch = common.random_microbatches([opts.batch], opts.seq_len, opts.vocab, seed=int(os.environ["RANK"]))
    t.train_step(batch)
    tracker = FSDPMemTracker(t.model, t.optimizer)
    tracker.track_inputs(tuple(batch[0]))
    with tracker:
        t.train_step(batch)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {"peak": sum(v for k, v in peak.items() if k != "Total")}


def _time_world(opts) -> dict:
    """Both modes' first loss on one batch, and their step times, interleaved."""
    with common.job_folder() as dump:
        trainers = {
            mode: _trainer(opts, f"{dump}/{i}", name, opts.folder) for i, (mode, name) in enumerate(MODES.items())
        }
    batch = common.random_microbatches([opts.batch], opts.seq_len, opts.vocab, seed=int(os.environ["RANK"]))
    first = {mode: t.global_loss(t.train_step(batch)) for mode, t in trainers.items()}
    device = next(iter(trainers.values())).device
    times = common.time_modes(trainers, {m: batch for m in trainers}, opts, device)
    return {"first": first, "times": times}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=4, hidden=512, intermediate=1408, seq_len=512)
    common.add_repetition_args(p, reps=6)
    p.add_argument("--vocab", type=int, default=32768, help="model vocabulary")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    opts = p.parse_args(argv)
    device = common.device_type(opts.device, 2)
    print(common.machine_line(device))
    with tempfile.TemporaryDirectory() as scratch:
        opts.folder = _llama_folder(opts, os.path.join(scratch, "llama"))
        run = common.spawn(_time_world, 2, device, opts)[0]
        memory = {m: common.spawn(_memory_world, 2, "cpu", opts, m)[0] for m in MODES} if device == "cpu" else {}
    losses = list(run["first"].values())
    assert abs(losses[0] - losses[1]) < 1e-4, run["first"]  # the same model, the same batch
    native = run["times"]["native llama3"]
    rows = []
    for mode, t in run["times"].items():
        peak = f"{memory[mode]['peak'] / MiB:.0f}" if mode in memory else "-"
        rows.append([mode, f"{statistics.median(t) * 1e3:.0f}", f"x{common.median_ratio(t, native):.2f}", peak])
    print(
        f"shape: Llama, {opts.layers} layers, hidden {opts.hidden}, FFN {opts.intermediate}, vocab {opts.vocab}; "
        f"FSDP(2), {opts.batch} x {opts.seq_len} tokens per rank per step; first loss {losses[0]:.5f} both; "
        f"{opts.reps} x {opts.steps} timed steps each, interleaved; peak: FSDPMemTracker, rank 0, MiB"
    )
    print(common.format_table(["model built by", "step ms", "vs native", "peak MiB"], rows))


if __name__ == "__main__":
    main()
