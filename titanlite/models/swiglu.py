"""The experts' SwiGLU: silu(gate) * up, or gpt-oss's clamped variant with a backward that keeps its inputs only."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0, alpha: float = 1.702) -> torch.Tensor:
    """silu(gate) * up; with a limit, gpt-oss's clamped variant: gate <= limit, -limit <= up <= limit,
    (up + 1) * gate * sigmoid(alpha * gate)."""
    if not limit:
        return F.silu(gate) * up
    return _ClampedSwiGLU.apply(gate, up, limit, alpha)


def _clamped_swiglu(gate, up, limit: float, alpha: float):
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class _ClampedSwiGLU(torch.autograd.Function):
    """gpt-oss's clamped SwiGLU keeping its two inputs only for backward (autograd would keep seven tensors of the
    experts' hidden size: the clamps' inputs and outputs, the sigmoid and the products); backward is its closed form
    (d/dg of g * sigmoid(a g) = s (1 + a g (1 - s)))."""

    @staticmethod
    def forward(ctx, gate, up, limit: float, alpha: float):
        ctx.save_for_backward(gate, up)
        ctx.limit, ctx.alpha = limit, alpha
        return _clamped_swiglu(gate, up, limit, alpha)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        limit, alpha = ctx.limit, ctx.alpha
        g = gate.clamp(max=limit)
        sig = torch.sigmoid(alpha * g)
        d_up = (grad * g * sig).masked_fill_((up < -limit) | (up > limit), 0.0)  # clamp passes [-limit, limit]
        d_gate = grad * (up.clamp(min=-limit, max=limit) + 1) * sig * (1 + alpha * g * (1 - sig))
        return d_gate.masked_fill_(gate > limit, 0.0), d_up, None, None
