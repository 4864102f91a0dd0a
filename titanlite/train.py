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
from titanlite.config import ConfigError, JobConfig
from titanlite.data import PackedDataLoader, build_tokenizer
from titanlite.distributed import init_distributed, set_seed, shutdown, world_size_from_env
from titanlite.metrics import MetricsLogger, StepMetrics, Throughput, setup_logging
from titanlite.models import model_args
from titanlite.models.llama import Transformer
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel_dims import ParallelDims
from titanlite.parallelize import apply_fsdp, describe, microbatch_sync

logger = logging.getLogger("titanlite")

IGNORE_INDEX = -100


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class StepOutput:
    """Device tensors of one optimizer step; reading them (.item()) syncs with the device."""

    loss_sum: torch.Tensor  # sum of token losses on this rank
    global_tokens: torch.Tensor  # valid tokens in the whole global batch
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


class Trainer:
    """Builds the mesh, the sharded model, optimizer and data from a JobConfig, and trains."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        # Everything a user can get wrong is checked before the process group starts.
        self.dims = resolve(cfg, world_size_from_env())
        preflight(cfg)
        self.grad_accum = accumulation_steps(cfg, self.dims.dp_degree)
        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        self.model_args = model_args(cfg.model, self.tokenizer.vocab_size, cfg.training.seq_len)
        self.dataloader = PackedDataLoader(
            self.tokenizer, cfg.training.dataset, seq_len=cfg.training.seq_len,
            global_batch_size=cfg.training.global_batch_size, local_batch_size=cfg.training.local_batch_size,
            dp_rank=int(os.environ.get("RANK", "0")), dp_degree=self.dims.dp_degree, split=cfg.training.dataset_split,
            text_field=cfg.training.dataset_text_field, config_name=cfg.training.dataset_config)

        self.env = init_distributed()
        set_seed(cfg.training.seed, cfg.training.deterministic)
        self.device = self.env.device
        self.mesh = self.dims.build_mesh(self.device.type)

        with torch.device("meta"):
            self.model = Transformer(self.model_args)
        self.num_sharded = apply_fsdp(
            self.model, self.mesh,
            param_dtype=cfg.training.mixed_precision_param,
            reduce_dtype=cfg.training.mixed_precision_reduce,
            reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
            cpu_offload=cfg.training.enable_cpu_offload,
        )
        self.model.to_empty(device="cpu" if cfg.training.enable_cpu_offload else self.device)
        self.model.init_weights(cfg.training.seed)
        for line in describe(self.num_sharded, self.mesh, self.dims):
            logger.info(line)
        self.delay_all_reduce = self._delay_all_reduce_enabled()

        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.step = 0
        self.tokens_seen = 0
        # Step at which the loss first went non-finite (-1: never), kept on the device: no sync per step.
        self._first_bad_step = torch.tensor(-1, device=self.device)
        self.metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, self.env.rank)
        self.losses: dict[int, float] = {}  # logged global loss per step
        self.checkpointer = CheckpointManager(
            cfg, model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader, train_state=self, device=self.device)
        self.checkpointer.load()  # resume (any topology) or initial weights; sets self.step on resume

    def _delay_all_reduce_enabled(self) -> bool:
        if not self.cfg.parallelism.hsdp_delay_all_reduce:
            return False
        if self.dims.dp_replicate > 1 and self.grad_accum > 1:
            logger.info(f"Delayed all-reduce: replicate all-reduce on the last of {self.grad_accum} microbatches")
            return True
        logger.info("parallelism.hsdp_delay_all_reduce has no effect: it needs data_parallel_replicate_degree > 1 "
                    f"and more than one microbatch (have replicate {self.dims.dp_replicate}, "
                    f"{self.grad_accum} microbatch(es))")
        return False

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOutput:
        """Forward and backward over the microbatches, clip, and step the optimizer and the lr schedule."""
        local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches).to(self.device)
        global_tokens = local_tokens.clone()
        dist.all_reduce(global_tokens)
        # FSDP averages gradients over the dp ranks; scaling by dp_degree makes the gradient that of
        # (sum of token losses over the global batch) / (valid tokens in the global batch).
        scale = self.dims.dp_degree / global_tokens.clamp(min=1)
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(microbatches):
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with microbatch_sync(self.model, i == len(microbatches) - 1, self.delay_all_reduce):
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
        return (total / out.global_tokens.clamp(min=1)).item()

    def train(self) -> dict[int, float]:
        """Train to training.steps; returns the logged loss per step."""
        cfg = self.cfg
        throughput = Throughput()
        logger.info(f"Training {cfg.training.steps} steps: global batch {cfg.training.global_batch_size} x "
                    f"seq {cfg.training.seq_len}, {self.grad_accum} microbatch(es) of {cfg.training.local_batch_size}"
                    f" per rank, dp degree {self.dims.dp_degree}")
        while self.step < cfg.training.steps:
            self.step += 1
            microbatches = self.dataloader.next_step()
            lr = self.lr_scheduler.get_last_lr()[0]
            out = self.train_step(microbatches)
            local_tokens = sum(inp.numel() for inp, _ in microbatches)
            self.tokens_seen += local_tokens * self.dims.dp_degree
            throughput.add(local_tokens)
            self._track_non_finite(out)
            if self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps:
                self.check_finite()
                loss = self.global_loss(out)
                self.losses[self.step] = loss
                self.metrics.log(StepMetrics(step=self.step, loss=loss, grad_norm=out.grad_norm.item(), lr=lr,
                                             tokens_per_sec=throughput.rate()))
            if self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps):
                break  # preempted: every rank saved this step; exit 0 so the job can be requeued
        self.checkpointer.close()
        self.check_finite()
        self.metrics.close()
        return self.losses

    def _track_non_finite(self, out: StepOutput) -> None:
        bad = ~torch.isfinite(out.loss_sum) | ~torch.isfinite(out.grad_norm)
        self._first_bad_step = torch.where(bad & (self._first_bad_step < 0),
                                           torch.tensor(self.step, device=self.device), self._first_bad_step)

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
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


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
        return 1
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
