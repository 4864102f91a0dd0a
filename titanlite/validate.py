"""Validation: mean token loss and perplexity on held-out data, the same sequences every time."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config import JobConfig
from titanlite.data.packing import PackedDataLoader
from titanlite.errors import ConfigError
from titanlite.loss import counted_labels, summed_cross_entropy


@dataclass
class ValidationResult:
    """Loss over all valid tokens of the held-out batches (all ranks), its exp, and what it covered."""

    loss: float
    perplexity: float
    tokens: int
    batches: int
    seconds: float


def held_out_source(cfg: JobConfig) -> tuple[str, str]:
    """(dataset, split) to validate on; ConfigError when that would be the training data itself."""
    v, t = cfg.validation, cfg.training
    if v.dataset:
        return v.dataset, v.dataset_split
    if t.dataset != "builtin" and Path(t.dataset).expanduser().exists():
        raise ConfigError(
            f"validation.dataset = '' would validate on training.dataset = {t.dataset!r} itself: a local "
            f"file or folder has no held-out split; valid: set validation.dataset to a held-out file or folder"
        )
    if t.dataset != "builtin" and v.dataset_split == t.dataset_split:
        raise ConfigError(
            f"validation.dataset_split = {v.dataset_split!r} is the training split of training.dataset = "
            f"{t.dataset!r}; valid: a held-out split name of that dataset (e.g. 'validation' or 'test')"
        )
    return t.dataset, v.dataset_split


class Validator:
    """Evaluates a (sharded) model on `validation.steps` global batches of held-out data.

    Every evaluation rewinds the loader to the start of the held-out stream, so each one covers the
    same sequences. A validation batch is training.global_batch_size sequences split over the
    data-parallel ranks as in training, so the result does not depend on the topology.
    """

    def __init__(self, cfg: JobConfig, tokenizer, dp_rank: int, dp_degree: int):
        self.cfg = cfg.validation
        dataset, split = held_out_source(cfg)
        t = cfg.training
        try:
            self.loader = PackedDataLoader(
                tokenizer,
                dataset,
                seq_len=t.seq_len,
                global_batch_size=t.global_batch_size,
                local_batch_size=t.local_batch_size,
                dp_rank=dp_rank,
                dp_degree=dp_degree,
                split=split,
                text_field=t.dataset_text_field,
                config_name=t.dataset_config,
            )
        except ConfigError as e:  # the loader's messages name training.*: say that this is the held-out data
            raise ConfigError(
                f"validation data {dataset!r} (split {split!r}, from validation.dataset = {self.cfg.dataset!r}): {e}"
            ) from e
        self._start = self.loader.state_dict()

    def due(self, step: int, last_step: int) -> bool:
        """Validate after this step?"""
        return step % self.cfg.freq == 0 or step == last_step

    def _batches(self):
        self.loader.load_state_dict(self._start)
        if self.cfg.steps > 0:
            for _ in range(self.cfg.steps):
                yield self.loader.next_step()
            return
        # steps = -1: one pass; a batch that ran past the end of the split (and so wrapped) is dropped.
        while True:
            batch = self.loader.next_step()
            s = self.loader.state_dict()
            if s["epoch"] == 0 or (s["epoch"] == 1 and s["doc_index"] == 0 and s["token_offset"] == 0):
                yield batch
            if s["epoch"] > 0:
                return

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> ValidationResult:
        """Forward only; sum of token losses / valid tokens, all-reduced over every rank."""
        t0 = time.perf_counter()
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, valid tokens
        batches = 0
        for microbatches in self._batches():
            batches += 1
            for inputs, labels in microbatches:
                inputs = inputs.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                logits = model(inputs)
                totals[0] += summed_cross_entropy(logits, labels).double()
                totals[1] += counted_labels(labels)
                del logits
        if batches == 0:
            raise ConfigError(
                "validation.steps = -1: the held-out data is shorter than one global batch "
                "(training.global_batch_size x (training.seq_len + 1) tokens); use fewer or shorter sequences"
            )
        if self.loader.dp_degree > 1:
            dist.all_reduce(totals)
        loss_sum, tokens = totals.tolist()
        loss = loss_sum / max(tokens, 1)
        return ValidationResult(
            loss=loss,
            perplexity=math.exp(min(loss, 700.0)),
            tokens=int(tokens),
            batches=batches,
            seconds=time.perf_counter() - t0,
        )


def build_validator(cfg: JobConfig, tokenizer, dp_rank: int, dp_degree: int) -> Validator | None:
    """The Validator when validation.enable is set, else None (checks run before any process group)."""
    return Validator(cfg, tokenizer, dp_rank, dp_degree) if cfg.validation.enable else None
