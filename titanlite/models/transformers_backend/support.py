"""What the transformers backend does not run yet, refused before launch in one line each that says where it runs
(the native families) or what to change."""

from __future__ import annotations

from titanlite.models.family import BACKEND
from titanlite.models.transformers_backend.tp import unsupported_style

NATIVE = "the native families (llama3, qwen3, qwen2, mistral, qwen3_moe, mixtral, deepseek_v3, glm4_moe, gpt_oss)"

# (degree name on dims, config key, what it is)
PARALLEL = (
    ("tp", "parallelism.tensor_parallel_degree", "tensor parallelism"),
    ("cp", "parallelism.context_parallel_degree", "context parallelism"),
    ("pp", "parallelism.pipeline_parallel_degree", "pipeline parallelism"),
    ("ep", "parallelism.expert_parallel_degree", "expert parallelism"),
)


def problem(cfg, dims, args, inference: bool = False) -> str | None:
    """Why the transformers backend cannot run this config (inference: sample from it), or None."""
    model = f"model.name = {BACKEND!r} ({args.model_type})"
    for attr, key, what in PARALLEL:
        degree = getattr(dims, attr, 1)
        if degree > 1 and attr == "tp" and args.tp_plan:
            if why := _tp_problem(cfg, args, inference):
                return f"{key} = {degree}: {what} of {model} follows its config's base_model_tp_plan, {why}"
            continue
        if degree > 1 and attr == "pp" and not inference:
            if why := _pp_problem(cfg, args):
                return f"{key} = {degree}: {what} of {model} {why}"
            continue
        if degree > 1:
            return (
                f"{key} = {degree}: {what} is not available for {model}; it is in {NATIVE}; the backend shards with "
                "FSDP or HSDP (data_parallel_shard_degree, data_parallel_replicate_degree)"
            )
    if inference:
        return None
    switches = (
        (cfg.float8.enable, "float8.enable = true"),
        (cfg.optimizer.name == "muon", "optimizer.name = 'muon'"),
        (cfg.fault_tolerance.enable, "fault_tolerance.enable = true"),
    )
    for on, setting in switches:
        if on:
            return f"{setting} is not available for {model} yet; it is in {NATIVE}"
    if cfg.model.attention == "block_causal" and (kind := args.state_layers):
        return (
            f"model.attention = 'block_causal': {args.model_type}'s {kind} layers carry their state from one packed "
            "document into the next, which transformers' PyTorch path cannot cut at document boundaries; use "
            "model.attention = 'causal'"
        )
    if cfg.model.attention == "block_causal" and args.hf_config.get("index_topk"):
        return (
            f"model.attention = 'block_causal': {args.model_type}'s sparse attention indexer chooses its keys across "
            "the packed documents of a row (index_topk), so a packed row is not each document alone; use "
            "model.attention = 'causal'"
        )
    return None


PP_PARTS = ("embed_tokens", "layers", "norm")  # the base_model_pp_plan entries a stage is cut by (stage.py)


def _pp_problem(cfg, args) -> str | None:
    """Why the backend cannot cut this model into pipeline stages, or None."""
    if missing := [part for part in PP_PARTS if part not in args.pp_plan]:
        return (
            f"follows its config's base_model_pp_plan, which lacks {', '.join(missing)} (it has "
            f"{', '.join(args.pp_plan) or 'none'}): the backend cuts stages by those entries; pipeline parallelism is "
            f"in {NATIVE}"
        )
    parts = ("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")
    if outside := sorted(n for n in args.parameter_shapes() if not n.startswith(parts)):
        return (
            f"cannot cut it into stages: its parameters {', '.join(outside[:3])} are outside the embedding, the "
            f"decoder layers and the final norm that its base_model_pp_plan names; pipeline parallelism is in {NATIVE}"
        )
    if cfg.checkpoint.last_save_in_hf:
        return (
            "writes no HF folder at the end (each pipeline rank holds part of the model); set "
            "checkpoint.last_save_in_hf = false and export the last checkpoint: python -m titanlite.checkpoint export "
            "--format hf"
        )
    return None


def _tp_problem(cfg, args, inference: bool) -> str | None:
    """Why the backend cannot split this model over tp by its base_model_tp_plan (tp.py), or None."""
    if style := unsupported_style(args.tp_plan):
        return (
            f"whose entry {style} the backend does not apply (it applies colwise, rowwise, colwise_gather_output, "
            f"rowwise_split_input, mla_kv_a_proj and the q/k norms' replicated_with_grad_allreduce); tensor "
            f"parallelism of other layouts is in the native families: {NATIVE}"
        )
    if cfg.parallelism.enable_sequence_parallel and not inference:
        return (
            "which has no sequence parallelism (transformers' layers add their residuals on whole tensors); set "
            "parallelism.enable_sequence_parallel = false"
        )
    return None
