"""The Mixture-of-Experts feed-forward of the decoder: a linear router computed in fp32, softmax, top-k (renormalised
when the model says so), and SwiGLU experts held as 3-D weights [experts, in, out] computed with torch._grouped_mm
(one expert after another for the sizes it does not take: grouped_mm_takes); dropless (every token reaches its top_k
experts, no capacity).

Routing is transformers' (Qwen3-MoE and Mixtral): probabilities = softmax(router(x)), the top_k of them choose the
experts, their values (renormalised with norm_topk_prob) weight the experts' outputs. Load balancing, set by the
model builder from `[moe] load_balance`:
- aux_loss: transformers' auxiliary loss E * sum_e f_e * P_e (f_e: the share of top-k slots expert e got, P_e: its
  mean probability, both averaged over the layers), with its statistics taken per sequence, so that the loss does
  not depend on how the global batch is split over ranks and microbatches (for one sequence it is transformers');
- aux_free: DeepSeek-V3's per-expert bias, added to the probabilities to choose the experts (not to weight them) and
  moved before each optimizer step against the load each expert got (update_load_balance); the bias is part of the
  model from then on (it chooses experts in generation too; an HF export, whose architecture has none, drops it);
- none.

With expert parallelism (parallel/ep.py) each rank holds experts / ep of the experts, and the tokens travel to their
experts' ranks and back with all_to_all_single of uneven sizes. Under tensor parallelism (models/decoder_tp.py) each
tp rank routes its own share of the tokens (tp_group).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.models.feed_forward import FeedForward
from titanlite.models.swiglu import swiglu


class _SumGradOverGroup(torch.autograd.Function):
    """Identity; the gradient is summed over the group (a weight every rank applies to its own tokens)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """x, whose gradient is summed over the group's ranks (a tensor each rank uses for its own part of the work)."""
    return _SumGradOverGroup.apply(x, group)


class _SumOverGroup(torch.autograd.Function):
    """The sum over the group on every rank; the gradient passes as it is (each rank holds the same copy of the loss
    that uses the sum, so each rank's own part gets that copy's gradient once)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    """Identity; the gradient is multiplied by `scale` (see parallel/ep.py: the experts' FSDP group is not the
    dense one)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of uneven sizes along dim 0; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def grouped_mm_takes(dim: int, hidden: int, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm computes experts of these sizes in this dtype: it needs every row of its operands
    to start on a 16-byte boundary (dim and hidden multiples of 4 in fp32, of 8 in bf16)."""
    per_row = 16 // dtype.itemsize
    return dim % per_row == 0 and hidden % per_row == 0


class GroupedMatmul:
    """Rows grouped by expert (counts per expert) times their expert's matrix of a stack [experts, in, out]:
    torch._grouped_mm, or one expert after another (transformers' loop) for the sizes it does not take
    (grouped_mm_takes). A stack is unbound, not sliced, in the loop: its gradient is one stack."""

    def __init__(self, counts: torch.Tensor):
        self.counts, self.ends, self._splits = counts, counts.cumsum(0).to(torch.int32), None

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if grouped_mm_takes(x.shape[1], w.shape[2], w.dtype):
            return torch._grouped_mm(x, w, offs=self.ends)
        if self._splits is None:
            self._splits = self.counts.tolist()  # a host sync, as the token exchange's
        return torch.cat([p @ we for p, we in zip(x.split(self._splits), w.unbind(0), strict=True)])


class GroupedExperts(nn.Module):
    """n_experts SwiGLU experts: w1 and w3 [experts, dim, hidden], w2 [experts, hidden, dim]; with biases (gpt-oss)
    b1, b3 [experts, hidden] and b2 [experts, dim]; swiglu_limit > 0: gpt-oss's clamped SwiGLU (swiglu). Given tokens
    sorted by expert and the count per expert, returns their outputs in the same order. With expert parallelism
    (ep > 1) the weights are split over the ep ranks by expert and the tokens are exchanged with them."""

    def __init__(
        self, n_experts: int, dim: int, hidden: int, biases: bool = False, swiglu_limit: float = 0.0, alpha=1.702
    ):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        if biases:
            self.b1 = nn.Parameter(torch.empty(n_experts, hidden))
            self.b3 = nn.Parameter(torch.empty(n_experts, hidden))
            self.b2 = nn.Parameter(torch.empty(n_experts, dim))
        else:
            self.b1 = self.b3 = self.b2 = None
        self.swiglu_limit, self.alpha = swiglu_limit, alpha
        # LoRA on the experts (models/expert_lora.py): low-rank factors of the fused gate/up and of the down weights
        self.gate_up_proj = self.down_proj = None
        self.ep, self.ep_group = 1, None  # set by parallel/ep.py
        self.grad_scale = 1.0  # set by parallel/ep.py

    # Eager under torch.compile: torch 2.13's compiled _grouped_mm takes bf16 only (its meta kernel checks), and the
    # token exchange reads sizes on the host; the rest of the block compiles around it.
    @torch.compiler.disable
    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep == 1:
            return self._compute(tokens, counts)
        return self._exchange(tokens, counts)

    def _local(self, w: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's experts of a stack (FSDP has gathered the rest), its gradient scaled (parallel/ep.py)."""
        w = w.to_local() if isinstance(w, DTensor) else w
        return w if self.grad_scale == 1.0 or w is None else _ScaleGrad.apply(w, self.grad_scale)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up, self.swiglu_limit, self.alpha)

    def _compute(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3, w2, b1, b3, b2 = (self._local(w) for w in (self.w1, self.w3, self.w2, self.b1, self.b3, self.b2))
        tokens, mm, rows = tokens.to(w1.dtype), GroupedMatmul(counts), tokens.shape[0]
        gate, up = mm(tokens, w1), mm(tokens, w3)
        if b1 is not None:  # each row's expert's bias (output_size: no host sync)
            gate = gate + b1.repeat_interleave(counts, dim=0, output_size=rows)
            up = up + b3.repeat_interleave(counts, dim=0, output_size=rows)
        if self.gate_up_proj is not None and not self.gate_up_proj.disabled:
            delta = self.gate_up_proj.delta(tokens, mm, self._local)
            gate, up = gate + delta[:, : gate.shape[1]], up + delta[:, gate.shape[1] :]
        hidden = self._act(gate, up)
        out = mm(hidden, w2)
        if b2 is not None:
            out = out + b2.repeat_interleave(counts, dim=0, output_size=rows)
        if self.down_proj is not None and not self.down_proj.disabled:
            out = out + self.down_proj.delta(hidden, mm, self._local)
        return out

    def _exchange(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, group, local = self.ep, self.ep_group, self.n_experts // self.ep
        send = counts.view(ep, local)  # to each ep rank, per expert it holds
        recv = torch.empty_like(send)  # from each ep rank, per expert this rank holds
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()  # the sizes: a host sync per layer
        got = _AllToAll.apply(tokens, recv_splits, send_splits, group)
        # what arrived is ordered by source rank, then expert; the matmuls want it by expert
        expert_of = torch.arange(local, device=tokens.device).repeat(ep).repeat_interleave(recv.flatten())
        by_expert = expert_of.argsort(stable=True)
        out = self._compute(got[by_expert], recv.sum(0))[by_expert.argsort()]
        return _AllToAll.apply(out, send_splits, recv_splits, group)


class MoE(nn.Module):
    """The Mixture-of-Experts feed-forward of one block (see the module doc): x (batch, seq, dim) -> same shape.

    score_func softmax or sigmoid; n_group > 1: the top_k are chosen among the experts of the topk_group groups
    whose two best scores (routing bias included) sum highest; the chosen weights are multiplied by scaling;
    shared_hidden > 0: a SwiGLU of that size (the shared experts) adds its output for every token; biases: the router
    and the experts have biases (gpt-oss, whose top-k-then-softmax equals softmax, top-k and renormalisation)."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        hidden: int,
        norm_topk_prob: bool,
        score_func: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        scaling: float = 1.0,
        shared_hidden: int = 0,
        biases: bool = False,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 1.702,
    ):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.score_func, self.n_group, self.topk_group, self.scaling = score_func, n_group, topk_group, scaling
        self.router = nn.Linear(dim, n_experts, bias=biases)
        self.experts = GroupedExperts(n_experts, dim, hidden, biases, swiglu_limit, swiglu_alpha)
        self.shared = FeedForward(dim, shared_hidden) if shared_hidden else None
        # aux_free's routing bias: state of the run, checkpointed with the model (zeros for the other modes)
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=True)
        # top-k slots each expert got in this optimizer step on this rank (update_load_balance reads and clears it)
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts), persistent=False)
        self.load_balance = "none"  # set by the model builder
        self.block, self.n_blocks = 0, 1  # its block's index among the model's (update_load_balance's row), of how many
        self.tp_group = None  # under tensor parallelism: the ranks that each route their own share of the tokens
        # the ranks whose tokens make up the same sequences (tp, and context parallelism's cp x tp): their load-
        # balancing statistics are summed (the router's gradient only over tp: FSDP already reduces it over cp)
        self.sequence_group = None
        self.last_counts: torch.Tensor | None = None  # this forward's slots per expert
        self.last_sequence_stats: tuple[torch.Tensor, torch.Tensor] | None = None  # aux_loss: (P, f) per sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        weight, bias = self.router.weight, self.router.bias
        if self.tp_group is not None:
            weight = _SumGradOverGroup.apply(weight, self.tp_group)
            bias = None if bias is None else _SumGradOverGroup.apply(bias, self.tp_group)
        logits = F.linear(flat.float(), weight.float(), None if bias is None else bias.float())
        probs = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        # the routing bias (zeros unless aux_free moved it, or a DeepSeek-V3 folder's e_score_correction_bias)
        # chooses the experts, also after training; it never weights them
        choice = probs + self.expert_bias
        if self.n_group > 1:
            choice = self._within_best_groups(choice)
        chosen = choice.topk(self.top_k, dim=-1).indices  # (tokens, top_k)
        weights = probs.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0))
        if self.scaling != 1.0:
            weights = weights * self.scaling
        slots = chosen.flatten()
        counts = torch.bincount(slots, minlength=self.n_experts)
        self.last_counts = counts
        if self.load_balance == "aux_loss" and torch.is_grad_enabled():
            if self.score_func == "sigmoid":  # aux_loss's probabilities: the scores normalised per token (DeepSeek-V3)
                probs = probs / probs.sum(dim=-1, keepdim=True)
            self.last_sequence_stats = self._sequence_stats(probs, chosen, b, s)
        order = slots.argsort(stable=True)  # by expert
        token = order // self.top_k
        out = self.experts(flat[token], counts)
        out = out * weights.flatten()[order].unsqueeze(1).to(out.dtype)
        routed = torch.zeros_like(flat).index_add_(0, token, out.to(flat.dtype))
        if self.shared is not None:
            routed = routed + self._shared(flat)
        return routed.view(b, s, d)

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The choice scores with every expert outside the topk_group best groups at -inf (a group's score: the sum
        of its two best experts')."""
        tokens = choice.shape[0]
        grouped = choice.view(tokens, self.n_group, -1)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # (tokens, n_group)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_group, dim=-1).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared experts on these tokens; under tensor parallelism (each tp rank its own tokens) their weights'
        gradients are summed over the tp ranks, as the router's."""
        if self.tp_group is None:
            return self.shared(flat)
        w1, w3, w2 = (
            _SumGradOverGroup.apply(m.weight, self.tp_group) for m in (self.shared.w1, self.shared.w3, self.shared.w2)
        )
        return F.linear(F.silu(F.linear(flat, w1)) * F.linear(flat, w3), w2)

    def _sequence_stats(self, probs, chosen, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, f) per sequence of this layer, each (batch, experts): the mean probability of each expert and the
        share of top-k slots it got, over the sequence's tokens (all tp ranks' shares of them)."""
        e = self.n_experts
        prob_sum = probs.view(b, s, e).sum(dim=1)
        slots = torch.zeros(b, e, device=probs.device).scatter_add_(
            1, chosen.view(b, -1), torch.ones(b, s * self.top_k, device=probs.device)
        )
        sums, tokens = torch.cat([prob_sum, slots]), s
        group = self.sequence_group or self.tp_group
        if group is not None:
            sums = _SumOverGroup.apply(sums, group)
            tokens = s * dist.get_world_size(group)
        return sums[:b] / tokens, sums[b:] / tokens


class CarryLoadStats(torch.autograd.Function):
    """aux_loss across pipeline stages: transformers' loss E * sum_e f_e * P_e averages f and P over every layer of a
    sequence, so one stage's P gets the gradient E / L^2 x (the sum of f over all L layers). Forward carries the
    earlier stages' sums (f, P) per sequence to the next stage with the hidden states; backward carries the later
    stages' sum of f back as the carrier's gradient. carrier: (2, batch, experts); scale: the aux term's weight."""

    @staticmethod
    def forward(ctx, carrier, f_stage, p_stage, scale: float):
        ctx.f_stage, ctx.f_so_far, ctx.scale = f_stage, carrier[0] + f_stage, scale
        return torch.stack([ctx.f_so_far, carrier[1] + p_stage.detach()])

    @staticmethod
    def backward(ctx, grad):
        later = grad[0]  # the sum of f over the later stages' layers (zero on the last stage)
        back = torch.stack([ctx.f_stage + later, torch.zeros_like(later)])
        return back, None, ctx.scale * (ctx.f_so_far + later), None


def stage_load_stats(layers: list[MoE]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(f, P) of these layers' last forward summed over them, per sequence (f detached); None without aux_loss."""
    stats = [m.last_sequence_stats for m in layers if m.last_sequence_stats is not None]
    if not stats:
        return None
    return torch.stack([f for _, f in stats]).sum(dim=0).detach(), torch.stack([p for p, _ in stats]).sum(dim=0)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of a model, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss_sum(layers: list[MoE]) -> torch.Tensor | None:
    """transformers' load-balancing loss summed over this forward's sequences (aux_loss layers; None otherwise):
    E * sum_e f_e * P_e per sequence, f and P averaged over the layers."""
    stats = [m.last_sequence_stats for m in layers if m.last_sequence_stats is not None]
    if not stats:
        return None
    prob = torch.stack([p for p, _ in stats]).mean(dim=0)
    share = torch.stack([f for _, f in stats]).mean(dim=0)
    return layers[0].n_experts * (share * prob).sum()


def record_forward(layers: list[MoE]) -> None:
    """After a forward with gradients: add its slots per expert to each layer's count for the step."""
    for m in layers:
        if m.last_counts is not None:
            m.tokens_per_expert += m.last_counts
        m.last_counts = None


@torch.no_grad()
def update_load_balance(
    layers: list[MoE], bias_rate: float, want_stats: bool, table: LoadTable | None = None
) -> dict | None:
    """Before the optimizer step: the step's slots per expert summed over every rank (each token is routed on one
    rank), aux_free's bias moved by bias_rate against each expert's load (sign of mean - load, centred), the
    counts cleared; with want_stats, {'max_over_mean': per MoE block in block order (device tensor), ...} for the
    log. table: the whole model's blocks (needed on a pipeline rank that holds no MoE block, which still joins
    the sum; None: from the layers)."""
    if table is None:
        if not layers:
            return None
        m = layers[0]
        table = LoadTable(m.n_blocks, m.n_experts, tuple(range(m.n_blocks)), m.expert_bias.device)
    # one row per block of the whole model: with pipeline parallelism a rank holds some blocks, and the sum over
    # every rank fills each block's row from the ranks of its stage
    counts = torch.zeros(table.n_blocks, table.n_experts, device=table.device)
    if layers:
        counts[[m.block for m in layers]] = torch.stack([m.tokens_per_expert for m in layers])
    for m in layers:
        m.tokens_per_expert.zero_()
    if bias_rate <= 0 and not want_stats:
        return None
    if dist.is_initialized():
        dist.all_reduce(counts)
    if bias_rate > 0:
        delta = bias_rate * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
        delta -= delta.mean(dim=1, keepdim=True)
        for m in layers:
            m.expert_bias += delta[m.block]
    if not want_stats:
        return None
    moe = counts[list(table.moe_rows)]  # a dense block's row stays empty: it is no layer of the balance
    return {"max_over_mean": moe.max(dim=1).values / moe.mean(dim=1).clamp(min=1e-9)}


class LoadTable(NamedTuple):
    """The shape of a model's expert loads: its blocks, experts per block, the blocks that are MoE, the device."""

    n_blocks: int
    n_experts: int
    moe_rows: tuple[int, ...]
    device: torch.device
