"""Per-rank memory of one training step, from the model shape and the sharding plan (no GPU needed).

Activations (a = bytes of the compute dtype, per token of a microbatch of B x S tokens): what one block
keeps for backward comes from the model's arguments (ModelArgs.block_activation_bytes: F without
AC, C with full AC, O with selective 'op'), checked against torch's MemTracker on CPU in
tests/test_activation_checkpoint.py; around the blocks:

    recompute (any AC)       one checkpointed block rebuilds its F in backward
    final norm               3*dim * a
    loss                     vocab * 12: the logits, their fp32 copy and log_softmax's fp32 output,
                             alive together at the loss (measured on CPU by MemTracker; torch's
                             loss_parallel under tp: vocab / tp * (12 + a), measured in fp32); in chunks
                             (training.loss_chunk_tokens) vocab * (8 + a) for one chunk's tokens only;
                             compiled loss ([compile] with inductor): vocab * a, the logits only (one
                             fused kernel reads them; no fp32 copy is kept)

    activations = B*S * (sum over blocks + final norm) + max(loss tokens * loss, B*S * recompute)

Selective k wraps every k-th block (C) and leaves the others at F. Fused GPU kernels (RMSNorm,
attention backends) save a little less, so on GPUs this is an upper bound by a few percent.

Sharded state per rank is read from the sharded (meta) model: the local shard of every parameter
(fp32 master weights), as many bytes of gradients, and AdamW's two fp32 moments.

FSDP's unsharded tensors (a = compute dtype, r = reduce dtype, units in forward order) follow FSDP2's own
schedule (torch/distributed/fsdp/_fully_shard), at the two moments that can make a step's peak:

    end of forward     the unit holding the output projection gathered, plus its all-gather output (FSDP
                       keeps that until the root's forward ends, which is after titanlite's loss) when the
                       unit is sharded over more than one rank, plus the output's gradient when the loss in
                       chunks makes it in forward; with every block's activations and the loss's
    reduce-scatter     a unit's unsharded gradient (a) and the reduce-scatter input it is copied into (r),
                       plus the unit before it gathered (prefetched for the next backward); with the blocks'
                       activations and one block's recompute, but no longer the loss's tensors

With reshard_after_forward 'never' every unit stays gathered after forward; with an int N every unit keeps
a 1/N shard. With one microbatch per step, gradients and activations are not alive at once (backward frees
a block's activations as it makes that block's gradients), so the step's peak is the largest of: end of
forward, reduce-scatter, and the whole gradient with a reduce-scatter's buffers (the end of backward); with
accumulation the gradients persist across microbatches and are added to the first two. Each moment is
checked against torch's FSDPMemTracker and against the peak RSS of real CPU runs in
benchmarks/memory_estimate.py (tests/test_memory_estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# The activations left when backward reduce-scatters the first units (activation_bytes' extra entry).
IN_BACKWARD = "in backward"
# Adam and AdamW keep two fp32-shaped states per parameter (exp_avg, exp_avg_sq).
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2}


def activation_bytes(
    args,
    tokens: int,
    act_bytes: int,
    wrapped: list[int],
    op_sac: bool,
    compiled_loss: bool = False,
    op_policy: str = "all_matmuls",
    loss_chunk_tokens: int = 0,
    tp: int = 1,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
) -> dict[str, int]:
    """Peak activation bytes of one microbatch of `tokens` tokens on one rank, by part (and 'total').

    wrapped: indices of the checkpointed blocks (see parallelize.checkpointed_blocks); op_sac: they
    use selective 'op' checkpointing rather than full recomputation, keeping the outputs op_policy says
    (all_matmuls or every_second_matmul); loss_chunk_tokens: the output projection and loss run this many tokens
    at a time (0: all at once); compiled_loss: the loss is one
    compiled kernel that keeps only the logits. tp, sequence_parallel, loss_parallel: tensor parallelism
    (each rank keeps its share of the heads and features; with sequence parallelism 1 / tp of the residual
    stream's tokens; with loss parallelism 1 / tp of the logits). The IN_BACKWARD entry is what is left once the
    loss's tensors are freed (the blocks, the final norm and one block's recompute); it is not a part of 'total'.
    """
    sp = tp > 1 and sequence_parallel
    per_block = args.block_activation_bytes(act_bytes, tp, sp)
    op = per_block["op_every_second" if op_policy == "every_second_matmul" else "op"]
    kept = op if op_sac else per_block["full"]
    blocks = sum(kept if i in wrapped else per_block["none"] for i in range(args.n_layers))
    vocab = args.vocab_size // tp if loss_parallel or loss_chunk_tokens > 0 else args.vocab_size
    loss = vocab * (act_bytes if compiled_loss else 12)
    if tp > 1 and loss_parallel and not compiled_loss:  # DTensor's loss_parallel keeps one more copy
        loss = vocab * (12 + act_bytes)
    loss_tokens = tokens
    if loss_chunk_tokens > 0:  # one chunk's logits, their fp32 copy and fp32 softmax (or log_softmax)
        loss_tokens, loss = min(loss_chunk_tokens, tokens), vocab * (8 + act_bytes)
    recompute = per_block["none"] if wrapped else 0
    parts = {
        "blocks": tokens * blocks,
        "final norm": tokens * args.dim * (4 + 4 + act_bytes) // (tp if sp else 1),
        "loss or recompute": max(loss_tokens * loss, tokens * recompute),
    }
    parts["total"] = sum(parts.values())
    parts[IN_BACKWARD] = parts["blocks"] + parts["final norm"] + tokens * recompute
    return parts


@dataclass
class ShardedState:
    """Bytes one rank holds for the sharded model state."""

    params: int
    grads: int
    optimizer: int


def sharded_state_bytes(model, optimizer_states: int = 2) -> ShardedState:
    """This rank's parameters (local shards, their own dtype), gradients (the same) and optimizer states (fp32)."""
    params = optim = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params += local.numel() * local.element_size()
        optim += optimizer_states * local.numel() * 4
    return ShardedState(params=params, grads=params, optimizer=optim)


def unit_numels(model) -> list[int]:
    """Parameter count of each fully_shard unit of the model as FSDP gathers it (root excluded): all of it, or
    this rank's tensor-parallel share."""
    out = []
    for group in model.shard_groups():
        seen = {id(p): p for m in group for p in m.parameters()}
        out.append(sum(gathered_numel(p) for p in seen.values()))
    return out


def gathered_numel(p) -> int:
    """Elements of p once FSDP has gathered it over the data-parallel ranks (split over "tp" only)."""
    n = p.numel()
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return n
    for name, placement in zip(mesh.mesh_dim_names or (), p.placements):
        if name == "tp" and placement.is_shard():
            n //= mesh.size(mesh.mesh_dim_names.index(name))
    return n


@dataclass
class FsdpBuffers:
    """Bytes of unsharded parameters and gradients FSDP holds at the moments that can make a step's peak (see the
    module docstring)."""

    forward_end: int
    reduce_scatter: int


def fsdp_buffer_bytes(
    units: list[int],
    output_unit: int,
    param_bytes: int,
    reduce_bytes: int,
    reshard_after_forward: str,
    sharded: bool = True,
    output_grad_in_forward: bool = False,
) -> FsdpBuffers:
    """FSDP's buffers for units (gathered parameter counts in forward order); output_unit: the count of the unit that
    holds the output projection; sharded: the units are split over more than one rank; output_grad_in_forward: the
    loss in chunks makes the output's gradient (compute dtype) in forward."""
    kept = 0
    if reshard_after_forward == "never":
        kept = (sum(units) - output_unit) * param_bytes
    elif reshard_after_forward.isdigit():
        kept = sum(units) * param_bytes // int(reshard_after_forward)
    forward_end = output_unit * param_bytes * (1 + int(sharded) + int(output_grad_in_forward))
    before = [0] + units[:-1]  # the unit gathered (prefetched) while this one reduce-scatters
    reducing = max(n * (param_bytes + reduce_bytes) + b * param_bytes for n, b in zip(units, before))
    if reshard_after_forward == "never":  # every unit is gathered already: nothing to prefetch
        reducing = max(units) * (param_bytes + reduce_bytes)
    return FsdpBuffers(forward_end=forward_end + kept, reduce_scatter=reducing + kept)
