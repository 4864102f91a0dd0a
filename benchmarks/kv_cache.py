"""Generation with the KV cache against the no-cache loop (every token recomputes the whole prefix).

    python benchmarks/kv_cache.py [--flavor debugmodel] [--prompt-len 32] [--new-tokens 128] [--reps 5] [--world 1]

One model (untrained weights, the byte tokenizer's vocabulary), plain at --world 1 or sharded with
FSDP over --world ranks as `titanlite.generate` builds it under torchrun; greedy generation from the
same random prompt with and without the cache, interleaved (A B A B ...) after one warm-up of each.
Prints the median total time and decode tokens/s of each, the median of the per-repetition
speed-ups, and whether the tokens were the same.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import common


def _run(opts, dtype: str):
    from titanlite.config import load
    from titanlite.generation import generate_timed, inference_model
    from titanlite.parallel.dims import ParallelDims
    from titanlite.runtime.distributed import init_distributed

    cfg = load(
        [
            "--model.flavor",
            opts.flavor,
            "--training.mixed_precision_param",
            dtype,
            "--training.seq_len",
            str(opts.prompt_len + opts.new_tokens),
        ]
    )
    env = init_distributed()
    world, device = env.world_size, env.device
    mesh = ParallelDims.from_config(cfg.parallelism, world).build_meshes(device.type) if world > 1 else None
    model = inference_model(cfg, 258, device, mesh)
    model.init_weights(cfg.training.seed)
    if mesh is None and dtype != "float32":  # a plain model computes in its parameters' dtype (not the RoPE table)
        for part in (model.tok_embeddings, model.layers, model.norm, model.output):
            part.to(getattr(torch, dtype))
    prompt = torch.randint(0, 258, (opts.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = {"KV cache": True, "no KV cache": False}
    timings, tokens = {name: [] for name in runs}, {}
    for i in range(opts.reps + 1):
        for name in list(runs) if i % 2 == 0 else list(reversed(runs)):
            new, timing = generate_timed(model, prompt, opts.new_tokens, kv_cache=runs[name])
            tokens[name] = new
            if i:  # the first of each warms up
                timings[name].append(timing)
    return timings, tokens["KV cache"] == tokens["no KV cache"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    opts = p.parse_args()
    device = common.device_type(opts.device, opts.world)
    dtype = common.param_dtype(opts.dtype, device)
    timings, same = common.spawn(_run, opts.world, device, opts, dtype)[0]
    print(common.machine_line(device))
    print(
        f"model {opts.flavor}, {opts.world} rank(s){' (FSDP)' if opts.world > 1 else ''}, prompt {opts.prompt_len} "
        f"tokens, {opts.new_tokens} new (greedy), {opts.reps} reps, {dtype}; same tokens: {same}"
    )
    rows = []
    for name, values in timings.items():
        med, lo, hi = common.summary([t.total_s for t in values])
        rate = statistics.median((t.new_tokens - 1) / (t.total_s - t.prefill_s) for t in values)
        prefill = statistics.median(t.prefill_s for t in values)
        rows.append([name, f"{med:.3f}", f"{lo:.3f}-{hi:.3f}", f"{prefill * 1e3:.1f}", f"{rate:.1f}"])
    print(common.format_table(["generation", "total s", "(min-max)", "prefill ms", "decode tokens/s"], rows))
    ratios = [b.total_s / a.total_s for a, b in zip(timings["KV cache"], timings["no KV cache"])]
    print(f"no KV cache / KV cache total time: {statistics.median(ratios):.2f} median of the per-repetition ratios")


if __name__ == "__main__":
    main()
