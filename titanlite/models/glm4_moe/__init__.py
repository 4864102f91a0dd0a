"""GLM-4.5 (355B-A32B) and GLM-4.5-Air (106B-A12B): grouped-query attention with q/k/v biases, RoPE on the first half
of each head (partial_rotary_factor 0.5), per-head q/k RMSNorm (GLM-4.5; not Air), dense first blocks, then
Mixture-of-Experts blocks with a shared expert and DeepSeek-V3's sigmoid routing with a correction bias; the
Glm4MoeForCausalLM architecture (model_type glm4_moe)."""

from __future__ import annotations

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.config_fields import field, is_positive_number
from titanlite.models.family import Family, HFArchitecture
from titanlite.models.hf_routing import SIGMOID_ROUTED_EXPERTS, note_mtp_layers, routing_args, routing_keys

MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")
# Glm4MoeConfig's defaults (transformers 5) for keys a config.json leaves out
DEFAULTS = dict(n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1, n_shared_experts=1)

_GLM = dict(family="glm4_moe", score_func="sigmoid", qkv_bias=True, partial_rotary_factor=0.5, n_kv_heads=8,
            explicit_head_dim=128, vocab_size=151552, norm_eps=1e-5, rope_theta=1_000_000.0, max_seq_len=8192,
            context_length=131072, n_shared_experts=1, top_k=8)  # fmt: skip
_SMALL = dict(family="glm4_moe", score_func="sigmoid", qkv_bias=True, partial_rotary_factor=0.5, norm_eps=1e-5,
              rope_theta=1_000_000.0, n_shared_experts=1)  # fmt: skip

# Shapes from the released config.json files (zai-org/GLM-4.5 and zai-org/GLM-4.5-Air, July 2025); tests check the
# counts (355B and 32B active, 106B and 12B active).
GLM4_MOE_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_SMALL, dim=256, n_layers=6, n_heads=8, n_kv_heads=4, explicit_head_dim=64,
                            qk_norm=True, intermediate_size=768, n_experts=8, top_k=2, moe_hidden_dim=128,
                            routed_scaling_factor=2.5, dense_layers=(0,)),
    "tiny": ModelArgs(**_SMALL, router_init_std=0.5, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, explicit_head_dim=32,
                      qk_norm=True, intermediate_size=160, n_experts=8, top_k=2, moe_hidden_dim=32,
                      routed_scaling_factor=2.5, dense_layers=(0,)),
    "Air": ModelArgs(**_GLM, dim=4096, n_layers=46, n_heads=96, intermediate_size=10944, n_experts=128,
                     moe_hidden_dim=1408, routed_scaling_factor=1.0, dense_layers=(0,)),
    "355B": ModelArgs(**_GLM, dim=5120, n_layers=92, n_heads=96, qk_norm=True, intermediate_size=12288, n_experts=160,
                      moe_hidden_dim=1536, routed_scaling_factor=2.5, dense_layers=(0, 1, 2)),
}  # fmt: skip


def glm_args(config: dict, file: str) -> dict:
    """The partial rotary, q/k norm, routing and block-layout fields of a GLM-4.5 config.json."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    where = config if config.get("partial_rotary_factor") is not None else rope
    factor = field(
        where, "partial_rotary_factor", file, 0.5, lambda v: is_positive_number(v) and v <= 1, "a number in (0, 1]"
    )
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // max(config.get("num_attention_heads", 1), 1))
    if int(head_dim * factor) % 2:
        raise ConfigError(
            f"{file}: partial_rotary_factor = {factor} rotates int({head_dim} x {factor}) = {int(head_dim * factor)} "
            f"features of each head of "
            f"{head_dim}; expected a share that rotates an even number of them (RoPE rotates pairs)"
        )
    note_mtp_layers(config, file, MTP_KEYS)
    qk_norm = field(config, "use_qk_norm", file, False, lambda v: isinstance(v, bool), "true or false")
    return dict(partial_rotary_factor=float(factor), qk_norm=qk_norm, **routing_args(config, file, DEFAULTS))


def glm_keys(args: ModelArgs) -> dict:
    """config.json's keys for an export of these arguments (the inverse of glm_args)."""
    return {**routing_keys(args), "partial_rotary_factor": args.partial_rotary_factor, "use_qk_norm": args.qk_norm}


FAMILY = Family(
    name="glm4_moe",
    flavors=GLM4_MOE_FLAVORS,
    model="titanlite.models.decoder:Transformer",
    hf=HFArchitecture(
        architecture="Glm4MoeForCausalLM",
        model_type="glm4_moe",
        attention_bias_is_qkv=True,
        extra_args=glm_args,
        extra_keys=glm_keys,
        mtp_keys=MTP_KEYS,
        export_extras={"output_router_logits": False},
        experts=SIGMOID_ROUTED_EXPERTS,
    ),
)
