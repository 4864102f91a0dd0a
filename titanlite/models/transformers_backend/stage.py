"""One pipeline stage of a transformers backend model, by its config's base_model_pp_plan (embed_tokens, layers,
norm): its decoder layers and, on the first stage, the embedding, on the last, the final norm, the output projection
and the loss.

The stage runs the transformers model's own forward (its rotary tables, its masks per layer kind, its hybrid
layers' extra inputs) with the other stages' layers passed through and, on a stage that is not the last, no final
norm; a later stage is given the previous one's hidden states as inputs_embeds. It holds the model's own modules, so
every parameter keeps the full model's name (model.layers.7.mlp.up_proj.weight on whichever stage holds layer 7).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class AbsentLayer(nn.Module):
    """A decoder layer another pipeline stage holds: the hidden states pass through (no parameters)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class BackendStage(nn.Module):
    """Decoder layers `blocks` of a BackendModel (with the embedding when first, the norm, output projection and loss
    when last); forward(x, carrier, labels, positions) as models/stage.StageModule's."""

    aux_grad_scale = 0.0  # (no titanlite load balancing reaches transformers' MoE blocks)
    inferring = False

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool, loss_fn, split: bool = False):
        super().__init__()
        base = model.model
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in blocks})
        self.norm = base.norm if last else None
        self.lm_head = model.lm_head if last else None
        if last and split:  # a zero-bubble schedule runs the loss's backward twice (input, then weight gradients)
            self.lm_head.backward_once = False
        self._model, self.blocks, self.loss_fn = (model,), set(blocks), loss_fn
        tied = model.args.tie_embeddings and first != last
        self._tied_alias = ((model.lm_head if first else base.embed_tokens),) if tied else ()
        # what the transformers model runs for this stage (tuples: not registered as this module's children)
        passed = [base.layers[i] if i in blocks else AbsentLayer() for i in range(len(base.layers))]
        self._stage_layers = (nn.ModuleList(passed),)
        self._received: torch.Tensor | None = None  # a later stage's input, given to its first layer as it is
        if not first:
            base.layers[min(blocks)].register_forward_pre_hook(self._give_received, with_kwargs=True)

    def forward(self, x: torch.Tensor, carrier=None, labels: torch.Tensor | None = None, positions=None):
        """x: tokens (first stage) or the previous stage's hidden states. The hidden states, or the last stage's
        summed loss."""
        model = self._model[0]
        position_ids = positions if model.args.attention == "block_causal" else None
        inputs = {"input_ids": x} if self.embed_tokens is not None else {"inputs_embeds": x}
        self._received = None if self.embed_tokens is not None else x
        try:
            with self._only_this_stage(model.model):
                h = model.model(**inputs, position_ids=position_ids, use_cache=False).last_hidden_state
        finally:
            self._received = None
        if self.lm_head is None:
            return h
        if self.lm_head.chunk_tokens > 0:
            return self.lm_head(h, labels)
        loss = self.loss_fn(self.lm_head(h), labels)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    @contextmanager
    def _only_this_stage(self, base: nn.Module):
        """The transformers model running this stage's layers only (the others passed through), its final norm only
        on the last stage."""
        layers, norm = base.layers, base.norm
        base.layers = self._stage_layers[0]
        base.norm = norm if self.norm is not None else nn.Identity()
        try:
            yield
        finally:
            base.layers, base.norm = layers, norm

    def _give_received(self, layer: nn.Module, args: tuple, kwargs: dict):
        """The first layer's arguments with the received hidden states as they are (whatever the model's forward
        does to inputs_embeds before its layers, an embedding multiplier say, the first stage did)."""
        if self._received is None:
            return None
        if args:
            return (self._received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._received}

    def expert_units(self) -> list[nn.Module]:
        """(none: transformers' experts are sharded with their decoder layer)"""
        return []

    def shard_groups(self) -> list[list[nn.Module]]:
        """Modules to shard together, one list per fully_shard call (the stage itself is the root)."""
        groups = [[self.embed_tokens, *self._tied_alias]] if self.embed_tokens is not None else []
        groups += [[layer] for layer in self.layers.values()]
        if self.lm_head is not None:
            groups.append([self.norm, self.lm_head, *self._tied_alias])
        return groups

    def tied_weight(self) -> nn.Parameter | None:
        """The weight this stage shares with another pipeline rank's stage (tied embeddings), or None."""
        return self._tied_alias[0].weight if self._tied_alias else None


def keep_only(model: nn.Module, blocks: set[int], first: bool, last: bool) -> None:
    """Drop from a (meta) BackendModel the decoder layers not in `blocks`, the embedding unless `first`, the norm and
    output projection unless `last`; with tied embeddings either end keeps both (one weight under both names)."""
    model.pipeline_part = True
    base, tied_end = model.model, model.args.tie_embeddings and (first or last)
    for i in range(len(base.layers)):
        if i not in blocks:
            base.layers[i] = AbsentLayer()
    if not first and not tied_end:
        base.embed_tokens = None
    if not last:
        base.norm = nn.Identity()
        if not tied_end:
            model.lm_head = None
    model.hf.lm_head = model.lm_head  # (the transformers object's own reference, for its init and save code)


def part_sizes(model: nn.Module) -> tuple[int, list[int], int]:
    """Parameters of (the embedding, each decoder layer, the final norm and output projection) of a whole model."""
    size = lambda m: sum(p.numel() for p in m.parameters()) if m is not None else 0  # noqa: E731
    base = model.model
    return size(base.embed_tokens), [size(b) for b in base.layers], size(base.norm) + size(model.lm_head)
