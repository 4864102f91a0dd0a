"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight), as transformers' DeepseekV3Attention computes it.

Keys and values come from one compressed latent per token: kv_a_proj maps the block's input to kv_lora_rank latent
features (RMSNorm'd, then kv_b_proj expands them to every head's no-RoPE key part and value) and qk_rope_head_dim
features of one RoPE key shared by every head. q comes from the input through q_a_proj, an RMSNorm and q_b_proj
(q_lora_rank > 0) or one projection (wq; q_lora_rank 0, DeepSeek-V2-Lite); each head's q is its no-RoPE part then
its RoPE part. RoPE rotates adjacent feature pairs (transformers' rope_interleave, the published layout), so the
weights load without a permutation. The softmax scale is 1/sqrt(qk head dim), times yarn_mscale(factor,
mscale_all_dim)^2 under DeepSeek's YaRN.

The KV cache of generation holds the expanded keys and values (every head's), not the latents: simple and exact,
at (qk + v head dims) x heads per position instead of kv_lora_rank + qk_rope_head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.models.args import ModelArgs
from titanlite.models.context_parallel import gather_sequence
from titanlite.models.hf_rope import yarn_mscale
from titanlite.models.kv_cache import LayerKV
from titanlite.models.moe import sum_grad_over_group
from titanlite.models.rope_attention import apply_rope, attend

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default for q_a_layernorm and kv_a_layernorm


def softmax_scale(args: ModelArgs) -> float:
    """The attention logits' scale of an MLA model (see the module doc)."""
    scale = args.head_dim**-0.5
    s = args.rope_scaling
    if s is not None and s.rope_type == "yarn" and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    cp_group = None  # context parallelism: as decoder.Attention's
    cp_inverse: torch.Tensor | None = None
    q_norm = k_norm = None  # no per-head q/k norm
    tp_group = None  # tensor parallelism (models/decoder_tp.py): the shared RoPE key's gradient is summed over it

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, h = args.dim, args.n_heads
        self.n_heads = self.n_kv_heads = h  # the KV cache holds every head's expanded keys and values
        self.head_dim, self.value_dim = args.head_dim, args.v_head_dim
        self.nope_dim, self.rope_dim, self.kv_rank = args.qk_nope_head_dim, args.qk_rope_head_dim, args.kv_lora_rank
        self.scale = softmax_scale(args)
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(d, args.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, h * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(d, h * self.head_dim, bias=False)
        self.kv_a_proj = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, h * (self.nope_dim + self.value_dim), bias=False)
        self.wo = nn.Linear(h * self.value_dim, d, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache: LayerKV | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.wq(x)
        q_nope, q_rope = q.view(b, s, -1, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(b, s, -1, self.nope_dim + self.value_dim)
        k_nope, v = kv.split([self.nope_dim, self.value_dim], dim=-1)
        if self.tp_group is not None:  # each tp rank's heads use it: its gradient is the sum of theirs
            k_rope = sum_grad_over_group(k_rope, self.tp_group)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope)  # one rotated key part, shared by every head
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.cp_group is not None and cache is None:  # every cp rank's keys and values, in sequence order
            k, v = (
                gather_sequence(k, self.cp_group, self.cp_inverse),
                gather_sequence(v, self.cp_group, self.cp_inverse),
            )
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out = attend(q, k, v, mask, scale=self.scale)
        else:
            k, v = cache.update(k, v)
            out = attend(q, k, v, mask, causal=cache.causal, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))
