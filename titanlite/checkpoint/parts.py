"""The parts of a checkpoint, each a `Stateful` that DCP saves and restores under its own top-level key.

model and optimizer are DTensor state dicts that DCP reshards to any topology; lr_scheduler,
dataloader and train_state are plain values that are the same on every rank (DCP stores them once).
"""

from __future__ import annotations

import random

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelPart(Stateful):
    """The model's parameters under their plain names; `dtype` casts floating tensors on save (export)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype

    def state_dict(self) -> dict:
        sd = get_model_state_dict(self.model)
        if self.dtype is not None:
            sd = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in sd.items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerPart(Stateful):
    """The optimizer state keyed by parameter names (so it reshards with the model)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class SchedulerPart(Stateful):
    """The LR schedule's position; on load the optimizer's lr follows it (also when no optimizer state is loaded)."""

    def __init__(self, lr_scheduler, optimizer: torch.optim.Optimizer):
        self.lr_scheduler, self.optimizer = lr_scheduler, optimizer

    def state_dict(self) -> dict:
        return self.lr_scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.lr_scheduler.load_state_dict(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
            group["lr"] = lr


class TrainStatePart(Stateful):
    """Step, tokens seen and the RNG states of `owner` (any object with int attributes step and tokens_seen).

    Every rank has the same seed and draws no rank-specific random numbers, so these values are global.
    """

    def __init__(self, owner, device: torch.device):
        self.owner, self.device = owner, device

    def _device_rng(self):
        return getattr(torch, self.device.type) if self.device.type != "cpu" else None

    def state_dict(self) -> dict:
        device_mod = self._device_rng()
        return {
            "step": self.owner.step,
            "tokens_seen": self.owner.tokens_seen,
            "rng_cpu": torch.get_rng_state().numpy().tobytes(),
            "rng_device_type": self.device.type,
            "rng_device": device_mod.get_rng_state().numpy().tobytes() if device_mod else b"",
            "rng_python": random.getstate(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.owner.step = int(state_dict["step"])
        self.owner.tokens_seen = int(state_dict["tokens_seen"])
        torch.set_rng_state(torch.frombuffer(bytearray(state_dict["rng_cpu"]), dtype=torch.uint8))
        device_mod = self._device_rng()
        if device_mod and state_dict["rng_device"] and state_dict["rng_device_type"] == self.device.type:
            device_mod.set_rng_state(torch.frombuffer(bytearray(state_dict["rng_device"]), dtype=torch.uint8))
        random.setstate(state_dict["rng_python"])
