"""`python -m titanlite.generate`: sample text from a checkpoint with the weights kept sharded.

    python -m titanlite.generate --nproc 4 --config debug_model --checkpoint outputs/debug/checkpoint \\
        --prompt "The function" --max-new-tokens 100 [--temperature 0.8 --top-k 50 --seed 0] [--no-kv-cache] \\
        [--section.key value]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from titanlite.checkpoint.catalog import checkpoint_folder
from titanlite.checkpoint.lora_export import dequantize_like_training, nf4_base_note
from titanlite.checkpoint.remote_inputs import local_checkpoint
from titanlite.config import load
from titanlite.data.chat import load_template
from titanlite.data.tokenizers import build_tokenizer
from titanlite.errors import ConfigError
from titanlite.generation import (
    generate_timed,
    inference_model,
    load_adapters,
    load_weights,
    resolve_checkpoint,
    settle_lora,
)
from titanlite.models.hf_config import hf_folder, is_hf_folder
from titanlite.models.registry import family_of_folder, model_args
from titanlite.observe.metrics import setup_logging
from titanlite.parallel.dims import ParallelDims
from titanlite.plan import check_parallelism
from titanlite.runtime.distributed import exit_process, init_distributed, pick_device, shutdown, world_size_from_env
from titanlite.runtime.exit_status import report_user_error
from titanlite.storage import is_url

logger = logging.getLogger("titanlite")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This command's own arguments, and the rest (config overrides --section.key value)."""
    p = argparse.ArgumentParser(
        prog="python -m titanlite.generate",
        allow_abbrev=False,
        description="Sample text from a titanlite checkpoint; other --section.key value "
        "arguments override the config as in training.",
    )
    p.add_argument("--config", default="debug_model", help="TOML config (a name in train_configs/ or a path)")
    p.add_argument(
        "--checkpoint",
        default="",
        help="a step-N DCP folder or the checkpoint root (newest step); default: "
        "<dump_folder>/<checkpoint.folder>; 'none' = untrained initial weights",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="run on this many processes of this node (torchrun through titanlite's launcher: a user error is one "
        "message and exit status 2); 0 = this process, or the ranks torchrun started",
    )
    p.add_argument("--prompt", default="", help="text to continue (after the BOS token, for a model that has one)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (rank 0's draw is broadcast)")
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="stop at the end-of-text token or an instruct model's end-of-turn token (default: go on)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="render --prompt as a user message with the chat template (data.chat_template) and print the "
        "assistant's reply; stops at the end of the turn",
    )
    p.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="recompute the whole prefix for every new token instead of decoding from a KV cache (slower; the "
        "same greedy tokens in fp32, and it goes on past max_seq_len with the last max_seq_len tokens)",
    )
    return p.parse_known_args(argv)


def run(argv: list[str]) -> str:
    """Parse, load, generate; returns the completion (printed by main on rank 0)."""
    args, overrides = parse_args(argv)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--top-k", args.top_k)):
        if value < 0:
            raise ConfigError(f"{flag} {value} is not valid; expected an integer >= 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature {args.temperature} is not valid; expected a finite number >= 0 (0 = greedy)")
    if args.checkpoint and is_url(args.checkpoint):  # read whole: a copy on this machine (remote_inputs.py)
        args.checkpoint = str(local_checkpoint(args.checkpoint))
    if args.checkpoint and is_hf_folder(args.checkpoint):
        # A HuggingFace folder: its config.json gives the shape, its tokenizer (if any) the tokenizer.
        hf = ["--model.flavor", "hf", "--checkpoint.initial_load_path", args.checkpoint]
        if not any(o.startswith("--model.name") for o in overrides):
            hf += ["--model.name", family_of_folder(args.checkpoint)]
        if (Path(args.checkpoint) / "tokenizer.json").is_file() and not any(
            o.startswith("--model.tokenizer_path") for o in overrides
        ):
            hf += ["--model.tokenizer_path", args.checkpoint]
        overrides = hf + overrides
    cfg = load(["--job.config_file", args.config, *overrides])
    if cfg.parallelism.context_parallel_degree > 1:  # a training setting: every rank generates the same tokens
        logger.info(
            f"parallelism.context_parallel_degree = {cfg.parallelism.context_parallel_degree} is a training setting: "
            "generation runs without it"
        )
        cfg.parallelism.context_parallel_degree = 1
    if cfg.parallelism.pipeline_parallel_degree > 1:  # a checkpoint does not depend on pp: one model per rank
        logger.info(
            f"parallelism.pipeline_parallel_degree = {cfg.parallelism.pipeline_parallel_degree} is a training setting: "
            "generation runs without it"
        )
        cfg.parallelism.pipeline_parallel_degree = 1
    if cfg.parallelism.expert_parallel_degree > 1:  # every rank runs the same tokens through every expert it gathers
        logger.info(
            f"parallelism.expert_parallel_degree = {cfg.parallelism.expert_parallel_degree} is a training setting: "
            "generation runs without it (with several processes each gathers a block's experts as it runs the block)"
        )
        cfg.parallelism.expert_parallel_degree = 1
    world = world_size_from_env()
    try:  # one process too: a degree it cannot honour is an error, not ignored
        dims = ParallelDims.from_config(cfg.parallelism, world)
    except ConfigError as e:
        raise ConfigError(f"{e} (generate runs on {world} process(es); --nproc N runs it on N)") from None
    dims = dims if world > 1 else None
    ckpt_arg = args.checkpoint or str(checkpoint_folder(cfg))
    if is_url(ckpt_arg):  # the configured checkpoint.folder is in object storage
        ckpt_arg = str(local_checkpoint(ckpt_arg, "checkpoint.folder"))
    checkpoint = None if ckpt_arg.lower() == "none" else resolve_checkpoint(ckpt_arg, given=bool(args.checkpoint))
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    settle_lora(cfg, checkpoint, _given_keys(overrides), tokenizer.vocab_size)  # the adapters' own [lora] and base
    _reach_the_models_limit(cfg, tokenizer.vocab_size)

    if dims is None:  # one process: a plain, unsharded model and no process group
        device, meshes = pick_device(0), None
    else:
        args_ = model_args(
            cfg.model, tokenizer.vocab_size, cfg.training.seq_len, hf_folder(cfg.checkpoint.initial_load_path)
        )
        check_parallelism(cfg, dims, args_, None, inference=True)
        env = init_distributed()
        # an MoE: every rank runs the same tokens, each gathers a block's experts like its other weights
        device, meshes = env.device, dims.build_meshes(env.device.type, args_.moe)
        logger.info(dims.describe() + ", weights gathered per block on demand")
        if tp_line := dims.describe_tp(False, False):
            logger.info(tp_line)
    model = inference_model(cfg, tokenizer.vocab_size, device, meshes, checkpoint)
    if checkpoint is None:
        model.init_weights(cfg.training.seed)
        logger.info(f"Untrained weights (seed {cfg.training.seed})")
    else:
        load_weights(model, checkpoint)
        if cfg.lora.enable and cfg.lora.base_dtype == "nf4":  # the adapters learnt against the 4-bit base
            logger.info(f"{nf4_base_note(dequantize_like_training(model, cfg, checkpoint), cfg)}, for sampling")
        a = model.args
        logger.info(f"Loaded {checkpoint}: {a.family}, {a.n_layers} blocks, dim {a.dim}, vocab {a.vocab_size}")
    load_adapters(model, cfg)  # a peft folder's adapters on a base without its own
    if args.chat:  # the conversation so far, ending with the assistant's header
        text = load_template(cfg.data.chat_template, tokenizer).render(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True
        )
        prompt_ids = tokenizer.with_bos(tokenizer.encode_with_specials(text))
    else:
        prompt_ids = tokenizer.with_bos(tokenizer.encode(args.prompt))
    new, timing = generate_timed(
        model,
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        stop_ids=tokenizer.stop_ids if args.stop_at_eos or args.chat else (),
        kv_cache=not args.no_kv_cache,
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(timing.describe())
    return tokenizer.decode(new)


def _given_keys(overrides: list[str]) -> set[str]:
    """The section.key names the command line sets (--section.key value or --section.key=value)."""
    return {o[2:].partition("=")[0] for o in overrides if o.startswith("--") and "." in o.partition("=")[0]}


def _reach_the_models_limit(cfg, vocab_size: int) -> None:
    """Positions up to the model's own limit (its context, or what its RoPE scaling reaches), not training's seq_len:
    generation has no activations to bound them; a larger training.seq_len raises the cap further."""
    args = model_args(cfg.model, vocab_size, cfg.training.seq_len, hf_folder(cfg.checkpoint.initial_load_path))
    cfg.training.seq_len = max(cfg.training.seq_len, args.position_limit())


def launch(nproc: int, argv: list[str]) -> int:
    """This command on nproc local processes, through titanlite's torchrun launcher; its exit status."""
    rest, skip = [], False
    for a in argv:  # drop --nproc N / --nproc=N: the workers run as ranks
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    torchrun = ["--standalone", f"--nproc_per_node={nproc}", "--local-ranks-filter=0"]
    command = [sys.executable, "-m", "titanlite.cli.launch", *torchrun, "-m", "titanlite.generate", *rest]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # torchrun's default, unannounced
    return subprocess.run(command, env=env).returncode


def entry() -> None:
    """`python -m titanlite.generate`: main(), then the exit (see distributed.exit_process)."""
    exit_process(main())


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m titanlite.generate`."""
    setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, _ = parse_args(argv)
        if args.nproc < 0:
            raise ConfigError(f"--nproc {args.nproc} is not valid; expected a whole number >= 0")
        if args.nproc > 0 and "RANK" not in os.environ:
            return launch(args.nproc, argv)
        completion = run(argv)
    except ConfigError as e:
        report_user_error(str(e), every_rank_alike=True)  # once, not once per rank
        shutdown()
        return 2
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(completion if args.chat else args.prompt + completion, flush=True)
    shutdown(wait_for_peers=True)
    return 0
