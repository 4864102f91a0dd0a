"""An MoE model's load balancing in the training loop: the load-balancing loss's term of each microbatch, the routing
bias update before each optimizer step, and the step's expert loads for the log (models/moe.py holds the maths)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titanlite.models.moe import moe_layers, update_load_balance


class LoadBalance:
    """The [moe] settings applied to one model; every method is a no-op for a dense model.

    aux_loss: the objective is sum(token losses) / global counted tokens + coef * sum(aux per sequence) / global
    batch size; the trainer scales the first term by dp_degree / global tokens (FSDP averages over the dp ranks), so
    the aux term of a microbatch is scaled by coef * dp_degree / global batch size. Every tp rank of a dp rank holds
    the same aux values (their statistics are summed over tp), as it holds the same token losses.
    """

    def __init__(self, model: torch.nn.Module, moe_cfg, args, dims, global_batch_size: int):
        self.model, self.layers = model, moe_layers(model) if args.moe else []
        mode = moe_cfg.load_balance if self.layers else "none"
        coef = args.router_aux_loss_coef if moe_cfg.aux_loss_coef < 0 else moe_cfg.aux_loss_coef
        # FSDP averages over the cp ranks too, each holding the same aux values (their statistics are summed over cp)
        cp = getattr(dims, "cp", 1)
        self.aux_scale = coef * dims.dp_degree * cp / global_batch_size if mode == "aux_loss" else 0.0
        self.bias_rate = moe_cfg.bias_update_rate if mode == "aux_free" else 0.0
        self.tp, self.global_batch_size = dims.tp * cp, global_batch_size  # ranks holding the same aux values
        self._aux_sum: torch.Tensor | None = None  # this step's aux values on this rank (for the log)

    def aux_term(self) -> torch.Tensor | float:
        """The last forward's load-balancing loss, scaled for backward beside the token losses (0 without it)."""
        aux = getattr(self.model, "aux_loss_sum", None) if self.aux_scale else None
        if aux is None:
            return 0.0
        self._aux_sum = aux.detach() if self._aux_sum is None else self._aux_sum + aux.detach()
        return aux * self.aux_scale

    def step_done(self) -> dict | None:
        """After the step's backward passes, before the optimizer step: the routing bias moves (aux_free) and the
        step's loads per layer are summed over the ranks; {'max_over_mean', 'aux_sum'} as device tensors."""
        if not self.layers:
            return None
        stats = update_load_balance(self.layers, self.bias_rate, want_stats=True)
        if self._aux_sum is not None:
            stats["aux_sum"], self._aux_sum = self._aux_sum, None
        return stats

    def report(self, stats: dict | None) -> dict | None:
        """The logged figures of a step's stats, as plain numbers (a host sync, and an all-reduce with aux_loss: call on
        every rank): the busiest expert's load over the mean, in the worst layer and averaged over the layers, and the
        mean load-balancing loss per sequence."""
        if stats is None:
            return None
        share = stats["max_over_mean"]
        worst = int(share.argmax())
        out = {
            "busiest_over_mean": float(share[worst]),
            "busiest_layer": worst,
            "busiest_over_mean_avg": float(share.mean()),
        }
        if "aux_sum" in stats:
            aux = stats["aux_sum"].clone()
            if dist.is_initialized():
                dist.all_reduce(aux)
            out["aux_loss"] = aux.item() / self.tp / self.global_batch_size
        return out
