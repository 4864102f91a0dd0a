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
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, positions=None) -> torch.Tensor:
        model = self._model[0]
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        rope, mask = model.training_rope_mask(positions, h.dtype)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.output is None:
            return h
        h = self.norm(h)
        if self.output.chunk_tokens > 0:
            return self.output(h, labels)
        loss = self.loss_fn(self.output(h), labels)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def shard_groups(self) -> list[list[nn.Module]]:
        """Modules to shard together, one list per fully_shard call (the stage itself is the root)."""
        groups = [[self.tok_embeddings]] if self.tok_embeddings is not None else []
        groups += [[block] for block in self.layers.values()]
        if self.output is not None:
            groups.append([self.norm, self.output])
        return groups


def keep_only(model: nn.Module, blocks: set[int], first: bool, last: bool) -> None:
    """Drop from `model` the blocks not in `blocks`, the embedding unless `first`, the norm and output projection
    unless `last` (before it is materialised: what is dropped is never allocated); the model is then marked
    `pipeline_part` (its state dict holds some of the model's names)."""
    model.pipeline_part = True
    for i in range(len(model.layers)):
        if i not in blocks:
            model.layers[i] = AbsentBlock()
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None


def part_sizes(model: nn.Module) -> tuple[int, list[int], int]:
    """Parameters of (the embedding, each block, the final norm and output projection) of a whole model."""
    size = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return size(model.tok_embeddings), [size(b) for b in model.layers], size(model.norm) + size(model.output)
