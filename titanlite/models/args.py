"""The shape of a decoder model (no torch): what every family's published flavors and HF configs become.

Llama 3, Qwen3, Qwen2 and Mistral are one architecture (pre-norm RMSNorm blocks, RoPE, grouped-query
attention, SwiGLU) that differs in a few switches: per-head RMSNorm of q and k (Qwen3), q/k/v biases
(Qwen2), a head dimension of its own (Qwen3, some Mistrals), tied embeddings, the RoPE theta and
scaling. ModelArgs holds them, and answers what the rest of the package asks of a model's shape
(parameter shapes and counts, FLOPs per token, the activation bytes of a block) so that nothing outside
`models/` knows a parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

ROPE_SCALINGS = ("llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for contexts beyond pretraining's, as transformers computes it (rope_type): llama3
    (Llama 3.1+: low frequencies divided by factor, a smooth band between), linear (every frequency divided by
    factor: position interpolation) or yarn (YaRN: interpolation of the low frequencies, extrapolation of the high
    ones, a linear ramp between set by beta_fast / beta_slow rotations, and every rotation scaled by
    attention_factor; Qwen3's long-context recipe, DeepSeek, gpt-oss)."""

    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn: the context pretraining used
    rope_type: str = "llama3"
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: q and k rotations scaled by it (logits by its square)
    truncate: bool = True  # yarn: the ramp's ends rounded to whole feature pairs
    mscale_all_dim: float = 0.0  # yarn, DeepSeek's attention: softmax scale x yarn_mscale(factor, this)^2; 0 = none


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a decoder model of one family."""

    family: str = "llama3"  # the family in models/registry.py (its HF architecture, its module)
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None  # None = n_heads (no grouped-query attention)
    explicit_head_dim: int | None = None  # None = dim // n_heads (Qwen3 sets its own)
    vocab_size: int = 0  # 0 = take the tokenizer's size
    multiple_of: int = 256  # FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    intermediate_size: int | None = None  # the FFN hidden size itself (HF configs); None = from the two above
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048  # positions the RoPE table covers
    context_length: int = 8192  # the release's published context length
    pretraining_context: int = 0  # the context it was pretrained at, YaRN's original context; 0 = context_length
    tie_embeddings: bool = False
    release: str = ""  # the release of a published flavor (Llama 3, 3.1, 3.2, 3.3; Qwen3)
    attention: str = "causal"  # causal, or block_causal (attend within each document only)
    # Mixture of Experts (models/moe.py): every block's feed-forward is n_experts SwiGLU experts of moe_hidden_dim,
    # each token going to top_k of them; 0 experts = the dense SwiGLU of ffn_hidden_dim.
    n_experts: int = 0
    top_k: int = 0
    moe_hidden_dim: int = 0
    norm_topk_prob: bool = (
        True  # the top-k routing weights renormalised to sum to 1 (Qwen3-MoE's flag; Mixtral: always)
    )
    router_aux_loss_coef: float = 0.001  # the published weight of the load-balancing loss ([moe] aux_loss_coef = -1)
    router_init_std: float = 0.02  # the router's init; the test flavors use decisive routers (ties flip at 1e-7)
    # DeepSeek-V3 / GLM-4.5 routing (models/moe.py): sigmoid scores, the top-k chosen within the topk_group best of
    # n_group expert groups, the chosen weights times routed_scaling_factor, and n_shared_experts experts' worth of
    # SwiGLU (moe_hidden_dim * n_shared_experts) that every token goes through beside its routed ones.
    score_func: str = "softmax"  # softmax (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3, GLM-4.5)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    dense_layers: tuple[int, ...] = ()  # blocks of an MoE model whose feed-forward is the dense SwiGLU
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; models/mla.py), on when kv_lora_rank > 0: keys and values
    # from a compressed kv_lora_rank latent, q through a q_lora_rank one (0: one q projection), each head's q/k split
    # into qk_nope_head_dim features without RoPE and qk_rope_head_dim with it (one rotated key shared by the heads).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    partial_rotary_factor: float = 1.0  # the share of each head's features RoPE rotates (GLM-4.5: 0.5)
    # gpt-oss (models/sinks.py, models/layer_masks.py, models/moe.py): a learned logit per head that every query also
    # attends to (with a zero value), blocks that see only the last sliding_window positions, biases on the output
    # projection, the router and the experts, and the clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate).
    attention_sinks: bool = False
    sliding_window: int = 0  # the keys a query of a sliding_layers block sees: this many, its own position last
    sliding_layers: tuple[int, ...] = ()
    out_bias: bool = False  # a bias on attention's output projection
    expert_biases: bool = False  # biases on the router and on each expert's projections
    swiglu_limit: float = 0.0  # > 0: gate <= limit and |up| <= limit in gpt-oss's SwiGLU; 0: plain SwiGLU
    swiglu_alpha: float = 1.702  # gpt-oss's SwiGLU: gate * sigmoid(alpha * gate)

    def position_limit(self) -> int:
        """The positions the model is meant to reach: its published context (config.json's max_position_embeddings),
        the context its RoPE scaling stretches to (factor x the original), or its max_seq_len, whichever is most."""
        limit = max(self.context_length, self.max_seq_len)
        s = self.rope_scaling
        if s is not None and s.rope_type in ("linear", "yarn"):
            original = s.original_max_position_embeddings if s.rope_type == "yarn" else self.context_length
            limit = max(limit, int(s.factor * original))
        return limit

    @property
    def head_dim(self) -> int:
        """Features per head of q and k (MLA: the no-RoPE and RoPE parts together)."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def value_dim(self) -> int:
        """Features per head of v and of the attention output."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Features per head that RoPE rotates (the first ones of each head; MLA: its RoPE part)."""
        if self.mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether block `layer` attends to the last sliding_window positions only."""
        return layer in self.sliding_layers

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek)."""
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        """Whether the blocks' feed-forward is a Mixture of Experts (all but dense_layers)."""
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer`'s feed-forward is the Mixture of Experts (else the dense SwiGLU)."""
        return self.moe and layer not in self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        """The blocks whose feed-forward is the Mixture of Experts."""
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    @property
    def shared_hidden_dim(self) -> int:
        """The hidden size of an MoE block's shared experts (one SwiGLU); 0 without."""
        return self.moe_hidden_dim * self.n_shared_experts

    @property
    def ffn_hidden_dim(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def with_overrides(self, **kw) -> ModelArgs:
        return replace(self, **kw)

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter of one block's attention, by its name inside the block."""
        d, h = self.dim, self.n_heads
        if self.mla:
            qk, r = self.head_dim, self.kv_lora_rank
            shapes = {}
            if self.q_lora_rank:
                shapes.update(
                    {
                        "attention.q_a_proj.weight": (self.q_lora_rank, d),
                        "attention.q_a_norm.weight": (self.q_lora_rank,),
                        "attention.q_b_proj.weight": (h * qk, self.q_lora_rank),
                    }
                )
            else:
                shapes["attention.wq.weight"] = (h * qk, d)
            shapes.update(
                {
                    "attention.kv_a_proj.weight": (r + self.qk_rope_head_dim, d),
                    "attention.kv_a_norm.weight": (r,),
                    "attention.kv_b_proj.weight": (h * (self.qk_nope_head_dim + self.v_head_dim), r),
                    "attention.wo.weight": (d, h * self.v_head_dim),
                }
            )
            return shapes
        q, kv = h * self.head_dim, self.kv_heads * self.head_dim
        shapes = {
            "attention.wq.weight": (q, d),
            "attention.wk.weight": (kv, d),
            "attention.wv.weight": (kv, d),
            "attention.wo.weight": (d, q),
        }
        if self.qkv_bias:
            shapes.update({"attention.wq.bias": (q,), "attention.wk.bias": (kv,), "attention.wv.bias": (kv,)})
        if self.qk_norm:
            shapes.update({"attention.q_norm.weight": (self.head_dim,), "attention.k_norm.weight": (self.head_dim,)})
        if self.out_bias:
            shapes["attention.wo.bias"] = (d,)
        if self.attention_sinks:
            shapes["attention.sinks"] = (h,)
        return shapes

    def block_shapes(self, layer: int | None = None) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter of transformer block `layer` (None: an MoE block of an MoE model), by its name
        inside the block."""
        d, ffn = self.dim, self.ffn_hidden_dim
        shapes = self.attention_shapes()
        if self.moe and (layer is None or self.is_moe_layer(layer)):  # experts as 3-D [experts, in, out] weights
            e, h = self.n_experts, self.moe_hidden_dim
            shapes.update(
                {
                    "feed_forward.router.weight": (e, d),
                    "feed_forward.experts.w1": (e, d, h),
                    "feed_forward.experts.w3": (e, d, h),
                    "feed_forward.experts.w2": (e, h, d),
                }
            )
            if self.expert_biases:
                shapes.update({"feed_forward.router.bias": (e,), "feed_forward.experts.b1": (e, h),
                               "feed_forward.experts.b3": (e, h), "feed_forward.experts.b2": (e, d)})  # fmt: skip
            if self.n_shared_experts:
                s = self.shared_hidden_dim
                shapes.update(
                    {
                        "feed_forward.shared.w1.weight": (s, d),
                        "feed_forward.shared.w3.weight": (s, d),
                        "feed_forward.shared.w2.weight": (d, s),
                    }
                )
        else:
            shapes.update(
                {
                    "feed_forward.w1.weight": (ffn, d),
                    "feed_forward.w3.weight": (ffn, d),
                    "feed_forward.w2.weight": (d, ffn),
                }
            )
        shapes.update({"attention_norm.weight": (d,), "ffn_norm.weight": (d,)})
        return shapes

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter of the model by its state-dict name (a tied output projection included)."""
        out = {"tok_embeddings.weight": (self.vocab_size, self.dim)}
        for i in range(self.n_layers):
            out.update({f"layers.{i}.{name}": shape for name, shape in self.block_shapes(i).items()})
        out.update({"norm.weight": (self.dim,), "output.weight": (self.vocab_size, self.dim)})
        return out

    def tied_copies(self) -> tuple[str, ...]:
        """State-dict names that are the same tensor as an earlier one (not stored again in HF folders)."""
        return ("output.weight",) if self.tie_embeddings else ()

    def param_counts(self) -> dict[str, int]:
        """Parameter counts: total (a tied weight once), embedding, non_embedding (the output projection in it);
        with experts also active and active_non_embedding: what one token computes with (top_k of the experts)."""
        blocks = sum(_numel(s) for i in range(self.n_layers) for s in self.block_shapes(i).values())
        embedding = self.vocab_size * self.dim
        output = self.vocab_size * self.dim
        non_embedding = blocks + self.dim + output  # + final norm
        total = embedding + non_embedding - (output if self.tie_embeddings else 0)
        per_expert = 3 * self.dim * self.moe_hidden_dim + (2 * self.moe_hidden_dim + self.dim) * self.expert_biases
        idle = len(self.moe_layers) * (self.n_experts - self.top_k) * per_expert
        return {
            "total": total,
            "embedding": embedding,
            "non_embedding": non_embedding,
            "active": total - idle,
            "active_non_embedding": non_embedding - idle,
        }

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at this sequence length (see titanlite/sizing/flops.py); an MoE
        counts the parameters a token is computed with (top_k experts), not every expert; a sliding-window block's
        attention, the keys of its window."""
        keys = sum(
            min(seq_len, self.sliding_window) if self.is_sliding_layer(i) else seq_len for i in range(self.n_layers)
        )
        attention = 6 * self.n_heads * (self.head_dim + self.value_dim) * keys
        return 6 * self.param_counts()["active_non_embedding"] + attention


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def args_to_dict(args: ModelArgs) -> dict:
    """The arguments as plain JSON-able values (saved next to checkpoints as model_args.json)."""
    out = {k: getattr(args, k) for k in args.__dataclass_fields__}
    if args.rope_scaling is not None:
        out["rope_scaling"] = dict(args.rope_scaling.__dict__)
    return out


def args_from_dict(data: dict) -> ModelArgs:
    """The inverse of args_to_dict (unknown keys are an error; a model_args.json from before families is Llama 3)."""
    data = dict(data)
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
    for key in ("dense_layers", "sliding_layers"):  # JSON lists
        if key in data:
            data[key] = tuple(data[key])
    return ModelArgs(**data)
