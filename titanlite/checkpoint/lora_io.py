"""LoRA adapters in and out: peft adapter folders (adapter_config.json + adapter_model.safetensors) read into a
run's adapters and written from a LoRA checkpoint, the merged HF export, and the checks that keep a LoRA
checkpoint on its own base (checkpoint/base_identity.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titanlite.checkpoint.base_identity import check_same_base, fingerprint
from titanlite.checkpoint.base_identity import read as read_base
from titanlite.checkpoint.catalog import read_metadata
from titanlite.checkpoint.consolidated import read_in_this_process
from titanlite.checkpoint.hf_folder import save_safetensors
from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.expert_lora import EXPERT_ROLES, inner_expert_role
from titanlite.models.hf_names import is_routing_bias
from titanlite.models.lora import (
    ADAPTER_A,
    PEFT_PREFIX,
    ROLE_MODULES,
    adapter_names,
    from_peft,
    is_adapter,
    is_backend,
    model_roles,
    peft_config,
    resolve_targets,
    to_peft,
    to_peft_name,
)
from titanlite.models.nf4 import nf4_block_table, quantized_linears
from titanlite.storage import location

logger = logging.getLogger("titanlite")

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def check_lora_resume(path: Path, lora, identity: dict | None, args: ModelArgs | None = None) -> None:
    """ConfigError when a checkpoint and the run disagree about LoRA (lora: the run's [lora] section), when its
    adapters were trained on another base than the run's (base_identity.check_same_base), or, given the model's
    args, with another lora.rank, alpha or targets."""
    saved = read_base(path)
    if lora.enable and saved is None:
        raise ConfigError(
            f"{path} holds a full-weight checkpoint, not LoRA adapters; lora.enable = true resumes only LoRA "
            "checkpoints: give the LoRA run its own job.dump_folder (or checkpoint.folder), or set lora.enable = false"
        )
    if not lora.enable and saved is not None:
        raise ConfigError(
            f"{path} holds only LoRA adapters (trained on the base {saved.get('path')}); resume it with "
            "lora.enable = true and the [lora] settings it was trained with, or export it merged with "
            "python -m titanlite.checkpoint export --format hf"
        )
    if not lora.enable:
        return
    check_same_base(saved, identity, str(path))
    trained = saved_lora(path)
    if args is not None and trained is not None and (diff := lora_differences(trained, lora, args, base=True)):
        key, then, now = diff[0]
        raise ConfigError(
            f"lora.{key} = {now!r}, but {path} was trained with lora.{key} = {then!r} ({path / 'job_config.toml'}): "
            f"its adapters mean something only with it; set lora.{key} = {then!r} to resume, or start a new "
            "job.dump_folder to train with the new value"
        )
    if args is not None and trained is not None and lora.base_dtype == "nf4":
        then, now = trained_nf4_blocks(saved, trained, args), nf4_block_table(meta_model(args), *nf4_sizes(lora))
        if changed := [n for n in now if now[n] != then.get(n)]:
            raise ConfigError(
                f"{path} was trained on a 4-bit base that quantized {changed[0]} in blocks of {then.get(changed[0])} "
                f"(block size, scaler block size; {len(changed) - 1} more differ), where this version quantizes it "
                f"in blocks of {now[changed[0]]}: its adapters mean something only on that base; resume it with the "
                "titanlite version that saved it, or start a new job.dump_folder"
            )


def nf4_sizes(lora) -> tuple[int, int]:
    """A [lora] section's largest NF4 block sizes: (nf4_block_size, nf4_scaler_block_size)."""
    return lora.nf4_block_size, lora.nf4_scaler_block_size


def meta_model(args: ModelArgs) -> torch.nn.Module:
    """The model of these args on the meta device (its shapes)."""
    from titanlite.models.registry import model_class

    with torch.device("meta"):
        return model_class(args.family)(args)


def base_record(cfg, args: ModelArgs | None) -> dict:
    """What a LoRA checkpoint records of its base (lora_base.json): its identity and, for a 4-bit base, the block
    sizes of each weight (nf4_blocks), which resume, export and sampling read back."""
    record = fingerprint(cfg.checkpoint.initial_load_path)
    if cfg.lora.base_dtype == "nf4" and args is not None:
        record["nf4_blocks"] = nf4_block_table(meta_model(args), *nf4_sizes(cfg.lora))
    return record


def trained_nf4_blocks(saved_base: dict | None, lora, args: ModelArgs) -> dict[str, list[int]]:
    """Weight name -> [block size, scaler block size] a 4-bit base was trained with (lora: that run's [lora]): as
    its lora_base.json records them; for a checkpoint saved before they were chosen per weight, lora's sizes for
    every weight; with no lora_base.json (a peft folder on a HF base), as nf4_blocks chooses them."""
    model = meta_model(args)
    if saved_base is None:
        return nf4_block_table(model, *nf4_sizes(lora))
    recorded = saved_base.get("nf4_blocks")
    if isinstance(recorded, dict):
        return {k: list(v) for k, v in recorded.items()}
    return {f"{name}.weight": list(nf4_sizes(lora)) for name in quantized_linears(model)}


def saved_lora(step: Path):
    """The [lora] section a checkpoint was saved with (its job_config.toml; defaults for keys it lacks), or None."""
    import tomllib

    from titanlite.config import Lora

    try:
        table = tomllib.loads((location(step) / "job_config.toml").read_text()).get("lora", {})
    except (OSError, ValueError):
        return None
    lora = Lora()
    for key, value in table.items() if isinstance(table, dict) else ():
        if hasattr(lora, key):
            setattr(lora, key, value)
    return lora


def lora_differences(trained, lora, args: ModelArgs, base: bool = False) -> list[tuple[str, object, object]]:
    """(key, trained value, this value) for each of rank, alpha, use_rslora and targets (compared as the roles they
    resolve to) where two [lora] sections give adapters of another shape or scale; base: also a 4-bit base quantized
    otherwise (base_dtype to or from nf4, nf4 block sizes), another model under the adapters."""
    out = []
    keys = ["rank", "alpha", "use_rslora", "targets"]
    if base and "nf4" in (getattr(trained, "base_dtype", None), lora.base_dtype):
        keys += ["base_dtype", "nf4_block_size", "nf4_scaler_block_size"]
    for key in keys:
        then, now = getattr(trained, key), getattr(lora, key)
        same = _roles(then, args) == _roles(now, args) if key == "targets" else then == now
        if not same:
            out.append((key, ",".join(then) if key == "targets" else then, ",".join(now) if key == "targets" else now))
    return out


def _roles(targets, args: ModelArgs) -> list[str] | None:
    try:
        return sorted(resolve_targets(list(targets), args))
    except ValueError:
        return None


def _read_peft_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / PEFT_CONFIG).read_text())
    except (OSError, ValueError) as e:
        what = "does not exist" if not folder.exists() else f"has no readable {PEFT_CONFIG} ({type(e).__name__}: {e})"
        raise ConfigError(
            f"lora.initial_adapter_path = {str(folder)!r} {what}; expected a peft adapter folder ({PEFT_CONFIG} + "
            f"{PEFT_WEIGHTS})"
        ) from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ConfigError(
            f"lora.initial_adapter_path = {str(folder)!r}: {PEFT_CONFIG} has peft_type "
            f"{config.get('peft_type') if isinstance(config, dict) else None!r}; only LORA adapters can be read"
        )
    return config


# adapter_config.json keys titanlite's LoRA cannot honour: key -> (what it does, the valid value)
UNSUPPORTED_PEFT_KEYS = {
    "use_dora": ("DoRA's magnitude vectors", "false"),
    "fan_in_fan_out": ("transposed (Conv1D) weights", "false"),
    "modules_to_save": ("whole trained copies of base modules", "null"),
    "rank_pattern": ("per-module ranks", "{}"),
    "alpha_pattern": ("per-module alphas", "{}"),
    "layers_to_transform": ("adapters on some blocks only", "null"),
    "layer_replication": ("replicated blocks", "null"),
    "lora_bias": ("a trained bias on each lora_B", "false"),
    "trainable_token_indices": ("trained embedding rows", "null"),
    "bias": ("trained biases of the base's projections", "'none'"),
    "alora_invocation_tokens": ("Activated LoRA: adapters on the tokens after the invocation only", "null"),
    "use_qalora": ("QA-LoRA's pooled inputs", "false"),
    "use_bdlora": ("block-diagonal adapters", "null"),
    "arrow_config": ("Arrow's routing among adapters", "null"),
    "monteclora_config": ("MonteCLoRA's sampled adapters", "null"),
    "kasa_config": ("KaSA's singular-value adapters", "null"),
    "velora_config": ("VeLoRA's compressed activations", "null"),
}
# adapter_config.json keys that do not change what the saved adapters compute: read (r, lora_alpha, the targets,
# exclude_modules), training-only (dropout), initialisation only (the *_config of init methods), or bookkeeping.
# Any other key with a value set is refused: a peft feature titanlite does not know may change the forward.
KNOWN_HARMLESS_PEFT_KEYS = {
    "r", "lora_alpha", "target_modules", "exclude_modules", "lora_dropout", "task_type", "peft_type", "auto_mapping",
    "peft_version", "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights", "layers_pattern",
    "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "qalora_group_size", "runtime_config", "ensure_weight_tying", "use_rslora", "target_parameters",
}  # fmt: skip


EXPERT_PARAMETERS = {f"mlp.{r}": r for r in EXPERT_ROLES}  # peft's target_parameters -> titanlite's expert role


def expert_order(folder: Path, config: dict) -> tuple[str, ...]:
    """The expert roles of a peft adapter's target_parameters (peft writes them in a set's order; its key names
    follow the experts module's registration order instead: expert_lora.inner_expert_role); ConfigError naming any
    other parameter."""
    params = config.get("target_parameters") or []
    if not isinstance(params, list) or (other := [p for p in params if p not in EXPERT_PARAMETERS]):
        shown = other[0] if isinstance(params, list) else params
        raise ConfigError(
            f"lora.initial_adapter_path = {str(folder)!r}: {PEFT_CONFIG} sets target_parameters with {shown!r}, "
            f"which titanlite's LoRA does not adapt; valid: {', '.join(EXPERT_PARAMETERS)} (an MoE's experts, "
            f"transformers' fused expert tensors)"
        )
    return tuple(EXPERT_PARAMETERS[p] for p in params)


def _check_supported(folder: Path, config: dict) -> None:
    unknown = [k for k, v in config.items() if k not in KNOWN_HARMLESS_PEFT_KEYS | UNSUPPORTED_PEFT_KEYS.keys() and v]
    if unknown:
        key = unknown[0]
        raise ConfigError(
            f"lora.initial_adapter_path = {str(folder)!r}: {PEFT_CONFIG} sets {key} = {config[key]!r}, a peft setting "
            "titanlite does not know (it may change what the adapters compute); valid: the key unset, null or false "
            "(titanlite reads r, lora_alpha and the adapted projections; one rank and alpha on the same projections "
            "of every block)"
        )
    for key, (what, valid) in UNSUPPORTED_PEFT_KEYS.items():
        value = config.get(key)
        if value not in (None, "none") if key == "bias" else bool(value):
            raise ConfigError(
                f"lora.initial_adapter_path = {str(folder)!r}: {PEFT_CONFIG} sets {key} = {value!r} ({what}), which "
                f"titanlite's LoRA does not support; valid: {key} = {valid} (one rank and alpha on the same "
                "projections of every block, nothing else trained)"
            )


def _module_roles(args: ModelArgs) -> dict[str, tuple[int, str]]:
    """peft module path (base_model.model.model.layers.0.self_attn.q_proj) -> (block, role), for every role the
    model can adapt."""
    if is_backend(args):
        return {f"{PEFT_PREFIX}{p}": (int(p.split(".")[2]), p.rpartition(".")[2]) for p in args.linears}
    out = {}
    for role in resolve_targets(["all"], args):
        for i in range(args.n_layers):
            name = f"layers.{i}.{ROLE_MODULES[role]}.{ADAPTER_A}.weight"
            out[to_peft_name(name, args).removesuffix(".lora_A.weight")] = (i, role)
    return out


def adapted_roles(folder: Path, config: dict, args: ModelArgs) -> list[str]:
    """The roles a peft adapter adapts, read from its weights' names (whatever target_modules says: a list, an
    expanded 'all-linear', a regex); ConfigError naming a tensor that is no adapter of a role, or a role adapted
    in some blocks only."""
    from safetensors import safe_open

    where = f"lora.initial_adapter_path = {str(folder)!r}: {PEFT_WEIGHTS}"
    try:
        with safe_open(str(folder / PEFT_WEIGHTS), "pt") as f:
            keys = list(f.keys())
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise ConfigError(f"{where} cannot be read ({type(e).__name__}: {e})") from None
    modules, blocks = _module_roles(args), {}
    experts = expert_order(folder, config)
    for role in experts:  # peft nests its wrappers: the first parameter the experts module registers is the inner one
        inner = ".base_layer" if role == inner_expert_role(experts) else ""
        modules.update({f"{PEFT_PREFIX}model.layers.{i}.mlp.experts{inner}": (i, role) for i in args.moe_layers})
    for key in keys:
        module, _, leaf = key.replace(".default.", ".").rpartition(".lora_")
        if leaf not in ("A.weight", "B.weight") or module not in modules:
            roles = ", ".join(resolve_targets(["all"], args))
            raise ConfigError(
                f"{where} holds {key}, which is not a LoRA A or B of a projection titanlite adapts in this "
                f"{args.family} model ({roles} of each block); valid: adapters of those projections only"
            )
        i, role = modules[module]
        blocks.setdefault(role, set()).add(i)
    if not blocks:
        raise ConfigError(f"{where} holds no adapters")
    for role, have in blocks.items():
        every = layers_with(role, args)
        if have != every:
            missing = sorted(every - have)
            excluded = config.get("exclude_modules")
            why = (
                f"; {PEFT_CONFIG} sets exclude_modules = {excluded!r}, which titanlite's LoRA does not support "
                "(valid: exclude_modules = null, or modules no adapter would be on)"
                if excluded
                else ""
            )
            raise ConfigError(
                f"{where} adapts {role} in {len(have)} of the {len(every)} blocks (not in block "
                f"{', '.join(map(str, missing[:8]))}){why}; titanlite's LoRA adapts the same projections in every "
                "block"
            )
    return [r for r in [*model_roles(args), *EXPERT_ROLES] if r in blocks]


def layers_with(role: str, args: ModelArgs) -> set[int]:
    """The blocks that have a projection of this role (a hybrid backend model's layer kinds have their own)."""
    if is_backend(args):
        return args.role_layers(role)
    return set(args.moe_layers) if role in EXPERT_ROLES else set(range(args.n_layers))


def peft_settings(folder: Path, args: ModelArgs) -> dict:
    """{rank, alpha, targets} of a peft adapter folder (targets as titanlite's lora.targets), after refusing what
    titanlite's LoRA cannot read, each refusal naming its adapter_config.json key."""
    config = _read_peft_config(folder)
    _check_supported(folder, config)
    if not (folder / PEFT_WEIGHTS).is_file():
        raise ConfigError(f"lora.initial_adapter_path = {str(folder)!r} has no {PEFT_WEIGHTS}")
    roles = adapted_roles(folder, config, args)
    targets = ["all"] if roles == resolve_targets(["all"], args) else roles
    return {
        "rank": config.get("r", 8),
        "alpha": config.get("lora_alpha", 8),
        "use_rslora": bool(config.get("use_rslora", False)),
        "targets": targets,
    }


def check_peft_folder(folder: Path, lora_cfg, args: ModelArgs) -> None:
    """ConfigError naming the setting where a peft adapter folder does not match the run's [lora]."""
    config = _read_peft_config(folder)
    _check_supported(folder, config)
    for key, ours, saved in (
        ("rank", lora_cfg.rank, config.get("r", 8)),
        ("alpha", lora_cfg.alpha, config.get("lora_alpha", 8)),
        ("use_rslora", lora_cfg.use_rslora, bool(config.get("use_rslora", False))),
    ):
        if ours != saved:
            raise ConfigError(
                f"lora.initial_adapter_path = {str(folder)!r} was trained with {key} {saved!r} ({PEFT_CONFIG}) but "
                f"lora.{key} gives {ours!r}; set lora.{key} to {saved!r}"
            )
    settings = peft_settings(folder, args)
    if _roles(settings["targets"], args) != _roles(lora_cfg.targets, args):
        theirs = ",".join(settings["targets"])
        raise ConfigError(
            f"lora.initial_adapter_path = {str(folder)!r} adapts {theirs} ({PEFT_WEIGHTS}) but lora.targets gives "
            f"{','.join(lora_cfg.targets)}; set lora.targets to {theirs}"
        )


def load_peft_adapter(model: torch.nn.Module, folder: str | Path, lora_cfg) -> None:
    """Start the (sharded) model's adapters from a peft adapter folder; every rank keeps its shards."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    check_peft_folder(folder, lora_cfg, model.args)
    try:
        experts = expert_order(folder, _read_peft_config(folder))
        full = from_peft(load_file(str(folder / PEFT_WEIGHTS)), adapter_names(model), model.args, experts)
    except ValueError as e:
        raise ConfigError(f"lora.initial_adapter_path = {str(folder)!r}: {PEFT_WEIGHTS} does not fit: {e}") from None
    model_sd = {k: v for k, v in get_model_state_dict(model).items() if is_adapter(k)}
    for name, t in full.items():
        if tuple(t.shape) != tuple(model_sd[name].shape):
            raise ConfigError(
                f"lora.initial_adapter_path = {str(folder)!r}: {name} has shape {tuple(t.shape)} there but "
                f"{tuple(model_sd[name].shape)} in the model; was it trained on another base?"
            )
    set_model_state_dict(
        model, {k: v.float() for k, v in full.items()}, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    logger.info(f"Started the adapters from {folder} (lora.initial_adapter_path)")


def saved_adapters(step: Path, prefix: str, routing_bias: bool = False) -> dict[str, torch.Tensor]:
    """The full adapter tensors of a LoRA checkpoint (read in this process); with routing_bias, also an MoE's
    routing biases (trained by [moe] load_balance = "aux_free" beside the adapters)."""
    metadata = read_metadata(step).state_dict_metadata
    dest = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in metadata.items()
        if k.startswith(prefix)
        and isinstance(md, TensorStorageMetadata)
        and (is_adapter(k) or (routing_bias and is_routing_bias(k)))
    }
    if not dest:
        raise ConfigError(f"--checkpoint {step} holds no LoRA adapters")
    read_in_this_process(dest, step)
    return {k[len(prefix) :]: v for k, v in dest.items()}


def write_peft(out: Path, adapters: dict[str, torch.Tensor], args: ModelArgs, lora_cfg, base: str, dtype=None) -> int:
    """Write a peft adapter folder; returns the number of tensors."""
    tensors = to_peft({k: v.to(dtype) if dtype is not None else v for k, v in adapters.items()}, args)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / PEFT_WEIGHTS)
    roles = resolve_targets(list(lora_cfg.targets), args)
    config = peft_config(roles, lora_cfg.rank, lora_cfg.alpha, lora_cfg.dropout, base, lora_cfg.use_rslora)
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return len(tensors)
