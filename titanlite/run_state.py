"""RunState: what a training run is at a step (model, optimizer, lr schedule, data loader and its position, DiLoCo's
outer state, step, tokens seen), the one object that the loop, the checkpoint manager, healing and the replica groups
share; and the weights-replaced event that whatever keeps something derived from the weights listens to.

It imports nothing of titanlite: any component may take it without reaching into the Trainer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Why the weights were replaced (what a listener receives).
LOADED = "loaded"  # the start: initial weights, a checkpoint or a base model, before the first forward
OPTIMIZER_STEP = "optimizer step"
HEALED = "healed"  # a fault-tolerant group took a live peer's state
SYNCED = "synced"  # DiLoCo's outer step set the global weights


class RunState:
    """The run's model parts, optimizer, lr schedule, data loader, DiLoCo outer state (None without DiLoCo), step
    (optimizer steps taken), tokens seen (counted labels trained on) and a DPO run's precomputed reference tables."""

    def __init__(self, model: torch.nn.Module, optimizer, lr_scheduler, dataloader, outer=None):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.outer = outer
        self.step = 0
        self.tokens_seen = 0
        self.reference_logps: dict[str, torch.Tensor] = {}  # [dpo] precomputed reference, per loader (preference/)
        self._listeners: list[Callable[[str], None]] = []

    def on_weights_replaced(self, listener: Callable[[str], None]) -> None:
        """Call `listener(why)` each time the weights are replaced (why: LOADED, OPTIMIZER_STEP, HEALED, SYNCED)."""
        self._listeners.append(listener)

    def weights_replaced(self, why: str) -> None:
        """Tell the listeners that the weights were replaced; every rank that holds a part of them calls it."""
        for listener in self._listeners:
            listener(why)
