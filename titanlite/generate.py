"""Sample text from a checkpoint with the weights kept sharded: `python -m titanlite.generate`.

    torchrun --nproc_per_node 4 -m titanlite.generate --config debug_model --checkpoint outputs/debug/checkpoint \\
        --prompt "The function" --max-new-tokens 100 [--temperature 0.8 --top-k 50 --seed 0] [--section.key value]

Under torchrun the model is sharded as `[parallelism]` says (FSDP, or HSDP with
data_parallel_replicate_degree > 1), every block resharded after its forward, so a block's full
weights exist only while it computes (all-gathered on demand). Every rank runs the same forward on
the same tokens; rank 0 picks the next token and broadcasts it. Run as a single process (no
torchrun) the model is a plain, unsharded Transformer. There is no KV cache: each new token
recomputes the whole prefix (fine for debug sizes), cropped to the model's max_seq_len.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite import config as config_mod
from titanlite.config import ConfigError, JobConfig

logger = logging.getLogger("titanlite")

_STEP_DIR = re.compile(r"^step-(\d+)$")


def resolve_checkpoint(path: str) -> Path:
    """A DCP checkpoint folder: `path` itself, or its newest `step-N` sub-folder (a checkpoint root)."""
    p = Path(path).expanduser()
    if (p / ".metadata").is_file():
        return p
    steps = [(int(m.group(1)), d) for d in (p.iterdir() if p.is_dir() else [])
             if (m := _STEP_DIR.match(d.name)) and (d / ".metadata").is_file()]
    if steps:
        return max(steps)[1]
    what = "does not exist" if not p.exists() else "is neither a DCP checkpoint (no .metadata) nor a folder of step-N ones"
    raise ConfigError(f"--checkpoint {path!r} {what}; valid: a step-N checkpoint folder, the checkpoint folder "
                      f"holding them (the newest is used), or 'none' for the untrained initial weights")


def build_model(cfg: JobConfig, vocab_size: int, device: torch.device, mesh=None) -> torch.nn.Module:
    """The Transformer of `cfg` on `device`, sharded over `mesh` for inference (or plain when None); empty weights."""
    from titanlite.models import model_args
    from titanlite.models.llama import Transformer
    from titanlite.parallelize import apply_fsdp

    args = model_args(cfg.model, vocab_size, cfg.training.seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype=cfg.training.mixed_precision_param,
                   reduce_dtype=cfg.training.mixed_precision_reduce, reshard_after_forward="always")
    model.to_empty(device=device)
    model.init_buffers()
    return model


def load_weights(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Load the "model" entry of a DCP checkpoint into the (sharded or plain) model, each rank its shard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, checkpoint_id=str(checkpoint), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # shape or key mismatches, as long nested errors
        args = model.args
        raise ConfigError(
            f"--checkpoint {str(checkpoint)!r} does not fit the model of this config (dim {args.dim}, "
            f"{args.n_layers} layers, vocab {args.vocab_size}): is it the config the checkpoint was trained "
            f"with? {type(e).__name__}: {str(e)[:500]}") from e
    set_model_state_dict(model, state["model"])


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """One token id (shape (1,)) from 1-D logits: argmax when temperature is 0, else softmax(logits / T) over the top k."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """The new token ids after `prompt_ids` (stops early at eos_id). Call on every rank with the same arguments."""
    device = model.rope.device
    max_len = model.args.max_seq_len
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    broadcast = dist.is_initialized() and dist.get_world_size() > 1
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -max_len:])[0, -1].float()
        nxt = sample_next(logits, temperature, top_k, generator)
        if broadcast:  # rank 0 decides: every rank must feed identical tokens to the next forward
            dist.broadcast(nxt, src=0)
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
        if eos_id is not None and int(nxt) == eos_id:
            break
    return tokens[0, len(prompt_ids):].tolist()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This command's own arguments, and the rest (config overrides --section.key value)."""
    p = argparse.ArgumentParser(prog="python -m titanlite.generate", allow_abbrev=False,
                                description="Sample text from a titanlite checkpoint; other --section.key value "
                                            "arguments override the config as in training.")
    p.add_argument("--config", default="debug_model", help="TOML config (a name in train_configs/ or a path)")
    p.add_argument("--checkpoint", default="",
                   help="a step-N DCP folder or the checkpoint root (newest step); default: "
                        "<dump_folder>/<checkpoint.folder>; 'none' = untrained initial weights")
    p.add_argument("--prompt", default="", help="text to continue (the BOS token is always prepended)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (rank 0's draw is broadcast)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="stop at the end-of-text token (default: go on into a new document)")
    return p.parse_known_args(argv)


def run(argv: list[str]) -> str:
    """Parse, load, generate; returns the completion (printed by main on rank 0)."""
    from titanlite.data import build_tokenizer
    from titanlite.distributed import init_distributed, pick_device, world_size_from_env
    from titanlite.parallel_dims import ParallelDims

    args, overrides = parse_args(argv)
    if args.max_new_tokens < 0 or args.top_k < 0 or args.temperature < 0:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}, --top-k {args.top_k} and --temperature "
                          f"{args.temperature} must be >= 0")
    cfg = config_mod.load(["--job.config_file", args.config, *overrides])
    world = world_size_from_env()
    dims = ParallelDims.from_config(cfg.parallelism, world) if world > 1 else None
    ckpt_arg = args.checkpoint or str(Path(cfg.job.dump_folder) / cfg.checkpoint.folder)
    checkpoint = None if ckpt_arg.lower() == "none" else resolve_checkpoint(ckpt_arg)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)

    if dims is None:  # one process: a plain, unsharded model and no process group
        device, mesh = pick_device(0), None
    else:
        env = init_distributed()
        device, mesh = env.device, dims.build_mesh(env.device.type)
        logger.info(dims.describe() + ", weights gathered per block on demand")
    model = build_model(cfg, tokenizer.vocab_size, device, mesh)
    if checkpoint is None:
        model.init_weights(cfg.training.seed)
        logger.info(f"Untrained weights (seed {cfg.training.seed})")
    else:
        load_weights(model, checkpoint)
        logger.info(f"Loaded {checkpoint}")
    prompt_ids = [tokenizer.bos_id, *tokenizer.encode(args.prompt)]
    t0 = time.perf_counter()
    new = generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   seed=args.seed, eos_id=tokenizer.eos_id if args.stop_at_eos else None)
    dt = time.perf_counter() - t0
    logger.info(f"Generated {len(new)} tokens in {dt:.1f}s ({len(new) / max(dt, 1e-9):.1f} tokens/s, no KV cache)")
    return tokenizer.decode(new)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m titanlite.generate`."""
    from titanlite.distributed import shutdown
    from titanlite.metrics import setup_logging

    setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, _ = parse_args(argv)
        completion = run(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        shutdown()
        return 2
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(args.prompt + completion, flush=True)
    shutdown(wait_for_peers=True)
    return 0


if __name__ == "__main__":
    from titanlite.generate import main as _main  # the imported module's ConfigError, as in config.py
    raise SystemExit(_main())
