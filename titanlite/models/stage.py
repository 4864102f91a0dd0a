"""One pipeline stage of a decoder.Transformer: its blocks and, on the first stage, the embedding, on the last, the
final norm, the output projection and the loss.

A stage module holds references to the model's own modules, so every parameter keeps the full model's name
(`layers.7.attention.wq.weight` on whichever stage holds block 7): checkpoints, initial weights and exports do not
depend on the pipeline degree. `keep_only` drops from the (meta) model what this rank's stages do not hold before
it is materialised, so a rank allocates only its own stages.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.loss import summed_cross_entropy
from titanlite.models.family import BACKEND
from titanlite.models.layer_masks import layer_masks
from titanlite.models.moe import CarryLoadStats, moe_layers, record_forward, stage_load_stats
from titanlite.models.transformers_backend import stage as backend_stage


class AbsentBlock(nn.Module):
    """A block that another pipeline stage holds: no parameters; the block indices of the rest stay the same."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this block is held by another pipeline stage: run the model through its stages")


class StageModule(nn.Module):
    """Blocks `blocks` of `model` (with the embedding when first, the norm, output projection and loss when last).

    split: the schedule splits backward into input and weight parts. forward(x, labels, positions): x is the
    tokens on the first stage, the previous stage's hidden states elsewhere; the last stage returns the summed
    cross-entropy over the counted labels (in chunks when the model's loss_chunk_tokens is set, else loss_fn over
    the logits), the others their hidden states.
    """

    def __init__(
        self, model: nn.Module, blocks: range, first: bool, last: bool, loss_fn=summed_cross_entropy, split=False
    ):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in blocks})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        if last and split:  # a zero-bubble schedule runs the loss's backward twice (input, then weight gradients)
            self.output.backward_once = False
        self._model = (model,)  # a tuple, not a submodule: its rope table and attention settings
        # Tied embeddings on one end: the module of the other end (never run here; a tuple, not a submodule) holds
        # the same weight under its own name, so that this rank's checkpoint and init name it as one process does.
        tied = model.args.tie_embeddings and first != last
        self._tied_alias = ((model.output if first else model.tok_embeddings),) if tied else ()
        self.loss_fn = loss_fn

    aux_grad_scale = 0.0  # an MoE's aux_loss term's weight in the objective (moe_balance.LoadBalance.aux_scale)
    inferring = False  # True while torch's pipeline stage runs a forward to learn shapes (compat.py): not a step's

    def forward(self, x: torch.Tensor, carrier=None, labels: torch.Tensor | None = None, positions=None):
        """x: tokens (first stage) or the previous stage's hidden states; carrier: with an MoE's aux_loss, the earlier
        stages' load statistics (models/moe.py CarryLoadStats). The hidden states (and carrier), or the last stage's
        summed loss."""
        model = self._model[0]
        if model.cp_group is not None:  # context parallelism: this rank's two chunks of every sequence
            seq_len = labels.shape[1]
            index, rope, mask = model.context_parallel_view(seq_len, labels.device, positions)
            x = x[:, index] if self.tok_embeddings is not None else x  # later stages get the chunks' hidden states
            labels = labels[:, index]
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if model.cp_group is not None:
            mask = layer_masks(model.args, mask, index, seq_len, h.dtype)
        else:
            rope, mask = model.training_rope_mask(positions, h.dtype, h.shape[1])
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        carrier = self._load_stats(carrier, x.shape[0], h.device) if model.args.moe else None
        if self.output is None:
            return h if carrier is None else (h, carrier)
        h = self.norm(h)
        if self.output.chunk_tokens > 0:
            loss = self.output(h, labels)
        else:
            loss = self.loss_fn(self.output(h), labels)
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return loss if carrier is None else loss + 0.0 * carrier.sum()  # the carriers' backward starts here

    def _load_stats(self, carrier, batch: int, device):
        """An MoE stage's part of the step's load balancing: its loads counted; with aux_loss, the carrier of the
        statistics (None otherwise), and on the last stage the aux loss recorded for the log. A stage of dense
        blocks only (DeepSeek-V3's first) passes the carrier on."""
        model = self._model[0]
        layers = moe_layers(self)
        counted = torch.is_grad_enabled() and not self.inferring
        if counted:
            record_forward(layers)
        if model.load_balance != "aux_loss":
            return None
        e, n = model.args.n_experts, len(model.args.moe_layers)  # the aux loss averages over the MoE blocks
        if carrier is None:
            carrier = torch.zeros(2, batch, e, device=device)
        if not torch.is_grad_enabled():  # a forward without gradients (validation): the carrier passes on
            return carrier
        stats = stage_load_stats(layers)
        if stats is not None:
            carrier = CarryLoadStats.apply(carrier, *stats, self.aux_grad_scale * e / n**2)
        if self.output is not None and counted:  # every layer's statistics are in: the aux loss of these sequences
            aux = e / n**2 * (carrier[0] * carrier[1]).sum().detach()
            model.aux_loss_sum = aux if model.aux_loss_sum is None else model.aux_loss_sum + aux
        return carrier

    def expert_units(self) -> list[nn.Module]:
        """The experts of this stage's MoE blocks: each its own fully_shard on the expert mesh (parallel/fsdp.py)."""
        return [m.experts for m in moe_layers(self)]

    def shard_groups(self) -> list[list[nn.Module]]:
        """Modules to shard together, one list per fully_shard call (the stage itself is the root)."""
        # a tied weight's two modules in one group (as in Transformer.shard_groups): FSDP keeps them one parameter
        groups = [[self.tok_embeddings, *self._tied_alias]] if self.tok_embeddings is not None else []
        groups += [[block] for block in self.layers.values()]
        if self.output is not None:
            groups.append([self.norm, self.output, *self._tied_alias])
        return groups

    def tied_weight(self) -> nn.Parameter | None:
        """The weight this stage shares with another pipeline rank's stage (tied embeddings: the first stage's
        embedding is the last stage's output projection), or None."""
        return self._tied_alias[0].weight if self._tied_alias else None


def stage_module(model: nn.Module, blocks: range, first: bool, last: bool, loss_fn, split: bool) -> nn.Module:
    """The stage module of blocks `blocks` of `model`: a StageModule, or a transformers backend model's BackendStage."""
    if model.args.family == BACKEND:
        return backend_stage.BackendStage(model, blocks, first, last, loss_fn, split)
    return StageModule(model, blocks, first, last, loss_fn, split)


def keep_only(model: nn.Module, blocks: set[int], first: bool, last: bool) -> None:
    """Drop from `model` the blocks not in `blocks`, the embedding unless `first`, the norm and output projection
    unless `last` (before it is materialised: what is dropped is never allocated); the model is then marked
    `pipeline_part` (its state dict holds some of the model's names). With tied embeddings, either end keeps both the
    embedding and the output projection: one weight under both names, as the whole model holds it."""
    if model.args.family == BACKEND:
        return backend_stage.keep_only(model, blocks, first, last)
    model.pipeline_part = True
    tied_end = model.args.tie_embeddings and (first or last)
    for i in range(len(model.layers)):
        if i not in blocks:
            model.layers[i] = AbsentBlock()
    if not first and not tied_end:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        if not tied_end:
            model.output = None


def part_sizes(model: nn.Module) -> tuple[int, list[int], int]:
    """Parameters of (the embedding, each block, the final norm and output projection) of a whole model."""
    if model.args.family == BACKEND:
        return backend_stage.part_sizes(model)
    size = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return size(model.tok_embeddings), [size(b) for b in model.layers], size(model.norm) + size(model.output)
