"""Sizing a job per rank without GPUs or a real process group (the dry run's report).

It builds the device mesh over a fake process group (as rank 0), the model on the meta device with
activation checkpointing, compile and FSDP applied as the Trainer does, and reports each rank's
parameter, gradient, optimizer, FSDP buffer and activation bytes against a GPU's memory (formulas in
titanlite.sizing.memory). `python -m titanlite.dry_run` is its CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from titanlite.compat import fake_store
from titanlite.config import gradient_sync_mode
from titanlite.dtypes import dtype_bytes
from titanlite.model_builder import build_model, chunked_loss_tokens, compiled_loss
from titanlite.models.registry import BACKEND, model_label
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel.ac import ac_label, describe_ac_compile
from titanlite.parallel.compile import compile_problem
from titanlite.parallel.fsdp import describe, gradient_sync_plan
from titanlite.sizing import memory as me
from titanlite.sizing.backend_activations import layer_bytes_for
from titanlite.sizing.pipeline import pipeline_report

DEFAULT_GPU_MEM_GIB = 80.0
# Kept free for the CUDA context, NCCL's buffers and the caching allocator's fragmentation.
RESERVE_FRACTION = 0.10
GIB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per rank of one training job (rank 0 holds the largest shard), by part."""

    params: int
    grads: int
    optimizer: int
    forward_end_buffers: int  # FSDP's buffers at the end of forward
    activations: dict[str, int]  # by part, with "total"
    backward: me.BackwardPeak  # the largest moment of backward
    units: list[int]  # parameter count of each fully_shard unit as gathered, in forward order
    grad_units: list[int]  # of those, the parameters that get gradients (a LoRA base's do not)
    unit_blocks: list[int | None]  # the transformer block each unit is, or None
    output_unit: int  # parameter count of the output projection as gathered
    on_cpu: bool  # parameters, gradients and optimizer state offloaded to CPU memory
    grads_with_activations: bool  # gradients persist across microbatches (accumulation): both at the peak
    held_grads: int  # bytes of those gradients (last_microbatch_only: every unit's unsharded gradient)
    total_params: int  # model parameters (a tied weight once)
    adapter_params: int  # LoRA: the adapters' parameters (0 without LoRA)
    setup_lines: list[str]  # the sharding lines of the start-up log
    ac_blocks: list[int]
    compiled: int
    dequantized: int = 0  # QLoRA: the temporaries of dequantizing the largest 4-bit weight, in a linear's backward
    nf4_bits: float = 0.0  # QLoRA: bits per 4-bit weight
    muon_transient: int = 0  # Muon: the largest matrix's whole update and Newton-Schulz temporaries, at its step
    muon_flops: float = 0.0  # Muon: Newton-Schulz FLOPs per rank and step (not in MFU)
    reference: int = 0  # [dpo] reference = 'copy': the frozen copy's parameter shards

    def moments(self) -> dict[str, int]:
        """Bytes on the GPU beyond the resident state at each moment that can make the step's peak (see
        titanlite.sizing.memory): FSDP's buffers, the activations then and, with accumulation, the gradients."""
        act = self.activations
        held = self.held_grads if self.grads_with_activations and not self.on_cpu else 0
        # With accumulation every gradient is held already: the walk's share of reduced ones is not added twice.
        walk = self.backward.total - (self.backward.grads if self.grads_with_activations or self.on_cpu else 0)
        # QLoRA: a linear's dequantized weight is counted in backward, which dequantizes beside every block's saved
        # activations; the end of forward is the loss's moment, after the last linear's copy is freed.
        out = {
            "end of forward": self.forward_end_buffers + act["total"] + held,
            "backward": walk + held + self.dequantized,
        }
        if not self.on_cpu:  # fused AdamW on GPUs makes no temporaries beside the gradients (Muon: one matrix's)
            out["optimizer step"] = self.grads + self.muon_transient
        return out

    @property
    def peak_moment(self) -> str:
        """The moment of the step's peak."""
        moments = self.moments()
        return max(moments, key=moments.get)

    @property
    def fsdp_buffers(self) -> int:
        """FSDP's buffers at the step's peak."""
        return self.forward_end_buffers if self.peak_moment == "end of forward" else self.backward.buffers

    @property
    def gpu_total(self) -> int:
        """Bytes on the GPU at the step's peak: the sharded state (unless offloaded) and the largest moment."""
        resident = 0 if self.on_cpu else self.params + self.optimizer + self.reference
        return resident + max(self.moments().values())


def rows_per_item(cfg) -> int:
    """Sequences per item of a batch: [dpo] counts pairs, each a chosen and a rejected sequence."""
    return 2 if cfg.dpo.enable else 1


def activations_for(cfg, plan, ac_blocks: list[int], local_batch_size: int) -> dict[str, int]:
    """The activation estimate (by part) of one microbatch of local_batch_size sequences for this job."""
    t, ac = cfg.training, cfg.activation_checkpoint
    return me.activation_bytes(
        plan.model_args,
        rows_per_item(cfg) * local_batch_size * t.seq_len // plan.dims.cp,  # cp: this rank's part of the sequences
        dtype_bytes(t.mixed_precision_param),
        ac_blocks,
        ac.mode == "selective" and ac.selective_ac_option == "op",
        compiled_loss=compiled_loss(cfg, plan.dims.tp),
        op_policy=ac.selective_op_policy,
        loss_chunk_tokens=chunked_loss_tokens(cfg, plan.dims.tp),
        tp=plan.dims.tp,
        sequence_parallel=cfg.parallelism.enable_sequence_parallel,
        loss_parallel=plan.dims.tp > 1 and cfg.parallelism.enable_loss_parallel,
        ep=plan.dims.ep,
        frozen_norms=cfg.lora.enable,
        cp=plan.dims.cp,
        layer_bytes=layer_bytes_for(cfg, plan),
    )


def backward_for(cfg, plan, est: MemoryEstimate, local_batch_size: int, act: dict[str, int]) -> me.BackwardPeak:
    """The largest moment of backward (memory_estimate.backward_peak) for microbatches of local_batch_size, whose
    activations (activations_for) are act."""
    t, ac = cfg.training, cfg.activation_checkpoint
    act_bytes = dtype_bytes(t.mixed_precision_param)
    tokens = rows_per_item(cfg) * local_batch_size * t.seq_len // plan.dims.cp
    op_sac = ac.mode == "selective" and ac.selective_ac_option == "op"
    tp, sp = plan.dims.tp, cfg.parallelism.enable_sequence_parallel
    kept, rebuilt = me.block_bytes(
        plan.model_args,
        tokens,
        act_bytes,
        est.ac_blocks,
        op_sac,
        ac.selective_op_policy,
        tp,
        sp,
        plan.dims.ep,
        cfg.lora.enable,
        plan.dims.cp,
        layer_bytes_for(cfg, plan),
    )
    return me.backward_peak(
        est.units,
        est.unit_blocks,
        kept,
        rebuilt,
        act["final norm"],
        est.grads,
        est.output_unit,
        act_bytes,
        dtype_bytes(t.mixed_precision_reduce),
        cfg.parallelism.fsdp_reshard_after_forward,
        est.grad_units,
    )


def largest_local_batch(cfg, plan, est: MemoryEstimate, usable_bytes: float, limit: int = 4096) -> int:
    """The largest training.local_batch_size whose step fits usable_bytes, all else as configured (0: none)."""
    best = 0
    for batch in range(1, limit + 1):
        act = activations_for(cfg, plan, est.ac_blocks, batch)
        trial = replace(est, activations=act, backward=backward_for(cfg, plan, est, batch, act))
        if trial.gpu_total > usable_bytes:
            break
        best = batch
    return best


def estimate(cfg, plan, world_size: int) -> MemoryEstimate:
    """Size one rank of the job: the sharded meta model over a fake process group, and the activation formulas."""
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        meshes = plan.dims.build_meshes("cpu", plan.model_args.moe)  # as on GPUs; the fake group does not talk
        # [float8] changes no parameter or state (the weights stay bf16/fp32): sized without torchao, which the
        # machine running the dry run may lack; its activations are counted as bf16's (docs/performance.md).
        plain = replace(cfg, float8=replace(cfg.float8, enable=False))
        plain, nf4 = me.nf4_sizing_config(plain)  # a QLoRA base: its compute-dtype twin, its 4-bit weights packed
        built = build_model(plain, plan.model_args, meshes)
        # As the Trainer does next (allocates nothing: Adam's state appears at the first step).
        build_lr_scheduler(build_optimizer(built.model, cfg.optimizer), cfg.lr_scheduler, cfg.training.steps)
        pbytes = dtype_bytes(cfg.training.mixed_precision_param)
        packed = me.packed_weights(built.model, cfg, pbytes) if nf4 else me.Packed()
        state = me.sharded_state_bytes(built.model, me.optimizer_states(cfg), packed=packed)
        # FSDP leaves NF4 weights alone on a shard group of one rank (parallel/fsdp.py): nothing of them is gathered
        units = me.unit_numels(built.model, packed=packed, compute_bytes=pbytes if plan.dims.fsdp_size > 1 else 0)
        grad_units = me.unit_numels(built.model, trainable_only=True)
        output_trains = built.model.output.weight.requires_grad
        adapters = sum(p.numel() for p in built.model.parameters() if p.requires_grad) if cfg.lora.enable else 0
        unit_blocks = me.unit_blocks(built.model)
        output_unit = me.gathered_numel(built.model.output.weight)
        sharded = plan.dims.fsdp_size > 1  # FSDP shards over the cp ranks too
        total_params = sum(p.numel() for p in built.model.parameters())
        setup_lines = describe(built.num_sharded, meshes.world, plan.dims, cfg.parallelism)
        o = cfg.optimizer
        muon = me.muon_step(
            built.model, o.muon_newton_schulz == "one_rank", o.muon_ns_steps, dtype_bytes(o.muon_ns_dtype)
        )
    finally:
        dist.destroy_process_group()
    t = cfg.training
    act = activations_for(cfg, plan, built.ac_blocks, t.local_batch_size)
    rbytes = dtype_bytes(t.mixed_precision_reduce)
    sync, _ = gradient_sync_plan(gradient_sync_mode(cfg.parallelism), plan.dims, plan.grad_accum)
    forward_end = me.forward_end_buffer_bytes(
        units,
        output_unit,
        pbytes,
        cfg.parallelism.fsdp_reshard_after_forward,
        sharded=sharded,
        loss_in_forward=chunked_loss_tokens(cfg, plan.dims.tp) > 0,
        output_trains=output_trains,
    )
    est = MemoryEstimate(
        params=state.params,
        grads=state.grads,
        optimizer=state.optimizer,
        forward_end_buffers=forward_end,
        activations=act,
        backward=me.BackwardPeak(0, 0, 0),
        units=units,
        grad_units=grad_units,
        unit_blocks=unit_blocks,
        output_unit=output_unit,
        on_cpu=t.enable_cpu_offload,
        grads_with_activations=plan.grad_accum > 1,
        held_grads=sum(grad_units) * rbytes if sync == "last_microbatch_only" else state.grads,
        total_params=total_params,
        adapter_params=adapters,
        setup_lines=setup_lines,
        ac_blocks=built.ac_blocks,
        compiled=built.compiled,
        dequantized=me.dequantized_bytes(packed.largest, pbytes),
        nf4_bits=packed.bits,
    )
    if cfg.optimizer.name.lower() == "muon":
        est.muon_transient, est.muon_flops = muon
    if cfg.dpo.enable and cfg.dpo.reference == "copy" and cfg.dpo.loss != "simpo":
        est.reference = state.params  # built and sharded as the policy (no gradients, no optimizer state)
    est.backward = backward_for(cfg, plan, est, t.local_batch_size, act)
    return est


def _muon_lines(cfg, est) -> list[str]:
    if cfg.optimizer.name.lower() != "muon":
        return []
    where = {"one_rank": "its share of the matrices", "every_rank": "every matrix it holds a shard of"}
    return [
        f"Muon: Newton-Schulz {est.muon_flops / 1e12:.2f} TFLOPs per step on each rank "
        f"({where[cfg.optimizer.muon_newton_schulz]}, orthogonalised whole; not in MFU); "
        f"{est.muon_transient / GIB:.2f} GiB of one matrix's temporaries at the optimizer step"
    ]


def _moe_lines(args, dims) -> list[str]:
    """What the report says of a Mixture of Experts: experts per rank, active parameters, what the activations hold."""
    if not args.moe:
        return []
    ep_part = (
        f"; the activations hold one block's token exchange and {me.EP_IMBALANCE:.2f}x the average routed tokens on "
        f"the busiest rank"
        if dims.ep > 1
        else ""
    )
    return [
        f"MoE: {args.n_experts} experts, top-{args.top_k}, {dims.describe_ep(args.n_experts)}; "
        f"{args.param_counts()['active'] / 1e9:.2f}B active parameters per token{ep_part}"
    ]


def _params_text(cfg) -> str:
    """What the parameters row holds: fp32, or a LoRA base in its dtype and the fp32 adapters."""
    if not cfg.lora.enable:
        return "fp32"
    if cfg.lora.base_dtype == "nf4":
        return "base nf4 + fp32 adapter"
    return f"base {'bf16' if cfg.lora.base_dtype == 'bfloat16' else 'fp32'} + fp32 adapter"


def _lora_lines(cfg, est: MemoryEstimate) -> list[str]:
    """What the report says of LoRA: the adapters' size and what the frozen base does without."""
    if not cfg.lora.enable:
        return []
    share = est.adapter_params / max(est.total_params, 1)
    return [
        f"LoRA: rank {cfg.lora.rank}, {est.adapter_params / 1e6:.1f}M adapter parameters ({share:.2%} of the model); "
        f"the frozen base ({cfg.lora.base_dtype}) has no gradients and no optimizer state"
    ] + (
        [
            f"QLoRA: the blocks' linears at {est.nf4_bits:.3f} bits per weight (the rest of the base in "
            f"{cfg.training.mixed_precision_param}); dequantizing the largest one takes "
            f"{est.dequantized / GIB:.2f} GiB at each linear (counted in backward)"
        ]
        if cfg.lora.base_dtype == "nf4"
        else []
    )


def _activation_text(tokens: int, dtype: str, ac: str) -> str:
    """What the activations row counts, within its column (the dtype is left out when it does not fit)."""
    text = f"{tokens} tokens, {dtype}, {ac}"
    return text if len(text) <= 46 else f"{tokens} tokens, {ac}"


def report(cfg, plan, world_size: int, where: str, gpu_mem_gib: float) -> tuple[list[str], bool]:
    """The dry run's report lines for this job, and whether it fits a GPU of gpu_mem_gib."""
    if plan.dims.pp > 1:  # per pipeline rank
        return pipeline_report(cfg, plan, world_size, where, gpu_mem_gib, gpu_mem_gib * (1 - RESERVE_FRACTION))
    est = estimate(cfg, plan, world_size)
    t, args, ac = cfg.training, plan.model_args, cfg.activation_checkpoint
    tokens = rows_per_item(cfg) * t.local_batch_size * t.seq_len // plan.dims.cp  # this rank's part of the sequences
    act, buffers, gpu_total, on_cpu = est.activations, est.fsdp_buffers, est.gpu_total, est.on_cpu
    total_params, lines = est.total_params, est.setup_lines
    usable = gpu_mem_gib * (1 - RESERVE_FRACTION)
    fits = gpu_total / GIB <= usable
    where_state = "CPU (offloaded)" if on_cpu else "GPU"
    lora = cfg.lora.enable
    p_dtype = t.mixed_precision_param

    def row(name, what, nbytes):
        return f"  {name:<14}{what:<46}{nbytes / GIB:9.2f}"

    lines = (
        [
            f"titanlite dry run: {cfg.job.config_file or 'defaults'}",
            f"world: {world_size} ranks = {where}; no GPU and no real process group used",
        ]
        + lines
        + [
            f"model: {model_label(cfg.model, args)}, {total_params / 1e9:.2f}B parameters, "
            f"{args.n_layers} blocks; "
            f"per rank {t.local_batch_size} x {t.seq_len} tokens per microbatch, {plan.grad_accum} microbatch(es) "
            f"per step",
            describe_ac_compile(ac, est.ac_blocks, est.compiled, args.n_layers),
            *_moe_lines(args, plan.dims),
            *_lora_lines(cfg, est),
            *_muon_lines(cfg, est),
            *_dpo_lines(cfg),
            "",
            "memory per rank (rank 0 holds the largest shard)                     GiB",
            row("parameters", f"{_params_text(cfg)} shards on {where_state}", est.params),
            row("gradients", f"fp32 shards{' of the adapters' if lora else ''} on {where_state}", est.grads),
            row(
                "optimizer",
                f"{me.optimizer_state_text(cfg, 'adapter parameter' if lora else 'parameter')} on {where_state}",
                est.optimizer,
            ),  # fmt: skip
            *([row("reference", "DPO: the frozen copy's parameter shards", est.reference)] if est.reference else []),
            row("FSDP buffers", "at the peak: gathered units + unsharded grads", buffers),
            row("activations", _activation_text(tokens, p_dtype, ac_label(ac)) + _how(args, plan), act["total"]),
        ]
        + [row("", f"  {k}", v) for k, v in act.items() if k != "total"]
        + [
            row("total on GPU", f"peak at: {est.peak_moment}", gpu_total),
            "  moments       "
            + ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.moments().items())
            + " GiB beyond the state"
            + (" (with the gradients held between microbatches)" if est.grads_with_activations else ""),
            f"  GPU memory    {gpu_mem_gib:.2f} GiB, {usable:.2f} usable ({RESERVE_FRACTION:.0%} kept for the CUDA "
            f"context, NCCL and fragmentation)",
            f"fits: {'yes' if fits else 'no'} ({gpu_total / GIB:.2f} of {usable:.2f} GiB usable)",
        ]
    )
    best = largest_local_batch(cfg, plan, est, usable * GIB)
    lines.append(
        f"largest local batch that fits: {best} (training.local_batch_size; now {t.local_batch_size})"
        if best
        else "largest local batch that fits: none, not even 1 sequence: shard over more GPUs, or more AC"
    )
    problem = compile_problem(cfg.compile, "cuda")
    if problem:
        lines.append(f"note: not checked here, but the GPU run will need it: {problem}")
    return lines, fits


def _dpo_lines(cfg) -> list[str]:
    """What the report says of a [dpo] run: rows per microbatch, the logits, and what its reference holds."""
    d = cfg.dpo
    if not d.enable:
        return []
    references = {
        "base": "the base (adapters switched off): no memory of its own",
        "copy": "a frozen copy of the initial weights (the 'reference' row)",
        "precomputed": "a table in CPU memory, 8 bytes per pair (computed before step 1)",
    }
    reference = "none (simpo)" if d.loss == "simpo" else references[d.reference]
    return [
        f"DPO ({d.loss}, beta {d.beta:g}): a microbatch of {cfg.training.local_batch_size} pairs is "
        f"{2 * cfg.training.local_batch_size} sequences; each token's log-probability in chunks as the loss's; "
        f"reference: {reference}"
    ]


def _how(args, plan) -> str:
    """How a transformers backend model's activations are counted: its layers' forward on fake tensors, or under
    tensor parallelism the native decoder's per-layer formula at its sizes."""
    if args.family != BACKEND:
        return ""
    return " (approx.)" if plan.dims.tp > 1 else " (measured)"
