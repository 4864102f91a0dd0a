"""What a generation run is, from the command's checkpoint, config and overrides: the configuration (a HF folder's
shape and tokenizer, the adapters' own [lora], training-only degrees dropped, positions up to the model's limit), the
mesh, the checkpoint and the tokenizer; and the model it samples from, sharded and loaded (titanlite.cli.generate
parses, calls these, prints)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from titanlite.checkpoint.catalog import checkpoint_folder
from titanlite.checkpoint.lora_export import dequantize_like_training, nf4_base_note
from titanlite.checkpoint.remote_inputs import local_checkpoint
from titanlite.config import JobConfig, load
from titanlite.data.tokenizers import build_tokenizer
from titanlite.errors import ConfigError
from titanlite.generation import inference_model, load_adapters, load_weights, resolve_checkpoint, settle_lora
from titanlite.models.args import ModelArgs
from titanlite.models.hf_config import hf_folder, is_hf_folder
from titanlite.models.registry import BACKEND, family_of_folder, native_family
from titanlite.models.resolve import resolved_model_args
from titanlite.models.transformers_backend.support import problem as backend_problem
from titanlite.parallel.dims import ParallelDims
from titanlite.plan import check_parallelism
from titanlite.runtime.distributed import init_distributed, pick_device, world_size_from_env
from titanlite.storage import is_url

logger = logging.getLogger("titanlite")

# Degrees that split training's work and that generation runs without, and why.
TRAINING_DEGREES = {
    "context_parallel_degree": "",  # every rank generates the same tokens
    "pipeline_parallel_degree": "",  # a checkpoint does not depend on pp: one model per rank
    "expert_parallel_degree": " (with several processes each gathers a block's experts as it runs the block)",
}


@dataclass
class GenerationPlan:
    """A generation run: its configuration, mesh degrees (None: one process, no process group), the checkpoint to
    load (None: untrained weights), the tokenizer and the model's arguments."""

    cfg: JobConfig
    dims: ParallelDims | None
    checkpoint: Path | None
    tokenizer: object
    args: ModelArgs


def plan_generation(checkpoint_arg: str, config: str, overrides: list[str]) -> GenerationPlan:
    """The plan of `python -m titanlite.generate --checkpoint checkpoint_arg --config config [overrides]`, checked:
    ConfigError for what cannot run."""
    if checkpoint_arg and is_url(checkpoint_arg):  # read whole: a copy on this machine (remote_inputs.py)
        checkpoint_arg = str(local_checkpoint(checkpoint_arg))
    cfg = load(["--job.config_file", config, *hf_folder_overrides(checkpoint_arg, overrides), *overrides])
    drop_training_degrees(cfg)
    dims = _dims(cfg)
    where = checkpoint_arg or str(checkpoint_folder(cfg))
    if is_url(where):  # the configured checkpoint.folder is in object storage
        where = str(local_checkpoint(where, "checkpoint.folder"))
    checkpoint = None if where.lower() == "none" else resolve_checkpoint(where, given=bool(checkpoint_arg))
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    settle_lora(cfg, checkpoint, given_keys(overrides), tokenizer.vocab_size)  # the adapters' own [lora] and base
    folder = hf_folder(cfg.checkpoint.initial_load_path)
    # Positions up to the model's own limit (its context, or what its RoPE scaling reaches), not training's seq_len:
    # generation has no activations to bound them; a larger training.seq_len raises the cap further.
    limit = resolved_model_args(cfg.model, tokenizer.vocab_size, cfg.training.seq_len, folder).position_limit()
    cfg.training.seq_len = max(cfg.training.seq_len, limit)
    args = resolved_model_args(cfg.model, tokenizer.vocab_size, cfg.training.seq_len, folder)
    if args.family == BACKEND and dims is not None and (problem := backend_problem(cfg, dims, args, inference=True)):
        raise ConfigError(problem)
    if dims is not None:
        check_parallelism(cfg, dims, args, None, inference=True)
    return GenerationPlan(cfg, dims, checkpoint, tokenizer, args)


def hf_folder_overrides(checkpoint_arg: str, overrides: list[str]) -> list[str]:
    """For a HuggingFace folder as the checkpoint: its config.json gives the shape and the family, its tokenizer (if
    any) the tokenizer, unless the overrides name them."""
    if not (checkpoint_arg and is_hf_folder(checkpoint_arg)):
        return []
    given = given_keys(overrides)
    hf = ["--model.flavor", "hf", "--checkpoint.initial_load_path", checkpoint_arg]
    if "model.name" not in given:
        hf += ["--model.name", family_of_folder(checkpoint_arg) if native_family(checkpoint_arg) else BACKEND]
    if (Path(checkpoint_arg) / "tokenizer.json").is_file() and "model.tokenizer_path" not in given:
        hf += ["--model.tokenizer_path", checkpoint_arg]
    return hf


def drop_training_degrees(cfg: JobConfig) -> None:
    """Set the degrees that only split training's work to 1, with a line each."""
    for key, how in TRAINING_DEGREES.items():
        degree = getattr(cfg.parallelism, key)
        if degree > 1:
            logger.info(f"parallelism.{key} = {degree} is a training setting: generation runs without it{how}")
            setattr(cfg.parallelism, key, 1)


def given_keys(overrides: list[str]) -> set[str]:
    """The section.key names the command line sets (--section.key value or --section.key=value)."""
    return {o[2:].partition("=")[0] for o in overrides if o.startswith("--") and "." in o.partition("=")[0]}


def _dims(cfg: JobConfig) -> ParallelDims | None:
    world = world_size_from_env()
    try:  # one process too: a degree it cannot honour is an error, not ignored
        dims = ParallelDims.from_config(cfg.parallelism, world)
    except ConfigError as e:
        raise ConfigError(f"{e} (generate runs on {world} process(es); --nproc N runs it on N)") from None
    return dims if world > 1 else None


def generation_model(plan: GenerationPlan) -> torch.nn.Module:
    """The plan's model, on this process's device (sharded over the process group when there are several: started
    here), with its checkpoint's weights (or untrained ones) and adapters."""
    cfg, vocab = plan.cfg, plan.tokenizer.vocab_size
    if plan.dims is None:  # one process: a plain, unsharded model and no process group
        device, meshes = pick_device(0), None
    else:
        env = init_distributed()
        # an MoE: every rank runs the same tokens, each gathers a block's experts like its other weights
        device, meshes = env.device, plan.dims.build_meshes(env.device.type, plan.args.moe)
        logger.info(plan.dims.describe() + ", weights gathered per block on demand")
        if tp_line := plan.dims.describe_tp(False, False):
            logger.info(tp_line)
    model = inference_model(cfg, vocab, device, meshes, plan.checkpoint)
    if plan.checkpoint is None:
        model.init_weights(cfg.training.seed)
        logger.info(f"Untrained weights (seed {cfg.training.seed})")
    else:
        load_weights(model, plan.checkpoint)
        if cfg.lora.enable and cfg.lora.base_dtype == "nf4":  # the adapters learnt against the 4-bit base
            logger.info(f"{nf4_base_note(dequantize_like_training(model, cfg, plan.checkpoint), cfg)}, for sampling")
        a = model.args
        logger.info(f"Loaded {plan.checkpoint}: {a.family}, {a.n_layers} blocks, dim {a.dim}, vocab {a.vocab_size}")
    load_adapters(model, cfg)  # a peft folder's adapters on a base without its own
    return model
