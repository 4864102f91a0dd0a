"""What one block keeps for backward, in bytes per token on one rank, from the model's arguments: with no activation
checkpointing ('none'), full AC ('full'), selective 'op' ('op') and selective 'op' under TorchTitan's every-second-
matmul policy ('op_every_second'). Counted from what autograd saves in models/decoder.py, checked against torch's
MemTracker without tensor parallelism (tests/test_activation_checkpoint.py, tests/test_memory_estimate.py).

Per token, with a = the compute dtype's bytes, q = n_heads * head_dim, kv = kv_heads * head_dim (each rank's share
under tensor parallelism, as are the heads and the FFN's hidden size):

    norms (2, over dim)   fp32 input and x/rms, the output, fp32 1/rms
    qk-norm (Qwen3)       fp32 input and x/rms over q and k, fp32 1/rms per head
    no AC                 norms + (2*q + 2*kv + 4*ffn) * a + fp32 logsumexp per head
                          (q, k, v, the attention output; the gate and up projections, silu and their product)
    full AC               dim * a (the block's input)
    selective 'op'        (3*dim + 2*q + 2*kv + 2*ffn) * a + logsumexp: the input and every matmul
                          output (q/k/v, attention, out, gate/up, down)
    'op', every second    (2*dim + 2*q + kv + ffn) * a + logsumexp: the input, attention and the 1st,
      matmul              3rd, ... matmul output (q, v, gate, down); k, out and up are recomputed

Each of 'none', 'op' and 'op_every_second' is a sum of parts: the norms (no AC only) or the block's input (the
others), attention (attention_parts: plain, with sinks, or multi-head latent attention), the FFN (dense_ffn_parts or
moe_ffn_parts) and attention's logsumexp with what context parallelism gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("none", "op", "op_every_second")  # the modes summed from parts; 'full' keeps the block's input only


@dataclass(frozen=True)
class RankShare:
    """One block's sizes on one rank: a = bytes per activation element; heads, q, kv and ffn are this rank's share
    under tensor parallelism; share is the fraction of the residual stream's tokens it holds (1 / tp with sequence
    parallelism); moe: whether the block's FFN is routed."""

    a: int
    tp: int
    heads: int
    kv_heads: int
    q: int
    kv: int
    ffn: int
    share: float
    moe: bool


def rank_share(args, act_bytes: int, tp: int, sequence_parallel: bool, layer: int | None) -> RankShare:
    """The sizes of block `layer` (None: an MoE block of an MoE model) on one of tp ranks."""
    heads, kv_heads = args.n_heads // tp, args.kv_heads // tp
    return RankShare(
        a=act_bytes,
        tp=tp,
        heads=heads,
        kv_heads=kv_heads,
        q=heads * args.head_dim,
        kv=kv_heads * args.head_dim,
        ffn=args.ffn_hidden_dim // tp,
        share=1 / tp if sequence_parallel else 1.0,
        moe=args.moe if layer is None else args.is_moe_layer(layer),
    )


def block_activation_bytes(
    args,
    act_bytes: int,
    tp: int = 1,
    sequence_parallel: bool = True,
    frozen_norms: bool = False,
    cp: int = 1,
    layer: int | None = None,
) -> dict[str, int]:
    """Bytes per token block `layer` keeps for backward on one rank, per AC mode (the module doc's table).

    tp: tensor parallelism (with sequence parallelism the residual stream and the norms hold 1 / tp of the tokens,
    the matmuls keep their whole-sequence inputs and the out-projections' whole-sequence outputs); cp: context
    parallelism, per token of this rank's part of the sequences; frozen_norms: the norms' weights get no gradients (a
    LoRA base) and keep no fp32 x/rms; layer: the block (None: an MoE block of an MoE model; a dense block of an MoE
    model keeps the dense FFN's)."""
    s = rank_share(args, act_bytes, tp, sequence_parallel, layer)
    norms = norm_bytes(args, s, frozen_norms)
    attention, lse = attention_parts(args, s, cp)
    ffn = moe_ffn_parts(args, s) if s.moe else dense_ffn_parts(args, s)
    block_input = args.dim * s.a * s.share
    none = norms + attention[0] + ffn[0] + lse
    op = block_input + attention[1] + ffn[1] + lse
    second = block_input + attention[2] + ffn[2] + lse
    return {"none": int(none), "full": int(block_input), "op": int(op), "op_every_second": int(second)}


def norm_bytes(args, s: RankShare, frozen_norms: bool) -> float:
    """The block's two norms (and Qwen3's q/k norms) with no AC: fp32 input and x/rms, the output, fp32 1/rms; the
    tokens of the residual stream on this rank, and the all-gathered whole-sequence inputs of the matmuls beside."""
    d, a, share = args.dim, s.a, s.share
    gathered = 1 if s.moe else 2  # the whole-sequence inputs of attention (and the dense FFN)
    norms = (2 * d * (4 + 4 + a) + 2 * 4) * share + gathered * d * a * (1 - share)
    if s.moe and not args.n_shared_experts:  # nothing saves the ffn norm's output: the router saves its fp32 copy
        norms -= d * a * share
    if args.qk_norm:
        norms += (s.q + s.kv) * (4 + 4) + 4 * (s.heads + s.kv_heads)  # its output is RoPE's saved input
    if frozen_norms:
        norms -= 2 * d * 4 * share + ((s.q + s.kv) * 4 if args.qk_norm else 0)
    return norms


def attention_parts(args, s: RankShare, cp: int) -> tuple[tuple[float, float, float], float]:
    """Attention's bytes per MODES (its matmul outputs and what the kernel keeps: q, k, v, its output), and the
    logsumexp with the other cp ranks' keys and values, gathered."""
    if args.mla:
        return mla_parts(args, s, cp)
    q, kv, a = s.q, s.kv, s.a
    # the other cp ranks' keys and values, gathered: kept by attention and, as the CPU's SDPA measures, once more
    # in the contiguous layout it computes in (MemTracker, benchmarks/memory_estimate.py cp2_fp32)
    lse = 4 * s.heads + 4 * kv * a * (cp - 1)
    parts = ((2 * q + 2 * kv) * a, (2 * q + 2 * kv) * a, (2 * q + kv) * a)
    if args.attention_sinks:  # q, k, v and the output 8 features wider (models/sinks.py), and a copy of the output
        parts = ((2 * q + 2 * kv) * a * (args.head_dim + 8) / args.head_dim + q * a, *parts[1:])
    return parts, lse


def mla_parts(args, s: RankShare, cp: int) -> tuple[tuple[float, float, float], float]:
    """Multi-head latent attention, in place of q/k/v: the latents and their norms (fp32 input and x/rms), q and the
    expanded k, the kv_b projection's output (v is a view of it) and the attention output."""
    a, heads, q = s.a, s.heads, s.q
    rq, r, rope, vd = args.q_lora_rank, args.kv_lora_rank, args.qk_rope_head_dim, args.value_dim
    kv_b = heads * (args.qk_nope_head_dim + vd)
    latents = (2 * rq + 2 * r + rope) * a + 8 * (rq + r) + 8
    lse = 4 * heads + 4 * (q + heads * vd) * a * (cp - 1)
    # v is zero-padded to the q/k head dim for the attention kernel (models/rope_attention.attend), which keeps
    # q, k, the padded v and its output; kv_b's output is not kept (k is a copy, v a padded copy)
    parts = (
        latents + (4 * q + heads * vd) * a,
        (rq + r + rope + q + kv_b) * a,
        (rq + q) * a if rq else (q + kv_b) * a,  # the 1st, 3rd, ... matmul outputs kept
    )
    return parts, lse


def dense_ffn_parts(args, s: RankShare) -> tuple[float, float, float]:
    """A dense FFN per MODES: the gate and up projections, silu and their product (no AC); gate/up, down and the
    whole-sequence output before the reduce-scatter ('op'); gate and down ('op', every second)."""
    d, ffn, a = args.dim, s.ffn, s.a
    return 4 * ffn * a, (2 * d + 2 * ffn) * a, (d + ffn) * a


def moe_ffn_parts(args, s: RankShare) -> tuple[float, float, float]:
    """An MoE FFN per MODES, per routed token (each tp rank routes 1 / tp of them, and with expert parallelism receives
    as many on average; models/moe.py), with its shared experts as a dense FFN of their hidden size:

        no AC                 fp32 router input and probabilities (4*dim + 4*E), the top_k slots' indices and
                              weights, and the experts' (expert_activation_bytes)
        selective 'op'        the FFN's input, the router's logits and the grouped matmuls' outputs
        'op', every second    the router's logits (5th matmul of the block) and the up projection's output (7th)
    """
    d, e, a, tp = args.dim, args.n_experts, s.a, s.tp
    experts = expert_activation_bytes(args, a, tp)
    sh = args.shared_hidden_dim // tp
    shared = (4 * sh * a, 2 * sh * a, sh * a) if sh else (0, 0, 0)
    return (
        (4 * d + 4 * e + 4 + 28 * args.top_k) / tp + experts["none"] + shared[0],
        d * a + 4 * e / tp + experts["op"] + shared[1],
        4 * e / tp + experts["op_every_second"] + shared[2],
    )


def expert_activation_bytes(args, act_bytes: int, tp: int = 1) -> dict[str, float]:
    """Of an MoE block's bytes, those per token the experts keep (on the rank that holds them: with expert
    parallelism a rank keeps them for the tokens it receives, top_k per routed token on average): per slot the
    experts' input, the gate and up projections' outputs, silu and their product, and the output (gpt-oss's clamped
    SwiGLU: 5*h, its inputs and two temporaries of its backward)."""
    k, h, d, a = args.top_k, args.moe_hidden_dim, args.dim, act_bytes
    return {
        "none": k * a * (2 * d + (5 if args.swiglu_limit else 4) * h + 1) / tp,
        "full": 0.0,
        "op": k * a * (2 * h + d) / tp,
        "op_every_second": k * h * a / tp,
    }


def exchange_bytes(args, act_bytes: int, tp: int = 1) -> float:
    """Bytes per token of one MoE block's token exchange under expert parallelism: the routed tokens sent and
    received (top_k copies each way), alive while the block runs forward or backward."""
    return 2 * args.top_k * args.dim * act_bytes / tp
