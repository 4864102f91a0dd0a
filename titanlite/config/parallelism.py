"""The [parallelism] section: the degrees of each kind of parallelism and gradient synchronisation."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.fields import one_of, setting

GRADIENT_SYNC = ("every_microbatch", "delay_all_reduce", "last_microbatch_only")


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
