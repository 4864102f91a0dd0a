"""Per-rank memory of one training step, from the model shape and the sharding plan (no GPU needed).

Activations (a = bytes of the compute dtype, per token of a microbatch of B x S tokens): what one block
keeps for backward comes from the model's arguments (sizing/activations.py: F without
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
(fp32 master weights, or a LoRA base in lora.base_dtype), as many bytes of gradients, and AdamW's two fp32
moments, for the parameters that train (with LoRA: the adapters only; a frozen base has neither). A QLoRA base's
4-bit weights count nf4_bits each (4.127 with QLoRA's blocks of 64 and 256), sharded and as FSDP gathers them, and a
linear's dequantized copy (dequantized_bytes, of the largest such weight) is added to backward.

FSDP's unsharded tensors (a = compute dtype, r = reduce dtype, units in forward order) follow FSDP2's own
schedule (torch/distributed/fsdp/_fully_shard). The step's peak is the largest of three moments:

    end of forward     every block's activations and the loss's; FSDP holds the unit with the output
                       projection gathered and, with the loss in chunks (which runs inside the model's
                       forward), the output's gradient made there and, when the unit is sharded over more
                       than one rank, its all-gather output (kept until the root's forward ends)
    backward           the largest over the units' backward (backward_peak): unit k's parameters and
                       gradient (a) beside the reduce-scatter input (r) of the unit after it, then its own
                       gradient and reduce-scatter input, with unit k - 1 prefetched; the activations of the
                       blocks up to k (k's own rebuilt if checkpointed); and this rank's share of the
                       gradients of the units after k, already reduced
    optimizer step     every gradient (fused AdamW on GPUs makes no temporaries; the CPU's foreach AdamW
                       makes one gradient-sized temporary, which is not counted)

With reshard_after_forward 'never' every unit stays gathered after forward; with an int N every unit keeps
a 1/N shard. With accumulation the gradients persist across microbatches and are added to the first two (with
gradient_sync last_microbatch_only, every unit's unsharded gradient in the reduce dtype instead of the sharded
ones). The moments are checked against torch's FSDPMemTracker and against the peak RSS of real CPU runs in
benchmarks/memory_estimate.py (tests/test_memory_estimate.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanlite.models.nf4 import quantized_linears
from titanlite.muon import is_muon_matrix, whole_experts_here
from titanlite.sizing.activations import block_activation_bytes, exchange_bytes, expert_activation_bytes

# Adam and AdamW keep two fp32-shaped states per parameter (exp_avg, exp_avg_sq).
# Under expert parallelism the busiest rank is taken to receive this many times the average routed tokens (headroom,
# not a measurement: the step line's busiest-expert figure shows what a run sees).
EP_IMBALANCE = 1.25
OPTIMIZER_STATES = {"adamw": 2, "adam": 2}


def diloco_copies(cfg) -> int:
    """fp32 copies of each trained weight DiLoCo keeps (fault_tolerance.mode): the global weights and the outer
    momentum, or none."""
    ft = cfg.fault_tolerance
    return 1 + (ft.outer_momentum > 0) if ft.enable and ft.mode == "diloco" else 0


def optimizer_states(cfg):
    """fp32 copies of a trained weight the optimizers keep, as a function of (name, parameter): the optimizer's states
    (Muon: one momentum for the blocks' matrices, AdamW's two for the rest), and under DiLoCo (fault_tolerance.mode)
    the global weights and the outer momentum (parallel/ft/diloco.py)."""
    outer = diloco_copies(cfg)
    if cfg.optimizer.name.lower() == "muon":
        return lambda name, p: (1 if is_muon_matrix(name, p) else 2) + outer
    return lambda name, p: OPTIMIZER_STATES.get(cfg.optimizer.name.lower(), 2) + outer


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
    ep: int = 1,
    frozen_norms: bool = False,
    cp: int = 1,
    layer_bytes: list[dict[str, int]] | None = None,
) -> dict[str, int]:
    """Peak activation bytes of one microbatch of `tokens` tokens on one rank, by part (and 'total').

    wrapped: indices of the checkpointed blocks (see parallel.ac.checkpointed_blocks); op_sac: they
    use selective 'op' checkpointing rather than full recomputation, keeping the outputs op_policy says
    (all_matmuls or every_second_matmul); loss_chunk_tokens: the output projection and loss run this many tokens
    at a time (0: all at once); compiled_loss: the loss is one
    compiled kernel that keeps only the logits. tp, sequence_parallel, loss_parallel: tensor parallelism
    (each rank keeps its share of the heads and features; with sequence parallelism 1 / tp of the residual
    stream's tokens; with loss parallelism 1 / tp of the logits). ep: an MoE's expert parallelism, which adds the
    token exchange of one block beside its recompute, and headroom for routing imbalance: the busiest rank is taken to
    receive EP_IMBALANCE times the average tokens for the experts' kept activations. frozen_norms: the norms'
    weights get no gradients (a LoRA base), so they keep less (activations.block_activation_bytes). cp: context
    parallelism, `tokens` being this rank's part of the sequences; attention keeps the gathered keys and values.
    layer_bytes: each block's bytes per token by AC mode, measured (a transformers backend model's), instead of the
    formula's.
    """
    sp = tp > 1 and sequence_parallel
    kept, rebuilt = block_bytes(
        args, 1, act_bytes, wrapped, op_sac, op_policy, tp, sequence_parallel, ep, frozen_norms, cp, layer_bytes
    )
    blocks = sum(kept)
    vocab = args.vocab_size // tp if loss_parallel or loss_chunk_tokens > 0 else args.vocab_size
    loss = vocab * (act_bytes if compiled_loss else 12)
    if tp > 1 and loss_parallel and not compiled_loss:  # DTensor's loss_parallel keeps one more copy
        loss = vocab * (12 + act_bytes)
    loss_tokens = tokens
    if loss_chunk_tokens > 0:  # one chunk's logits, their fp32 copy and fp32 softmax (or log_softmax)
        loss_tokens, loss = min(loss_chunk_tokens, tokens), vocab * (8 + act_bytes)
    recompute = max(rebuilt, default=0)
    parts = {
        "blocks": int(tokens * blocks),
        "final norm": tokens * args.dim * (4 * (1 - frozen_norms) + 4 + act_bytes) // (tp if sp else 1),
        "loss or recompute": int(max(loss_tokens * loss, tokens * recompute)),
    }
    parts["total"] = sum(parts.values())
    return parts


def block_bytes(
    args,
    tokens: int,
    act_bytes: int,
    wrapped: list[int],
    op_sac: bool,
    op_policy: str = "all_matmuls",
    tp: int = 1,
    sequence_parallel: bool = True,
    ep: int = 1,
    frozen_norms: bool = False,
    cp: int = 1,
    layer_bytes: list[dict[str, int]] | None = None,
) -> tuple[list[int], list[int]]:
    """Per block (arguments as activation_bytes'): the bytes it keeps for backward, and the bytes its backward
    rebuilds on top of them (a checkpointed block's whole forward; 0 for the others; under expert parallelism also
    the token exchange, and the experts' share grows by EP_IMBALANCE)."""
    kept, rebuilt = [], []
    for i in range(args.n_layers):
        per_block = dict(
            layer_bytes[i]
            if layer_bytes
            else block_activation_bytes(args, act_bytes, tp, tp > 1 and sequence_parallel, frozen_norms, cp, i)
        )
        transient = 0.0
        if args.is_moe_layer(i) and ep > 1:
            for mode, experts in expert_activation_bytes(args, act_bytes, tp).items():
                per_block[mode] += experts * (EP_IMBALANCE - 1)
            transient = exchange_bytes(args, act_bytes, tp)
        if args.attention_sinks:  # attention's backward holds the gradients of its 8-features-wider q, k, v, output
            transient += 2 * (args.n_heads + args.kv_heads) // tp * (args.head_dim + 8) * act_bytes
        op = per_block["op_every_second" if op_policy == "every_second_matmul" else "op"]
        wrapped_kept = op if op_sac else per_block["full"]
        kept.append(int(tokens * (wrapped_kept if i in wrapped else per_block["none"])))
        rebuilt.append(int(tokens * ((per_block["none"] if i in wrapped else 0) + transient)))
    return kept, rebuilt


@dataclass
class ShardedState:
    """Bytes one rank holds for the sharded model state."""

    params: int
    grads: int
    optimizer: int


def nf4_bits(block_size: int, scaler_block_size: int, factor_bytes: int) -> float:
    """Bits per weight of an NF4 tensor: its 4-bit code, an int8 scale per block and a factor (of factor_bytes, the
    tensor's dtype) per block of scales."""
    return 4 + 8 / block_size + 8 * factor_bytes / (block_size * scaler_block_size)


@dataclass
class Packed:
    """A QLoRA base's 4-bit weights, as the dry run counts them."""

    ids: frozenset[int] = frozenset()  # of the parameters held in NF4
    bits: float = 16.0  # per weight
    largest: int = 0  # elements of the largest, as gathered (its dequantized copy in a linear's backward)


def nf4_sizing_config(cfg):
    """(the config the dry run builds a QLoRA model from: its compute-dtype twin, sized without torchao, and whether
    the base is nf4)."""
    if not (cfg.lora.enable and cfg.lora.base_dtype == "nf4"):
        return cfg, False
    return dataclasses.replace(
        cfg, lora=dataclasses.replace(cfg.lora, base_dtype=cfg.training.mixed_precision_param)
    ), True


def packed_weights(model, cfg, compute_bytes: int) -> Packed:
    """The weights of the twin model (nf4_sizing_config) that the real one holds in NF4."""
    weights = [m.weight for m in quantized_linears(model).values()]
    bits = nf4_bits(cfg.lora.nf4_block_size, cfg.lora.nf4_scaler_block_size, compute_bytes)
    return Packed(frozenset(id(w) for w in weights), bits, max((gathered_numel(w) for w in weights), default=0))


def muon_step(model, one_rank: bool, ns_steps: int = 5, ns_bytes: int = 2) -> tuple[int, float]:
    """Muon (titanlite.muon), per rank and step: the bytes of the largest matrix's transients (its whole update in
    fp32, three iterates and the Gram matrix and its square per matrix, ns_bytes each: 2 in bf16) and the
    Newton-Schulz FLOPs (ns_steps iterations of x x^T, its square and the product with x) of the matrices this rank
    orthogonalises: every one it holds a shard of, or with one_rank its share of them (round-robin over the ranks of
    each matrix's mesh); an experts stack sharded on its experts dim only counts this rank's experts."""
    largest, flops = 0, 0.0
    for name, p in model.named_parameters():
        if not (p.requires_grad and is_muon_matrix(name, p)):
            continue
        placements = getattr(p, "placements", ())
        whole_here = whole_experts_here(p)
        shape = (p.to_local() if whole_here and placements else p).shape
        n, count = shape.numel(), (shape[0] if p.ndim == 3 else 1)
        small, big = sorted(shape[-2:])
        largest = max(largest, 4 * n + ns_bytes * (3 * n + 2 * count * small * small))
        ranks = p.device_mesh.size() if one_rank and not whole_here and placements else 1
        flops += count * ns_steps * (4 * small * small * big + 2 * small**3) / ranks
    return largest, flops


def optimizer_state_text(cfg, what: str = "parameter") -> str:
    """How many fp32 copies the optimizer keeps, in words: 'AdamW, 2 x fp32 per parameter', Muon's split, and
    DiLoCo's outer state."""
    outer = diloco_copies(cfg)
    if cfg.optimizer.name.lower() == "muon":
        text = f"Muon, {1 + outer} x fp32 per block matrix, AdamW {2 + outer} x per other {what}"
    else:
        text = f"{cfg.optimizer.name}, {2 + outer} x fp32 per {what}"
    if outer:
        text += " (with DiLoCo's global weights" + (" and outer momentum)" if outer == 2 else ")")
    return text


def sharded_state_bytes(model, optimizer_states=2, packed: Packed = Packed()) -> ShardedState:
    """This rank's parameters (local shards, their own dtype; packed: those held in NF4 instead), and for those
    that train their gradients (the same) and optimizer states (fp32; optimizer_states: per parameter, or a
    function of (name, parameter) as optimizer_states(cfg))."""
    params = grads = optim = 0
    states_of = optimizer_states if callable(optimizer_states) else lambda name, p: optimizer_states
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if id(p) in packed.ids:
            params += int(local.numel() * packed.bits / 8)
        else:
            params += local.numel() * local.element_size()
        if p.requires_grad:
            grads += local.numel() * local.element_size()
            optim += states_of(name, p) * local.numel() * 4
    return ShardedState(params=params, grads=grads, optimizer=optim)


def unit_numels(model, trainable_only: bool = False, packed: Packed = Packed(), compute_bytes: int = 0) -> list[int]:
    """Parameter count of each fully_shard unit of the model as FSDP gathers it (root excluded): all of it, or
    this rank's tensor-parallel share; trainable_only: of the parameters that get gradients. NF4 weights (packed)
    count as their bytes over compute_bytes' (0: not gathered at all, as on a shard group of one rank)."""
    ratio = packed.bits / 8 / compute_bytes if compute_bytes else 0.0
    out = []
    for group in model.shard_groups():
        seen = {id(p): p for m in group for p in m.parameters() if p.requires_grad or not trainable_only}
        out.append(sum(int(gathered_numel(p) * (ratio if i in packed.ids else 1)) for i, p in seen.items()))
    return out


def dequantized_bytes(numel: int, compute_bytes: int) -> int:
    """The temporaries of dequantizing one NF4 weight of numel elements in a linear's forward or backward (torchao's
    get_original_weight): two int64 halves of the codes and three compute-dtype tensors (measured with MemTracker on
    CPU: 20.0 bytes per weight in fp32, 14.0 in bf16)."""
    return numel * (8 + 3 * compute_bytes)


def unit_blocks(model) -> list[int | None]:
    """For each fully_shard unit of the model (as unit_numels), the index of the transformer block it is, or None."""
    index = {id(block): i for i, block in enumerate(model.layers)}
    return [index.get(id(group[0])) if len(group) == 1 else None for group in model.shard_groups()]


def gathered_numel(p) -> int:
    """Elements of p once FSDP has gathered it over the data-parallel ranks (split over "tp", or an MoE's experts
    over "ep", only)."""
    n = p.numel()
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return n
    for name, placement in zip(mesh.mesh_dim_names or (), p.placements):
        if name in ("tp", "ep") and placement.is_shard():
            n //= mesh.size(mesh.mesh_dim_names.index(name))
    return n


def _kept_gathered(units: list[int], output_unit: int, param_bytes: int, reshard_after_forward: str) -> int:
    """Bytes of parameters that stay gathered after forward beyond the unit computing ('never'; an int N)."""
    if reshard_after_forward == "never":
        return (sum(units) - output_unit) * param_bytes
    if reshard_after_forward.isdigit():
        return sum(units) * param_bytes // int(reshard_after_forward)
    return 0


def _unit_backward_buffers(units: list[int], k: int, a: int, r: int, prefetch: bool, grads: list[int]) -> int:
    """FSDP's buffers over unit k's backward: its parameters and gradient beside the reduce-scatter input of the unit
    after it (freed at k's post-backward), then its own gradient and reduce-scatter input; unit k - 1 prefetched.
    grads: the count of each unit's parameters that get gradients (all of them but a LoRA base's)."""
    n, g = units[k], grads[k]
    after = grads[k + 1] if k + 1 < len(units) else 0
    before = units[k - 1] if k and prefetch else 0
    return max(n * a + g * r, n * a + g * a + after * r) + before * a


def forward_end_buffer_bytes(
    units: list[int],
    output_unit: int,
    param_bytes: int,
    reshard_after_forward: str,
    sharded: bool = True,
    loss_in_forward: bool = False,
    output_trains: bool = True,
) -> int:
    """FSDP's buffers at the end of forward (units: gathered parameter counts in forward order; output_unit: the count
    of the unit that holds the output projection; sharded: the units are split over more than one rank;
    loss_in_forward: the loss in chunks runs inside the model's forward, making the output's gradient (compute
    dtype) there while FSDP still holds the output unit's all-gather output; output_trains: the output projection
    gets a gradient, which a frozen LoRA base's does not)."""
    grad = loss_in_forward and output_trains
    gathered = output_unit * param_bytes * (1 + int(sharded and loss_in_forward) + int(grad))
    return gathered + _kept_gathered(units, output_unit, param_bytes, reshard_after_forward)


@dataclass
class BackwardPeak:
    """The largest moment of backward, by part: FSDP's buffers, the activations still alive, and the gradients
    already reduced (sharded)."""

    buffers: int
    activations: int
    grads: int

    @property
    def total(self) -> int:
        return self.buffers + self.activations + self.grads


def backward_peak(
    units: list[int],
    unit_blocks: list[int | None],
    block_kept: list[int],
    block_rebuilt: list[int],
    final_norm: int,
    grads: int,
    output_unit: int,
    param_bytes: int,
    reduce_bytes: int,
    reshard_after_forward: str,
    grad_units: list[int] | None = None,
) -> BackwardPeak:
    """Walk backward unit by unit (units in forward order; unit_blocks: the block each unit holds, or None; block_kept
    and block_rebuilt from block_bytes): at unit k, the blocks up to its own keep their activations (its own rebuilt
    if checkpointed), and the units after it have their sharded share of grads (this rank's gradient bytes).
    grad_units: each unit's count of parameters that get gradients (None: all of them)."""
    a, r = param_bytes, reduce_bytes
    grad_units = units if grad_units is None else grad_units
    kept = _kept_gathered(units, output_unit, a, reshard_after_forward)
    first_block = next((k for k, b in enumerate(unit_blocks) if b is not None), len(units))
    total_units = sum(grad_units) or 1
    best = BackwardPeak(0, 0, 0)
    for k in range(len(units)):
        block = unit_blocks[k]
        if block is not None:
            act = sum(block_kept[: block + 1]) + block_rebuilt[block] + final_norm
        else:  # the embedding runs backward after every block, the output before them
            act = 0 if k < first_block else sum(block_kept) + final_norm
        buffers = _unit_backward_buffers(units, k, a, r, reshard_after_forward != "never", grad_units) + kept
        moment = BackwardPeak(buffers, act, grads * sum(grad_units[k + 1 :]) // total_units)
        best = max(best, moment, key=lambda m: m.total)
    return best
