"""The dry run's verdicts for transformers-backend models at their published shapes: does a fine-tune fit on 80 GB
GPUs? Each model's text config is written to a folder (config.json alone: the dry run needs no weights) and sized
for full fine-tuning, LoRA and QLoRA; docs/model_families.md holds the table.

    python benchmarks/backend_verdicts.py                 # every model and setup; about a minute here
    python benchmarks/backend_verdicts.py --models gemma3_27b --seq-len 8192

The shapes are the releases' config.json text configs (Qwen/Qwen3.5-27B, Qwen/Qwen3.5-35B-A3B, google/gemma-3-27b-it)
as published on the Hugging Face Hub; keys that do not change the size (token ids, rope details) are left at
transformers' defaults. Activations are measured on fake tensors with transformers' PyTorch code paths (its Gated
DeltaNet fallback keeps more than flash-linear-attention's kernels): an upper bound for a GPU with those kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import tempfile

QWEN3_5_COMMON = dict(
    vocab_size=248320, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    full_attention_interval=4, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attn_output_gate=True, partial_rotary_factor=0.25,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
)  # fmt: skip
MODELS = {
    "qwen3_5_27b": dict(
        model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48,
        **QWEN3_5_COMMON,
    ),
    "qwen3_5_35b_a3b": dict(
        model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, **QWEN3_5_COMMON,
    ),
    "gemma3_27b": dict(
        model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208, sliding_window=1024,
        query_pre_attn_scalar=168, max_position_embeddings=131072, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)],
    ),
}  # fmt: skip

BF16_AC = ["--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full"]
LORA = ["--lora.enable", "true", "--lora.targets", "all", "--lora.rank", "16"]
# name -> (GPUs, overrides)
SETUPS = {
    "full fine-tuning, FSDP over 8 GPUs": (8, BF16_AC),
    "LoRA r=16 on every linear, 1 GPU (bf16 base)": (1, [*BF16_AC, *LORA, "--lora.base_dtype", "bfloat16"]),
    "QLoRA r=16 on every linear, 1 GPU (nf4 base)": (1, [*BF16_AC, *LORA, "--lora.base_dtype", "nf4"]),
}


def write_config(root: str, name: str) -> str:
    """A folder holding MODELS[name]'s config.json."""
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(MODELS[name], f, indent=1)
    return folder


def verdict(folder: str, gpus: int, overrides: list[str], seq_len: int) -> dict:
    """The dry run's figures of one setup (its exit status 0: fits, 1: does not fit)."""
    from titanlite.cli.dry_run import main as dry_run

    argv = [
        "--world-size", str(gpus), "--dry-run-gpu-mem-gib", "80", "--model.name", "transformers",
        "--model.flavor", "hf", "--checkpoint.initial_load_path", folder, "--training.seq_len", str(seq_len),
        "--training.local_batch_size", "1", "--training.global_batch_size", str(gpus), *overrides,
    ]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = dry_run(argv)
    out = printed.getvalue()
    if status not in (0, 1):
        raise RuntimeError(f"dry run failed ({status}): {out[-2000:]}")
    total = re.search(r"total on GPU .*?([\d.]+)\s*$", out, re.M)
    largest = re.search(r"largest local batch that fits: (\d+)", out)
    return {
        "fits": status == 0,
        "peak_gib": float(total.group(1)) if total else None,
        "largest_batch": int(largest.group(1)) if largest else 0,
        "params": re.search(r"model: .*?, ([\d.]+B) parameters", out).group(1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (one sequence per GPU)")
    p.add_argument("--json", help="also write the figures to this file")
    opts = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name in opts.models:
            folder = write_config(root, name)
            for setup, (gpus, overrides) in SETUPS.items():
                r = verdict(folder, gpus, overrides, opts.seq_len)
                results[f"{name} / {setup}"] = r
                fits = f"fits, up to {r['largest_batch']} x {opts.seq_len} tokens per GPU" if r["fits"] else "no fit"
                print(f"{name} ({r['params']}), {setup}, seq {opts.seq_len}: {r['peak_gib']:.1f} GiB per GPU; {fits}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
