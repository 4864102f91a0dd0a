"""The start-up summary: world, parameter counts in total and on this rank, and this rank's state memory."""

from __future__ import annotations

import os

from torch import nn

from titanlite.dtypes import dtype_bytes
from titanlite.models.nf4 import local_nf4
from titanlite.models.registry import model_label
from titanlite.observe.metrics import job_label
from titanlite.sizing.flops import flops_per_token, param_counts
from titanlite.sizing.memory import Packed, nf4_bits, optimizer_state_text, optimizer_states, sharded_state_bytes


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def degenerate_run_warnings(cfg, device_type: str, dataloader) -> list[str]:
    """Warnings for settings that train, but not as meant: too little data, endless warmup, fp16 on a CPU."""
    out, t = [], cfg.training
    global_batch = dataloader.global_batch_size  # resolved by the plan (training.global_batch_size may be -1)
    batch_tokens = global_batch * (t.seq_len + 1)
    epoch_tokens = getattr(getattr(dataloader, "loader", dataloader), "tokens_per_epoch", lambda: None)()
    if epoch_tokens is not None and epoch_tokens < batch_tokens:
        out.append(
            f"training.dataset holds {epoch_tokens:,} tokens, fewer than one global batch "
            f"(training.global_batch_size {global_batch} x (training.seq_len {t.seq_len} + 1) = "
            f"{batch_tokens:,}): every step trains on the same tokens again and the loss will fall towards 0 "
            f"without learning anything general; use more data, or a smaller batch or seq_len"
        )
    if cfg.lr_scheduler.warmup_steps >= t.steps:
        out.append(
            f"lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} >= training.steps = {t.steps}: the "
            f"lr never reaches optimizer.lr = {cfg.optimizer.lr} (it ends at "
            f"{t.steps / (cfg.lr_scheduler.warmup_steps + 1):.0%} of it); use fewer warmup steps"
        )
    if device_type == "cpu" and t.mixed_precision_param == "float16":
        out.append(
            "training.mixed_precision_param = 'float16' on a CPU: CPUs have no fast float16 matmuls, so this "
            "is about 10x slower than float32; use float32 on CPUs (bfloat16 or float16 on GPUs)"
        )
    return out


def trained_adapters(model: nn.Module, cfg) -> int | None:
    """With LoRA the adapters' parameter count (whole, not this rank's shards); None without."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad) if cfg.lora.enable else None


def nf4_weights(model: nn.Module, cfg) -> Packed:
    """A QLoRA model's NF4 weights, for the state's bytes (their element size would count them unpacked)."""
    ids = frozenset(id(p) for p in model.parameters() if local_nf4(p) is not None)
    lora = cfg.lora
    bits = nf4_bits(lora.nf4_block_size, lora.nf4_scaler_block_size, dtype_bytes(cfg.training.mixed_precision_param))
    return Packed(ids, bits)


def startup_lines(model: nn.Module, model_args, dims, cfg) -> list[str]:
    """Log lines describing the world, the model's size in total and on this rank, and this rank's state memory."""
    counts = param_counts(model_args)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    mem = sharded_state_bytes(model, optimizer_states(cfg), packed=nf4_weights(model, cfg))
    adapters = trained_adapters(model, cfg)
    fpt = flops_per_token(model_args, cfg.training.seq_len, adapters)
    job = cfg.job.config_file or "no config file (defaults)"
    moe = []
    if model_args.moe:
        a, lb = model_args, cfg.moe.load_balance
        moe = [
            f"MoE: {a.n_experts} experts, top-{a.top_k}, {dims.describe_ep(a.n_experts)}; {counts['active']:,} "
            f"active parameters per token; load balance {lb}"
        ]
    lora, flops_rule = [], "6 x non-embedding"
    if adapters is not None:
        lo = cfg.lora
        lora = [
            f"LoRA: rank {lo.rank}, alpha {lo.alpha:g}, targets {', '.join(lo.targets)}: {adapters:,} adapter "
            f"parameters ({adapters / counts['total']:.2%} of the model) train; the base is frozen in {lo.base_dtype}"
        ]
        flops_rule = f"6 x {adapters:,} adapter parameters + 4 x frozen non-embedding"
    return [
        f"Job: {job}" + (f": {cfg.job.description}" if cfg.job.description else ""),
        f"World size {dims.world_size}{_nodes(dims.world_size)}: data-parallel degree {dims.dp_degree} "
        f"(replicate {dims.dp_replicate} x shard {dims.dp_shard})"
        + (f" x tensor parallel {dims.tp}" if dims.tp > 1 else "")
        + (f" x pipeline parallel {dims.pp}" if getattr(dims, "pp", 1) > 1 else ""),
        f"Model {model_label(cfg.model, model_args)}: {counts['total']:,} parameters "
        f"({counts['non_embedding']:,} non-embedding), {local:,} on this rank (its shards)",
        f"Per-rank memory estimate: parameters {human_bytes(mem.params)} + gradients "
        f"{human_bytes(mem.grads)} + optimizer {human_bytes(mem.optimizer)} ({optimizer_state_text(cfg)}) = "
        f"{human_bytes(mem.params + mem.grads + mem.optimizer)}, plus activations and "
        f"gathered blocks",
        *moe,
        *lora,
        f"FLOPs per token: {fpt:.4g} ({flops_rule} {'active ' if model_args.moe else ''}parameters + 12 x "
        f"layers x heads x head_dim x seq_len {cfg.training.seq_len})",
    ]


def _nodes(world: int) -> str:
    """' (2 nodes x 8 processes)' when torchrun started the job on several nodes, else ''; under SLURM with the
    job's id (' (2 nodes x 8 processes, slurm-1234)')."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    processes = f"{per_node} process" + ("es" if per_node > 1 else "")
    parts = [f"{world // per_node} nodes x {processes}"] if 0 < per_node < world else []
    parts += [label] if (label := job_label()) else []
    return f" ({', '.join(parts)})" if parts else ""
