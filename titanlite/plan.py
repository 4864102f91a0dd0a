"""What a configuration resolves to for one world size, before any process group exists.

`validate_for_world` runs every check a run makes before it starts (degrees, batch sizes, tokenizer,
model shape, data, activation checkpointing, compile); the Trainer, the launcher's pre-check
(`python -m titanlite.config --world-size N`) and the dry run all call it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from titanlite.checkpoint.catalog import checkpoint_folder, preflight
from titanlite.checkpoint.hf_io import check_hf_weights
from titanlite.checkpoint.lora_io import check_peft_folder
from titanlite.checkpoint.remote_inputs import stage_remote_inputs
from titanlite.checkpoint.resume import check_resume
from titanlite.config import JobConfig
from titanlite.config.dpo import dpo_problem
from titanlite.data.build import check_data
from titanlite.data.tokenizers import build_tokenizer
from titanlite.dtypes import dtype_bytes
from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.hf_config import hf_folder, missing_weights_note, pickled
from titanlite.models.lora import apply_lora, lora_problem
from titanlite.models.nf4 import qlora_problem
from titanlite.models.registry import BACKEND, model_class
from titanlite.models.resolve import resolved_model_args
from titanlite.models.transformers_backend.support import problem as backend_problem
from titanlite.muon import muon_problem
from titanlite.observe.wandb_tracker import wandb_problem
from titanlite.parallel import ac, cp, ep, float8, fsdp, ft, pp, tp
from titanlite.parallel import compile as compile_kind
from titanlite.parallel.dims import ParallelDims
from titanlite.runtime.run_control import check_lock_free

logger = logging.getLogger("titanlite")


def batch_plan(cfg: JobConfig, dp_degree: int) -> tuple[int, int]:
    """(global batch size, microbatches per optimizer step) at this dp degree: training.global_batch_size
    (-1: one microbatch per rank) over training.local_batch_size x dp degree. The only place either is derived."""
    t = cfg.training
    per_pass = t.local_batch_size * dp_degree
    global_batch = per_pass if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_pass:
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size} is not a multiple of training.local_batch_size "
            f"= {t.local_batch_size} x data-parallel degree {dp_degree} = {per_pass}; "
            f"valid: any multiple of {per_pass}"
        )
    return global_batch, global_batch // per_pass


def resolve(cfg: JobConfig, world_size: int) -> tuple[ParallelDims, int, int]:
    """Checks that need the world size: (dims, global batch size, microbatches per step); cfg is not changed."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    # a fault-tolerant group reads its part of each global batch: the dp ranks of all groups split it
    groups = cfg.fault_tolerance.group_count if cfg.fault_tolerance.enable else 1
    global_batch, grad_accum = batch_plan(cfg, dims.dp_degree * groups)
    return dims, global_batch, grad_accum


def model_shapes(cfg: JobConfig, args: ModelArgs) -> dict[str, tuple]:
    """The shapes a checkpoint of this run holds, from a model on the meta device (nothing allocated): the state
    dict, or with LoRA what trains (the adapters) and the buffers."""
    with torch.device("meta"):
        model = model_class(args.family)(args)
    if not cfg.lora.enable:
        return {name: tuple(t.shape) for name, t in model.state_dict().items()}
    apply_lora(model, cfg.lora)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in frozen}


def check_adapters_and_optimizer(cfg: JobConfig, dims: ParallelDims, args: ModelArgs, device_type: str | None):
    """ConfigError with the first problem of Muon, LoRA (and its adapter folder) or QLoRA with this job (device_type
    None: the dry run, which does not ask for torchao)."""
    for problem in (muon_problem(cfg), lora_problem(cfg, args, sizing_only=device_type is None), dpo_problem(cfg)):
        if problem:
            raise ConfigError(problem)
    if cfg.lora.enable and cfg.lora.initial_adapter_path:
        check_peft_folder(Path(cfg.lora.initial_adapter_path).expanduser(), cfg.lora, args)
    if problem := qlora_problem(cfg, dims, args, installed=device_type is not None):
        raise ConfigError(problem)


def machine_memory(device_type: str) -> int:
    """Bytes of memory one rank's device has: the GPU's, or this machine's RAM for the CPU."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_machine_holds(cfg: JobConfig, args: ModelArgs, device_type: str) -> None:
    """ConfigError when the sequence length and microbatch cannot fit this device at all: the RoPE table and
    every block's input for one microbatch (what a step keeps with any activation checkpointing) exceed its
    memory. A job that only might not fit is the dry run's to judge."""
    t = cfg.training
    tokens = t.local_batch_size * t.seq_len
    rope = args.max_seq_len * (args.head_dim // 2) * 16  # float64 angles, then complex64 rotations
    p = cfg.parallelism
    split = p.tensor_parallel_degree if p.tensor_parallel_degree > 1 and p.enable_sequence_parallel else 1
    need = rope + tokens * args.n_layers * args.dim * dtype_bytes(t.mixed_precision_param) // split
    have = machine_memory(device_type)
    if need > have:
        raise ConfigError(
            f"training.seq_len = {t.seq_len:,} with training.local_batch_size = {t.local_batch_size} needs at "
            f"least {need / 2**30:,.1f} GiB per rank ({args.n_layers} blocks x {tokens:,} tokens x dim {args.dim}, "
            f"plus the RoPE table), more than this {device_type} device's {have / 2**30:,.1f} GiB; lower them "
            f"(`run_train.sh --dry-run` sizes a job without running it)"
        )


@dataclass
class RunPlan:
    """What a configuration resolves to for one world size, built before any process group."""

    dims: ParallelDims
    global_batch_size: int  # sequences per optimizer step (training.global_batch_size, -1 resolved)
    grad_accum: int  # microbatches per optimizer step on each rank
    tokenizer: object
    model_args: ModelArgs


def locked_folders(cfg: JobConfig) -> dict[str, Path]:
    """The folders a training job locks against a second job, by the config key that names them: the dump
    folder, and the checkpoint folder (wherever it is) when checkpointing is on."""
    folders = {"job.dump_folder": Path(cfg.job.dump_folder)}
    if cfg.checkpoint.enable:
        folders["checkpoint.folder"] = checkpoint_folder(cfg)
    return folders


# Each kind of parallelism says why it cannot run a job (parallel/<kind>.py: problem(...) -> str | None), in this
# order: the first problem found is the one reported.
PARALLEL_KINDS = (fsdp, tp, ep, cp, float8, ft, pp, compile_kind, ac)


def check_parallelism(cfg: JobConfig, dims: ParallelDims, args: ModelArgs, device_type: str | None, inference=False):
    """ConfigError with the first kind of parallelism's problem with this job (device_type None: the dry run, which
    skips the checks of this machine; inference: generation's plan)."""
    for kind in PARALLEL_KINDS:
        if problem := kind.problem(cfg, dims, args, device_type, inference=inference):
            raise ConfigError(problem)
    if (warning := tp.cross_node_warning(dims)) and int(os.environ.get("RANK", "0")) == 0:
        logger.warning(warning)


def validate_for_world(cfg: JobConfig, world_size: int, device_type: str | None = "cpu") -> RunPlan:
    """Every check a run makes before its process group, as ConfigError; returns the plan.

    device_type is the device the run computes on; None (the dry run, on another machine) skips the
    checks of this machine's software (a compiler for torch.compile) and of the job's folders.
    """
    dims, global_batch, grad_accum = resolve(cfg, world_size)
    if device_type is not None:
        stage_remote_inputs(cfg)  # inputs in object storage that are read whole: copied once per machine
        preflight(cfg)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    folder = hf_folder(cfg.checkpoint.initial_load_path)
    start = Path(cfg.checkpoint.initial_load_path).expanduser()
    if folder is None and cfg.model.name == BACKEND and (start / "config.json").is_file() and not pickled(start):
        folder = start  # the transformers backend from a config alone: the weights are drawn from training.seed
    if folder is None and cfg.model.flavor == "hf" and (start / "config.json").is_file():
        raise ConfigError(f"checkpoint.initial_load_path = {str(start)!r} {missing_weights_note(start)}")
    if folder is None and cfg.model.flavor == "hf" and (start / "model_args.json").is_file():
        raise ConfigError(
            f"checkpoint.initial_load_path = {str(start)!r} is a titanlite checkpoint, but model.flavor = 'hf' takes "
            "the model's shape from a HuggingFace folder's config.json: export it as one first (python -m "
            f"titanlite.checkpoint export --checkpoint {start} --format hf --output <folder>) and set "
            "checkpoint.initial_load_path to that folder"
        )
    args = resolved_model_args(cfg.model, tokenizer.vocab_size, cfg.training.seq_len, folder)
    if folder is not None and args.family != BACKEND:  # (the backend's loader names what a folder lacks)
        check_hf_weights(folder, args)  # names and shapes from the safetensors headers only
    if args.family == BACKEND and (problem := backend_problem(cfg, dims, args)):
        raise ConfigError(problem)
    check_parallelism(cfg, dims, args, device_type)
    check_adapters_and_optimizer(cfg, dims, args, device_type)
    if problem := wandb_problem(cfg.metrics):
        raise ConfigError(problem)
    check_data(cfg, tokenizer)
    if device_type is not None:
        check_machine_holds(cfg, args, device_type)
        if int(os.environ.get("RANK", "0")) == 0:  # rank 0 holds the locks; peers would see their own job's
            for key, folder in locked_folders(cfg).items():  # another job on the same dump or checkpoint folder
                check_lock_free(folder, key)
        check_resume(cfg, args, model_shapes(cfg, args))
    return RunPlan(dims, global_batch, grad_accum, tokenizer, args)
