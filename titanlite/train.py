"""The Trainer and `python -m titanlite.train`: the training loop and nothing else."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanlite import config as config_mod
from titanlite.checkpoint import CheckpointManager, preflight
from titanlite.config import ConfigError, JobConfig, gradient_sync_mode
from titanlite.data import PackedDataLoader, build_tokenizer
from titanlite.distributed import init_distributed, pick_device, set_seed, shutdown, world_size_from_env
from titanlite.flops import flops_per_token
from titanlite.metrics import MetricsLogger, setup_logging
from titanlite.models import model_args
from titanlite.models.llama import LlamaArgs, Transformer
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel_dims import ParallelDims
from titanlite.parallelize import (apply_ac, apply_compile, apply_fsdp, compile_problem, describe,
                                   describe_ac_compile, gradient_sync_plan, microbatch_sync)
from titanlite.profiling import Profiler
from titanlite.summary import startup_lines
from titanlite.validate import build_validator

logger = logging.getLogger("titanlite")

IGNORE_INDEX = -100


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class StepOutput:
    """Device tensors of one optimizer step; reading them (.item()) syncs with the device."""

    loss_sum: torch.Tensor  # sum of token losses on this rank
    global_tokens: torch.Tensor | int  # valid tokens in the whole global batch
    grad_norm: torch.Tensor  # global gradient norm before clipping


def accumulation_steps(cfg: JobConfig, dp_degree: int) -> int:
    """Microbatches per optimizer step, from the global and local batch sizes and the dp degree."""
    t = cfg.training
    per_pass = t.local_batch_size * dp_degree
    if t.global_batch_size % per_pass:
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size} is not a multiple of training.local_batch_size "
            f"= {t.local_batch_size} x data-parallel degree {dp_degree} = {per_pass}; "
            f"valid: any multiple of {per_pass}")
    return t.global_batch_size // per_pass


def resolve(cfg: JobConfig, world_size: int) -> ParallelDims:
    """Checks that need the world size; fills training.global_batch_size = -1. Runs before any process group."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    if cfg.training.global_batch_size == -1:
        cfg.training.global_batch_size = cfg.training.local_batch_size * dims.dp_degree
    accumulation_steps(cfg, dims.dp_degree)
    raf = cfg.parallelism.fsdp_reshard_after_forward
    if raf.isdigit() and dims.dp_shard % int(raf):
        raise ConfigError(f"parallelism.fsdp_reshard_after_forward = {raf} must divide the shard degree "
                          f"{dims.dp_shard}; valid: default, always, never or a divisor of {dims.dp_shard}")
    return dims


@dataclass
class RunPlan:
    """What a configuration resolves to for one world size, built before any process group."""

    dims: ParallelDims
    grad_accum: int
    tokenizer: object
    model_args: LlamaArgs
    dataloader: PackedDataLoader
    validator: object  # titanlite.validate.Validator, or None when validation is off


def validate_for_world(cfg: JobConfig, world_size: int, rank: int = 0, device_type: str | None = "cpu") -> RunPlan:
    """Every check a run makes before its process group, as ConfigError; the dry run calls it too.

    device_type is the device the run computes on; None (the dry run, on another machine) skips the
    checks of this machine's software (a compiler for torch.compile).
    """
    dims = resolve(cfg, world_size)
    if device_type is not None:  # the dry run may run elsewhere: the job's folders are not its to create
        preflight(cfg)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    args = model_args(cfg.model, tokenizer.vocab_size, cfg.training.seq_len)
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op" and int(ac.selective_ac_option) > args.n_layers:
        raise ConfigError(f"activation_checkpoint.selective_ac_option = {ac.selective_ac_option!r} checkpoints no "
                          f"block of the {args.n_layers}; valid: 'op' or an integer from 1 to {args.n_layers}")
    problem = compile_problem(cfg.compile, device_type) if device_type else None
    if problem:
        raise ConfigError(problem)
    t = cfg.training
    dataloader = PackedDataLoader(
        tokenizer, t.dataset, seq_len=t.seq_len, global_batch_size=t.global_batch_size,
        local_batch_size=t.local_batch_size, dp_rank=rank, dp_degree=dims.dp_degree, split=t.dataset_split,
        text_field=t.dataset_text_field, config_name=t.dataset_config)
    validator = build_validator(cfg, tokenizer, rank, dims.dp_degree)
    return RunPlan(dims=dims, grad_accum=accumulation_steps(cfg, dims.dp_degree), tokenizer=tokenizer,
                   model_args=args, dataloader=dataloader, validator=validator)


@dataclass
class BuiltModel:
    model: Transformer
    ac_blocks: list[int]  # indices of the activation-checkpointed blocks
    compiled: int  # blocks compiled
    num_sharded: int  # fully_shard units besides the root


def build_model(cfg: JobConfig, args: LlamaArgs, mesh) -> BuiltModel:
    """The model on the meta device with activation checkpointing, compile and FSDP applied, in that order."""
    with torch.device("meta"):
        model = Transformer(args)
    ac_blocks = apply_ac(model, cfg.activation_checkpoint)
    compiled = apply_compile(model, cfg.compile)
    num_sharded = apply_fsdp(
        model, mesh,
        param_dtype=cfg.training.mixed_precision_param,
        reduce_dtype=cfg.training.mixed_precision_reduce,
        reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
        cpu_offload=cfg.training.enable_cpu_offload,
    )
    return BuiltModel(model=model, ac_blocks=ac_blocks, compiled=compiled, num_sharded=num_sharded)


class Trainer:
    """Builds the mesh, the sharded model, optimizer and data from a JobConfig, and trains."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        # Everything a user can get wrong is checked before the process group starts.
        plan = validate_for_world(cfg, world_size_from_env(), rank=int(os.environ.get("RANK", "0")),
                                  device_type=pick_device(int(os.environ.get("LOCAL_RANK", "0"))).type)
        self.dims, self.grad_accum, self.tokenizer = plan.dims, plan.grad_accum, plan.tokenizer
        self.model_args, self.dataloader = plan.model_args, plan.dataloader
        self.validator = plan.validator

        self.env = init_distributed()
        set_seed(cfg.training.seed, cfg.training.deterministic)
        self.device = self.env.device
        self.mesh = self.dims.build_mesh(self.device.type)

        built = build_model(cfg, self.model_args, self.mesh)
        self.model, self.num_sharded = built.model, built.num_sharded
        self.model.to_empty(device="cpu" if cfg.training.enable_cpu_offload else self.device)
        self.model.init_weights(cfg.training.seed)
        for line in describe(self.num_sharded, self.mesh, self.dims) + startup_lines(
                self.model, self.model_args, self.dims, cfg):
            logger.info(line)
        logger.info(describe_ac_compile(cfg.activation_checkpoint, built.ac_blocks, built.compiled,
                                        self.model_args.n_layers))
        self.gradient_sync, sync_line = gradient_sync_plan(gradient_sync_mode(cfg.parallelism), self.dims,
                                                           self.grad_accum)
        if sync_line:
            logger.info(sync_line)

        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.step = 0
        self.tokens_seen = 0
        # Step at which the loss first went non-finite (-1: never), kept on the device: no sync per step.
        self._first_bad_step = torch.tensor(-1, device=self.device)
        self.metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, self.env.rank, device=self.device,
                                     flops_per_token=flops_per_token(self.model_args, cfg.training.seq_len),
                                     total_steps=cfg.training.steps)
        self.losses: dict[int, float] = {}  # logged global loss per step
        self.val_losses: dict[int, float] = {}  # validation loss per step
        self.checkpointer = CheckpointManager(
            cfg, model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader, train_state=self, device=self.device)
        self.checkpointer.load()  # resume (any topology) or initial weights; sets self.step on resume

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]],
                   global_tokens: int | None = None) -> StepOutput:
        """Forward and backward over the microbatches, clip, and step the optimizer and the lr schedule.

        global_tokens: the valid labels in the whole global batch when the caller knows them (the data
        loader does); None counts them with one all-reduce.
        """
        microbatches = [(inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True))
                        for inputs, labels in microbatches]
        if global_tokens is None:
            # Counted on the device: a blocking host-to-device copy would be a host sync every step.
            count = sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches)
            dist.all_reduce(count)
            global_tokens = count.clamp(min=1)
        else:
            global_tokens = max(global_tokens, 1)
        # FSDP averages gradients over the dp ranks; scaling by dp_degree makes the gradient that of
        # (sum of token losses over the global batch) / (valid tokens in the global batch).
        scale = self.dims.dp_degree / global_tokens
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(microbatches):
            with microbatch_sync(self.model, i == len(microbatches) - 1, self.gradient_sync):
                logits = self.model(inputs)
                token_loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                 reduction="sum", ignore_index=IGNORE_INDEX)
                del logits
                (token_loss_sum * scale).backward()
            loss_sum += token_loss_sum.detach()
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.training.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return StepOutput(loss_sum=loss_sum, global_tokens=global_tokens, grad_norm=grad_norm)

    def global_loss(self, out: StepOutput) -> float:
        """Mean token loss over the global batch (one all-reduce; call on logged steps only)."""
        total = out.loss_sum.clone()
        dist.all_reduce(total)
        return (total / out.global_tokens).item()

    def train(self) -> dict[int, float]:
        """Train to training.steps; returns the logged loss per step."""
        cfg = self.cfg
        if self.step >= cfg.training.steps:
            logger.info(f"Already at step {self.step} of training.steps = {cfg.training.steps}: nothing to train "
                        f"(raise training.steps to go on, or use a new job.dump_folder to start over)")
        logger.info(f"Training {cfg.training.steps} steps: global batch {cfg.training.global_batch_size} x "
                    f"seq {cfg.training.seq_len}, {self.grad_accum} microbatch(es) of {cfg.training.local_batch_size}"
                    f" per rank, dp degree {self.dims.dp_degree}")
        profiler = Profiler(cfg.profiling, cfg.job.dump_folder, self.env.rank, self.device, self.step).start()
        self.metrics.start()
        try:
            while self.step < cfg.training.steps:
                self.step += 1
                microbatches = self.dataloader.next_step()
                lr = self.lr_scheduler.get_last_lr()[0]
                out = self.train_step(microbatches, self.dataloader.global_valid_tokens)
                local_tokens = sum(inp.numel() for inp, _ in microbatches)
                self.tokens_seen += local_tokens * self.dims.dp_degree
                self.metrics.step_done(self.step, local_tokens)
                self._track_non_finite(out)
                # Only logged steps read device values (host syncs) and all-reduce the loss.
                if self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps:
                    self.check_finite()
                    loss = self.global_loss(out)
                    self.losses[self.step] = loss
                    self.metrics.log(self.metrics.collect(self.step, loss, out.grad_norm.item(), lr))
                if self.validator is not None and self.validator.due(self.step, cfg.training.steps):
                    self.validate()
                profiler.step(self.step)
                if self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps,
                                                before_save=self.check_finite):
                    break  # preempted: every rank saved this step; exit 0 so the job can be requeued
            profiler.stop()
            self.check_finite()
        finally:
            self.checkpointer.close()  # waits for an async save and restores the signal handlers
            self.metrics.close()
        return self.losses

    def validate(self) -> float:
        """Loss on the held-out data (the same sequences every time); logged and written to TensorBoard."""
        r = self.validator.evaluate(self.model, self.device)
        self.val_losses[self.step] = r.loss
        self.metrics.log_validation(self.step, r.loss, r.perplexity, r.tokens, r.seconds)
        self.metrics.exclude_time(r.seconds)
        return r.loss

    def _track_non_finite(self, out: StepOutput) -> None:
        bad = ~torch.isfinite(out.loss_sum) | ~torch.isfinite(out.grad_norm)
        # A Python scalar, not torch.tensor(step, device=...): creating a device tensor from host data syncs.
        self._first_bad_step.masked_fill_(bad & (self._first_bad_step < 0), self.step)

    def check_finite(self) -> None:
        """Raise NonFiniteLossError naming the first step whose loss or gradient norm was not finite."""
        bad = int(self._first_bad_step.item())
        if bad >= 0:
            raise NonFiniteLossError(
                f"the loss or gradient norm became non-finite at step {bad} (noticed at step {self.step}); "
                f"try a lower optimizer.lr, more lr_scheduler.warmup_steps or training.max_norm > 0")


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """The global gradient norm over all ranks (a plain tensor); clips to max_norm when it is > 0."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    # One all-reduce: clip_grad_norm_ would reduce the partial norm once to clip and again for full_tensor().
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m titanlite.train`."""
    setup_logging()
    try:
        cfg = config_mod.load(argv)
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        shutdown()
        return 2
    try:
        if cfg.job.print_config and trainer.env.rank == 0:
            print(config_mod.to_toml(cfg))
        trainer.train()
    except NonFiniteLossError as e:
        logger.error(str(e))
        shutdown()
        return 1
    except BaseException:
        shutdown()
        raise
    shutdown(wait_for_peers=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
