"""The tensor-parallel plan of the decoder (every built-in family): which module is split how over the "tp" mesh.

Megatron-style: q/k/v and the FFN in-projections column-parallel (each rank a part of the heads and of the
hidden features), the out-projections row-parallel (one reduction per attention and per FFN), the embedding
and the output projection split over the vocabulary. With sequence parallelism the residual stream and the
norms hold seq / tp tokens per rank (the reductions become reduce-scatters, and all-gathers bring the whole
sequence to attention and the FFN); without it they are replicated. With loss parallelism the logits stay
split over the vocabulary and the loss is computed on the shards (loss.loss_parallel_context).

Qwen3's per-head q/k norms act on each rank's own heads; their weight is replicated over tp and its gradient
summed over the ranks (SequenceParallel over the head dimension). Qwen2's q/k/v biases are split with their
rows, as gpt-oss's attention sinks are with their heads. The attention module's head counts become the local ones,
which the KV cache reads.

With [float8]'s tensorwise recipe the float8 linears take torchao's float8 styles (as TorchTitan): each input is cast
to float8 under one scale for the whole tensor (a max over the tp ranks) before it is all-gathered, so the
sequence-parallel all-gathers carry float8, and an attention's or FFN's input is cast once for its projections.
The rowwise recipe keeps the plain styles (its all-gathers stay in bf16).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanlite.compat import resolve_async_collective
from titanlite.models.mla import LatentAttention
from titanlite.models.moe import MoE


class ReplicateParallel(ParallelStyle):
    """A module whose parameters are replicated over tp and whose input and output are whole, identical on every
    tp rank (the norms without sequence parallelism): DTensors inside, plain tensors outside."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            dist_param = DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))

        def to_dtensor(mod, inputs):
            return tuple(
                DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(lambda mod, inputs, out: out.to_local() if isinstance(out, DTensor) else out)
        return module


class VocabParallelOutput(ParallelStyle):
    """The output projection split over the vocabulary (column-parallel): its input gathered to the whole
    sequence (from `input_layout`), its logits split over the vocabulary (loss parallel: a DTensor) or gathered
    (plain tensors); a summed loss it returns instead (given labels: models/chunked_loss.py) passes through."""

    def __init__(self, input_layout, loss_parallel: bool):
        super().__init__()
        self.input_layout, self.loss_parallel = input_layout, loss_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                dist_param = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
                mod.register_parameter(key, dist_param)

        def gather_input(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
            return (x.redistribute(placements=[Replicate()]), *inputs[1:])

        def split_output(mod, out, mesh):
            if not isinstance(out, DTensor):  # the summed loss, the same on every rank
                return out
            return out if self.loss_parallel else out.redistribute(placements=[Replicate()]).to_local()

        return distribute_module(module, device_mesh, partition, gather_input, split_output)


def _moe_plan(moe: MoE, tp_mesh: DeviceMesh, seq, split: bool) -> ParallelStyle:
    """An MoE feed-forward under tensor parallelism: its weights are not split by tp (its experts may be, by expert
    parallelism); in training each tp rank routes its own share of the sequence (Shard(1); a whole sequence is split
    first without sequence parallelism and gathered after), with the router's gradient and the load-balancing
    statistics summed over the tp ranks (moe.tp_group); in generation every tp rank computes every token."""
    part = Shard(1) if split else Replicate()
    if split:
        moe.tp_group = tp_mesh.get_group()
    return PrepareModuleInputOutput(
        input_layouts=(seq,),
        desired_input_layouts=(part,),
        use_local_input=True,
        output_layouts=(part,),
        desired_output_layouts=(seq,),
        use_local_output=True,
    )


def _latent_attention_plan(attention: LatentAttention, tp_mesh: DeviceMesh, styles) -> dict[str, ParallelStyle]:
    """Multi-head latent attention under tensor parallelism: the per-head projections (q_b_proj or wq, kv_b_proj) are
    column-parallel, so each rank computes its heads; the latent projections and their norms are whole on every
    rank (plain modules on the whole sequence, which every rank holds), their gradients complete on each: the
    head-parallel matmuls sum their input gradients over tp, and the RoPE key part that every head shares has its
    gradient summed over tp too (attention.tp_group)."""
    attention.tp_group = tp_mesh.get_group()
    q = "attention.q_b_proj" if hasattr(attention, "q_b_proj") else "attention.wq"
    return {q: styles.colwise(q), "attention.kv_b_proj": styles.colwise("attention.kv_b_proj")}


class _LinearStyles:
    """The styles of a block's projections: torchao's float8 ones for the float8 linears of a tensorwise run, the
    plain ones otherwise."""

    def __init__(self, block: nn.Module, float8_tensorwise: bool):
        self.block = block
        self.ao = None
        if float8_tensorwise:  # torchao: only a run with [float8] gets here
            from torchao.float8 import float8_tensor_parallel

            self.ao = float8_tensor_parallel

    def _float8(self, *names: str) -> bool:
        return self.ao is not None and all(type(self.block.get_submodule(n)).__name__ == "Float8Linear" for n in names)

    def colwise(self, name: str) -> ParallelStyle:
        return self.ao.Float8ColwiseParallel() if self._float8(name) else ColwiseParallel()

    def rowwise(self, name: str, output_layout) -> ParallelStyle:
        if self._float8(name):
            return self.ao.Float8RowwiseParallel(output_layouts=output_layout)
        return RowwiseParallel(output_layouts=output_layout)

    def gather_input(
        self, projections: tuple[str, ...], n_inputs: int, use_local_output: bool = False
    ) -> ParallelStyle:
        """The whole sequence for a module whose first input is split over tp (sequence parallelism): cast to float8
        before the all-gather when every projection that reads it is a float8 linear."""
        layouts = dict(
            input_layouts=(Shard(1),) + (None,) * (n_inputs - 1),
            desired_input_layouts=(Replicate(),) + (None,) * (n_inputs - 1),
            use_local_output=use_local_output,
        )
        if not use_local_output and self._float8(*projections):
            reader = projections[0].split(".", 1)[1]  # named from the module whose input this is
            return self.ao.PrepareFloat8ModuleInput(**layouts, fwd_config_submodule_fqn=reader)
        return PrepareModuleInput(**layouts)


def parallelize_decoder(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    inference: bool = False,
    float8_tensorwise: bool = False,
):
    """Apply the plan to a decoder.Transformer in place (on the meta device, after [float8]'s conversion, before
    activation checkpointing, compile and FSDP). inference: generation's plan (an MoE computes every token on every
    tp rank). float8_tensorwise: torchao's float8 styles for the float8 linears."""
    tp = tp_mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel if sequence_parallel else ReplicateParallel
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "norm": norm(),
            "output": VocabParallelOutput(seq, loss_parallel),
        },
    )
    for block in model.layers:
        latent = isinstance(block.attention, LatentAttention)
        styles = _LinearStyles(block, float8_tensorwise)
        plan = {"attention_norm": norm(), "ffn_norm": norm(), "attention.wo": styles.rowwise("attention.wo", seq)}
        qkv = ("attention.wq", "attention.wk", "attention.wv")
        if latent:
            plan.update(_latent_attention_plan(block.attention, tp_mesh, styles))
        else:
            plan.update({name: styles.colwise(name) for name in qkv})
        if isinstance(block.feed_forward, MoE):
            plan["feed_forward"] = _moe_plan(block.feed_forward, tp_mesh, seq, split=not inference)
        else:
            plan.update(
                {
                    "feed_forward.w1": styles.colwise("feed_forward.w1"),
                    "feed_forward.w3": styles.colwise("feed_forward.w3"),
                    "feed_forward.w2": styles.rowwise("feed_forward.w2", seq),
                }
            )
        if sequence_parallel:  # the whole sequence for attention (x, rope, mask, cache) and the FFN
            # a latent attention's latent projections are plain modules (see _latent_attention_plan): a local input
            plan["attention"] = styles.gather_input(qkv, 4, use_local_output=latent)
            if not isinstance(block.feed_forward, MoE):
                plan["feed_forward"] = styles.gather_input(("feed_forward.w1", "feed_forward.w3"), 1)
        if block.attention.q_norm is not None:  # over each rank's heads (dim 2 of (batch, seq, heads, head_dim))
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        sinks = getattr(block.attention, "sinks", None)
        if sinks is not None:  # gpt-oss's sink per head: each rank its heads' (Attention reads its local part)
            block.attention.sinks = nn.Parameter(distribute_tensor(sinks, tp_mesh, [Shard(0)]))
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp
    # The first block gets a plain tensor, not a collective's wrapper: a compiled block would otherwise drop the
    # embedding's gradient (compat.resolve_async_collective).
    model.tok_embeddings.register_forward_hook(lambda mod, inputs, out: resolve_async_collective(out))
    if model.args.tie_embeddings:  # both are split over the vocabulary rows (Shard(0)): one parameter again
        model.output.weight = model.tok_embeddings.weight
