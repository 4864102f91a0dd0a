"""The Trainer: builds a run from its plan (mesh, sharded model, optimizer, data, checkpoints) and trains;
the training loop and nothing else."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.checkpoint.data_identity import current as data_identity
from titanlite.checkpoint.hf_copy import write_hf_copy
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.compat import version_warning
from titanlite.config import JobConfig, gradient_sync_mode
from titanlite.config.compare import check_same_config, given_settings
from titanlite.data.build import build_loader
from titanlite.data.counted import no_counted_tokens
from titanlite.errors import NonFiniteLossError
from titanlite.loss import TokenLoss, loss_parallel_context, training_loss
from titanlite.model_builder import build_model, compiled_loss
from titanlite.models.nf4 import materialize_nf4
from titanlite.models.rope_attention import describe_attention
from titanlite.moe_balance import LoadBalance
from titanlite.observe.metrics import MetricsLogger
from titanlite.observe.profiling import Profiler
from titanlite.observe.summary import degenerate_run_warnings, startup_lines, trained_adapters
from titanlite.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from titanlite.parallel.ac import describe_ac_compile
from titanlite.parallel.float8 import listen_for_new_weights
from titanlite.parallel.fsdp import describe, gradient_sync_plan, microbatch_sync
from titanlite.parallel.ft import Next, data_slice, outer_optimizer, replica_groups
from titanlite.parallel.pp import Pipeline
from titanlite.plan import locked_folders, validate_for_world
from titanlite.preference.objective import build_objective, fill_reference
from titanlite.run_state import OPTIMIZER_STEP, RunState
from titanlite.runtime.distributed import gather_objects, init_distributed, pick_device, set_seed, world_size_from_env
from titanlite.runtime.exit_status import record_end
from titanlite.runtime.hang_watch import HangWatch
from titanlite.runtime.run_control import guard_run, release_all
from titanlite.sizing.flops import flops_per_token
from titanlite.validate import Validator

logger = logging.getLogger("titanlite")


@dataclass
class StepOutput:
    """Device tensors of one optimizer step; reading them (.item()) syncs with the device."""

    loss_sum: torch.Tensor  # sum of token losses on this rank
    global_tokens: torch.Tensor | int  # valid tokens in the whole global batch
    grad_norm: torch.Tensor  # global gradient norm before clipping
    moe: dict | None = None  # an MoE model's load balance this step (device tensors; moe_balance.LoadBalance)
    committed: bool = True  # False: a fault-tolerant step that a group failed; not applied, to be retried


class Trainer:
    """Builds the mesh, the sharded model, optimizer and data from a JobConfig, and trains."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        given = given_settings(cfg)  # compared between the ranks once they can talk
        # Everything a user can get wrong is checked before the process group starts.
        plan = validate_for_world(
            cfg, world_size_from_env(), device_type=pick_device(int(os.environ.get("LOCAL_RANK", "0"))).type
        )
        self.dims, self.grad_accum, self.tokenizer = plan.dims, plan.grad_accum, plan.tokenizer
        self.global_batch_size, self.model_args = plan.global_batch_size, plan.model_args

        self.env = init_distributed(cfg.training.hang_timeout_seconds)
        check_same_config(given, gather_objects)  # before any collective that another rank's settings could break
        self.device = self.env.device
        self.hang = HangWatch(
            cfg.job.dump_folder, self.env.rank, self.env.world_size, cfg.training.hang_timeout_seconds
        )
        if self.env.rank == 0 and (warning := version_warning()):
            logger.warning(warning)
        # One job per dump folder and checkpoint folder; a worker whose launcher died exits instead of training on.
        self.locks, self.watchdog = guard_run(locked_folders(cfg), self.env.rank, self.env.world_size)
        set_seed(cfg.training.seed, cfg.training.deterministic)
        self.meshes = self.dims.build_meshes(self.device.type, self.model_args.moe)
        self.pp_group = self.meshes.pp.get_group() if self.meshes.pp is not None else None  # the grad norm's

        dataloader, self.validator = self._build_data()
        self.tokens_by_source = [0] * len(dataloader.names)
        model, self.pipeline, self.fsdp_roots = self._build_model()
        self.gradient_sync, sync_line = gradient_sync_plan(
            gradient_sync_mode(cfg.parallelism), self.dims, self.grad_accum
        )
        if sync_line:
            logger.info(sync_line)
        # With [compile] on (inductor only: the loss has no graph breaks to hide), the loss is compiled too.
        loss_fn = training_loss(compiled_loss(cfg, self.dims.tp))
        self.loss_parallel = self.dims.tp > 1 and cfg.parallelism.enable_loss_parallel
        sequences = self.global_batch_size * (2 if cfg.dpo.enable else 1)  # [dpo]: a pair is two sequences
        self.balance = LoadBalance(model, cfg.moe, self.model_args, self.dims, sequences)

        optimizer = build_optimizer(model, cfg.optimizer)
        lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
        # DiLoCo's global weights and outer momentum (None without): checkpointed with the optimizer
        self.state = RunState(model, optimizer, lr_scheduler, dataloader, outer_optimizer(cfg, model))
        # the loss of a microbatch: token cross-entropy, or [dpo]'s on pairs (with its reference model)
        self.objective, validation_objective = TokenLoss(loss_fn), TokenLoss()
        if cfg.dpo.enable:
            held_out = self.validator.loader.layouts if self.validator is not None else None
            self.objective, validation_objective = build_objective(
                cfg, self.state, self.model_args, self.meshes, self.device, self.dims.tp, held_out
            )
        if self.validator is not None:
            self.validator.objective = validation_objective
        listen_for_new_weights(self.state, model, cfg.float8)  # float8 all-gathers: scales from new weights
        # Step at which the loss first went non-finite (-1: never), kept on the device: no sync per step.
        self._first_bad_step = torch.tensor(-1, device=self.device)
        self.metrics = MetricsLogger(
            cfg.metrics,
            cfg.job.dump_folder,
            self.env.rank,
            device=self.device,
            flops_per_token=flops_per_token(self.model_args, cfg.training.seq_len, trained_adapters(model, cfg)),
            total_steps=cfg.training.steps,
        )
        self.losses: dict[int, float] = {}  # logged global loss per step
        self.val_losses: dict[int, float] = {}  # validation loss per step
        self.checkpointer = CheckpointManager(
            cfg, self.state, self.device, data_identity=data_identity(self.tokenizer, dataloader)
        )
        resumed = self.checkpointer.load()  # resume (any topology) or initial weights; sets the step on resume
        if cfg.dpo.enable:  # dpo.reference = 'precomputed' on a fresh start: from the initial weights, before step 1
            dp_rank = self.dims.dp_rank(self.env.rank)
            objectives = [self.objective] + ([self.validator.objective] if self.validator is not None else [])
            fill_reference(objectives, model, cfg, dp_rank, self.dims.dp_degree, self.dims.tp, self.device, resumed)
        # the policy around each step: the groups of a fault-tolerant job (sync or DiLoCo); one that does nothing
        self.replicas = replica_groups(
            cfg, self.state, self.env, checkpointer=self.checkpointer, hang=self.hang, check_finite=self.check_finite,
            global_batch_size=self.global_batch_size, balance=self.balance,
        )  # fmt: skip

    # The run's state (run_state.RunState), as attributes of the Trainer for its callers.
    model = property(lambda self: self.state.model)
    optimizer = property(lambda self: self.state.optimizer)
    lr_scheduler = property(lambda self: self.state.lr_scheduler)
    dataloader = property(lambda self: self.state.dataloader)
    outer = property(lambda self: self.state.outer)

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def tokens_seen(self) -> int:
        """Counted labels trained on."""
        return self.state.tokens_seen

    def _build_data(self):
        """(the training loader, the validator or None): every dp rank reads its own sequences (the ranks build a
        missing token store together); the cp, tp and pp ranks of one dp rank read the same batches."""
        cfg = self.cfg
        dp_rank = self.dims.dp_rank(self.env.rank)
        pin = self.device.type == "cuda"
        rank, degree = data_slice(cfg, self.dims, dp_rank)  # a fault-tolerant group reads its part of each batch
        train = build_loader(
            cfg, self.tokenizer, "training", dp_rank=rank, dp_degree=degree,
            global_batch_size=self.global_batch_size, pin_memory=pin,
        )  # fmt: skip
        validator = None
        if cfg.validation.enable:  # each fault-tolerant group validates on its own
            loader = build_loader(
                cfg, self.tokenizer, "validation", dp_rank=dp_rank, dp_degree=self.dims.dp_degree,
                global_batch_size=self.global_batch_size, pin_memory=pin,
            )  # fmt: skip
            validator = Validator(cfg, loader)
        if self.env.rank == 0:
            for warning in degenerate_run_warnings(cfg, self.device.type, train):
                logger.warning(warning)
        return train, validator

    def _build_model(self):
        """(the model, the pipeline or None, the FSDP roots): built sharded on the meta device, then allocated and
        initialised from the seed; with pp, this rank's stages and the schedule that runs them."""
        cfg = self.cfg
        built = build_model(cfg, self.model_args, self.meshes)
        self.num_sharded = built.num_sharded  # fully_shard units besides the roots
        model, pipeline, roots = built.model, None, [built.model]
        model.to_empty(device="cpu" if cfg.training.enable_cpu_offload else self.device)
        materialize_nf4(model)
        model.init_weights(cfg.training.seed)
        if built.stages:
            roots = built.stages
            pipeline = Pipeline(
                built.stages, built.stage_ids, len(built.stage_blocks), cfg.parallelism,
                cfg.training.local_batch_size, self.meshes.pp, self.device, self.model_args.attention == "block_causal",
            )  # fmt: skip
            logger.info(pipeline.describe(built.stage_blocks, built.stage_ids))
        for line in describe(built.num_sharded, self.meshes.world, self.dims, cfg.parallelism, len(roots)):
            logger.info(line)
        for line in startup_lines(model, self.model_args, self.dims, cfg):
            logger.info(line)
        if built.float8:
            logger.info(f"Float8: {built.float8} linear layers, {cfg.float8.recipe} scaling (torchao)")
        logger.info(
            describe_ac_compile(cfg.activation_checkpoint, built.ac_blocks, built.compiled, self.model_args.n_layers)
        )
        kernel = getattr(model, "attention_kernel", "auto")
        logger.info(f"Attention: {describe_attention(self.model_args.attention, kernel, self.device.type)}")
        return model, pipeline, roots

    def train_step(self, microbatches: list, global_tokens: int | None = None) -> StepOutput:
        """Forward and backward over the microbatches, clip, and step the optimizer and the lr schedule.

        microbatches: (inputs, labels, ...) tuples, e.g. the loader's Microbatch. global_tokens: the
        counted labels of the whole global batch when the caller knows them (the data loader does);
        None counts them with one all-reduce.
        """
        if global_tokens is None:
            # Counted on the device: a blocking host-to-device copy would be a host sync every step.
            count = sum(self.objective.counted(mb[1].to(self.device, non_blocking=True)) for mb in microbatches)
            count = torch.as_tensor(count, device=self.device)  # (pairs: a number of rows, known on the host)
            dist.all_reduce(count)
            # the cp and tp ranks of a dp rank hold the same labels
            global_tokens = count // (self.dims.tp * self.dims.cp * self.dims.pp)
            # with fault tolerance: the live groups' tokens (the parts of the absent ones are not trained)
            global_tokens = self.replicas.global_tokens(global_tokens).clamp(min=1)
        else:
            global_tokens = max(global_tokens, 1)
        # FSDP averages gradients over the dp ranks (and the cp ranks, each with its part of the tokens); scaling by
        # their number makes the gradient that of (sum of token losses over the global batch) / (valid tokens in it).
        # (with fault tolerance: averaged over the live replica groups too)
        scale = self.dims.dp_degree * self.dims.cp * self.replicas.participants / global_tokens
        loss_sum = torch.zeros((), device=self.device)
        self.objective.begin()
        for i, mb in enumerate(microbatches):
            self.hang.phase(f"step {self.step}: forward/backward, microbatch {i + 1} of {len(microbatches)}")
            last = i == len(microbatches) - 1
            with microbatch_sync(self.fsdp_roots, last, self.gradient_sync), loss_parallel_context(self.loss_parallel):
                if self.pipeline is not None:  # every stage's forward and backward, by the schedule
                    all_reduce = last or self.gradient_sync != "delay_all_reduce"
                    self.model.aux_loss_sum = None  # an MoE's aux loss: its gradient comes through the stages
                    token_loss_sum = self.pipeline.step(mb, scale, self.balance.aux_scale, all_reduce=all_reduce)
                    self.balance.aux_term()  # (only its value is kept here, for the log)
                else:
                    token_loss_sum, _ = self.objective(self.model, mb, self.device)
                    (token_loss_sum * scale + self.balance.aux_term()).backward()
            loss_sum += token_loss_sum.detach()
        self.replicas.average_gradients(self.model.parameters())
        self.hang.phase(f"step {self.step}: gradient norm, clipping and optimizer step")
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.training.max_norm, self.pp_group)
        moe = self.balance.step_done()  # aux_free moves its routing bias before the optimizer step
        committed = self.replicas.commit()
        if committed:
            self.optimizer.step()
            self.state.weights_replaced(OPTIMIZER_STEP)
        self.optimizer.zero_grad(set_to_none=True)
        if committed:
            self.lr_scheduler.step()
        return StepOutput(loss_sum, global_tokens, grad_norm, moe, committed)

    def global_loss(self, out: StepOutput) -> float:
        """Mean token loss over the global batch (one all-reduce; call on logged steps only)."""
        total = out.loss_sum.clone()
        dist.all_reduce(total)
        total = self.replicas.sum(total)
        # every tp rank holds its dp rank's loss (with pp: the last stage's ranks; the others hold 0)
        return (total / self.dims.tp / out.global_tokens).item()

    def train(self) -> dict[int, float]:
        """Train to training.steps; returns the logged loss per step."""
        state, groups = self.state, self.replicas  # groups: the policy around each step (parallel/ft/protocol.py)
        profiler = self._start()
        try:
            while groups.unfinished(state, self.cfg.training.steps):
                if groups.before_step(state) is Next.STOP:
                    break  # a stop signal came while the groups met, or a heal took this group to the end: saved
                lr = self.lr_scheduler.get_last_lr()[-1]  # (Muon: its AdamW group, at optimizer.lr)
                data = self._next_batch()
                out = self.train_step(data.microbatches, groups.known_tokens(data.global_valid_tokens))
                self._count(data, out)
                next_ = groups.after_step(state, out.committed)  # retried, synced, healed or stopped there
                if next_ is Next.STOP:
                    break
                if next_ is Next.GO_ON and self._step_done(out, lr, profiler):
                    break  # preempted: every rank saved this step; exit 0 so the job can be requeued
            self._finish(profiler)
        finally:
            self._close()
        self._log_sources()
        return self.losses

    def _start(self) -> Profiler:
        """Say what the run trains, and start the profiler (returned), the metrics and the hang watch."""
        cfg = self.cfg
        if not self.replicas.unfinished(self.state, cfg.training.steps):
            logger.info(
                f"Already at step {self.step} of training.steps = {cfg.training.steps}: nothing to train "
                f"(raise training.steps to go on, or use a new job.dump_folder to start over)"
            )
        pairs = " pairs (chosen and rejected: 2 sequences each)" if cfg.dpo.enable else ""
        logger.info(
            f"Training {cfg.training.steps} steps: global batch {self.global_batch_size}{pairs} x "
            f"seq {cfg.training.seq_len}, {self.grad_accum} microbatch(es) of {cfg.training.local_batch_size}"
            f" per rank, dp degree {self.dims.dp_degree}"
        )
        profiler = Profiler(cfg.profiling, cfg.job.dump_folder, self.env.rank, self.device, self.step).start()
        self.metrics.open_wandb(cfg.to_dict(), resumed=self.step > 0)
        self.metrics.start()
        self.hang.start()
        return profiler

    def _next_batch(self):
        """The next step's global batch (this rank's part of it, loader.StepBatch); the step is counted."""
        self.state.step += 1
        self.hang.phase(f"step {self.step}: waiting for its data")
        data = self.dataloader.next_step()
        if data.global_valid_tokens == 0:  # every rank sees the same global count
            what = f"step {self.step}'s global batch of {self.global_batch_size} sequences"
            raise no_counted_tokens(self.dataloader, what, self.cfg.training)
        return data

    def _count(self, data, out: StepOutput) -> None:
        """A committed step's tokens (by source), its throughput and whether its loss stayed finite."""
        if not out.committed:
            return
        self.state.tokens_seen += data.global_tokens  # padding is not a token trained on
        rows = 2 if self.cfg.dpo.enable else 1  # a preference pair is two sequences
        for i, n in enumerate(data.sequences_by_source):
            self.tokens_by_source[i] += n * rows * self.cfg.training.seq_len
        # tokens/s and MFU per rank: the pp x cp x tp ranks of a dp rank share its tokens (and FLOPs)
        self.metrics.step_done(self.step, data.local_tokens / (self.dims.tp * self.dims.cp * self.dims.pp))
        self._track_non_finite(out)

    def _step_done(self, out: StepOutput, lr: float, profiler: Profiler) -> bool:
        """After a step that stands: log it (logged steps only read device values), validate and save when due;
        True when a stop signal made every rank save this step."""
        cfg, step = self.cfg, self.step
        if step % cfg.metrics.log_freq == 0 or step == cfg.training.steps:
            self.hang.phase(f"step {step}: reducing the loss for the log")
            self.check_finite()
            loss = self.global_loss(out)
            self.losses[step] = loss
            moe, replicas, pairs = self.balance.report(out.moe), self.replicas.label(), self.objective.report()
            self.metrics.log(self.metrics.collect(step, loss, out.grad_norm.item(), lr, moe, replicas, pairs))
        if self.validator is not None and self.validator.due(step, cfg.training.steps):
            self.hang.phase(f"validation at step {step}")
            self.validate()
        profiler.step(step)
        self.hang.phase(f"step {step}: checkpoint save, if due")
        return self.checkpointer.maybe_save(step, last=step == cfg.training.steps, before_save=self.check_finite)

    def _finish(self, profiler: Profiler) -> None:
        """After the last step (or a stop): the final checks, the HuggingFace copy, the record of how it ended."""
        self.hang.phase(f"after step {self.step}: final checks and saves")
        profiler.stop()
        self.check_finite()
        stopped = self.checkpointer.preempted
        if self.cfg.checkpoint.last_save_in_hf and self.step == self.cfg.training.steps and not stopped:
            write_hf_copy(self.cfg, self.model, self.tokenizer, self.step, self.env.rank)
        if self.env.local_rank == 0:  # each node's launcher reads its own record (multi-node: several)
            record_end("stopped" if stopped else "finished", self.step)

    def _close(self) -> None:
        """Stop the hang watch, leave the replica groups, wait for a pending save, release the folders."""
        self.hang.stop()
        self.replicas.close()
        try:
            self.checkpointer.close()  # waits for an async save (the folder still locked) and restores signals
        finally:
            self.watchdog.stop()  # its heartbeats kept the locks alive until here
            release_all(self.locks)
        self.metrics.close()
        if hasattr(self.dataloader, "close"):
            self.dataloader.close()  # the prefetch thread

    def _log_sources(self) -> None:
        total = sum(self.tokens_by_source)
        if len(self.tokens_by_source) > 1 and total:
            shares = ", ".join(
                f"{name} {n / total:.1%} ({n:,})" for name, n in zip(self.dataloader.names, self.tokens_by_source)
            )
            logger.info(f"Tokens trained on by source in this run: {shares}")

    def validate(self) -> float:
        """Loss on the held-out data (the same sequences every time); logged and written to TensorBoard."""
        loss_of = self.pipeline.evaluate if self.pipeline is not None else None
        r = self.validator.evaluate(self.model, self.device, loss_of)
        self.val_losses[self.step] = r.loss
        self.metrics.log_validation(self.step, r.loss, r.perplexity, r.tokens, r.seconds, r.pairs)
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
                f"try a lower optimizer.lr, more lr_scheduler.warmup_steps or training.max_norm > 0"
            )
