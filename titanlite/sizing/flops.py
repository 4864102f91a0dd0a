"""Model FLOPs per token (from the shape alone) and the peak FLOP/s of known accelerators. No torch.

Convention (TorchTitan's, with one stated difference for tied embeddings):

    flops_per_token = 6 * N + 12 * n_layers * n_heads * head_dim * seq_len

N counts every parameter except the token-embedding table (a lookup, not a matmul); of a Mixture of Experts only
the active ones, the top_k experts a token is computed with (not every expert: TorchTitan #4300); the output
projection is counted, also when it shares its weight with the embedding (TorchTitan subtracts the
shared table then, missing the output matmul). 6 = 2 (multiply-add) x 3 (forward + backward
needing twice the forward). The second term is the attention score and value matmuls (QK^T and
PV: 2 matmuls x 2 FLOPs x 3 passes = 12), counted over the full seq_len as if not causal.

With LoRA the frozen base's weights get no gradient: its matmuls cost forward + the input's gradient, 4 * N, and the
adapters' A adapters parameters the full 6 each: 4 * N + 6 * A + the attention term.
"""

from __future__ import annotations

from titanlite.models.args import ModelArgs


def param_counts(args: ModelArgs) -> dict[str, int]:
    """Parameter counts of a model: total (a tied weight once), embedding, non_embedding."""
    return args.param_counts()


def flops_per_token(args: ModelArgs, seq_len: int, adapters: int | None = None) -> int:
    """Training FLOPs (forward + backward) per token at this sequence length; with `adapters` (LoRA: the adapters'
    parameter count) the base is frozen. See the module doc."""
    full = args.flops_per_token(seq_len)
    if adapters is None:
        return full
    base = args.param_counts()["active_non_embedding"]
    return full - 2 * base + 6 * adapters


# Dense bf16 tensor-core peak FLOP/s per device (vendor data sheets, no sparsity). Matched in order
# against the device name as torch.cuda.get_device_name() reports it, so the specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("GH200", 989e12),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("MI355X", 2.5e15),
    ("MI325X", 1307e12),
    ("MI300X", 1307e12),
    ("MI250X", 191.5e12),  # per GCD: each shows as one device
)


def peak_flops(device_name: str | None, override: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: the override when > 0, else from the table by name; None if unknown."""
    if override > 0:
        return override
    if not device_name:
        return None
    for key, value in PEAK_BF16_FLOPS:
        if key in device_name:
            return value
    return None
