"""What the trainer and the validator call per microbatch under [dpo]: the summed pair losses (divided later by the
global pair count, as token losses are by the global token count), and the step's reward statistics for the log."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from titanlite.errors import ConfigError
from titanlite.loss import takes_positions
from titanlite.preference.losses import model_sequence_logps, pair_losses
from titanlite.preference.reference import AdaptersOff, FrozenCopy, Precomputed, frozen_copy_model

logger = logging.getLogger("titanlite")

REPORTED = ("reward_chosen", "reward_rejected", "margin", "accuracy")
DESCRIBED = {
    "base": "the model with its adapters switched off",
    "copy": "a frozen copy of the initial weights, sharded as the model",
    "precomputed": "each pair's log-probabilities, computed once before step 1 and kept in the checkpoints",
}


class PreferenceObjective:
    """The [dpo] loss of a microbatch of pairs against `reference` (None: simpo), and its running statistics."""

    def __init__(self, dpo_cfg, reference, copies: int = 1):
        self.cfg, self.reference, self.copies = dpo_cfg, reference, copies  # copies: tp ranks with the same values
        self._stats: torch.Tensor | None = None  # sum of loss, chosen and rejected rewards, correct pairs, pairs

    def begin(self) -> None:
        """Start a new step's (or evaluation's) statistics."""
        self._stats = None

    def __call__(self, model: torch.nn.Module, mb, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the microbatch's summed pair losses, its labels on the device)."""
        inputs = mb.inputs.to(device, non_blocking=True)
        labels = mb.labels.to(device, non_blocking=True)
        extra = [mb.positions.to(device, non_blocking=True)] if takes_positions(model) else []
        reference = None if self.reference is None else self.reference.logps(inputs, extra, labels, mb.pairs)
        policy, counts = model_sequence_logps(model, inputs, extra, labels)
        c = self.cfg
        losses, chosen, rejected = pair_losses(c.loss, c.beta, policy, reference, counts, c.gamma, c.label_smoothing)
        pairs = torch.ones_like(chosen).sum()  # on the device: no host data, no sync
        stats = torch.stack([losses.detach().sum(), chosen.sum(), rejected.sum(), (chosen > rejected).sum(), pairs])
        stats = stats.double()
        self._stats = stats if self._stats is None else self._stats + stats
        return losses.sum(), labels

    @staticmethod
    def counted(labels: torch.Tensor) -> int:
        """What a microbatch counts for in the loss's normalization: its pairs."""
        return labels.shape[0] // 2

    def report(self) -> dict[str, float]:
        """The statistics since begin(), over every rank (a collective): mean rewards of chosen and rejected, their
        margin and the share of pairs whose chosen reward is the higher."""
        stats = self._stats if self._stats is not None else torch.zeros(5, dtype=torch.float64)
        if dist.is_initialized():
            stats = stats.clone()
            dist.all_reduce(stats)
            stats /= self.copies
        _, chosen, rejected, correct, pairs = (stats / stats[4].clamp(min=1)).tolist()
        return dict(zip(REPORTED, (chosen, rejected, chosen - rejected, correct)))


def build_objective(cfg, state, model_args, meshes, device, copies: int, validation_layouts=None):
    """(the training objective, the validation objective) of a [dpo] run: the reference its dpo.reference names
    (precomputed tables are placed in `state` for checkpoints and filled by fill_reference)."""
    kind, d = cfg.dpo.reference, cfg.dpo
    what = {"sigmoid": "DPO", "ipo": "IPO", "simpo": "SimPO"}[d.loss]
    extra = f", gamma {d.gamma:g}" if d.loss == "simpo" else ""
    extra += f", label smoothing {d.label_smoothing:g}" if d.label_smoothing and d.loss != "ipo" else ""
    logger.info(f"Objective: {what} on preference pairs (dpo.loss = {d.loss!r}, beta {d.beta:g}{extra}); reference: "
                f"{'none' if d.loss == 'simpo' else DESCRIBED[kind]}")  # fmt: skip
    if cfg.dpo.loss == "simpo":
        return PreferenceObjective(cfg.dpo, None, copies), PreferenceObjective(cfg.dpo, None, copies)
    if kind == "base":
        reference = AdaptersOff(state.model)
        return PreferenceObjective(cfg.dpo, reference, copies), PreferenceObjective(cfg.dpo, reference, copies)
    if kind == "copy":
        reference = FrozenCopy(frozen_copy_model(cfg, model_args, meshes, device))
        return PreferenceObjective(cfg.dpo, reference, copies), PreferenceObjective(cfg.dpo, reference, copies)
    train = Precomputed(state, "training", state.dataloader.layouts)
    held_out = Precomputed(state, "validation", validation_layouts) if validation_layouts else None
    return PreferenceObjective(cfg.dpo, train, copies), PreferenceObjective(cfg.dpo, held_out, copies)


def fill_reference(objectives, model, cfg, dp_rank: int, dp_degree: int, copies: int, device, resumed: bool) -> None:
    """Compute the precomputed references' tables on a fresh start (the initial weights); a resumed run has them from
    its checkpoint (ConfigError when that lacks pairs this run trains on: its weights are no longer the initial
    ones)."""
    block_causal = takes_positions(model)
    for objective in objectives:
        reference = objective.reference
        if not isinstance(reference, Precomputed):
            continue
        if resumed and (reference.missing() or reference.changed()):
            what = "has no" if reference.missing() else "has other tokens' (another cut of the pairs) as"
            raise ConfigError(
                f"dpo.reference = 'precomputed': the checkpoint this run resumes from {what} reference "
                f"log-probabilities for {reference.name} pairs this run trains on (it was saved with another "
                "dpo.reference, without validation, or with another training.seq_len, data.pair_truncation or "
                "dataset), and the weights are no longer the initial ones to compute them; valid: the settings the "
                "run was saved with, or a new run (another job.dump_folder)"
            )
        if reference.missing():
            reference.compute(model, cfg.training.local_batch_size, dp_rank, dp_degree, copies, device, block_causal)
