"""The parts of a checkpoint, each a `Stateful` that DCP saves and restores under its own top-level key.

model and optimizer are DTensor state dicts that DCP reshards to any topology; lr_scheduler,
dataloader and train_state are plain values that are the same on every rank (DCP stores them once).
"""

from __future__ import annotations

import random

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelPart(Stateful):
    """The model's parameters under their plain names; `dtype` casts floating tensors on save (export).

    trainable_only (LoRA): only what trains (the adapters) and the buffers; the frozen base is left to its own
    folder (checkpoint.initial_load_path), loaded before this part."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None, trainable_only: bool = False):
        self.model, self.dtype = model, dtype
        self.options = StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None

    def state_dict(self) -> dict:
        sd = get_model_state_dict(self.model, options=self.options)
        if self.dtype is not None:
            sd = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in sd.items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        set_model_state_dict(self.model, state_dict, options=self.options)


class OptimizerPart(Stateful):
    """The optimizer state keyed by parameter names (so it reshards with the model); with DiLoCo, the outer state too.

    `hyper` (per param group: betas, eps, weight decay of the run's config; Muon's own for its group) replaces the
    saved values on load: the config wins over the checkpoint for hyperparameters; the moments are the checkpoint's.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, hyper: list | None = None, outer=None):
        self.model, self.optimizer, self.hyper = model, optimizer, hyper or [{}] * len(optimizer.param_groups)
        self.outer = outer  # DiLoCo's outer state (parallel/ft/diloco.OuterOptimizer), kept under "diloco"

    def state_dict(self) -> dict:
        sd = get_optimizer_state_dict(self.model, self.optimizer)
        # Each group's parameters only: its settings are the run's on load (below), and a setting a later titanlite
        # adds (Muon's have grown) would otherwise be a key that older checkpoints lack. Older checkpoints still load.
        sd["param_groups"] = [{"params": group["params"]} for group in sd["param_groups"]]
        if self.outer is not None and self.outer.in_checkpoint:
            sd["diloco"] = self.outer.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        outer = state_dict.pop("diloco", None)
        if outer is not None:
            self.outer.load_state_dict(outer)
        lrs = [group["lr"] for group in self.optimizer.param_groups]  # the schedule's (SchedulerPart), not saved ones
        # DCP keeps one rank's param groups: under pipeline parallelism they name one stage's parameters, and the
        # other ranks' groups come back holding nothing but their parameters (no fused, foreach, initial_lr...).
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        # The run's settings win over the checkpoint's, before torch's load (which reads `fused` and `capturable`
        # there to place each "step") and after it: a group that came back with parameters only gets the optimizer's
        # defaults (fused None: a resumed GPU run would step with foreach, not fused, and not resume exactly).
        for saved, before in zip(state_dict.get("param_groups", []), settings):
            saved.update(before)
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
        for group, lr, before, hyper in zip(self.optimizer.param_groups, lrs, settings, self.hyper):
            group.update(before)
            group.update(hyper, lr=lr)


class SchedulerPart(Stateful):
    """The LR schedule's position and plan.

    On load the config wins: the peak lr is the run's optimizer.lr, and when the run's training.steps or
    [lr_scheduler] differ from the checkpoint's, the schedule is re-planned from the loaded step so that
    the lr goes on from where it was (titanlite.optim.LRSchedule). `replanned` then holds (old plan,
    new plan, step). The optimizer's lr follows, also when no optimizer state is loaded.
    """

    def __init__(self, lr_scheduler, optimizer: torch.optim.Optimizer, peak_lrs: list[float] | None = None):
        self.lr_scheduler, self.optimizer, self.peak_lrs = lr_scheduler, optimizer, peak_lrs
        self.replanned = None

    def state_dict(self) -> dict:
        sd = self.lr_scheduler.state_dict()
        # every param group follows the one schedule (build_lr_scheduler): saved once, whatever the groups (Muon has
        # two), so that a checkpoint resumes with another optimizer's groups (its state left out)
        sd["lr_lambdas"] = sd["lr_lambdas"][:1]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        schedule = self.lr_scheduler.lr_lambdas[0]
        wanted = schedule.plan() if hasattr(schedule, "plan") else None
        self.lr_scheduler.load_state_dict(state_dict)
        step = self.lr_scheduler.last_epoch
        if wanted is not None and schedule.plan() != wanted:
            self.replanned = (schedule.plan(), wanted, step)
            schedule.replan(step, *wanted)
        if self.peak_lrs is not None:  # one per param group
            self.lr_scheduler.base_lrs = list(self.peak_lrs)
        lrs = [base * fn(step) for base, fn in zip(self.lr_scheduler.base_lrs, self.lr_scheduler.lr_lambdas)]
        self.lr_scheduler._last_lr = lrs
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr


class TrainStatePart(Stateful):
    """Step, tokens seen, the RNG states and the precomputed DPO reference tables of `owner` (run_state.RunState, or
    any object with int attributes step and tokens_seen).

    Every rank has the same seed and draws no rank-specific random numbers, so these values are global.
    """

    def __init__(self, owner, device: torch.device):
        self.owner, self.device = owner, device
        self.tables_saved: set[str] | None = None  # while loading: the reference tables the checkpoint holds

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
            **{f"reference_logps.{k}": t for k, t in self._tables().items()},
        }

    def _tables(self) -> dict:
        tables = getattr(self.owner, "reference_logps", {})
        return {k: t for k, t in tables.items() if self.tables_saved is None or k in self.tables_saved}

    def load_state_dict(self, state_dict: dict) -> None:
        self.owner.step = int(state_dict["step"])
        self.owner.tokens_seen = int(state_dict["tokens_seen"])
        torch.set_rng_state(torch.frombuffer(bytearray(state_dict["rng_cpu"]), dtype=torch.uint8))
        device_mod = self._device_rng()
        if device_mod and state_dict["rng_device"] and state_dict["rng_device_type"] == self.device.type:
            device_mod.set_rng_state(torch.frombuffer(bytearray(state_dict["rng_device"]), dtype=torch.uint8))
        random.setstate(state_dict["rng_python"])
        for key in self._tables():
            self.owner.reference_logps[key] = state_dict[f"reference_logps.{key}"]
