"""An MoE model's load balancing in the training loop: the load-balancing loss's term of each microbatch, the routing
bias update before each optimizer step, and the step's expert loads for the log (models/moe.py holds the maths)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titanlite.models.moe import LoadTable, moe_layers, update_load_balance


class LoadBalance:
    """The [moe] settings applied to one model; every method is a no-op for a dense model.

    aux_loss: the objective is sum(token losses) / global counted tokens + coef * sum(aux per sequence) / global
    batch size; the trainer scales the first term by dp_degree / global tokens (FSDP averages over the dp ranks), so
    the aux term of a microbatch is scaled by coef * dp_degree / global batch size. Every tp rank of a dp rank holds
    the same aux values (their statistics are summed over tp), as it holds the same token losses.

    Fault tolerance (across_groups): the replica groups average their gradients, and the loads that move the routing
    bias are summed over the live groups, so that every group moves it alike, as one job of all the groups would.
    """

    def __init__(self, model: torch.nn.Module, moe_cfg, args, dims, global_batch_size: int):
        # (a pipeline rank may hold no MoE block: it still joins the step's sums over the ranks)
        self.model, self.layers = model, moe_layers(model) if args.moe else []
        self.moe = args.moe
        mode = moe_cfg.load_balance if args.moe else "none"
        self.moe_rows = tuple(args.moe_layers)
        device = next((b.device for b in model.buffers()), torch.device("cpu"))
        self.table = LoadTable(args.n_layers, args.n_experts, self.moe_rows, device)
        coef = args.router_aux_loss_coef if moe_cfg.aux_loss_coef < 0 else moe_cfg.aux_loss_coef
        # FSDP averages over the cp ranks too, each holding the same aux values (their statistics are summed over cp)
        cp = getattr(dims, "cp", 1)
        self.aux_scale = coef * dims.dp_degree * cp / global_batch_size if mode == "aux_loss" else 0.0
        self.bias_rate = moe_cfg.bias_update_rate if mode == "aux_free" else 0.0
        self.tp, self.global_batch_size = dims.tp * cp, global_batch_size  # ranks holding the same aux values
        self._aux_sum: torch.Tensor | None = None  # this step's aux values on this rank (for the log)
        self.groups = None  # fault tolerance: the replica groups (parallel/ft/groups.ReplicaGroups), see across_groups
        self._bias_before: list | None = None  # (routing bias, its value before this step moved it)

    def across_groups(self, groups) -> None:
        """Fault tolerance: balance over the live replica groups, `groups` (its .sum adds a tensor over them; it calls
        step_committed after each step). Each group trains 1 / group_count of the global batch and the groups'
        gradients are averaged, so the aux term is scaled by group_count (a mean over the live groups' sequences, as
        the token loss is over their tokens); a step that is not committed leaves the routing bias where it was."""
        self.groups = groups
        self.aux_scale *= groups.ft.group_count

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
        if not self.moe:
            return None
        if self.groups is not None and self.layers:
            self._loads_of_every_group()
        stats = update_load_balance(self.layers, self.bias_rate, want_stats=True, table=self.table)
        if self.aux_scale:  # (with pp, only the last stage's ranks hold aux values: the others add zero)
            aux = self._aux_sum if self._aux_sum is not None else torch.zeros((), device=stats["max_over_mean"].device)
            stats["aux_sum"], self._aux_sum = aux, None
        return stats

    def _loads_of_every_group(self) -> None:
        """Each rank's loads become the sum of this rank's over the live groups: update_load_balance's sum over this
        group's ranks then counts every group's tokens (exact integers in float32, the same in every group)."""
        counts = torch.stack([m.tokens_per_expert for m in self.layers])
        for m, summed in zip(self.layers, self.groups.sum(counts)):
            m.tokens_per_expert.copy_(summed)
        if self.bias_rate:
            self._bias_before = [(b, b.clone()) for b in self.routing_biases()]

    def routing_biases(self) -> list[torch.Tensor]:
        """aux_free: the MoE layers' routing biases (their persistent buffers); [] otherwise."""
        if not self.bias_rate:
            return []
        kept = [(m, set(m.state_dict(keep_vars=True))) for m in self.layers]
        return [b for m, names in kept for n, b in m.named_buffers() if n in names]

    def step_committed(self, committed: bool) -> None:
        """Fault tolerance, after the commit: a step that a group failed (retried, its sums meaningless) puts the
        routing bias back."""
        if not committed and self._bias_before is not None:
            with torch.no_grad():
                for bias, before in self._bias_before:
                    bias.copy_(before)
        self._bias_before = None

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
            "busiest_layer": self.moe_rows[worst],  # the block's index
            "busiest_over_mean_avg": float(share.mean()),
        }
        if "aux_sum" in stats:
            aux, sequences = stats["aux_sum"].clone(), self.global_batch_size
            if dist.is_initialized():
                dist.all_reduce(aux)
            if self.groups is not None:  # the live groups' parts of the global batch
                aux = self.groups.sum(aux)
                sequences = self.global_batch_size * self.groups.participants / self.groups.ft.group_count
            out["aux_loss"] = aux.item() / self.tp / sequences
        return out
