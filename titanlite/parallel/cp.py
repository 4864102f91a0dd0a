"""Context parallelism: each sequence split over the "cp" ranks of a data-parallel rank, two balanced chunks per rank
(one from each end, so causal attention's work is even); attention gathers the keys and values over the cp mesh
(parallel/dims.py). The attention maths live in models/context_parallel.py; this module holds the checks, the
wiring of a model to its meshes and nothing else.
"""

from __future__ import annotations


def problem(cfg, dims, args, device_type: str | None = None, inference: bool = False) -> str | None:
    """Why parallelism.context_parallel_degree cannot split this job's sequences, or None."""
    cp = dims.cp
    if cp == 1:
        return None
    p, t = cfg.parallelism, cfg.training
    # an MoE's tp ranks route their own shares of each rank's tokens, with or without sequence parallelism
    split = 2 * cp * (dims.tp if dims.tp > 1 and (p.enable_sequence_parallel or args.moe) else 1)
    if t.seq_len % split:
        what = f"2 x context_parallel_degree {cp}" + (
            f" x tensor_parallel_degree {dims.tp} (sequence parallelism or an MoE)" if split != 2 * cp else ""
        )
        return (
            f"training.seq_len = {t.seq_len} does not split into {what} = {split} equal chunks (each cp rank "
            f"takes two, one from each end); valid: a multiple of {split}, the nearest "
            f"{nearest_multiples(t.seq_len, split)}"
        )
    if t.loss_chunk_tokens == 0:
        return (
            f"parallelism.context_parallel_degree = {cp} does not work with training.loss_chunk_tokens = 0 (the loss "
            "of whole logits) yet; set context_parallel_degree = 1, or change that setting (docs/long_context.md)"
        )
    return None


def apply_cp(model, meshes) -> None:
    """Bind the model's attention to this rank's context-parallel group (and an MoE's load statistics to the ranks
    sharing its sequences); nothing without cp."""
    if meshes is not None and meshes.cp is not None:
        model.set_context_parallel(meshes.cp.get_group(), meshes.sequence.get_group() if meshes.sequence else None)


def nearest_multiples(value: int, step: int) -> str:
    """The positive multiple(s) of step nearest to value: '32', or '32 or 40' when both are as near."""
    below, above = value - value % step, value - value % step + step
    if below <= 0 or above - value < value - below:
        return str(above)
    return str(below) if value - below < above - value else f"{below} or {above}"
