"""Pipeline parallelism: the blocks split into stages over the "pp" ranks, run by torch.distributed.pipelining.

Each rank holds one stage (GPipe, 1F1B) or several (Interleaved1F1B: stages r, r + pp, ...; ZBVZeroBubble: r and
2 pp - 1 - r, a V). The split balances the stages' parameters, the embedding and output projection included (the
first and last stages hold fewer blocks), unless `pipeline_parallel_layers_per_stage` gives it. Each stage is its
own FSDP root over the stage group's data-parallel mesh (tensor parallelism inside it as without pp). The last stage
computes the loss, the summed cross-entropy scaled as the Trainer scales it, so the gradients and the logged loss
are those of one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from titanlite.compat import forward_only_schedule, pipeline_stage_class
from titanlite.config.parallelism import PIPELINE_SCHEDULES
from titanlite.optim import tie_across_ranks

SCHEDULES = dict(zip(PIPELINE_SCHEDULES, (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)))
SINGLE_STAGE = ("GPipe", "1F1B")  # one stage per rank
V_SHAPED = ("ZBVZeroBubble",)  # rank r holds stages r and 2 pp - 1 - r


def stages_per_rank(parallelism) -> int:
    """Stages each rank holds: pipeline_parallel_stages_per_rank, or the schedule's default (-1)."""
    n = parallelism.pipeline_parallel_stages_per_rank
    if n != -1:
        return n
    return 1 if parallelism.pipeline_parallel_schedule in SINGLE_STAGE else 2


def pipeline_microbatches(parallelism, local_batch_size: int) -> int:
    """Pipeline microbatches per local batch: pipeline_parallel_microbatches, or one per sequence (-1)."""
    n = parallelism.pipeline_parallel_microbatches
    return local_batch_size if n == -1 else n


def rank_stages(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """The stage indices a pipeline rank holds, in order."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def split_by_size(embedding: int, blocks: list[int], output: int, n_stages: int) -> list[int]:
    """Blocks per stage, contiguous, each stage at least one, minimising the largest stage's parameters (the first
    stage also holds the embedding, the last the output projection)."""
    n = len(blocks)
    prefix = [0]
    for b in blocks:
        prefix.append(prefix[-1] + b)

    def cost(stage: int, start: int, end: int) -> int:
        extra = (embedding if stage == 0 else 0) + (output if stage == n_stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    # best[s][e]: the smallest largest-stage cost of blocks [0, e) over stages 0..s; cut[s][e] its last start
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for e in range(1, n + 1):
        best[0][e] = cost(0, 0, e)
    for s in range(1, n_stages):
        for e in range(s + 1, n + 1):
            for start in range(s, e):
                c = max(best[s - 1][start], cost(s, start, e))
                if c < best[s][e]:
                    best[s][e], cut[s][e] = c, start
    counts, end = [], n
    for s in range(n_stages - 1, 0, -1):
        start = cut[s][end]
        counts.append(end - start)
        end = start
    counts.append(end)
    return counts[::-1]


def stage_blocks(parallelism, sizes: tuple[int, list[int], int]) -> list[range]:
    """The blocks of every stage, in stage order: pipeline_parallel_layers_per_stage, or split by parameters."""
    n_stages = parallelism.pipeline_parallel_degree * stages_per_rank(parallelism)
    counts = parallelism.pipeline_parallel_layers_per_stage or split_by_size(*sizes, n_stages)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def problem(cfg, dims, args, device_type: str | None = None, inference: bool = False) -> str | None:
    """Why this job cannot run with its pipeline settings (None when it can, or pp is 1)."""
    p, t = cfg.parallelism, cfg.training
    if dims.pp == 1 or inference:
        return None
    key = f"parallelism.pipeline_parallel_degree = {dims.pp}"
    for on, what, instead in (
        (cfg.float8.enable, "float8 training (float8.enable = true)", ""),
    ):  # fmt: skip
        if on:
            return f"{key} does not work with {what} yet; set pipeline_parallel_degree = 1{instead}"
    schedule, per_rank = p.pipeline_parallel_schedule, stages_per_rank(p)
    if schedule in SINGLE_STAGE and per_rank != 1:
        return (
            f"parallelism.pipeline_parallel_stages_per_rank = {per_rank}: pipeline_parallel_schedule = {schedule} "
            f"runs one stage per rank; use 1 (or -1), or Interleaved1F1B for several"
        )
    if schedule in V_SHAPED and per_rank != 2:
        return (
            f"parallelism.pipeline_parallel_stages_per_rank = {per_rank}: pipeline_parallel_schedule = {schedule} "
            f"runs exactly 2 stages per rank; use 2 (or -1)"
        )
    if schedule in V_SHAPED and args.tie_embeddings:
        return (
            f"model.tie_embeddings = true with parallelism.pipeline_parallel_schedule = {schedule}: its rank 0 holds "
            f"the first stage and the last, which would share the tied weight inside one rank; use GPipe, 1F1B or "
            f"Interleaved1F1B (or model.tie_embeddings = false for an untied copy)"
        )
    raf = p.fsdp_reshard_after_forward
    if schedule in V_SHAPED and raf not in ("default", "never"):
        return (
            f"parallelism.fsdp_reshard_after_forward = {raf!r} with pipeline_parallel_schedule = {schedule}: "
            f"its weight backward needs the stage's gathered parameters; use default or never"
        )
    ac = cfg.activation_checkpoint
    if schedule in V_SHAPED and ac.mode == "selective" and ac.selective_ac_option == "op":
        return (
            f"parallelism.pipeline_parallel_schedule = {schedule} runs each block's backward twice (input, then "
            f"weight gradients), which selective op activation checkpointing refuses; use activation_checkpoint.mode "
            f"= full (or selective_ac_option = an integer), or 1F1B or Interleaved1F1B"
        )
    if schedule in V_SHAPED and cfg.compile.enable:
        return (
            f"parallelism.pipeline_parallel_schedule = {schedule} splits each backward into input and weight parts, "
            f"which torch.compile'd blocks do not support; set compile.enable = false or use 1F1B or Interleaved1F1B"
        )
    n_stages = dims.pp * per_rank
    layers = p.pipeline_parallel_layers_per_stage
    if not layers and n_stages > args.n_layers:
        valid = [d for d in range(1, args.n_layers // per_rank + 1) if dims.world_size % d == 0]
        return (
            f"{key} x {per_rank} stage(s) per rank = {n_stages} stages, but the model has {args.n_layers} blocks and "
            f"each stage needs one; valid pipeline_parallel_degree: {', '.join(map(str, valid))}"
        )
    if layers and (len(layers) != n_stages or sum(layers) != args.n_layers):
        return (
            f"parallelism.pipeline_parallel_layers_per_stage = {layers} must hold one count per stage ({n_stages}: "
            f"pipeline_parallel_degree {dims.pp} x {per_rank} per rank) summing to the model's {args.n_layers} "
            f"blocks (it has {len(layers)} summing to {sum(layers)})"
        )
    m = pipeline_microbatches(p, t.local_batch_size)
    if t.local_batch_size % m:
        valid = [d for d in range(1, t.local_batch_size + 1) if t.local_batch_size % d == 0]
        return (
            f"parallelism.pipeline_parallel_microbatches = {m} does not divide training.local_batch_size = "
            f"{t.local_batch_size}; valid: -1 or {', '.join(map(str, valid))}"
        )
    rounds = max(1, m // dims.pp)
    if schedule == "Interleaved1F1B" and m % rounds:  # torch runs it in rounds of equal size
        valid = [d for d in range(dims.pp, t.local_batch_size + 1) if t.local_batch_size % d == 0 and not
                 d % max(1, d // dims.pp)]  # fmt: skip
        return (
            f"parallelism.pipeline_parallel_microbatches = {m} does not split into Interleaved1F1B's rounds at "
            f"pipeline_parallel_degree {dims.pp} (it must be a multiple of max(1, microbatches // pp) = {rounds}); "
            + (f"valid for training.local_batch_size = {t.local_batch_size}: {', '.join(map(str, valid))}" if valid
               else f"use a training.local_batch_size that is a multiple of {dims.pp}")
        )  # fmt: skip
    if schedule == "1F1B" and m < dims.pp:  # torch's 1F1B refuses it; its multi-stage schedules run it
        valid = [d for d in range(dims.pp, t.local_batch_size + 1) if t.local_batch_size % d == 0]
        fix = (
            f"valid for training.local_batch_size = {t.local_batch_size}: {', '.join(map(str, valid))}"
            if valid
            else f"raise training.local_batch_size to a multiple of {dims.pp}"
        )
        return (
            f"parallelism.pipeline_parallel_microbatches = {m} is too few for 1F1B at pipeline_parallel_degree "
            f"{dims.pp}: it needs at least {dims.pp} (one in flight per stage rank); {fix}; or use GPipe, "
            f"Interleaved1F1B or ZBVZeroBubble, which run with fewer"
        )
    return None


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, per_rank: int) -> float:
    """The share of a step a rank idles in theory (forward and backward of every stage taking equal times):
    (pp - 1) / (v m + pp - 1) with v stages per rank and m microbatches; ZBVZeroBubble fills it with the weight
    gradients (0, if forward, input-backward and weight-backward take equal times) once m >= 2 pp - 1."""
    if pp == 1:
        return 0.0
    if schedule in V_SHAPED and n_microbatches >= 2 * pp - 1:
        return 0.0
    return (pp - 1) / (per_rank * n_microbatches + pp - 1)


def share_tied_weight(stage_modules: list, stage_ids: list[int], stage_to_rank: dict, n_stages: int, mesh):
    """Tied embeddings: the first stage's embedding and the last stage's output projection are one weight, of which
    the two ranks holding those stages keep identical copies (the same init by name, summed gradient, the same step).
    Marks this rank's copy for clip_grad_norm (counted in the norm on the first stage only); returns the two ranks'
    group, or None where this rank holds no copy."""
    tied = [(m.tied_weight(), i) for m, i in zip(stage_modules, stage_ids) if m.tied_weight() is not None]
    if not tied:
        return None
    ((weight, stage),) = tied  # one: problem() refuses a schedule that puts both ends on one rank
    ranks = mesh.mesh.tolist()  # the global ranks of this pp group, by pp rank
    ends = [ranks[stage_to_rank[0]], ranks[stage_to_rank[n_stages - 1]]]
    # the two ends' ranks alone create their group (the middle stages' ranks take no part)
    group = mesh.get_group() if len(ranks) == 2 else dist.new_group(ends, use_local_synchronization=True)
    tie_across_ranks(weight, group, counted=stage == 0)
    return group


class Pipeline:
    """This rank's pipeline stages and their schedule: one step() per local batch, forward and backward of every
    pipeline microbatch through all stages. positions: the microbatches' document starts go to every stage
    (block-causal attention)."""

    def __init__(self, stage_modules: list, stage_ids: list[int], n_stages: int, parallelism, local_batch_size, mesh,
                 device: torch.device, positions: bool = False):  # fmt: skip
        group, self.pp, self.device, self.positions = mesh.get_group(), mesh.size(), device, positions
        self.stages = [
            pipeline_stage_class()(module, i, n_stages, device, group=group)
            for module, i in zip(stage_modules, stage_ids)
        ]
        self.first = 0 in stage_ids
        self.n_microbatches = pipeline_microbatches(parallelism, local_batch_size)
        self.schedule_name = parallelism.pipeline_parallel_schedule
        cls = SCHEDULES[self.schedule_name]
        stages = self.stages[0] if self.schedule_name in SINGLE_STAGE else self.stages
        # Losses are sums over tokens, scaled by the Trainer: the schedule must not divide by the microbatch count.
        self.schedule = cls(stages, self.n_microbatches, loss_fn=self._loss, scale_grads=False)
        self.scale = 1.0
        self._sums: list[torch.Tensor] = []
        self.stage_to_rank = {i: r for r in range(self.pp) for i in rank_stages(r, self.pp, len(stage_ids),
                                                                                 self.schedule_name)}  # fmt: skip
        self.tie_group = share_tied_weight(stage_modules, stage_ids, self.stage_to_rank, n_stages, mesh)
        self._evaluation = None  # the forward-only schedule of validation (several stages per rank)

    def _loss(self, token_loss_sum: torch.Tensor, target) -> torch.Tensor:
        self._sums.append(token_loss_sum.detach())
        return token_loss_sum * self.scale

    def _run(self, run, microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.device
        inputs = microbatch[0].to(device, non_blocking=True)
        labels = microbatch[1].to(device, non_blocking=True)
        kwargs = {"labels": labels}
        if self.positions and len(microbatch) > 2:
            kwargs["positions"] = microbatch[2].to(device, non_blocking=True)
        self._sums = []
        run(*((inputs,) if self.first else ()), target=labels, return_outputs=False, **kwargs)
        # the last n: the schedule's first step (and the first after a switch between eval and training) also calls
        # the loss once, to infer the stages' gradient shapes
        if self._sums and len(self._sums) not in (self.n_microbatches, self.n_microbatches + 1):
            raise RuntimeError(f"the pipeline schedule computed {len(self._sums)} losses for {self.n_microbatches} "
                               f"microbatches")  # fmt: skip
        sums = self._sums[-self.n_microbatches :]
        loss = torch.stack(sums).sum() if sums else torch.zeros((), device=device)
        return loss, labels

    def step(self, microbatch, scale: float, aux_scale: float = 0.0, all_reduce: bool = True) -> torch.Tensor:
        """Forward and backward of one local batch (inputs, labels[, positions]); the gradient is that of
        scale x the summed token loss + aux_scale x an MoE's aux loss. all_reduce=False: the gradients are not
        all-reduced across replicas yet (the delayed all-reduce). Returns the summed token loss (zero on ranks
        without the last stage)."""
        self.scale = scale
        for stage in self.stages:
            stage.all_reduce = all_reduce
            stage.submod.aux_grad_scale = aux_scale
        return self._run(self.schedule.step, microbatch)[0]

    @torch.no_grad()
    def evaluate(self, microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss (zero without the last stage), labels) of one local batch, forward only."""
        if self.schedule_name in SINGLE_STAGE:
            return self._run(self.schedule.eval, microbatch)
        if self._evaluation is None:  # its own stages: a schedule's stages hold its buffers and metadata
            self._evaluation = forward_only_schedule(
                [
                    pipeline_stage_class()(s.submod, s.stage_index, s.num_stages, self.device, group=s.group)
                    for s in self.stages
                ],
                self.n_microbatches,
                self._loss,
                self.stage_to_rank,
            )
        return self._run(self._evaluation.step, microbatch)

    def describe(self, blocks: list[range], stage_ids: list[int]) -> str:
        """The start-up line: schedule, microbatches, this rank's stages and the split."""
        split = ", ".join(str(len(b)) for b in blocks)
        mine = ", ".join(f"{i} (blocks {b.start}-{b.stop - 1})" for i, b in ((i, blocks[i]) for i in stage_ids))
        bubble = bubble_fraction(self.schedule_name, self.pp, self.n_microbatches, len(stage_ids))
        return (
            f"Pipeline: {self.schedule_name}, {self.n_microbatches} microbatches per local batch, {len(blocks)} stages "
            f"of {split} blocks; this rank: stage {mine}; bubble {bubble:.1%} in theory"
        )
