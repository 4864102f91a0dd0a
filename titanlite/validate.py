"""Validation: mean token loss and perplexity on held-out data, the same sequences every time."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.config import JobConfig
from titanlite.data.counted import no_counted_tokens
from titanlite.errors import ConfigError
from titanlite.loss import TokenLoss, loss_parallel_context
from titanlite.models.eval_mode import eval_mode


@dataclass
class ValidationResult:
    """Loss over all valid tokens of the held-out batches (all ranks), its exp, and what it covered."""

    loss: float
    perplexity: float
    tokens: int
    batches: int
    seconds: float
    pairs: dict | None = None  # [dpo]: mean rewards, margin and reward accuracy on the held-out pairs


class Validator:
    """Evaluates a (sharded) model on `validation.steps` global batches of held-out data.

    Every evaluation rewinds the loader to the start of the held-out stream, so each one covers the
    same sequences. A validation batch is training.global_batch_size sequences split over the
    data-parallel ranks as in training, so the result does not depend on the topology.
    """

    def __init__(self, cfg: JobConfig, loader):
        self.cfg, self.training = cfg.validation, cfg.training
        p = cfg.parallelism
        self.loss_parallel = p.tensor_parallel_degree > 1 and p.enable_loss_parallel
        self.tp = p.tensor_parallel_degree
        self.cp = getattr(p, "context_parallel_degree", 1)
        self.pp = getattr(p, "pipeline_parallel_degree", 1)
        self.loader = loader  # titanlite.data.build.build_loader(cfg, tokenizer, "validation", ...)
        self.objective = TokenLoss()  # the trainer sets [dpo]'s (preference/objective.py)
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
        if hasattr(self.loader, "sequences_per_epoch"):
            for _ in range(self.loader.sequences_per_epoch() // self.loader.global_batch_size):
                yield self.loader.next_step()
            return
        while True:
            batch = self.loader.next_step()
            s = self.loader.state_dict()
            if s["epoch"] == 0 or (s["epoch"] == 1 and s["doc_index"] == 0 and s["token_offset"] == 0):
                yield batch
            if s["epoch"] > 0:
                return

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device, loss_of=None) -> ValidationResult:
        """Forward only, in eval mode (no dropout); sum of token losses / valid tokens, all-reduced over every rank.
        loss_of(microbatch): (summed token loss, labels) when the model is not called as a whole (pipeline stages:
        parallel/pp.py)."""
        with eval_mode(model):
            return self._evaluate(model, device, loss_of)

    def _evaluate(self, model: torch.nn.Module, device: torch.device, loss_of) -> ValidationResult:
        t0 = time.perf_counter()
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, valid tokens (pairs)
        batches = 0
        self.objective.begin()
        for step in self._batches():
            batches += 1
            for mb in step.microbatches:
                with loss_parallel_context(self.loss_parallel):
                    loss_sum, labels = loss_of(mb) if loss_of else self.objective(model, mb, device)
                totals[0] += loss_sum.double()
                totals[1] += self.objective.counted(labels)
        if batches == 0:
            raise ConfigError(
                "validation.steps = -1: the held-out data is shorter than one global batch "
                "(training.global_batch_size x (training.seq_len + 1) tokens); use fewer or shorter sequences"
            )
        if self.loader.dp_degree * self.cp * self.pp > 1:
            dist.all_reduce(totals)
            # the tp ranks of a dp rank hold the same sums; its cp ranks each a part of the loss, all of the labels;
            # its pp ranks all of the labels, and only the last stage's the loss
            div = [self.tp, self.tp * self.cp * self.pp]
            totals /= torch.tensor(div, dtype=totals.dtype, device=totals.device)
        pairs = self.objective.report()
        loss_sum, tokens = totals.tolist()
        if tokens == 0:
            raise no_counted_tokens(self.loader, f"validation's {batches} global batch(es)", self.training)
        loss = loss_sum / max(tokens, 1)
        return ValidationResult(
            loss=loss,
            perplexity=math.exp(min(loss, 700.0)),
            tokens=int(tokens),
            batches=batches,
            seconds=time.perf_counter() - t0,
            pairs=pairs,
        )
