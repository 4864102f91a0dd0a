"""Expert parallelism: each MoE block's experts split by expert over the "ep" ranks of the expert mesh (dims.py), the
tokens exchanged with them (models/moe.py), and the experts' gradients put on the dense parameters' footing.

The experts become DTensors split on dim 0 (the expert index) over "ep", so the checkpoint holds the full
[experts, in, out] weights by their names and resumes at any ep. FSDP then shards what each rank holds over "efsdp"
(and replicates it over "dp_replicate") on the expert mesh; the other parameters keep the data-parallel mesh.

Gradient scale: FSDP averages a gradient over its own group. The dense parameters' group is the dp ranks, the
experts' is efsdp x replicate = dp_shard x tp / ep x replicate ranks, while every token reached its experts once
(through the exchange, or on the tp rank that routed it); the loss is scaled for the dense average, so the experts'
gradients are multiplied by tp / ep.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titanlite.models.registry import FAMILIES


def problem(cfg, dims, args, device_type: str | None = None, inference: bool = False) -> str | None:
    """Why expert parallelism cannot split this model's experts (or is asked of a dense model), or None."""
    ep, key = dims.ep, f"parallelism.expert_parallel_degree = {dims.ep}"
    if not args.moe:
        if ep > 1:
            moe = ", ".join(n for n, f in FAMILIES.items() if any(a.moe for a in f.flavors.values()))
            return (
                f"{key} splits a Mixture of Experts' experts, but model.name = {cfg.model.name!r} "
                f"({cfg.model.flavor}) has none; valid: 1, or an MoE family ({moe})"
            )
        return None
    if args.n_experts % ep:
        valid = ", ".join(str(d) for d in range(1, args.n_experts + 1) if args.n_experts % d == 0)
        return f"{key} does not divide the model's {args.n_experts} experts; valid: {valid}"
    if dims.tp > 1 and not inference and cfg.training.seq_len % dims.tp:
        return (
            f"parallelism.tensor_parallel_degree = {dims.tp} with a Mixture of Experts splits every sequence's tokens "
            f"over the tp ranks to route them, but training.seq_len = {cfg.training.seq_len} is not a multiple of "
            f"{dims.tp}; valid: a multiple of {dims.tp}"
        )
    return None


def apply_ep(model: nn.Module, expert_mesh: DeviceMesh | None, tp: int) -> int:
    """Split the experts of `model.expert_units()` over expert_mesh's "ep" dimension (on the meta device, before
    FSDP), bind their token exchange to those ranks and set their gradient scale; returns the ep degree."""
    ep = expert_mesh["ep"].size() if expert_mesh is not None else 1
    for experts in model.expert_units():
        if ep > 1:
            for module in experts.modules():  # the stacks, and LoRA's factors of them (models/expert_lora.py)
                for name, param in list(module.named_parameters(recurse=False)):
                    split = distribute_tensor(param, expert_mesh["ep"], [Shard(0)])
                    module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
            experts.ep, experts.ep_group = ep, expert_mesh.get_group("ep")
        experts.grad_scale = tp / ep
    return ep


def expert_fsdp_mesh(expert_mesh: DeviceMesh | None, dp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards the experts over: ("dp_replicate",) "efsdp" of the expert mesh, or the data-parallel
    mesh when there is none (ep 1, tp 1)."""
    if expert_mesh is None:
        return dp_mesh
    names = tuple(n for n in expert_mesh.mesh_dim_names if n != "ep")
    return expert_mesh[names]
