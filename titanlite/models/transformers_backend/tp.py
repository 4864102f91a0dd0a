"""Tensor parallelism of a transformers-backend model by its own config's `base_model_tp_plan` (the plan
transformers' own `tp_plan="auto"` reads), over the "tp" mesh, before activation checkpointing, compile and FSDP.

The decoder layers' projections take the plan's styles, translated to torch's: `colwise` and `rowwise` (Megatron's
pair: each rank a part of the heads or hidden features, one reduction per attention and MLP), `colwise_gather_output`
and `rowwise_split_input` (the output gathered, the input split again: Phi-3's fused projections, Qwen3.5's Gated
DeltaNet, whose own computation then runs whole on every rank), and `replicated_with_grad_allreduce` for the
per-head q/k norms (their weight whole on every rank, their gradient summed over tp: torch's SequenceParallel over
the head dimension, as the native families do). The embedding and the output projection are split over the
vocabulary as in the native families (loss parallelism keeps the logits split). Every other parameter (norms, a
convolution's weights) stays whole and is computed alike on every tp rank, and so do a routed MoE's experts
(the plan's packed expert styles are not applied: the experts' input, routing and output are whole on every rank,
so their gradients are too; the shared experts and attention are split). `mla_kv_a_proj`, multi-head latent
attention's latent projection (DeepSeek-V2/V3.2, GLM-5, ...), stays whole too, the RoPE key part of its output
having its gradient summed over tp: every head uses that one key part, and each rank computes its own heads. A plan
style outside these is refused before launch (`unsupported_style`); without sequence parallelism (transformers'
layers add their residuals on whole tensors).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanlite.models.decoder_tp import VocabParallelOutput
from titanlite.models.moe import sum_grad_over_group


class SharedRopeKey(ParallelStyle):
    """MLA's latent projection (kv_a_proj_with_mqa) whole on every tp rank, the last rope_dim features of its output
    (the RoPE key part every head shares) with their gradient summed over tp. The latent part's gradient is whole
    already: kv_b_proj is column-split, and a column split sums its input's gradient."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def sum_rope_grad(mod, args, out):
            latent, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            return torch.cat([latent, sum_grad_over_group(rope, group)], dim=-1)

        module.register_forward_hook(sum_rope_grad)
        return module


LAYER = "layers.*."
STYLES = {  # the plan's style -> torch's, given the model's config
    "colwise": lambda config: ColwiseParallel(),
    "rowwise": lambda config: RowwiseParallel(),
    "colwise_gather_output": lambda config: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda config: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda config: SequenceParallel(sequence_dim=2, use_local_output=True),
    "mla_kv_a_proj": lambda config: SharedRopeKey(config.qk_rope_head_dim),
}
NORMS = ("q_norm", "k_norm")  # the one place replicated_with_grad_allreduce is read as "over each rank's heads"


# A routed MoE's experts (their packed 3-D weights and the module's all-reduce): not split; every tp rank holds and
# computes them whole (their input and output are whole on every rank, so are their gradients)
EXPERTS = re.compile(r"(^|\.)experts(\.|$)")


def layer_plan(plan: dict) -> dict[str, str]:
    """The plan's styles of a decoder layer's modules, by their names inside the layer (a routed MoE's experts left
    out: kept whole)."""
    inside = {k[len(LAYER) :]: v for k, v in (plan or {}).items() if k.startswith(LAYER)}
    return {name: style for name, style in inside.items() if not EXPERTS.search(name)}


def unsupported_style(plan: dict) -> str | None:
    """'<module>: <style>' of the first plan entry the backend cannot apply, or None ({}: no plan, also None)."""
    for name, style in layer_plan(plan).items():
        if style not in STYLES or (style == "replicated_with_grad_allreduce" and not name.endswith(NORMS)):
            return f"{LAYER}{name}: {style!r}"
        if "*" in name:  # a module inside a list of the layer's (LongCat's self_attn.*): not looked up by name
            return f"{LAYER}{name}: {style!r}"
    other = [k for k in (plan or {}) if not k.startswith(LAYER)]
    return f"{other[0]}: {plan[other[0]]!r}" if other else None


def parallelize_backend(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    inference: bool = False,
    float8_tensorwise: bool = False,
) -> None:
    """Apply the model's base_model_tp_plan to a BackendModel in place (on the meta device); sequence_parallel
    must be False (refused before launch: support.problem)."""
    assert not sequence_parallel and not float8_tensorwise, "refused by transformers_backend.support.problem"
    parallelize_module(
        model,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": VocabParallelOutput(Replicate(), loss_parallel),
        },
    )
    config = model.hf.config
    styles = layer_plan(config.base_model_tp_plan)
    for layer in model.model.layers:
        present = {name: STYLES[style](config) for name, style in styles.items() if _has(layer, name)}
        parallelize_module(layer, tp_mesh, present)
        for name, style in styles.items():  # a model may add to a projection's output in place (Llama 4's shared
            if style.startswith("rowwise") and name in present:  # expert): its own tensor, not a DTensor's view
                layer.get_submodule(name).register_forward_hook(_own_copy)
    if model.args.tie_embeddings:  # both split over the vocabulary rows: one parameter again
        model.lm_head.weight = model.model.embed_tokens.weight


def _own_copy(module: nn.Module, args, output):
    """A row-parallel projection's output as a tensor of its own (the local tensor of its reduced DTensor is a view
    that autograd forbids modifying in place)."""
    return output.clone()


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
