"""Muon for the blocks' weight matrices and AdamW for every other parameter, in one optimizer step
(optimizer.name = "Muon"; docs/optimizers.md).

Muon (Jordan et al. 2024, kellerjordan.github.io/posts/muon; Liu et al. 2025, "Muon is Scalable for LLM Training",
arXiv:2502.16982), as Jordan's code and torch.optim.Muon write it: B = mu B + (1 - mu) G; U = (1 - mu) G + mu B
(Nesterov) or B; O = Newton-Schulz(U), an approximate U V^T of U's SVD; W = W - lr wd W - lr scale(shape) O.
An MoE's 3-D experts weight [experts, in, out] is that many matrices.

Newton-Schulz needs the whole matrix, and the weights are sharded (FSDP, HSDP, TP, EP; PP puts whole blocks on a
rank). Each rank gathers the whole update U of every matrix it holds a shard of (DTensor.full_tensor over that
matrix's mesh); optimizer.muon_newton_schulz every_rank (the default) orthogonalises it on each of them, one_rank on
one rank of the mesh (round-robin) which broadcasts O; each rank keeps its own shard of O. Every rank of every
topology thus computes the update a single process computes (the same bits in both modes), and the momentum buffer
stays sharded like the weight. An experts stack sharded on its experts dim only (EP, FSDP over EP) holds whole
matrices on each rank: they are orthogonalised where they are, with no collective. TorchTitan's DistMuon gathers
each matrix to one rank and scatters the result, overlapping the ranks' work; one_rank here broadcasts each result
before the next matrix, which spreads the FLOPs but not the time on GPUs (docs/optimizers.md). The AdamW part is
torch.optim.AdamW itself, sharing this optimizer's param group and state (one state dict, one lr schedule, one
checkpoint part).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, tuned for a steep slope at zero
NS_EPS = 1e-7


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """A weight matrix of a block (attention, MLP, shared and routed experts), not a router's, a norm or a bias."""
    if not name.startswith("layers.") or ".router." in name:
        return False
    return param.ndim == 3 or (param.ndim == 2 and name.endswith(".weight"))


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Newton-Schulz's quintic iteration on each matrix (the last two dims), in `dtype` (bfloat16 as torch.optim.Muon):
    x / |x|, then x <- a x + (b x x^T + c (x x^T)^2) x, on the wide orientation."""
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    flat = x.reshape(-1, *x.shape[-2:])  # a batch of matrices; fused multiply-adds round once per term
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = flat @ flat.mT
        flat = torch.baddbmm(flat, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), flat, beta=a)
    x = flat.reshape(x.shape)
    return x.mT if tall else x


def lr_scale(shape: torch.Size, adjust: str) -> float:
    """The lr factor of one matrix: match_rms_adamw 0.2 x sqrt(max(rows, cols)) (Liu et al.: AdamW's update RMS),
    original sqrt(max(1, rows / cols)) (Jordan), rows and cols as an nn.Linear's (out, in)."""
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (shape[-1], shape[-2])  # experts: [e, in, out]
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _my_shard(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `whole` (the same on every rank), placed as `like`'s local tensor is."""
    if not isinstance(like, DTensor):
        return whole
    mesh = like.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()


def _orthogonalize_on_one_rank(
    whole: torch.Tensor, like: torch.Tensor, index: int, steps: int, dtype: torch.dtype
) -> torch.Tensor:
    """Newton-Schulz of `whole` (the same on every rank of `like`'s mesh) on one rank of that mesh, chosen round-robin
    by `index`, and its result broadcast to the others: along each mesh dim in turn, from the rank that holds it."""
    mesh = like.device_mesh
    owner = [int(c) for c in torch.unravel_index(torch.tensor(index % mesh.size()), tuple(mesh.shape))]
    mine = list(mesh.get_coordinate())
    if mine == owner:
        result = orthogonalize(whole, steps, dtype).contiguous()  # (sent as laid out)
    else:
        result = torch.empty(whole.shape, dtype=dtype, device=whole.device)
    for d in range(mesh.ndim):  # after dim d, every rank that matches the owner on dims > d holds it
        if mine[d + 1 :] == owner[d + 1 :] and mesh.size(d) > 1:
            dist.broadcast(result, group=mesh.get_group(d), group_src=owner[d])
    return result


class MuonAdamW(torch.optim.Optimizer):
    """Two param groups: group 0 the Muon matrices (lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr,
    distribution), group 1 everything else, stepped by an AdamW that shares this optimizer's group and state."""

    def __init__(self, muon_params, adamw_params, muon: dict, adamw: dict):
        self.adamw = torch.optim.AdamW(adamw_params, **adamw)
        super().__init__([{"params": muon_params, **muon}, self.adamw.param_groups[0]], {})
        self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share_with_adamw()

    def _share_with_adamw(self) -> None:
        """Optimizer.load_state_dict makes new group dicts and a new state: AdamW steps the same ones."""
        self.adamw.param_groups = [self.param_groups[1]]
        self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        if self.adamw.param_groups[0] is not self.param_groups[1] or self.adamw.state is not self.state:
            self._share_with_adamw()  # (a load through another path, e.g. DCP's set_optimizer_state_dict)
        group = self.param_groups[0]
        lr, decay, mu = group["lr"], group["weight_decay"], group["momentum"]
        steps, dtype = group["ns_steps"], getattr(torch, group.get("ns_dtype", "bfloat16"))
        for index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])  # (elementwise: on the shards)
            buf.lerp_(grad, 1 - mu)  # an average: (1 - mu) x the sum form, a scale Newton-Schulz removes
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            weight, scale = _local(p), -lr * lr_scale(p.shape, group["adjust_lr"])
            weight.mul_(1 - lr * decay)
            if whole_experts_here(p):  # each expert is its own matrix, and this rank holds whole experts
                weight.add_(orthogonalize(update, steps, dtype).to(p.dtype), alpha=scale)
                continue
            # Every rank of the matrix's mesh takes part in its gather (FSDP and TP give each rank a gradient).
            whole = _whole(_dtensor_like(p, update))
            if group["distribution"] == "one_rank" and isinstance(p, DTensor) and p.device_mesh.size() > 1:
                whole = _orthogonalize_on_one_rank(whole, p, index, steps, dtype)
            else:
                whole = orthogonalize(whole, steps, dtype)
            weight.add_(_my_shard(whole, p).to(p.dtype), alpha=scale)
        self.adamw.step()
        return None


def whole_experts_here(p: torch.Tensor) -> bool:
    """An experts stack [experts, in, out] sharded on its experts dim only: the local shard is whole matrices."""
    if p.ndim != 3:
        return False
    return not isinstance(p, DTensor) or all(pl.is_replicate() or getattr(pl, "dim", None) == 0 for pl in p.placements)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _dtensor_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def build_muon(model: torch.nn.Module, opt_cfg, adamw: dict) -> MuonAdamW:
    """Muon over the blocks' trainable weight matrices, AdamW (`adamw`: its keyword arguments) over the rest."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_muon_matrix(n, p)]
    others = [p for n, p in named if not is_muon_matrix(n, p)]
    return MuonAdamW(matrices, others, muon_hyperparameters(opt_cfg), adamw)


def muon_hyperparameters(opt_cfg) -> dict:
    """The Muon group's settings from [optimizer] (lr included)."""
    return {
        "lr": opt_cfg.muon_lr or opt_cfg.lr,
        "weight_decay": opt_cfg.weight_decay if opt_cfg.muon_weight_decay < 0 else opt_cfg.muon_weight_decay,
        "momentum": opt_cfg.muon_momentum,
        "nesterov": opt_cfg.muon_nesterov,
        "ns_steps": opt_cfg.muon_ns_steps,
        "ns_dtype": opt_cfg.muon_ns_dtype,
        "adjust_lr": opt_cfg.muon_adjust_lr,
        "distribution": opt_cfg.muon_newton_schulz,
    }


def muon_problem(cfg) -> str | None:
    """Why optimizer.name = "Muon" cannot train this job, or None: with CPU offload (every Newton-Schulz would run on
    the host) or with LoRA (an adapter trains two thin factors of a matrix)."""
    if cfg.optimizer.name.lower() != "muon":
        return None
    if cfg.training.enable_cpu_offload:
        return (
            f"optimizer.name = {cfg.optimizer.name!r} with training.enable_cpu_offload = true is not supported: the "
            "optimizer step runs on the host there, and Muon's Newton-Schulz of every matrix with it; use AdamW, or "
            "turn the offload off"
        )
    if cfg.lora.enable:
        return (
            f"optimizer.name = {cfg.optimizer.name!r} with lora.enable = true is not supported: Muon orthogonalises "
            "whole weight matrices, and a LoRA adapter trains two thin factors of one; use optimizer.name = 'AdamW' "
            "for adapters"
        )
    return None
