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

import torch.distributed as dist

from titanlite.data.chat import load_template
from titanlite.errors import ConfigError
from titanlite.generation import generate_timed
from titanlite.generation_plan import generation_model, plan_generation
from titanlite.observe.metrics import setup_logging
from titanlite.runtime.distributed import exit_process, shutdown
from titanlite.runtime.exit_status import report_user_error

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
    """Parse, plan, load, generate; returns the completion (printed by main on rank 0)."""
    args, overrides = parse_args(argv)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--top-k", args.top_k)):
        if value < 0:
            raise ConfigError(f"{flag} {value} is not valid; expected an integer >= 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature {args.temperature} is not valid; expected a finite number >= 0 (0 = greedy)")
    plan = plan_generation(args.checkpoint, args.config, overrides)
    model, tokenizer = generation_model(plan), plan.tokenizer
    if args.chat:  # the conversation so far, ending with the assistant's header
        text = load_template(plan.cfg.data.chat_template, tokenizer).render(
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
