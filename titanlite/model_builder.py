"""The one place that builds a model for a plan: on the meta device, then tensor parallelism, activation
checkpointing, compile and FSDP, in that order (training); or sharded for inference with every block
resharded (tensor parallel without sequence or loss parallelism)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanlite.config import JobConfig
from titanlite.dtypes import TORCH_DTYPES
from titanlite.loss import training_loss
from titanlite.models.lora import apply_lora
from titanlite.models.nf4 import quantize_base
from titanlite.models.registry import model_class
from titanlite.models.stage import keep_only, part_sizes, stage_module
from titanlite.parallel.ac import apply_ac
from titanlite.parallel.compile import apply_compile
from titanlite.parallel.cp import apply_cp
from titanlite.parallel.dims import Meshes
from titanlite.parallel.ep import apply_ep
from titanlite.parallel.float8 import apply_float8
from titanlite.parallel.fsdp import apply_fsdp
from titanlite.parallel.pp import V_SHAPED, rank_stages, stage_blocks, stages_per_rank
from titanlite.parallel.tp import apply_tp


@dataclass
class BuiltModel:
    model: torch.nn.Module
    ac_blocks: list[int]  # indices of the activation-checkpointed blocks
    compiled: int  # blocks compiled
    num_sharded: int  # fully_shard units besides the root
    float8: int = 0  # linears converted to float8 training ([float8])
    stages: list[torch.nn.Module] | None = None  # pipeline parallelism: this rank's stage modules (models/stage.py)
    stage_ids: list[int] | None = None  # their stage indices
    stage_blocks: list[range] | None = None  # the blocks of every stage


def compiled_loss(cfg: JobConfig, tp: int = 1) -> bool:
    """Whether the training loss is torch.compile'd ([compile] with inductor): one fused kernel, not chunked.

    Never under tensor parallelism: a compiled cross-entropy of vocabulary-split logits (loss parallel) is
    wrong when inductor's cache is warm (torch 2.13), and the loss in chunks already splits over the vocabulary.
    Never under context parallelism: the model computes the loss of its own part of each sequence, whose labels only
    it knows (logits of this rank's tokens against the whole sequence's labels crashed at step 1).
    """
    cp = cfg.parallelism.context_parallel_degree
    return cfg.compile.enable and cfg.compile.backend == "inductor" and tp == 1 and cp == 1


def chunked_loss_tokens(cfg: JobConfig, tp: int = 1) -> int:
    """Tokens per chunk of the output projection and loss for this run (with tensor parallelism: over each
    rank's share of the vocabulary); 0 when the loss is not chunked (a compiled loss; [dpo] has none: its
    per-token log-probabilities stay chunked)."""
    return 0 if compiled_loss(cfg, tp) and not cfg.dpo.enable else cfg.training.loss_chunk_tokens


def lora_base_dtype(cfg: JobConfig) -> torch.dtype:
    """The dtype of a LoRA run's frozen base (with nf4: of the weights not quantized, and the one the 4-bit weights
    dequantize to)."""
    name = cfg.training.mixed_precision_param if cfg.lora.base_dtype == "nf4" else cfg.lora.base_dtype
    return TORCH_DTYPES[name]


def build_model(cfg: JobConfig, args, meshes: Meshes | None, *, inference: bool = False) -> BuiltModel:
    """The model of `cfg` with shape `args` on the meta device, parallelised over `meshes` (None: not sharded), for
    training or for inference (generation); see build_for_training and build_for_inference."""
    return (build_for_inference if inference else build_for_training)(cfg, args, meshes)


def build_for_training(cfg: JobConfig, args, meshes: Meshes | None) -> BuiltModel:
    """[float8] linears (parallel/float8.py), tensor parallelism (a "tp" mesh dimension: torchao's float8 styles for
    tensorwise float8 linears), [lora] adapters (models/lora.py: the base frozen, in 4 bits with nf4), expert
    parallelism (an MoE model's experts over the expert mesh's "ep" ranks), context parallelism,
    [activation_checkpoint], [compile], this rank's pipeline stages, and FSDP with the configured reshard policy on the
    data-parallel sub-mesh (the experts on the expert mesh), in that order."""
    model, tp_mesh = _on_meta(cfg, args), meshes.tp if meshes is not None else None
    tp = 1 if tp_mesh is None else tp_mesh.size()
    float8 = apply_float8(model, cfg.float8, tp) if cfg.float8.enable else 0  # before TP (its float8 styles)
    if tp_mesh is not None:
        p, tensorwise = cfg.parallelism, bool(float8) and cfg.float8.recipe == "tensorwise"
        apply_tp(model, tp_mesh, cfg.model.name, sequence_parallel=p.enable_sequence_parallel,
                 loss_parallel=p.enable_loss_parallel, inference=False, float8_tensorwise=tensorwise)  # fmt: skip
    if cfg.lora.enable:  # adapters follow the tensor-parallel split of their projections; the rest is frozen
        apply_lora(model, cfg.lora, base_dtype=lora_base_dtype(cfg))
        if cfg.lora.base_dtype == "nf4":  # QLoRA: FSDP then splits the 4-bit weights by rows
            quantize_base(model, cfg.lora.nf4_block_size, cfg.lora.nf4_scaler_block_size, lora_base_dtype(cfg))
    _experts(model, args, meshes, cfg.moe.load_balance, tp)
    apply_cp(model, meshes)  # each rank computes its chunks of every sequence
    model.loss_chunk_tokens = chunked_loss_tokens(cfg, tp)
    model.output.per_token = cfg.dpo.enable  # [dpo]: each token's log-probability, in chunks (not a summed loss)
    built = BuiltModel(model, apply_ac(model, cfg.activation_checkpoint), apply_compile(model, cfg.compile), 0, float8)
    units, reshard = [model], cfg.parallelism.fsdp_reshard_after_forward  # the FSDP roots: the model, or its stages
    if meshes is not None and meshes.pp is not None:
        units = _split_stages(cfg, model, meshes.pp, built, tp_mesh)
        # A stage runs forward over every pipeline microbatch before their backwards: gathering its parameters once
        # per local batch, not once per microbatch (and a zero-bubble schedule's weight backward needs them).
        reshard = "never" if reshard == "default" else reshard
    built.num_sharded = _shard(cfg, units, meshes, reshard, cfg.training.enable_cpu_offload)
    return built


def build_for_inference(cfg: JobConfig, args, meshes: Meshes | None) -> BuiltModel:
    """Tensor parallelism without sequence or loss parallelism, the adapters (unmerged, in the base's dtype), an MoE's
    experts with no load balancing, and FSDP resharding every block after its forward."""
    model, tp_mesh = _on_meta(cfg, args), meshes.tp if meshes is not None else None
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, cfg.model.name, sequence_parallel=False, loss_parallel=False, inference=True,
                 float8_tensorwise=False)  # fmt: skip
    if cfg.lora.enable:
        apply_lora(model, cfg.lora, base_dtype=None)
    _experts(model, args, meshes, "none", 1 if tp_mesh is None else tp_mesh.size())
    return BuiltModel(model, [], 0, _shard(cfg, [model], meshes, "always", cpu_offload=False))


def _on_meta(cfg: JobConfig, args) -> torch.nn.Module:
    with torch.device("meta"):
        return model_class(args.family)(args)


def _experts(model, args, meshes: Meshes | None, load_balance: str, tp: int) -> None:
    """An MoE's load balancing, and its experts split over the expert mesh (expert parallelism)."""
    if args.moe:
        model.set_load_balance(load_balance)
        if meshes is not None:
            apply_ep(model, meshes.expert, tp=tp)


def _shard(cfg: JobConfig, units: list, meshes: Meshes | None, reshard: str, cpu_offload: bool) -> int:
    """fully_shard of each unit's blocks and itself on the data-parallel mesh (none without meshes); how many units
    besides the roots."""
    if meshes is None:
        return 0
    t = cfg.training
    return sum(
        apply_fsdp(
            unit,
            meshes.data_parallel,
            param_dtype=t.mixed_precision_param,
            reduce_dtype=t.mixed_precision_reduce,
            reshard_after_forward=reshard,
            cpu_offload=cpu_offload,
            expert_mesh=meshes.expert,
        )  # fmt: skip
        for unit in units
    )


def _split_stages(cfg: JobConfig, model, pp_mesh, built: BuiltModel, tp_mesh) -> list[torch.nn.Module]:
    """This rank's pipeline stage modules (parallel/pp.py); the rest of the model is dropped before it is allocated."""
    p = cfg.parallelism
    blocks = stage_blocks(p, part_sizes(model))
    ids = rank_stages(pp_mesh.get_local_rank(), pp_mesh.size(), stages_per_rank(p), p.pipeline_parallel_schedule)
    last = len(blocks) - 1
    keep_only(model, {b for i in ids for b in blocks[i]}, 0 in ids, last in ids)
    loss_fn = training_loss(compiled_loss(cfg, 1 if tp_mesh is None else tp_mesh.size()))
    split = p.pipeline_parallel_schedule in V_SHAPED  # zero-bubble: backward in input and weight parts
    built.stages = [stage_module(model, blocks[i], i == 0, i == last, loss_fn, split) for i in ids]
    built.stage_ids, built.stage_blocks = ids, blocks
    return built.stages
