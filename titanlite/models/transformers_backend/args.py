"""BackendArgs: the shape of a transformers model as titanlite sizes and checks it, read from a HuggingFace config.json
(the text model of a multimodal one). transformers is imported only when a backend model is asked for."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.family import BACKEND
from titanlite.models.hf_config import CONFIG, read_config

logger = logging.getLogger("titanlite")

# config.json keys that change the logits after the output projection: titanlite's chunked loss does not apply them
LOGIT_CHANGES = ("final_logit_softcapping", "logits_scaling", "logit_scale", "output_multiplier_scale")


@dataclass(frozen=True)
class BackendArgs(ModelArgs):
    """ModelArgs of a transformers model: the shared fields filled from its text config (sizes, layers, heads), the
    config itself (`hf_config`, what builds the model) and its parameter counts taken from the model built on the
    meta device (`counts`); `n_experts` stays 0: transformers' own MoE blocks are not titanlite's."""

    hf_config: dict = field(default_factory=dict)  # the text model's config (to_dict), model_type included
    counts: dict = field(default_factory=dict)  # total, embedding, non_embedding, active, active_non_embedding
    attention_layers: int = 0  # layers with softmax attention (a linear-attention or convolution layer has no keys)
    hf_experts: int = 0  # routed experts per MoE layer (for the summary)
    hf_top_k: int = 0

    @property
    def model_type(self) -> str:
        """The text model's model_type (e.g. qwen3_5_text)."""
        return self.hf_config.get("model_type", "")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter by its state-dict name (transformers' names), from the meta model."""
        return dict(self.counts.get("shapes", {}))

    def tied_copies(self) -> tuple[str, ...]:
        return ("lm_head.weight",) if self.tie_embeddings else ()

    def param_counts(self) -> dict[str, int]:
        """Parameter counts of the model as built (a tied weight once); active: what one token computes with."""
        return {k: v for k, v in self.counts.items() if k != "shapes"}

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x the parameters a token is computed with, plus softmax attention over
        `seq_len` keys in each attention layer (sliding-window layers: their window); linear-attention and
        convolution layers count as their parameters only (their state is O(1) per token)."""
        window = self.sliding_window or seq_len
        types = self.hf_config.get("layer_types") or ["full_attention"] * self.n_layers
        keys = sum(min(seq_len, window) if t == "sliding_attention" else seq_len for t in types if "attention" in t
                   and t != "linear_attention")  # fmt: skip
        attention = 6 * self.n_heads * 2 * self.head_dim * keys
        return 6 * self.param_counts()["active_non_embedding"] + attention


def text_config(config: dict, source: str):
    """transformers' config object of the text model a config.json describes (the text part of a multimodal one);
    ConfigError in one line when transformers cannot read it."""
    import transformers

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(
            f"{source}/{CONFIG}: model_type {model_type!r} is not one transformers {transformers.__version__} knows; "
            "upgrade transformers or use a folder of a model it implements"
        )
    try:
        cfg = transformers.AutoConfig.for_model(**config)
    except Exception as e:  # transformers' own validation: its message, one line
        raise ConfigError(f"{source}/{CONFIG}: transformers cannot read it: {' '.join(str(e).split())[:300]}") from None
    text = cfg.get_text_config(decoder=True)
    return text if isinstance(text, transformers.PretrainedConfig) else cfg  # (a text_config key it does not own)


def causal_lm_class(text, source: str):
    """transformers' *ForCausalLM class for a text config; ConfigError when there is none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
    except KeyError:
        raise ConfigError(
            f"{source}/{CONFIG}: model_type {text.model_type!r} has no causal language model class in transformers "
            "(it is not a text generator titanlite can train: an encoder, a vision or speech model?)"
        ) from None


def _refuse(config: dict, text, source: str) -> None:
    if config.get("auto_map") or text.to_dict().get("auto_map"):
        raise ConfigError(
            f"{source}/{CONFIG} has auto_map: its model needs code from the folder (trust_remote_code), which "
            "titanlite never runs; use a model that transformers itself implements"
        )
    for key in LOGIT_CHANGES:
        value = getattr(text, key, None)
        if value not in (None, 0, 1, 1.0):
            raise ConfigError(
                f"{source}/{CONFIG}: {key} = {value} changes the logits after the output projection, which "
                "titanlite's chunked loss does not apply; this model is not supported by the transformers backend yet"
            )


def backend_args(config_folder, vocab_size: int, seq_len: int, attention: str, tie: bool | None) -> BackendArgs:
    """The BackendArgs of a HuggingFace folder's config.json (weights or not), with the vocabulary and positions
    titanlite needs."""
    source = str(config_folder)
    config = read_config(config_folder)
    text = text_config(config, source)
    _refuse(config, text, source)
    cls = causal_lm_class(text, source)
    hf = text.to_dict()
    if tie is not None and tie != bool(getattr(text, "tie_word_embeddings", False)):
        raise ConfigError(
            f"model.tie_embeddings = {str(tie).lower()}: the transformers backend takes tie_word_embeddings from "
            f"{source}/{CONFIG}; leave model.tie_embeddings unset"
        )
    counts, experts, top_k = _counts(cls, text)
    n_layers = text.num_hidden_layers
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * n_layers)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return BackendArgs(
        family=BACKEND,
        dim=text.hidden_size,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        explicit_head_dim=head_dim,
        vocab_size=max(text.vocab_size, vocab_size),
        intermediate_size=getattr(text, "intermediate_size", None),
        max_seq_len=max(getattr(text, "max_position_embeddings", seq_len) or seq_len, seq_len),
        context_length=getattr(text, "max_position_embeddings", seq_len) or seq_len,
        tie_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        attention=attention,
        sliding_window=getattr(text, "sliding_window", None) or 0,
        hf_config=hf,
        counts=counts,
        attention_layers=sum(1 for t in types if t != "linear_attention" and "attention" in t),
        hf_experts=experts,
        hf_top_k=top_k,
    )


def _counts(cls, text) -> tuple[dict, int, int]:
    """Parameter counts and shapes of the model built on the meta device, and its routed experts and top-k."""
    import torch

    with torch.device("meta"):
        model = cls._from_config(text)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    experts = int(getattr(text, "num_experts", 0) or getattr(text, "n_routed_experts", 0)
                  or getattr(text, "num_local_experts", 0) or 0)  # fmt: skip
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    idle = expert_params * (experts - top_k) // experts if experts and top_k else 0
    counts = {
        "total": total,
        "embedding": embed,
        "non_embedding": total - embed,
        "active": total - idle,
        "active_non_embedding": total - embed - idle,
        "shapes": shapes,
    }
    return counts, experts, top_k
