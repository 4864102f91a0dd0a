"""LoRA on a Mixture of Experts' experts, as peft puts it on transformers 5's fused expert tensors
(`target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`): one adapter per expert on the fused
gate/up weight (one A shared by the gate and up halves, a B over both) and one on the down weight, held as grouped
low-rank factors A [experts, in, r] and B [experts, r, out] and computed with the experts' grouped matmuls. They are
split by expert parallelism with the experts and never by tensor parallelism (the experts are not).

peft's layout of an expert adapter (its ParamWrapper): lora_A.weight [r * experts, in] (expert-major rows) and
lora_B.weight [out, r * experts] (rank-major columns). peft nests the two wrappers in the order the experts module
registers its parameters (gate_up_proj, then down_proj, in every family), whatever the order of target_parameters
(which it writes in a set's order): gate_up_proj's wrapper is the inner one, its keys under `experts.base_layer.`.
"""

from __future__ import annotations

import torch
from torch import nn

# titanlite's role -> (the expert stacks it adapts, gate then up: their outputs side by side); in the order
# transformers' fused experts register their parameters (which decides peft's nesting)
EXPERT_ROLES = {"experts.gate_up_proj": ("w1", "w3"), "experts.down_proj": ("w2",)}


class _Factor(nn.Module):
    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device="meta"))


class GroupedAdapter(nn.Module):
    """The low-rank factors of one expert stack: lora_a.weight [experts, in, r], lora_b.weight [experts, r, out]."""

    disabled = False  # True: the experts compute without it (models/lora.adapters_disabled)

    def __init__(self, n_experts: int, d_in: int, d_out: int, rank: int, scaling: float):
        super().__init__()
        self.lora_a, self.lora_b = _Factor(n_experts, d_in, rank), _Factor(n_experts, rank, d_out)
        self.scaling = scaling

    def delta(self, x: torch.Tensor, mm, local) -> torch.Tensor:
        """scaling * (x A_e) B_e for rows x grouped by expert (mm: the experts' GroupedMatmul; local: this rank's
        experts of a stack)."""
        a, b = local(self.lora_a.weight), local(self.lora_b.weight)
        return mm(mm(x.to(a.dtype), a), b) * self.scaling


def add_expert_adapters(experts: nn.Module, roles: list[str], rank: int, scaling: float) -> list[GroupedAdapter]:
    """Give a GroupedExperts its adapters for these expert roles (on the meta device, before expert parallelism)."""
    made = []
    for role in roles:
        stacks = [getattr(experts, w) for w in EXPERT_ROLES[role]]
        e, d_in = stacks[0].shape[:2]
        adapter = GroupedAdapter(e, d_in, sum(s.shape[2] for s in stacks), rank, scaling)
        setattr(experts, role.removeprefix("experts."), adapter)
        made.append(adapter)
    return made


def is_expert_adapter(name: str) -> bool:
    """Whether an adapter parameter's name is an expert adapter's."""
    return any(f".feed_forward.{role}.lora_" in name for role in EXPERT_ROLES)


def expert_peft_key(name: str, roles: list[str]) -> str:
    """An expert adapter's key in peft's adapter_model.safetensors (roles: the expert roles adapted, in any order)."""
    layer = name.split(".")[1]
    role = next(r for r in EXPERT_ROLES if f".feed_forward.{r}." in name)
    inner = "base_layer." if role == inner_expert_role(roles) else ""
    return f"base_model.model.model.layers.{layer}.mlp.experts.{inner}lora_{'A' if '.lora_a.' in name else 'B'}.weight"


def inner_expert_role(roles) -> str | None:
    """Of the expert roles adapted, the one whose peft wrapper is nested inside the other's (the first the experts
    module registers); None when one role or none is adapted."""
    adapted = [r for r in EXPERT_ROLES if r in roles]
    return adapted[0] if len(adapted) > 1 else None


def expert_to_peft(t: torch.Tensor, is_a: bool, interleaved: bool = False) -> torch.Tensor:
    """A [experts, in, r] -> [r * experts, in] (row e * r + j: A[e, :, j]); B [experts, r, out] -> [out, r * experts]
    (column j * experts + e: B[e, j, :]); interleaved: B's gate and up halves alternate column by column in HF's
    layout (gpt-oss's gate_up_proj)."""
    if is_a:
        return t.permute(0, 2, 1).reshape(-1, t.shape[1]).contiguous()
    if interleaved:
        half = t.shape[2] // 2
        t = torch.stack([t[..., :half], t[..., half:]], dim=-1).flatten(-2)
    return t.permute(2, 1, 0).reshape(t.shape[2], -1).contiguous()


def expert_from_peft(t: torch.Tensor, is_a: bool, n_experts: int, interleaved: bool = False) -> torch.Tensor:
    """The inverse of expert_to_peft."""
    if is_a:
        return t.reshape(n_experts, -1, t.shape[1]).permute(0, 2, 1).contiguous()
    t = t.reshape(t.shape[0], -1, n_experts).permute(2, 1, 0)
    return (torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1) if interleaved else t).contiguous()


@torch.no_grad()
def merge_expert_adapters(experts: nn.Module) -> None:
    """Fold a GroupedExperts' adapters into its stacks (W_e += scaling * A_e B_e) and zero B."""
    for role, stacks in EXPERT_ROLES.items():
        adapter = getattr(experts, role.removeprefix("experts."))
        if adapter is None:
            continue
        delta = torch.bmm(adapter.lora_a.weight.float(), adapter.lora_b.weight.float()) * adapter.scaling
        start = 0
        for w in stacks:
            stack = getattr(experts, w)
            stack.copy_((stack.float() + delta[..., start : start + stack.shape[2]]).to(stack.dtype))
            start += stack.shape[2]
        adapter.lora_b.weight.zero_()
