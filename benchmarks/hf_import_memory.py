"""Peak host memory of each rank while importing a sharded HuggingFace folder at FSDP(world).

    python benchmarks/hf_import_memory.py [--world 4] [--hidden 1024] [--layers 8] [--vocab 32000]

A random-weight LlamaForCausalLM is saved (bf16, several safetensors files). Each rank builds the
sharded, empty titanlite model, resets its peak-RSS counter (/proc/self/clear_refs), imports the
folder with titanlite's HF import, and reports how much its peak resident memory rose, against a
1/world share of the model in fp32 (what the rank must hold) and the largest single tensor.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MIB = 1024**2


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(field)


def _rank(folder: str):
    import torch.distributed as dist

    from titanlite.checkpoint.hf_io import load_hf_weights
    from titanlite.config import load
    from titanlite.model_builder import build_model
    from titanlite.models.registry import hf_args
    from titanlite.parallel.dims import ParallelDims
    from titanlite.runtime.distributed import init_distributed

    env = init_distributed()
    cfg = load(
        [
            "--model.flavor",
            "hf",
            "--checkpoint.initial_load_path",
            folder,
            "--training.mixed_precision_param",
            "float32",
        ]
    )
    args = hf_args(folder)
    dims = ParallelDims.from_config(cfg.parallelism, env.world_size)
    model = build_model(cfg, args, dims.build_meshes("cpu")).model
    model.to_empty(device="cpu")
    model.init_buffers()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter (VmHWM)
    before = _rss_kib("VmRSS:")
    load_hf_weights(model, folder)
    peak = _rss_kib("VmHWM:")
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    return {"rank": env.rank, "rise_mib": (peak - before) / 1024, "local_mib": local / MIB}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--intermediate", type=int, default=2816)
    opts = p.parse_args()
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        config = transformers.LlamaConfig(
            vocab_size=opts.vocab,
            hidden_size=opts.hidden,
            intermediate_size=opts.intermediate,
            num_hidden_layers=opts.layers,
            num_attention_heads=opts.hidden // 64,
            num_key_value_heads=opts.hidden // 128,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(tmp, max_shard_size="100MB")
        total = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() for p in model.parameters())
        files = len(list(Path(tmp).glob("*.safetensors")))
        del model
        results = run_distributed(_rank, opts.world, tmp)
    full_fp32 = total * 4 / MIB
    print(
        f"model: {total:,} parameters ({full_fp32:,.0f} MiB in fp32, {full_fp32 / 2:,.0f} MiB bf16 on disk in "
        f"{files} files); largest tensor {largest * 4 / MIB:,.0f} MiB in fp32; FSDP({opts.world}), CPU, gloo"
    )
    print(f"{'rank':>4} {'peak RSS rise MiB':>18} {'its shards MiB':>15} {'rise / (model/world + largest)':>31}")
    for r in sorted(results, key=lambda r: r["rank"]):
        bound = full_fp32 / opts.world + largest * 4 / MIB
        print(f"{r['rank']:>4} {r['rise_mib']:>18.0f} {r['local_mib']:>15.0f} {r['rise_mib'] / bound:>31.2f}")
    print(f"whole model in fp32: {full_fp32:,.0f} MiB (what one process would hold without sharded reads)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
