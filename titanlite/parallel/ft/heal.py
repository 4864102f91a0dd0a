"""Healing a restarted replica group (fault tolerance, docs/fault_tolerance.md): what rank r of a live group sends to
rank r of the group that heals, through torchft, and how it is taken.

It is what a checkpoint of the run holds, as this rank's local shards: the model's tensors (every parameter and
persistent buffer, an MoE's expert shards and routing bias included; with LoRA the adapters and the buffers, the
frozen base being loaded from checkpoint.initial_load_path by every group and compared by the weights fingerprint),
the optimizer state, the lr schedule, the data position, the step and the token count. Both ranks hold the same
layout (the groups' settings are compared first), so a shard goes where the same shard was.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from titanlite.config.compare import describe_difference
from titanlite.errors import ConfigError
from titanlite.run_state import RunState


def local(t):
    """A tensor's local shard (itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def healed_names(model: torch.nn.Module, lora: bool) -> set[str]:
    """The names of the model's state-dict entries that healing sends: all of them, or with LoRA those a LoRA
    checkpoint holds (what trains, and the buffers)."""
    names = set(model.state_dict())
    if not lora:
        return names
    kept = {n for n, p in model.named_parameters() if p.requires_grad} | {n for n, _ in model.named_buffers()}
    return names & kept


def peer_state(state: RunState, settings: dict[str, str], names: set[str]) -> dict:
    """What this rank sends to the same rank of a group that heals: its part of the run state."""
    opt = state.optimizer.state_dict()
    return {
        "model": {k: local(v) for k, v in state.model.state_dict().items() if k in names},
        "optimizer": {
            "state": {i: {k: local(v) for k, v in s.items()} for i, s in opt["state"].items()},
            "param_groups": opt["param_groups"],
        },
        "lr_scheduler": state.lr_scheduler.state_dict(),
        "dataloader": state.dataloader.state_dict(),
        "step": state.step,
        "tokens_seen": state.tokens_seen,
        "settings": settings,
    }


def take_state(run: RunState, state: dict, settings: dict[str, str], names: set[str]) -> None:
    """Take a live peer's state (peer_state) into the run state; refused, naming the keys, when its shared settings
    differ: its tensors' shapes and meaning follow them."""
    peer = state.get("settings", {})
    if peer != settings:
        keys = sorted(k for k in settings.keys() | peer.keys() if settings.get(k) != peer.get(k))
        raise ConfigError(
            f"this group cannot heal from the live replica groups: they differ in "
            f"{describe_difference(settings, [k for k in keys if k in settings], peer)}; every group "
            "must run the same configuration (only the dump folder, checkpoint folder, logging and "
            "fault_tolerance.replica_id may differ)"
        )
    with torch.no_grad():
        for k, v in run.model.state_dict().items():
            if k in names:
                local(v).copy_(state["model"][k])
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    opt_state = {}
    for i, s in state["optimizer"]["state"].items():
        p = params[int(i)]
        opt_state[int(i)] = {k: _like(p, v) for k, v in s.items()}
    run.optimizer.load_state_dict({"state": opt_state, "param_groups": state["optimizer"]["param_groups"]})
    run.lr_scheduler.load_state_dict(state["lr_scheduler"])
    run.dataloader.load_state_dict(state["dataloader"])
    run.step, run.tokens_seen = int(state["step"]), int(state["tokens_seen"])


def _like(param, value):
    """An optimizer state tensor received as this rank's local shard, placed like `param`."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    shard = value.to(local(param).device)
    if isinstance(param, DTensor):
        return DTensor.from_local(shard, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)  # fmt: skip
    return shard
