"""The decoder every built-in family uses: RMSNorm, RoPE, grouped-query attention (SDPA), SwiGLU
feed-forward; per-head q/k RMSNorm (Qwen3) and q/k/v biases (Qwen2) when the args ask for them.

The model is built on the meta device, sharded, moved with `to_empty`, then `init_weights` fills
every parameter from a generator seeded by (seed, parameter name) on the full tensor, keeping only
this rank's shard: the same seed gives bit-identical full weights at any sharding.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.loss import IGNORE_INDEX
from titanlite.models.args import ModelArgs
from titanlite.models.chunked_loss import chunked_linear_cross_entropy, chunked_token_logprobs
from titanlite.models.context_parallel import cp_attention_mask, gather_sequence, inverse_order, local_index
from titanlite.models.feed_forward import FeedForward
from titanlite.models.kv_cache import KVCache, LayerKV
from titanlite.models.layer_masks import block_mask, layer_masks, needs_sdpa_masks
from titanlite.models.lora import adapter_init, is_adapter
from titanlite.models.mla import LatentAttention
from titanlite.models.moe import MoE, aux_loss_sum, moe_layers, record_forward
from titanlite.models.nf4 import local_nf4, write_full
from titanlite.models.rope_attention import apply_rope, attend, block_causal_mask, cached_attention_mask, rope_table
from titanlite.models.sinks import attend_with_sinks

__all__ = ["ModelArgs", "Transformer", "TransformerBlock", "rope_table"]


class Attention(nn.Module):
    cp_group = None  # context parallelism: keys and values are gathered over this group (set_context_parallel)
    cp_inverse: torch.Tensor | None = None  # where each token sits among the gathered ones (set per forward)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=args.out_bias)
        # gpt-oss: a sink logit per head (models/sinks.py); split with the heads under tensor parallelism
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if args.attention_sinks else None
        if args.qk_norm:  # one RMSNorm over head_dim, shared by every head
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache: LayerKV | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1, not the configured head count: a tensor-parallel plan leaves each rank a part of the heads
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.cp_group is not None and cache is None:  # every cp rank's keys and values, in sequence order
            k, v = (
                gather_sequence(k, self.cp_group, self.cp_inverse),
                gather_sequence(v, self.cp_group, self.cp_inverse),
            )
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        causal = True
        if cache is not None:  # over the cached prefix and these positions; causal only when the cache was empty
            k, v = cache.update(k, v)
            causal = cache.causal
        if self.sinks is None:
            out = attend(q, k, v, mask, causal=causal)
        else:
            sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks  # this rank's heads
            out = attend_with_sinks(q, k, v, sinks, mask, causal=causal)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.sliding = args.is_sliding_layer(layer_id)  # attends to the last sliding_window positions only
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = LatentAttention(args) if args.mla else Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.is_moe_layer(layer_id):
            self.feed_forward = MoE(
                args.dim,
                args.n_experts,
                args.top_k,
                args.moe_hidden_dim,
                args.norm_topk_prob,
                score_func=args.score_func,
                n_group=args.n_group,
                topk_group=args.topk_group,
                scaling=args.routed_scaling_factor,
                shared_hidden=args.shared_hidden_dim,
                biases=args.expert_biases,
                swiglu_limit=args.swiglu_limit,
                swiglu_alpha=args.swiglu_alpha,
            )
            self.feed_forward.block, self.feed_forward.n_blocks = layer_id, args.n_layers  # its row in the loads
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache: LayerKV | None = None) -> torch.Tensor:
        """mask: what models/layer_masks.layer_masks built (this block takes its kind's)."""
        h = x + self.attention(self.attention_norm(x), rope, block_mask(mask, self.sliding), cache)
        return h + self.feed_forward(self.ffn_norm(h))


class OutputProjection(nn.Linear):
    """The output projection; given labels, it returns the summed cross-entropy instead of the logits, computed
    `chunk_tokens` tokens at a time (models/chunked_loss.py) so that no full logits tensor is ever made. Called as
    a module either way, so FSDP gathers and frees its weight around it as around any unit."""

    chunk_tokens = 0  # 0: never chunked (the model returns logits and the caller takes the loss)
    backward_once = True  # False: its backward may run twice (a pipeline schedule that splits backward)
    per_token = False  # True: given labels, each token's log-probability instead of the summed loss ([dpo])

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(x)
        group, start, weight = None, 0, self.weight
        if isinstance(self.weight, DTensor):  # split over the vocabulary by the tensor-parallel plan
            mesh, weight = self.weight.device_mesh, self.weight.to_local()
            x = x.to_local() if isinstance(x, DTensor) else x  # the whole sequence, on every tp rank
            group, start = mesh.get_group(), mesh.get_local_rank() * weight.shape[0]
        if self.per_token:
            return chunked_token_logprobs(x, weight, labels, self.chunk_tokens, IGNORE_INDEX, group, start)
        return chunked_linear_cross_entropy(
            x, weight, labels, self.chunk_tokens, IGNORE_INDEX, group, start, self.backward_once
        )


def is_transformer_block(name: str, module: nn.Module) -> bool:
    """Shard-unit predicate: every transformer block."""
    return isinstance(module, TransformerBlock)


class Transformer(nn.Module):
    """Decoder: tokens (batch, seq) -> logits (batch, seq, vocab).

    With args.attention = "block_causal", forward(tokens, positions) attends within each document only
    (a position of 0 starts one) and rotates by the positions; without positions it is causal.
    forward(tokens, cache=KVCache) continues the sequences held in the cache (see kv_cache.py): the
    tokens take positions cache.offset onwards, causally, and their keys and values are added to it.
    forward(tokens, labels=labels) returns the summed cross-entropy instead of the logits, computed in chunks of
    loss_chunk_tokens tokens (set by the model builder; 0 when the caller computes the loss from logits).
    """

    # Submodules that get their own fully_shard, as predicates over (qualified name, module).
    # Embedding and output groups are added by shard_groups(); the root is sharded last by the caller.
    shard_unit_predicates: tuple[Callable[[str, nn.Module], bool], ...] = (is_transformer_block,)

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("ModelArgs.vocab_size must be set (> 0) before building the model")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputProjection(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.attention_kernel = "auto"  # block-causal kernel: auto (flex on CUDA, else SDPA), sdpa or flex
        self.aux_loss_sum: torch.Tensor | None = None  # MoE with aux_loss: the last forward's, over its sequences
        self.register_buffer("rope", self._rope_table(), persistent=False)

    def _rope_table(self, device=None) -> torch.Tensor:
        a = self.args
        return rope_table(a.rope_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device=device)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        labels: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits (batch, positions, vocab); the summed loss when given labels; last_only: the logits of the last
        position alone (generation's next token: a long prompt never makes the whole (prompt x vocab) logits)."""
        rope, mask, n_keys = self.rope, None, tokens.shape[1]
        queries = torch.arange(n_keys, device=tokens.device)
        if self.cp_group is not None and cache is None:  # this rank's two chunks of every sequence
            queries, rope, mask = self.context_parallel_view(tokens.shape[1], tokens.device, positions)
            tokens, labels = tokens[:, queries], None if labels is None else labels[:, queries]
        elif cache is not None:
            if positions is not None:
                raise ValueError("forward with a KV cache takes no positions: the tokens follow the cache's offset")
            n = tokens.shape[1]
            start = cache.begin(n)
            rope, mask = self.rope[start : start + n], cached_attention_mask(start, n, tokens.device)
            queries, n_keys = queries + start, start + n
        elif positions is not None and self.args.attention == "block_causal":
            rope, mask = self._block_causal(positions)
        h = self.tok_embeddings(tokens)
        mask = layer_masks(self.args, mask, queries, n_keys, h.dtype)  # per kind of block (sliding windows, sinks)
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, mask) if cache is None else layer(h, rope, mask, cache.layers[i])
        if cache is not None:
            cache.advance(tokens.shape[1])
        if self.args.moe and torch.is_grad_enabled():  # the step's expert loads; the aux loss for the trainer
            layers = moe_layers(self)
            record_forward(layers)
            self.aux_loss_sum = aux_loss_sum(layers)
        if labels is not None:  # the summed loss, in chunks (see loss_chunk_tokens)
            return self.output(self.norm(h), labels)
        return self.output(self.norm(h[:, -1:] if last_only else h))

    def training_rope_mask(self, positions: torch.Tensor | None, dtype: torch.dtype | None, seq_len: int):
        """The rotation table and attention mask(s) of a forward of seq_len tokens without cache or context
        parallelism: block-causal over the documents that `positions` marks (args.attention = block_causal), else
        causal (mask None); one per kind of block for sliding windows and sinks (models/layer_masks.py); a boolean
        mask becomes additive in `dtype` (None: kept boolean)."""
        rope, mask = self.rope, None
        if positions is not None and self.args.attention == "block_causal":
            rope, mask = self._block_causal(positions)
        return rope, layer_masks(self.args, mask, torch.arange(seq_len, device=self.rope.device), seq_len, dtype)

    def _block_causal(self, positions: torch.Tensor):
        """The rotations by document position and the block-causal mask (SDPA's for sliding windows and sinks)."""
        kernel = "sdpa" if needs_sdpa_masks(self.args) else self.attention_kernel
        return self.rope[positions], block_causal_mask(positions, kernel)

    cp_group = None  # context parallelism (set_context_parallel): forward computes this rank's part of sequences

    def set_context_parallel(self, group, sequence_group=None) -> None:
        """Split every sequence over the ranks of `group` (context parallelism; models/context_parallel.py); an MoE
        sums its load-balancing statistics over sequence_group (the cp x tp ranks; None: `group`)."""
        self.cp_group = group
        for layer in self.layers:
            layer.attention.cp_group = group
        for m in moe_layers(self):
            m.sequence_group = sequence_group or group

    def context_parallel_view(self, seq_len: int, device, positions):
        """(the positions of this cp rank's two chunks of a sequence of seq_len, their rotations, its queries' mask
        over the whole sequence); the attention of every block here gathers keys and values in sequence order."""
        cp = dist.get_world_size(self.cp_group)
        index = local_index(seq_len, cp, dist.get_rank(self.cp_group), device)
        inverse = inverse_order(seq_len, cp, device)
        for layer in self.layers:
            if hasattr(layer, "attention"):  # (with pp: the blocks of this rank's stages)
                layer.attention.cp_inverse = inverse
        block = positions is not None and self.args.attention == "block_causal"
        rope = self.rope[positions[:, index]] if block else self.rope[index]
        kernel = "sdpa" if needs_sdpa_masks(self.args) else self.attention_kernel
        return index, rope, cp_attention_mask(index, seq_len, positions if block else None, kernel)

    @property
    def loss_chunk_tokens(self) -> int:
        """Tokens per chunk of the output projection and loss when forward gets labels; 0: forward takes none."""
        return self.output.chunk_tokens if self.output is not None else 0  # (None: on another pipeline stage)

    @loss_chunk_tokens.setter
    def loss_chunk_tokens(self, value: int) -> None:
        self.output.chunk_tokens = value

    load_balance = "none"  # an MoE model's load balancing (set_load_balance)

    def set_load_balance(self, mode: str) -> None:
        """The MoE load balancing of every block: aux_loss, aux_free or none (models/moe.py)."""
        self.load_balance = mode
        for m in moe_layers(self):
            m.load_balance = mode

    def expert_units(self) -> list[nn.Module]:
        """The experts of each MoE block, in block order: each its own fully_shard, on the expert mesh, before the
        block's (parallel/fsdp.py); none for a dense model."""
        return [m.experts for m in moe_layers(self)]

    def float8_linears(self, tp: int = 1) -> set[str]:
        """Qualified names of the projections float8 training may convert: each plain nn.Linear inside a block whose
        sizes, once split over `tp` tensor-parallel ranks, are multiples of 16 (the float8 matmul's need); never an MoE
        router (kept fp32), the embedding or the output projection. Under tensor parallelism an MoE's shared experts
        stay too: they are computed from their weights, not called (MoE._shared)."""
        moes = moe_layers(self)
        kept = {id(sub) for m in moes for sub in m.modules()} if tp > 1 else {id(m.router) for m in moes}
        step = 16 * tp  # either side of a linear may be the one the tensor-parallel plan splits
        return {
            name
            for name, m in self.layers.named_modules(prefix="layers")
            if type(m) is nn.Linear and id(m) not in kept and m.in_features % step == 0 and m.out_features % step == 0
        }

    def shard_groups(self) -> list[list[nn.Module]]:
        """Modules to shard together, one list per fully_shard call (the root excluded)."""
        units = [[m] for name, m in self.named_modules() if any(p(name, m) for p in self.shard_unit_predicates)]
        if self.args.tie_embeddings:
            return [[self.tok_embeddings, self.output]] + units  # a tied weight lives in exactly one group
        return [[self.tok_embeddings]] + units + [[self.norm, self.output]]

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (garbage after to_empty, and not in checkpoints); re-tie the output."""
        self.rope = self._rope_table(device=self.rope.device)
        for m in moe_layers(self):  # a resumed run's expert_bias comes from its checkpoint, loaded after this
            m.expert_bias.zero_()
            m.tokens_per_expert.zero_()
        # to_empty from the meta device gives each module its own tensor, untying a plain (unsharded) model;
        # a sharded one keeps the tie (both modules share one DTensor parameter in one FSDP group). A middle pipeline
        # stage holds neither module.
        tied = self.args.tie_embeddings and self.output is not None
        if tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter as a function of (seed, name) only, whatever the sharding; rebuild buffers."""
        for name, param in self.named_parameters():  # a tied weight is visited once, under its first name
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            gen = torch.Generator(device=param.device).manual_seed(_name_seed(seed, name))
            self._init_rule(name)(full, gen)
            if local_nf4(param) is not None:  # QLoRA's base: the whole weight quantized, this rank's rows kept
                write_full(param, full)
                continue
            if isinstance(param, DTensor):
                # src_data_rank=None: every rank drew the same full tensor; keep the local shard, no comms.
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)
        self.init_buffers()

    def _init_rule(self, name: str) -> Callable[[torch.Tensor, torch.Generator], None]:
        a = self.args
        if is_adapter(name):
            return adapter_init(name)
        if name.endswith("norm.weight"):
            return lambda t, g: t.fill_(1.0)
        if name.endswith((".bias", "experts.b1", "experts.b2", "experts.b3")):
            return lambda t, g: t.zero_()
        if name == "tok_embeddings.weight":
            std = a.dim**-0.5 if a.tie_embeddings else 1.0
            return lambda t, g: nn.init.normal_(t, 0.0, std, generator=g)
        if name == "output.weight":
            std = a.dim**-0.5
            return lambda t, g: nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=g)
        if name.endswith("router.weight"):
            return lambda t, g: nn.init.normal_(t, 0.0, a.router_init_std, generator=g)
        if name.startswith("layers."):
            layer_id = int(name.split(".")[1])
            depth_std = 0.02 / math.sqrt(2 * (layer_id + 1))
            std = (
                depth_std
                if name.endswith(("wo.weight", "w2.weight", "w3.weight", "experts.w2", "experts.w3"))
                else 0.02
            )
            return lambda t, g: nn.init.trunc_normal_(t, 0.0, std, -2 * std, 2 * std, generator=g)
        raise KeyError(f"no init rule for parameter {name}")


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)
