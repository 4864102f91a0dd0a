"""Tensor parallelism: the family's plan (models/<family>/) applied over the "tp" mesh, before AC, compile and FSDP."""

from __future__ import annotations

import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.models.registry import tp_plan


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    family: str,
    sequence_parallel: bool,
    loss_parallel: bool,
    inference: bool = False,
):
    """Tensor parallelism over tp_mesh by the family's plan (models/<family>/); call before AC, compile and FSDP."""
    tp_plan(family)(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, inference=inference
    )
    # The split embedding returns a view; FSDP warns that an in-place op on it would skip its backward hook. The
    # decoder adds to the residual stream out of place, so the warning would only alarm.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")
