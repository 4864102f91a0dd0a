"""The model-family protocol (no torch): what a family folder under models/ declares.

A family is its published shapes (flavors of ModelArgs), its nn.Module ("module:Class"; the module
builds from ModelArgs, names its shard groups and fills its weights by name), its tensor-parallel plan
("module:function"), and its HuggingFace
architecture: the config.json class it reads and writes, the switches that class implies, and a check
that refuses the config.json settings titanlite does not implement. Shapes, FLOPs, the memory
inventory and the tensor names all come from ModelArgs; a new family that is this decoder with
other switches is one folder and one line in models/registry.py (docs/model_families.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from titanlite.models.args import ModelArgs

BACKEND = "transformers"  # model.name of the transformers backend (models/transformers_backend/): no family folder


def no_extra_checks(config: dict, file: str) -> None:
    """A family whose config.json holds nothing beyond the shared fields to refuse."""


def no_extra_args(config: dict, file: str) -> dict:
    """A family whose config.json holds no ModelArgs fields beyond the shared ones."""
    return {}


def no_extra_keys(args: ModelArgs) -> dict:
    """A family whose export writes no config.json keys beyond the shared ones."""
    return {}


@dataclass(frozen=True)
class HFExperts:
    """How a HF Mixture-of-Experts architecture says how many experts it has and names its router and experts."""

    count_keys: tuple[str, ...]  # config.json keys of the expert count, the first present one read
    hidden_key: str  # config.json key of an expert's hidden size
    norm_topk_key: str | None  # config.json key of the top-k renormalisation; None: always renormalised
    router: str  # the router's HF name inside a layer ("mlp.gate.weight")
    weights: dict[str, str]  # titanlite's grouped weight (w1, w3, w2) -> the HF name of one expert's, with {e}
    norm_topk_default: bool = False  # the renormalisation when config.json leaves norm_topk_key out
    # the HF name of the routing bias that chooses experts ("mlp.gate.e_score_correction_bias"); None: the class has
    # none (an aux_free bias is then left out of exports)
    routing_bias: str | None = None
    router_bias: str | None = None  # the HF name of the router's bias (gpt-oss: "mlp.router.bias"); None: it has none
    # HF tensors that each hold every expert of a layer (gpt-oss), in place of `weights`: HF name inside a layer ->
    # the titanlite expert tensors it holds, interleaved along its last dimension (one: the tensor itself)
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class HFArchitecture:
    """A HuggingFace *ForCausalLM class as titanlite reads and writes its config.json."""

    architecture: str  # "Qwen3ForCausalLM"
    model_type: str  # "qwen3"
    # other model_type values of folders of this architecture (Kimi K2's "kimi_k2": DeepseekV3ForCausalLM)
    model_type_aliases: tuple[str, ...] = ()
    qk_norm: bool = False  # the class always has per-head q/k RMSNorm
    qkv_bias: bool = False  # the class always has q/k/v biases
    default_head_dim: int | None = None  # head_dim when config.json has none; None = hidden_size / heads
    check: Callable[[dict, str], None] = no_extra_checks  # ConfigError for settings titanlite does not implement
    export_extras: dict = field(default_factory=dict)  # config.json keys an export adds for this class
    experts: HFExperts | None = None  # a Mixture-of-Experts architecture's expert names and keys
    # max_position_embeddings -> the context pretraining used (YaRN's original context), where a release's differ
    pretraining_contexts: dict = field(default_factory=dict)
    attention_bias_is_qkv: bool = False  # config.json's attention_bias switches q/k/v biases (GLM-4.5), not refused
    extra_args: Callable[[dict, str], dict] = no_extra_args  # ModelArgs fields of the family's own config.json keys
    extra_keys: Callable[[ModelArgs], dict] = no_extra_keys  # config.json keys an export writes for those fields
    # config.json keys counting multi-token-prediction layers stored after the model's (not trained, as transformers'
    # class skips them; an HF export carries them over from the folder the run started from)
    mtp_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """A model family: its name, published shapes, nn.Module and HF architecture."""

    name: str
    flavors: dict[str, ModelArgs]
    model: str  # "module:Class"
    hf: HFArchitecture
    # "module:function" applying tensor parallelism to the model in place: (model, tp_mesh, *, sequence_parallel,
    # loss_parallel, inference)
    tp_plan: str = "titanlite.models.decoder_tp:parallelize_decoder"
