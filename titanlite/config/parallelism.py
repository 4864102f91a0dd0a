"""The [parallelism] section: the degrees of each kind of parallelism and gradient synchronisation."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.fields import one_of, setting

GRADIENT_SYNC = ("every_microbatch", "delay_all_reduce", "last_microbatch_only")
# torch.distributed.pipelining schedules titanlite runs (parallel/pp.py); the last two hold several stages per rank
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = setting(
        -1,
        "ranks each parameter is sharded over (FSDP); -1 = what replicate leaves",
        lambda v: v == -1 or v >= 1,
        "-1 or a number >= 1",
    )
    data_parallel_replicate_degree: int = setting(
        1, "replica groups (HSDP when > 1 with shard > 1; DDP-like with shard 1)", lambda v: v >= 1, "a number >= 1"
    )
    tensor_parallel_degree: int = setting(
        1,
        "ranks each block's matmuls are split over (tensor parallelism, the innermost mesh dimension: keep it "
        "within a node); world = replicate x shard x tp",
        lambda v: v >= 1,
        "a number >= 1",
    )
    context_parallel_degree: int = setting(
        1,
        "ranks each sequence is split over (context parallelism, for long sequences): each takes two chunks, one "
        "from each end, and attention gathers the keys and values; FSDP shards over data_parallel_shard_degree x "
        "this; world = replicate x shard x cp x tp (docs/long_context.md)",
        lambda v: v >= 1,
        "a number >= 1",
    )
    expert_parallel_degree: int = setting(
        1,
        "Mixture-of-Experts models: ranks each block's experts are split over (expert parallelism; tokens travel to "
        "their experts' ranks), taken from the data-parallel shard ranks x tp; it divides the experts and "
        "data_parallel_shard_degree x tensor_parallel_degree",
        lambda v: v >= 1,
        "a number >= 1",
    )
    pipeline_parallel_degree: int = setting(
        1,
        "ranks the blocks are split over as pipeline stages (pipeline parallelism, the outermost mesh dimension: "
        "across nodes); world = pp x replicate x shard x cp x tp (docs/parallelism.md)",
        lambda v: v >= 1,
        "a number >= 1",
    )
    pipeline_parallel_schedule: str = setting(
        "1F1B",
        "with pp > 1: the order in which stages run forward and backward over the pipeline microbatches: GPipe, "
        "1F1B, Interleaved1F1B (several stages per rank, a smaller bubble) or ZBVZeroBubble (two stages per rank "
        "in a V; backward split into input and weight parts)",
        one_of(*PIPELINE_SCHEDULES),
        ", ".join(PIPELINE_SCHEDULES),
    )
    pipeline_parallel_microbatches: int = setting(
        -1,
        "with pp > 1: pipeline microbatches each local batch is split into (the more, the smaller the bubble); "
        "-1 = training.local_batch_size (one sequence each); must divide the local batch",
        lambda v: v == -1 or v >= 1,
        "-1 or a number >= 1",
    )
    pipeline_parallel_stages_per_rank: int = setting(
        -1,
        "with pp > 1: pipeline stages (model chunks) each rank holds; -1 = 1 for GPipe and 1F1B, 2 for "
        "Interleaved1F1B and ZBVZeroBubble (which needs exactly 2)",
        lambda v: v == -1 or v >= 1,
        "-1 or a number >= 1",
    )
    pipeline_parallel_layers_per_stage: list[int] = setting(
        [],
        "with pp > 1: blocks in each stage, in order (one number per stage, summing to the model's blocks); empty = "
        "split by cost (parameters: the embedding and the output projection count, so the first and last stages "
        "hold fewer blocks)",
        lambda v: all(n >= 1 for n in v),
        "a list of numbers >= 1, one per stage",
    )
    enable_sequence_parallel: bool = setting(
        True, "with tp > 1: norms and the residual stream split over the sequence (less activation memory)"
    )
    enable_loss_parallel: bool = setting(
        True, "with tp > 1: the output projection and the loss stay split over the vocabulary (no full logits)"
    )
    fsdp_reshard_after_forward: str = setting(
        "default",
        "free gathered params after forward: default, always, never, or an int (reshard group size)",
        lambda v: v in ("default", "always", "never") or (v.isdigit() and int(v) >= 1),
        "default, always, never, or an integer >= 1",
    )
    hsdp_delay_all_reduce: bool = setting(
        False,
        "HSDP with accumulation: all-reduce across replicas only on the last microbatch "
        "(shorthand for gradient_sync = delay_all_reduce)",
    )
    gradient_sync: str = setting(
        "every_microbatch",
        "gradient reduction with accumulation: every_microbatch; delay_all_reduce (replicas "
        "all-reduce on the last microbatch only; reduce-scatter on each); last_microbatch_only (no reduction "
        "before the last microbatch; holds unsharded gradients, model size x reduce dtype, per rank)",
        one_of(*GRADIENT_SYNC),
        ", ".join(GRADIENT_SYNC),
    )
