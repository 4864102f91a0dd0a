"""The dry run under pipeline parallelism: each pipeline rank's memory and the schedule's bubble.

Each pipeline rank is built as the Trainer builds it (over a fake process group, as the first rank of its stage
group): its stages' parameter, gradient and optimizer shards are counted from the sharded meta model. A stage keeps
its parameters gathered over all of a local batch's pipeline microbatches (titanlite's default under pp) and its
unsharded gradients until the last one (reduce dtype); its activations are those of the microbatches the schedule
holds in flight on that rank, each of its blocks keeping what activation checkpointing leaves
(memory_estimate.block_bytes), plus one block's recompute and, on the last stage, the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from titanlite.compat import fake_store
from titanlite.dtypes import dtype_bytes
from titanlite.model_builder import build_model, chunked_loss_tokens, compiled_loss
from titanlite.models.registry import model_class, model_label
from titanlite.models.stage import part_sizes
from titanlite.parallel.fsdp import describe
from titanlite.parallel.pp import bubble_fraction, pipeline_microbatches, rank_stages, stage_blocks, stages_per_rank
from titanlite.sizing import memory as me
from titanlite.sizing.backend_activations import layer_bytes_for

GIB = 1024**3


@dataclass
class RankMemory:
    """Bytes on one pipeline rank (the first rank of its stage group, which holds the largest shard)."""

    pp_rank: int
    stages: list[int]
    params: int
    grads: int
    optimizer: int
    gathered: int  # the stages' parameters gathered, and their unsharded gradients
    activations: int
    in_flight: float  # microbatches of the rank's whole work held at once
    split: list[int]  # blocks per stage, every stage
    setup: list[str]  # the start-up lines about the sharding

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered + self.activations


def in_flight(schedule: str, pp: int, rank: int, m: int, v: int) -> float:
    """Microbatches (of all of the rank's stages) whose activations a rank holds at its peak: GPipe all m; 1F1B
    pp - rank; interleaved schedules their warm-up forwards plus one, in stage chunks (torch's own warm-up count);
    ZBVZeroBubble 1F1B's pp (the zero-bubble V keeps 1F1B's activation memory)."""
    if schedule == "GPipe":
        return m
    if schedule == "1F1B":
        return min(m, pp - rank)
    if schedule == "ZBVZeroBubble":
        return min(m, pp)
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    return min(warmup + 1, m * v) / v


def _built_rank(cfg, plan, world_size: int, pp_rank: int) -> dict:
    """What the dry run reads from pipeline rank pp_rank's stages, built over a fake process group."""
    dims = plan.dims
    dist.init_process_group("fake", store=fake_store(), rank=pp_rank * (world_size // dims.pp), world_size=world_size)
    try:
        meshes = dims.build_meshes("cpu", plan.model_args.moe)
        plain, nf4 = me.nf4_sizing_config(replace(cfg, float8=replace(cfg.float8, enable=False)))
        built = build_model(plain, plan.model_args, meshes)
        pbytes = dtype_bytes(cfg.training.mixed_precision_param)
        packed = me.packed_weights(built.model, cfg, pbytes) if nf4 else me.Packed()
        gathered = pbytes if dims.fsdp_size > 1 else 0  # a shard group of one rank gathers no NF4 weight
        return dict(
            state=me.sharded_state_bytes(built.model, me.optimizer_states(cfg), packed=packed),
            units=[n for stage in built.stages for n in me.unit_numels(stage, packed=packed, compute_bytes=gathered)],
            grad_units=[n for stage in built.stages for n in me.unit_numels(stage, trainable_only=True)],
            ac_blocks=built.ac_blocks,
            dequantized=me.dequantized_bytes(packed.largest, pbytes),
            setup=describe(built.num_sharded, meshes.world, dims, cfg.parallelism, len(built.stages)),
        )
    finally:
        dist.destroy_process_group()


def rank_memory(cfg, plan, world_size: int, pp_rank: int, split: list[range], built: dict) -> RankMemory:
    """Size pipeline rank pp_rank (split: every stage's blocks); built caches the builds by the shape of a rank's
    stages (ranks whose stages hold as many blocks of each kind, with or without the ends, hold the same state)."""
    dims, args, t, p = plan.dims, plan.model_args, cfg.training, cfg.parallelism
    ids = rank_stages(pp_rank, dims.pp, stages_per_rank(p), p.pipeline_parallel_schedule)
    last = len(split) - 1 in ids
    # the blocks' kinds too: a dense block among MoE ones (dense_layers) holds other weights
    key = (tuple(tuple(args.is_moe_layer(b) for b in split[i]) for i in ids), 0 in ids, last)
    if key not in built:
        built[key] = _built_rank(cfg, plan, world_size, pp_rank)
    b = built[key]
    state, units, grad_units, ac_blocks, setup = b["state"], b["units"], b["grad_units"], b["ac_blocks"], b["setup"]
    blocks = [block for i in ids for block in split[i]]
    pbytes, rbytes = dtype_bytes(t.mixed_precision_param), dtype_bytes(t.mixed_precision_reduce)
    gathered_params = sum(units) if p.fsdp_reshard_after_forward in ("default", "never") else 2 * max(units)
    gathered = gathered_params * pbytes + sum(grad_units) * rbytes if dims.fsdp_size > 1 else sum(grad_units) * rbytes
    m = pipeline_microbatches(p, t.local_batch_size)
    tokens = t.local_batch_size // m * t.seq_len // dims.cp  # one pipeline microbatch
    ac = cfg.activation_checkpoint
    op_sac = ac.mode == "selective" and ac.selective_ac_option == "op"
    measured = layer_bytes_for(cfg, plan)  # (a transformers backend model's layers)
    kept, rebuilt = me.block_bytes(
        args, tokens, pbytes, ac_blocks, op_sac, ac.selective_op_policy, dims.tp, p.enable_sequence_parallel,
        dims.ep, cfg.lora.enable, dims.cp, measured,
    )  # fmt: skip
    flight = in_flight(p.pipeline_parallel_schedule, dims.pp, pp_rank, m, stages_per_rank(p))
    activations = flight * sum(kept[b] for b in blocks) + max(rebuilt[b] for b in blocks)
    if last:  # the final norm's and the loss's share, for the microbatch whose loss is computed
        parts = me.activation_bytes(
            args, tokens, pbytes, ac_blocks, op_sac, compiled_loss=compiled_loss(cfg, dims.tp),
            op_policy=ac.selective_op_policy, loss_chunk_tokens=chunked_loss_tokens(cfg, dims.tp), tp=dims.tp,
            sequence_parallel=p.enable_sequence_parallel, loss_parallel=dims.tp > 1 and p.enable_loss_parallel,
            layer_bytes=measured,
        )  # fmt: skip
        activations += parts["final norm"] + parts["loss or recompute"]
    activations += b["dequantized"]  # QLoRA: a linear's dequantized weight in backward
    return RankMemory(pp_rank, ids, state.params, state.grads, state.optimizer, gathered, int(activations),
                      flight, [len(b) for b in split], setup)  # fmt: skip


def pipeline_report(cfg, plan, world_size: int, where: str, gpu_mem_gib: float, usable_gib: float):
    """The dry run's report under pipeline parallelism (lines, fits): one row per pipeline rank."""
    dims, args, t, p = plan.dims, plan.model_args, cfg.training, cfg.parallelism
    with torch.device("meta"):
        split = stage_blocks(p, part_sizes(model_class(args.family)(args)))
    built: dict = {}
    ranks = [rank_memory(cfg, plan, world_size, r, split, built) for r in range(dims.pp)]
    m, v = pipeline_microbatches(p, t.local_batch_size), stages_per_rank(p)
    bubble = bubble_fraction(p.pipeline_parallel_schedule, dims.pp, m, v)
    worst = max(ranks, key=lambda r: r.total)
    fits = worst.total / GIB <= usable_gib
    split = ", ".join(map(str, ranks[0].split))
    lines = [
        f"titanlite dry run: {cfg.job.config_file or 'defaults'}",
        f"world: {world_size} ranks = {where}; no GPU and no real process group used",
        *ranks[0].setup,
        f"model: {model_label(cfg.model, args)}, {args.param_counts()['total'] / 1e9:.2f}B parameters, "
        f"{args.n_layers} blocks in {dims.pp * v} stages of {split} (by parameters)",
        f"pipeline: {p.pipeline_parallel_schedule}, {dims.pp} ranks x {v} stage(s), {m} microbatches of "
        f"{t.local_batch_size // m} x {t.seq_len} tokens per local batch, {plan.grad_accum} local batch(es) per "
        f"step; bubble {bubble:.1%} in theory ((pp - 1) / (stages per rank x microbatches + pp - 1))",
        "",
        "memory per pipeline rank (GiB)   params  grads  optim  gathered  activations (in flight)   total",
    ]
    for r in ranks:
        lines.append(
            f"  rank {r.pp_rank:<3} stages {','.join(map(str, r.stages)):<8} {r.params / GIB:7.2f} "
            f"{r.grads / GIB:6.2f} {r.optimizer / GIB:6.2f} {r.gathered / GIB:9.2f} {r.activations / GIB:12.2f} "
            f"({r.in_flight:g}){'':<4}{r.total / GIB:8.2f}"
        )
    lines += [
        "  gathered: the stages' parameters (held over the local batch's microbatches) and unsharded gradients",
        f"  GPU memory    {gpu_mem_gib:.2f} GiB, {usable_gib:.2f} usable",
        f"fits: {'yes' if fits else 'no'} (pipeline rank {worst.pp_rank}: {worst.total / GIB:.2f} of "
        f"{usable_gib:.2f} GiB usable)",
    ]
    return lines, fits
