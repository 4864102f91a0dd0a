"""The [lora] section: low-rank adapters on a frozen base model (docs/lora.md). No torch here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from titanlite.config.fields import POSITIVE, fraction, one_of, positive, setting

# The projections an adapter can sit on, by the role names HF and peft use in every family (the multi-head latent
# attention of DeepSeek-V3 has q_a_proj, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj).
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "experts.gate_up_proj",  # an MoE's experts (peft's target_parameters on transformers 5's fused expert tensors)
    "experts.down_proj",
)
BASE_DTYPES = ("float32", "bfloat16", "nf4")
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")


@dataclass
class Lora:
    enable: bool = setting(
        False,
        "train low-rank adapters on a frozen base (checkpoint.initial_load_path) instead of the full weights",
    )
    rank: int = setting(16, "rank r of each adapter (A: r x in, B: out x r)", positive, POSITIVE)
    alpha: float = setting(
        32.0, "scale of each adapter's output: alpha / rank, or alpha / sqrt(rank) with use_rslora (peft's lora_alpha)",
        positive, POSITIVE,
    )  # fmt: skip
    use_rslora: bool = setting(
        False, "rank-stabilised LoRA: scale by alpha / sqrt(rank), so higher ranks keep learning (peft's use_rslora)"
    )
    dropout: float = setting(
        0.0, "dropout on an adapter's input in training (peft's lora_dropout)", fraction, "0 <= p < 1"
    )
    targets: list[str] = setting(
        ["all"],
        "projections that get adapters: any of " + ", ".join(LORA_TARGETS) + "; 'all' = every one the model has "
        "as a dense projection (peft's all-linear: an MoE family's attention); experts.* = every expert of an MoE; "
        "a transformers-backend model: the names of its decoder layers' linears (in_proj_qkv, gate_up_proj, ...)",
        lambda v: bool(v) and (v == ["all"] or all(isinstance(t, str) and MODULE_NAME.fullmatch(t) for t in v)),
        "'all' or a non-empty list of module names: " + ", ".join(LORA_TARGETS) + " (the native families), or a "
        "transformers-backend model's linears",
    )
    base_dtype: str = setting(
        "float32",
        "dtype the frozen base weights are kept in: float32, bfloat16 (half the memory, no fp32 copy; needs "
        "training.mixed_precision_param = bfloat16), or nf4 (QLoRA: the blocks' linears in 4 bits through torchao, "
        "the rest of the base in training.mixed_precision_param); adapters and their optimizer state stay float32",
        one_of(*BASE_DTYPES),
        " or ".join(BASE_DTYPES),
    )
    nf4_block_size: int = setting(
        64,
        "nf4: weights per quantization block at most (one scale each; QLoRA's 64; each weight gets the largest "
        "even size up to it that its shape allows)",
        positive,
        POSITIVE,
    )
    nf4_scaler_block_size: int = setting(
        256,
        "nf4: block scales per second-level block at most (double quantization; QLoRA's 256; each weight gets "
        "the largest its shape and FSDP's split by rows allow)",
        positive,
        POSITIVE,
    )
    initial_adapter_path: str = setting(
        "",
        "a PEFT adapter folder (adapter_config.json + adapter_model.safetensors; local or an s3:// URL) to start "
        "the adapters from; "
        "'' = new adapters (A random, B zero); unused when resuming",
    )
