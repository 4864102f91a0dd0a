"""HuggingFace config.json <-> ModelArgs (no torch), for any HFArchitecture of models/family.py: read a model
folder's shape, check it against a flavor, and write config.json / generation_config.json for an export."""

from __future__ import annotations

import json
import logging
import pathlib

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.config_fields import POSITIVE_INT as _POSITIVE_INT
from titanlite.models.config_fields import POSITIVE_NUMBER as _POSITIVE_NUMBER
from titanlite.models.config_fields import REQUIRED as _REQUIRED
from titanlite.models.config_fields import field as _field
from titanlite.models.config_fields import is_int as _is_int
from titanlite.models.config_fields import is_positive_number as _is_positive_number
from titanlite.models.family import HFArchitecture
from titanlite.models.hf_rope import rope_from_config, rope_to_config

logger = logging.getLogger("titanlite")

CONFIG = "config.json"
# ModelArgs field -> config.json key, for the fields a checkpoint's weights depend on.
SHAPE_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_hidden_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "tie_embeddings": "tie_word_embeddings",
}


def is_hf_folder(path: str | pathlib.Path) -> bool:
    """A folder with config.json and safetensors weights (a HuggingFace model folder)."""
    p = pathlib.Path(path).expanduser()
    return p.is_dir() and (p / CONFIG).is_file() and any(p.glob("*.safetensors"))


def missing_weights_note(folder: pathlib.Path) -> str:
    """Why a folder with a config.json is not a HuggingFace model folder titanlite reads: no *.safetensors (with
    how to convert the pickled pytorch_model*.bin it may hold instead)."""
    note = "has a config.json but no *.safetensors weights (a HuggingFace model folder needs both)"
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        note += (
            f"; its *.bin / *.pt weights are pickles, which can run code when opened, so titanlite reads only "
            f"safetensors: convert them once where you trust the files, e.g. transformers' "
            f"AutoModelForCausalLM.from_pretrained('{folder}').save_pretrained('<new folder>')"
        )
    return note


def pickled(folder: pathlib.Path) -> bool:
    """Whether a folder holds pickled weights (*.bin, *.pt): a model folder titanlite does not read."""
    return any(folder.glob("*.bin")) or any(folder.glob("*.pt"))


def hf_folder(initial_load_path: str) -> pathlib.Path | None:
    """checkpoint.initial_load_path when it names a HuggingFace model folder (one with *.safetensors)."""
    path = pathlib.Path(initial_load_path).expanduser() if initial_load_path else None
    return path if path is not None and path.is_dir() and any(path.glob("*.safetensors")) else None


def read_config(folder: str | pathlib.Path) -> dict:
    """config.json of a model folder as transformers applies it to the folder's weights; ConfigError naming the
    file when it is missing or not a JSON object.

    A config that ties the embeddings while the weights hold their own, different lm_head.weight is read as
    untied (with a warning), as transformers does: the file's lm_head is the output projection.
    """
    path = pathlib.Path(folder).expanduser() / CONFIG
    if not path.is_file():
        raise ConfigError(
            f"{path.parent} has no {CONFIG}: not a HuggingFace model folder (it needs config.json "
            f"and model.safetensors or *.safetensors with model.safetensors.index.json)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object but a {type(data).__name__}; expected {{...}}")
    if data.get("tie_word_embeddings") is True and (found := _differing_lm_head(path.parent)):
        if str(path) not in _WARNED_UNTIED:
            _WARNED_UNTIED.add(str(path))
            logger.warning(
                f"{path} says tie_word_embeddings = true, but {found}: using that lm_head.weight as the output "
                f"projection, untied from the embedding (as transformers does); set tie_word_embeddings to false "
                f"in {CONFIG} to silence this warning"
            )
        data = {**data, "tie_word_embeddings": False}
    return data


_WARNED_UNTIED: set[str] = set()  # config.json files whose untied lm_head this process has warned about
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_CHUNK = 64 * 1024**2  # bytes compared at a time


def _safetensors_header(file: pathlib.Path) -> tuple[int, dict]:
    """(where the data starts, the JSON header) of a .safetensors file; ValueError or OSError when unreadable."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > 100_000_000:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return 8 + size, header


def _differing_lm_head(folder: pathlib.Path) -> str | None:
    """Where the folder's lm_head.weight is, when its values differ from model.embed_tokens.weight's; None when
    there is no lm_head, it equals the embedding, or a file is unreadable (the weights check names that file)."""
    found = {}
    try:
        for file in sorted(folder.glob("*.safetensors")):
            start, header = _safetensors_header(file)
            for name in (EMBED, LM_HEAD):
                if name in header:
                    entry = header[name]
                    begin, end = (int(x) for x in entry["data_offsets"])
                    found[name] = (file, start + begin, end - begin, entry["dtype"], list(entry["shape"]))
        if LM_HEAD not in found or EMBED not in found:
            return None
        (lm_file, lm_at, size, *lm_kind), (em_file, em_at, em_size, *em_kind) = found[LM_HEAD], found[EMBED]
        where = f"{lm_file.name} holds an {LM_HEAD} that differs from {EMBED} (in {em_file.name})"
        if lm_kind != em_kind or size != em_size:
            return f"{where}: {lm_kind[0]} {lm_kind[1]} vs {em_kind[0]} {em_kind[1]}"
        with open(lm_file, "rb") as a, open(em_file, "rb") as b:
            a.seek(lm_at)
            b.seek(em_at)
            for offset in range(0, size, _CHUNK):
                n = min(_CHUNK, size - offset)
                if a.read(n) != b.read(n):
                    return where
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def holds_lm_head(folder: pathlib.Path) -> bool:
    """Whether a folder's safetensors files hold an lm_head.weight (read from their headers only)."""
    for file in pathlib.Path(folder).glob("*.safetensors"):
        try:
            if LM_HEAD in _safetensors_header(file)[1]:
                return True
        except (OSError, ValueError):
            continue  # the weights check names an unreadable file
    return False


_DTYPES = ("bfloat16", "float16", "float32", "float64")


def architecture_of(config: dict, source: str) -> tuple[str, list[str] | None]:
    """(model_type, architectures or None when config.json names none) of a config.json; ConfigError naming the
    file when they are mistyped. Without a model_type the folder is read as Llama's (as titanlite writes none
    other without one)."""
    file = str(pathlib.Path(source) / CONFIG)
    archs = _field(
        config,
        "architectures",
        file,
        None,
        lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
        'a list of class names such as ["LlamaForCausalLM"]',
    )
    return _field(config, "model_type", file, "llama", lambda v: isinstance(v, str), "a string"), archs


def args_from_config(config: dict, source: str, arch: HFArchitecture, family: str) -> ModelArgs:
    """The ModelArgs of a config.json of this HF architecture (source: its folder); ConfigError naming the file,
    the field, its value and what is valid for a missing, mistyped or unsupported field."""
    file = str(pathlib.Path(source) / CONFIG)

    def positive_int(key, default=_REQUIRED):
        return _field(config, key, file, default, lambda v: _is_int(v) and v > 0, _POSITIVE_INT)

    def flag(key):
        return _field(config, key, file, False, lambda v: isinstance(v, bool), "true or false")

    qkv_bias = arch.qkv_bias or (arch.attention_bias_is_qkv and flag("attention_bias"))
    for key in ("mlp_bias",) if arch.attention_bias_is_qkv else ("attention_bias", "mlp_bias"):
        if flag(key):
            biases = " (q/k/v biases only, as Qwen2)" if arch.qkv_bias else ""
            raise ConfigError(
                f"{file} has {key} = true; titanlite's {arch.architecture} has no such biases{biases}: expected false"
            )
    act = _field(config, "hidden_act", file, "silu", lambda v: isinstance(v, str), "a string")
    if act != "silu":
        raise ConfigError(f"{file} has hidden_act = {act!r}; {arch.architecture} in titanlite uses 'silu'")
    arch.check(config, file)
    dtype_names = ", ".join(_DTYPES)
    for key in ("torch_dtype", "dtype"):
        _field(config, key, file, None, lambda v: v in _DTYPES, f"one of {dtype_names}")
    dim, heads = positive_int("hidden_size"), positive_int("num_attention_heads")
    even = "an even positive integer (RoPE rotates pairs of features)"
    # transformers' default when head_dim is absent or null: hidden_size // num_attention_heads (floored)
    default_head_dim = arch.default_head_dim or dim // heads
    head_dim = _field(config, "head_dim", file, default_head_dim, lambda v: _is_int(v) and v > 0 and v % 2 == 0, even)
    if config.get("head_dim") is None and (head_dim == 0 or head_dim % 2):
        raise ConfigError(
            f"{file} has no head_dim, and hidden_size // num_attention_heads = {dim} // {heads} = {head_dim} (what "
            f"transformers takes then) is not valid; expected {even}: add the model's head_dim to {CONFIG}"
        )
    kv_heads = positive_int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(
            f"{file}: num_key_value_heads = {kv_heads} is not valid; expected a divisor of "
            f"num_attention_heads = {heads}"
        )
    context = positive_int("max_position_embeddings", 8192)
    theta, rope_scaling = rope_from_config(config, file, context)
    moe = {}
    if arch.experts is not None:
        x = arch.experts
        n_experts, top_k = _expert_count(config, file, x.count_keys), positive_int("num_experts_per_tok")
        if top_k > n_experts:
            raise ConfigError(f"{file}: num_experts_per_tok = {top_k} is more than the {n_experts} experts")
        coef = _field(config, "router_aux_loss_coef", file, 0.001, lambda v: _is_positive_number(v) or v == 0, ">= 0")
        moe = dict(
            n_experts=n_experts,
            top_k=top_k,
            moe_hidden_dim=positive_int(x.hidden_key),
            norm_topk_prob=_field(
                config, x.norm_topk_key, file, x.norm_topk_default, lambda v: isinstance(v, bool), "true or false"
            )
            if x.norm_topk_key
            else True,
            router_aux_loss_coef=float(coef),
        )
    fields = dict(
        family=family,
        dim=dim,
        n_layers=positive_int("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=kv_heads,
        explicit_head_dim=None if head_dim * heads == dim and not arch.default_head_dim else head_dim,
        vocab_size=positive_int("vocab_size"),
        intermediate_size=positive_int("intermediate_size"),
        qk_norm=arch.qk_norm,
        qkv_bias=qkv_bias,
        norm_eps=float(_field(config, "rms_norm_eps", file, 1e-6, _is_positive_number, _POSITIVE_NUMBER)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_seq_len=min(context, 8192),
        context_length=context,
        pretraining_context=arch.pretraining_contexts.get(context, 0),
        tie_embeddings=flag("tie_word_embeddings"),
        **moe,
    )
    fields.update(arch.extra_args(config, file))  # the family's own keys (they may switch a shared field)
    return ModelArgs(**fields)


def _expert_count(config: dict, file: str, keys: tuple[str, ...]) -> int:
    """The expert count under any of its keys (transformers reads num_experts and num_local_experts as aliases of
    each other); ConfigError when absent, not a positive integer, or given twice with two values."""
    given = {k: config[k] for k in keys if config.get(k) is not None}
    for key in given:
        _field(config, key, file, _REQUIRED, lambda v: _is_int(v) and v > 0, _POSITIVE_INT)
    if len(set(given.values())) > 1:
        both = " and ".join(f"{k} = {v}" for k, v in given.items())
        raise ConfigError(f"{file} has {both}: two counts of the same experts; expected one of them, or equal values")
    if not given:
        names = " or ".join(repr(k) for k in keys)
        raise ConfigError(f"{file} has no {names}, which titanlite needs; expected {_POSITIVE_INT}")
    return next(iter(given.values()))


ROUTING_AND_MLA_FIELDS = (
    "score_func",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "n_shared_experts",
    "dense_layers",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "partial_rotary_factor",
    "attention_sinks",
    "sliding_window",
    "sliding_layers",
    "out_bias",
    "expert_biases",
    "swiglu_limit",
    "swiglu_alpha",
)


def mismatches(args: ModelArgs, hf: ModelArgs) -> list[str]:
    """'field: flavor value vs config.json key value' for every field the weights or the math depend on."""
    out = [f"family {args.family} vs {hf.family}"] if args.family != hf.family else []
    out += [
        f"{field} {getattr(args, field)} vs {key} {getattr(hf, field)}"
        for field, key in SHAPE_KEYS.items()
        if getattr(args, field) != getattr(hf, field)
    ]
    if args.rope_theta != hf.rope_theta:
        out.append(f"rope_theta {args.rope_theta} vs rope_theta {hf.rope_theta}")
    if args.rope_scaling != hf.rope_scaling:
        out.append(f"rope_scaling {args.rope_scaling} vs rope_scaling {hf.rope_scaling}")
    for field in ("n_experts", "top_k", "moe_hidden_dim", "norm_topk_prob", *ROUTING_AND_MLA_FIELDS):
        if getattr(args, field) != getattr(hf, field):
            out.append(f"{field} {getattr(args, field)} vs {getattr(hf, field)}")
    for field in ("qk_norm", "qkv_bias"):
        if getattr(args, field) != getattr(hf, field):
            out.append(f"{field} {getattr(args, field)} vs {getattr(hf, field)} (the architecture's)")
    if args.norm_eps != hf.norm_eps:
        out.append(f"norm_eps {args.norm_eps} vs rms_norm_eps {hf.norm_eps}")
    return out


def config_from_args(args: ModelArgs, arch: HFArchitecture, dtype: str, bos_id: int | None, eos_ids: list[int]) -> dict:
    """A config.json of this HF architecture for these arguments."""
    config = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "hidden_act": "silu",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": max(args.context_length, args.max_seq_len),
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": args.qkv_bias and arch.attention_bias_is_qkv,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        **arch.export_extras,
    }
    if arch.experts is not None:
        x = arch.experts
        config.update(
            {
                x.count_keys[0]: args.n_experts,
                "num_experts_per_tok": args.top_k,
                x.hidden_key: args.moe_hidden_dim,
                "router_aux_loss_coef": args.router_aux_loss_coef,
            }
        )
        if x.norm_topk_key:
            config[x.norm_topk_key] = args.norm_topk_prob
    config.update(arch.extra_keys(args))
    config.update(rope_to_config(args))  # both spellings: rope_scaling (transformers 4, vLLM), rope_parameters (5)
    if args.partial_rotary_factor != 1.0:  # transformers 5 reads it from rope_parameters
        config["rope_parameters"]["partial_rotary_factor"] = args.partial_rotary_factor
    return config


def generation_config(bos_id: int | None, eos_ids: list[int]) -> dict:
    """generation_config.json: the ids a generator starts with and stops at."""
    return {"bos_token_id": bos_id, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids, "do_sample": False}
