"""Optimizer, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from titanlite.muon import build_muon, muon_hyperparameters


def optimizer_hyperparameters(opt_cfg) -> list[dict]:
    """The [optimizer] values each param group holds besides lr (a resumed run applies them over the saved ones):
    one group, or Muon's two (its matrices, then AdamW's rest)."""
    adam = {"betas": (opt_cfg.beta1, opt_cfg.beta2), "eps": opt_cfg.eps, "weight_decay": opt_cfg.weight_decay}
    if opt_cfg.name.lower() != "muon":
        return [adam]
    return [{k: v for k, v in muon_hyperparameters(opt_cfg).items() if k != "lr"}, adam]


def peak_lrs(opt_cfg) -> list[float]:
    """Each param group's peak lr (the schedule multiplies them)."""
    if opt_cfg.name.lower() != "muon":
        return [opt_cfg.lr]
    return [muon_hyperparameters(opt_cfg)["lr"], opt_cfg.lr]


def build_optimizer(model: torch.nn.Module, opt_cfg) -> torch.optim.Optimizer:
    """AdamW (or Adam) over the model's trainable (sharded) parameters (with LoRA: the adapters only): the fused
    kernel when they are all on an accelerator, else the foreach (multi-tensor) implementation; or Muon over the
    blocks' weight matrices with that AdamW over the rest (titanlite.muon)."""
    name = opt_cfg.name.lower()
    params = [p for p in model.parameters() if p.requires_grad]
    on_accelerator = bool(params) and all(p.device.type not in ("cpu", "meta") for p in params)
    impl = {"fused": True} if on_accelerator else {"foreach": True}
    adam = {"lr": opt_cfg.lr, **impl, **optimizer_hyperparameters(opt_cfg)[-1]}
    if name == "muon":
        return build_muon(model, opt_cfg, adam)
    return {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[name](params, **adam)


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay_type: str, min_factor: float) -> float:
    """Multiplier of the peak lr for the optimizer step that follows `step` completed steps.

    Linear warmup over warmup_steps (never exactly 0), then linear or cosine decay from 1 to
    min_factor at total_steps, or constant.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_type == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * shape


class LRSchedule:
    """The lr factor for each step: lr_factor's warmup and decay; after a re-plan (a resumed run whose
    training.steps or [lr_scheduler] changed) a decay from the factor the old plan had reached to
    min_factor at the new last step, so the lr never jumps.

    LambdaLR saves and restores this object's attributes with its state.
    """

    def __init__(self, total_steps: int, warmup_steps: int, decay_type: str, min_factor: float):
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        self.decay_type, self.min_factor = decay_type, min_factor
        self.from_step, self.from_factor = -1, 1.0  # the re-plan point (-1: none)

    def plan(self) -> tuple:
        """What the schedule was configured with: (total steps, warmup steps, decay type, min factor)."""
        return self.total_steps, self.warmup_steps, self.decay_type, self.min_factor

    def __call__(self, step: int) -> float:
        if self.from_step < 0 or step < max(self.from_step, self.warmup_steps):
            return lr_factor(step, *self.plan())
        if self.decay_type == "constant":
            return self.from_factor
        progress = min(1.0, (step - self.from_step) / max(1, self.total_steps - self.from_step))
        shape = 1.0 - progress if self.decay_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_factor + (self.from_factor - self.min_factor) * shape

    def replan(self, step: int, total_steps: int, warmup_steps: int, decay_type: str, min_factor: float) -> None:
        """Go on from `step` with another plan, starting from the factor this one has at `step`."""
        factor = self(step)
        self.total_steps, self.warmup_steps, self.decay_type, self.min_factor = (
            total_steps,
            warmup_steps,
            decay_type,
            min_factor,
        )
        self.from_step, self.from_factor = step, factor


def build_lr_scheduler(optimizer: torch.optim.Optimizer, sched_cfg, total_steps: int) -> LambdaLR:
    """A LambdaLR that follows an LRSchedule; its state is the step count and the schedule's plan."""
    schedule = LRSchedule(total_steps, sched_cfg.warmup_steps, sched_cfg.decay_type, sched_cfg.min_lr_factor)
    return LambdaLR(optimizer, schedule)


_TIED = "titanlite_tied_across_ranks"  # the parameter attribute tie_across_ranks sets: (group, counted here)


def tie_across_ranks(param: torch.nn.Parameter, group, counted: bool) -> None:
    """Mark `param` as one weight of which the other ranks of `group` hold identical copies (tied embeddings over
    pipeline stages): clip_grad_norm sums its gradient over `group` and counts it in the norm only where `counted`."""
    setattr(param, _TIED, (group, counted))


def _sum_tied_gradients(parameters) -> None:
    """Each tied parameter's gradient summed over the ranks holding a copy (the same shard of it on each)."""
    for p in parameters:
        if (tie := getattr(p, _TIED, None)) is not None:
            dist.all_reduce(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, group=tie[0])


def clip_grad_norm(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """The global gradient norm over all ranks (a plain tensor); clips to max_norm when it is > 0.

    Gradients on different device meshes (an MoE's experts live on the expert mesh) are normed per mesh, each
    with one all-reduce, and combined; with pipeline parallelism (pp_group: this rank's "pp" group) the stages'
    norms are combined too (one more all-reduce). A weight tied across ranks (tie_across_ranks) first gets the sum of
    its copies' gradients, and counts once."""
    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    _sum_tied_gradients(p for params in by_mesh.values() for p in params)
    norms = []
    for params in by_mesh.values():
        counted = [p.grad for p in params if getattr(p, _TIED, (None, True))[1]]
        norm = torch.nn.utils.get_total_norm(counted, foreach=True)
        # One all-reduce: clip_grad_norm_ would reduce the partial norm once to clip and again for full_tensor().
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if pp_group is not None:  # each stage rank holds its stages' parameters only
        squared = norm.double() ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt().to(norm.dtype)
    if max_norm > 0:
        for params in by_mesh.values():  # a foreach op takes one mesh's tensors at a time
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
