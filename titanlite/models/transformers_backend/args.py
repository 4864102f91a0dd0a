"""BackendArgs: the shape of a transformers model as titanlite sizes and checks it, read from a HuggingFace config.json
(the text model of a multimodal one). transformers is imported only when a backend model is asked for."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.family import BACKEND
from titanlite.models.hf_config import CONFIG, read_config

logger = logging.getLogger("titanlite")

# config.json keys that change the logits after the output projection: titanlite's chunked loss does not apply them
LOGIT_CHANGES = (
    "final_logit_softcapping", "logits_scaling", "logit_scale", "output_multiplier_scale", "lm_head_multiplier",
    "logits_soft_cap", "logits_mup_width_multiplier", "unpadded_vocab_size",
)  # fmt: skip
# config keys of randomness in training (dropout, router noise): set to 0, else the losses would depend on the ranks
NOISE = ("dropout", "pdrop", "jitter", "noise")
# module class names of layers that keep a state along the sequence (case-sensitive: "SeedOssModel" is not an SSM)
STATE_LAYERS = re.compile(
    r"Mamba|DeltaNet|LinearAttention|RgLru|RGLRU|Recurrent(Block|Layer)|SSM|ShortConv|Lightning|Rwkv|RWKV|LSTM|Retention"
)


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
    state_layers: str = ""  # the class of its layers that keep a state along the sequence (Mamba, Gated DeltaNet)
    hf_weights: bool = False  # the folder holds every weight (no initialisation from the seed is needed)
    frozen: tuple[str, ...] = ()  # name parts of parameters no loss reaches (a sparse-attention indexer): not trained
    linears: tuple[str, ...] = ()  # the decoder layers' trained nn.Linear modules (model.layers.0.self_attn.q_proj)
    tp_plan: dict = field(default_factory=dict)  # the config class's base_model_tp_plan (tensor parallelism: tp.py)
    pp_plan: dict = field(default_factory=dict)  # its base_model_pp_plan (pipeline stages: stage.py)

    @property
    def model_type(self) -> str:
        """The text model's model_type (e.g. qwen3_5_text)."""
        return self.hf_config.get("model_type", "")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter by its state-dict name (transformers' names), from the meta model."""
        return dict(self.counts.get("shapes", {}))

    @property
    def linear_roles(self) -> list[str]:
        """The names LoRA targets the decoder layers' linears by (peft's: their last name part), in model order."""
        return list(dict.fromkeys(path.rpartition(".")[2] for path in self.linears))

    def role_layers(self, role: str) -> set[int]:
        """The decoder layers that have a linear of this name (a hybrid model's layer kinds differ)."""
        return {int(path.split(".")[2]) for path in self.linears if path.rpartition(".")[2] == role}

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


def saved_backend_args(saved: dict) -> BackendArgs:
    """The BackendArgs a checkpoint's model_args.json holds (its JSON lists read back as tuples)."""
    fields = BackendArgs.__dataclass_fields__
    data = {k: v for k, v in saved.items() if k in fields and k != "rope_scaling"}
    for key in ("frozen", "linears", "dense_layers", "sliding_layers"):
        if isinstance(data.get(key), list):
            data[key] = tuple(data[key])
    return BackendArgs(**data)


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
    try:  # read as transformers reads a folder (its JSON encodings of infinities, say)
        cfg = transformers.AutoConfig.from_pretrained(source, trust_remote_code=False)
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
    own = text.to_dict() if text is not None else {}
    if config.get("auto_map") or own.get("auto_map"):
        raise ConfigError(
            f"{source}/{CONFIG} has auto_map: its model needs code from the folder (trust_remote_code), which "
            "titanlite never runs; use a model that transformers itself implements"
        )
    if config.get("quantization_config") or own.get("quantization_config"):
        method = (config.get("quantization_config") or {}).get("quant_method", "?")
        raise ConfigError(
            f"{source}/{CONFIG} has quantization_config (quant_method {method!r}): its weights are stored quantized, "
            "which the transformers backend does not dequantize; use the model's bf16 release (or dequantize it "
            "with transformers first)"
        )
    for key in LOGIT_CHANGES:
        value = own.get(key, getattr(text, key, None))
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
    if config.get("auto_map"):
        _refuse(config, None, source)
    text = text_config(config, source)
    _refuse(config, text, source)
    cls = causal_lm_class(text, source)
    _quiet(text, source)
    hf = text.to_dict()
    if tie is not None and tie != bool(getattr(text, "tie_word_embeddings", False)):
        raise ConfigError(
            f"model.tie_embeddings = {str(tie).lower()}: the transformers backend takes tie_word_embeddings from "
            f"{source}/{CONFIG}; leave model.tie_embeddings unset"
        )
    counts, experts, top_k, model = _counts(cls, text)
    _check_layout(cls, model, source)
    frozen = (".indexer.",) if getattr(text, "index_topk", None) else ()
    _say_what_differs(text, source, experts, frozen)
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
        state_layers=_state_layers(model, types),
        hf_weights=any(Path(config_folder).expanduser().glob("*.safetensors")),
        frozen=frozen,
        linears=_layer_linears(model, frozen),
        tp_plan=dict(getattr(text, "base_model_tp_plan", None) or {}),
        pp_plan={k: [list(v) for v in io] for k, io in (getattr(text, "base_model_pp_plan", None) or {}).items()},
    )


def _layer_linears(model, frozen: tuple[str, ...]) -> tuple[str, ...]:
    """The names of the decoder layers' plain nn.Linear modules that train (what LoRA can adapt)."""
    return tuple(
        name
        for name, m in model.named_modules()
        if name.startswith("model.layers.") and type(m) is torch.nn.Linear and not any(f in f".{name}." for f in frozen)
    )


def _counts(cls, text) -> tuple[dict, int, int, object]:
    """Parameter counts and shapes of the model built on the meta device, its routed experts and top-k, and the
    model."""
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
    return counts, experts, top_k, model


def _quiet(text, source: str) -> None:
    """Dropout and router noise off, with one line: random draws in training would make the losses depend on the
    number of ranks (every rank draws the same numbers) and a resume on another topology inexact."""
    noisy = {}
    for key, value in text.to_dict().items():
        if any(n in key for n in NOISE) and isinstance(value, float) and value > 0:
            setattr(text, key, 0.0)
            noisy[key] = value
    if noisy and os.environ.get("RANK", "0") == "0":
        set_ = ", ".join(f"{k} = {v:g}" for k, v in noisy.items())
        logger.warning(f"{source}/{CONFIG}: {set_} set to 0 (titanlite trains without dropout or router noise)")


def _say_what_differs(text, source: str, experts: int, frozen: tuple[str, ...]) -> None:
    """One line each (rank 0) for what the backend trains unlike transformers' own training of the model."""
    if os.environ.get("RANK", "0") != "0":
        return
    if experts:
        logger.warning(
            f"{source}: {text.model_type}'s experts train without load balancing: titanlite's [moe] settings do not "
            "reach transformers' MoE blocks, and its router's auxiliary loss is not added"
        )
    if frozen:
        logger.warning(
            f"{source}: {text.model_type}'s sparse-attention indexer ({frozen[0].strip('.')}) is not trained: no loss "
            "of a causal LM reaches it (it chooses keys); it keeps the folder's weights"
        )


def _check_layout(cls, model, source: str) -> None:
    """ConfigError unless the class has the layout the backend shards by (model.embed_tokens, model.layers, lm_head)
    and runs sdpa attention."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not (isinstance(layers, torch.nn.ModuleList) and hasattr(base, "embed_tokens") and hasattr(model, "lm_head")):
        raise ConfigError(
            f"{source}/{CONFIG}: {cls.__name__} does not have the layout the transformers backend shards by "
            "(model.embed_tokens, model.layers, lm_head), as older architectures (GPT-2, GPT-NeoX, OPT, Falcon, "
            "Mamba) do not; it is not supported yet"
        )
    if not getattr(cls, "_supports_sdpa", False):
        raise ConfigError(
            f"{source}/{CONFIG}: {cls.__name__} has no sdpa attention in transformers, which the backend runs (packed "
            "documents are masked through it); it is not supported yet"
        )
    if getattr(model.lm_head, "bias", None) is not None:
        raise ConfigError(
            f"{source}/{CONFIG}: {cls.__name__}'s output projection has a bias, which titanlite's chunked loss does "
            "not add; it is not supported by the transformers backend yet"
        )


def _state_layers(model, types) -> str:
    """The class name of the model's layers that keep a state along the sequence, or ''."""
    for t in types:
        if "linear_attention" in t or "mamba" in t or "conv" in t:
            return t.replace("_", " ")
    for m in model.modules():
        if STATE_LAYERS.search(type(m).__name__):
            return type(m).__name__
    return ""
