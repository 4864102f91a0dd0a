"""LoRA: low-rank adapters on a decoder's projections, by the role names every family shares (peft's names).

An adapted projection stays the nn.Linear it was (its weight keeps its name and, under tensor parallelism, its
split) and gains two children: `lora_a` (rank x in) and `lora_b` (out x rank), so that
y = x W^T + b + (alpha / rank) * B(A(dropout(x))). A starts as peft starts it (Kaiming-uniform, drawn from the
init generator of its own name: the same adapters at any topology) and B at zero, so the adapted model starts as
the base. Under tensor parallelism each adapter follows its base matmul's split: a column-split projection gets a
whole A and a column-split B, a row-split one a row-split A (its partial sums join the base's before the
reduction) and a whole B. Every other parameter is frozen.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from titanlite.models.args import ModelArgs
from titanlite.models.expert_lora import (
    EXPERT_ROLES,
    GroupedAdapter,
    add_expert_adapters,
    expert_from_peft,
    expert_peft_key,
    expert_to_peft,
    is_expert_adapter,
    merge_expert_adapters,
)
from titanlite.models.family import BACKEND
from titanlite.models.hf_names import (
    fused_experts,
    half_split_to_interleaved,
    interleaved_to_half_split,
    rope_heads,
    to_hf_name,
)

# Role -> the projection it names inside a transformer block.
ROLE_MODULES = {
    "q_proj": "attention.wq",
    "k_proj": "attention.wk",
    "v_proj": "attention.wv",
    "o_proj": "attention.wo",
    "gate_proj": "feed_forward.w1",
    "up_proj": "feed_forward.w3",
    "down_proj": "feed_forward.w2",
    "q_a_proj": "attention.q_a_proj",  # multi-head latent attention (models/mla.py)
    "q_b_proj": "attention.q_b_proj",
    "kv_a_proj_with_mqa": "attention.kv_a_proj",
    "kv_b_proj": "attention.kv_b_proj",
}
MLP_ROLES = ("gate_proj", "up_proj", "down_proj")
LATENT_ROLES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def is_backend(args: ModelArgs) -> bool:
    """Whether these are a transformers-backend model's args (its linears are adapted by their own names)."""
    return args.family == BACKEND


def model_roles(args: ModelArgs) -> list[str]:
    """The roles this model's blocks have a dense projection for (an MoE's experts: expert_roles); a transformers
    backend model's: the names of its decoder layers' linears."""
    if is_backend(args):
        return args.linear_roles
    if args.mla:
        q = ["q_a_proj", "q_b_proj"] if args.q_lora_rank else ["q_proj"]
        attention = [*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    else:
        attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return [r for r in ROLE_MODULES if r in attention or (r in MLP_ROLES and not args.moe)]


ADAPTER_A, ADAPTER_B = "lora_a", "lora_b"


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (A or B)."""
    return f".{ADAPTER_A}." in name or f".{ADAPTER_B}." in name


def expert_roles(args: ModelArgs) -> list[str]:
    """The expert roles of a model (models/expert_lora.py): an MoE's fused gate/up and down stacks; none if dense."""
    return list(EXPERT_ROLES) if args.moe else []


def resolve_targets(targets: list[str], args: ModelArgs) -> list[str]:
    """The roles that get adapters: ['all'] is every dense projection of the model (peft's all-linear: an MoE's
    attention); experts.* roles an MoE's experts; ValueError for an MLP role of an MoE model, an expert role of a
    dense one."""
    roles = model_roles(args)
    if targets == ["all"]:
        return roles
    if is_backend(args) and (other := [r for r in targets if r not in roles]):
        raise ValueError(
            f"{', '.join(other)}: {args.model_type}'s decoder layers have no nn.Linear of that name (fused expert "
            f"tensors take no adapters in the transformers backend); valid targets for it: {', '.join(roles)} "
            "(or 'all')"
        )
    if is_backend(args):
        return list(targets)
    if other := [r for r in targets if r in EXPERT_ROLES and not args.moe]:
        raise ValueError(
            f"{', '.join(other)}: the {args.family} model is dense, it has no experts; valid targets for it: "
            f"{', '.join(roles)} (or 'all')"
        )
    roles = roles + expert_roles(args)
    if args.moe and (mlp := [r for r in targets if r in MLP_ROLES]):
        raise ValueError(
            f"{', '.join(mlp)}: the {args.family} model's feed-forward is a Mixture of Experts, whose experts take "
            f"adapters as experts.gate_up_proj and experts.down_proj (transformers' fused expert tensors); valid "
            f"targets for it: {', '.join(roles)} (or 'all')"
        )
    if other := [r for r in targets if r not in roles]:
        attention = "multi-head latent attention" if args.mla else "attention"
        raise ValueError(
            f"{', '.join(other)}: the {args.family} model's {attention} has no such projection; valid targets for "
            f"it: {', '.join(roles)} (or 'all')"
        )
    return list(targets)


def adapter_init(name: str):
    """The init of an adapter parameter as fn(tensor, generator): A as peft's (Kaiming-uniform), B zero."""
    if f".{ADAPTER_B}." in name:
        return lambda t, g: t.zero_()
    if is_expert_adapter(name):  # [experts, in, r]: drawn as peft's lora_A [r * experts, in] (fan-in: in)
        return _expert_a_init
    return lambda t, g: nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)


def _expert_a_init(t: torch.Tensor, g: torch.Generator) -> None:
    e, d_in, r = t.shape
    flat = nn.init.kaiming_uniform_(t.new_empty(e * r, d_in), a=math.sqrt(5), generator=g)
    t.copy_(flat.view(e, r, d_in).transpose(1, 2))


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank adapter (the class an adapted projection is switched to)."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_dropout: nn.Module
    scaling: float
    disabled = False  # True: the base projection alone (adapters_disabled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        return out + self.lora_b(self.lora_a(self.lora_dropout(x))) * self.scaling


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Inside the block the model computes as its base: every adapter (LoRALinear's, an MoE's GroupedAdapter) is
    skipped."""
    adapters = [m for m in model.modules() if isinstance(m, (LoRALinear, GroupedAdapter))]
    for m in adapters:
        m.disabled = True
    try:
        yield model
    finally:
        for m in adapters:
            m.disabled = False


def _adapter_weights(linear: nn.Linear, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty A and B for `linear`, split as its weight is (tensor parallelism) or plain."""
    w = linear.weight
    a = torch.empty(rank, linear.in_features, device=w.device, dtype=torch.float32)
    b = torch.empty(linear.out_features, rank, device=w.device, dtype=torch.float32)
    if not isinstance(w, DTensor):
        return a, b
    (placement,) = w.placements
    if placement == Shard(0):  # column-parallel: x whole, out split
        a_place, b_place = Replicate(), Shard(0)
    elif placement == Shard(1):  # row-parallel: x split, partial sums reduced after the module
        a_place, b_place = Shard(1), Replicate()
    else:
        a_place = b_place = Replicate()
    mesh = w.device_mesh
    return (
        distribute_tensor(a, mesh, [a_place], src_data_rank=None),
        distribute_tensor(b, mesh, [b_place], src_data_rank=None),
    )


def adapter_scaling(rank: int, alpha: float, rslora: bool = False) -> float:
    """An adapter's output scale: alpha / rank, or rsLoRA's alpha / sqrt(rank)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def add_adapter(linear: nn.Linear, rank: int, alpha: float, dropout: float, rslora: bool = False) -> None:
    """Give `linear` an adapter of this rank (call on the meta device, after tensor parallelism)."""
    a, b = _adapter_weights(linear, rank)
    linear.lora_a = nn.Linear(linear.in_features, rank, bias=False, device="meta")
    linear.lora_b = nn.Linear(rank, linear.out_features, bias=False, device="meta")
    linear.lora_a.weight = nn.Parameter(a)
    linear.lora_b.weight = nn.Parameter(b)
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    linear.scaling = adapter_scaling(rank, alpha, rslora)
    linear.__class__ = LoRALinear


def adapted_modules(model: nn.Module, roles: list[str]) -> dict[str, nn.Linear]:
    """Qualified name -> projection of every block's targeted dense roles, in model order."""
    if is_backend(model.args):
        return {p: model.get_submodule(p) for p in model.args.linears if p.rpartition(".")[2] in roles}
    wanted = {ROLE_MODULES[r] for r in roles if r in ROLE_MODULES}
    out = {}
    for i, block in enumerate(model.layers):
        for path in ROLE_MODULES.values():  # model order within a block
            if path in wanted:
                out[f"layers.{i}.{path}"] = block.get_submodule(path)
    return out


def apply_lora(model: nn.Module, lora_cfg, base_dtype: torch.dtype | None = None) -> int:
    """Adapters on the [lora] targets of every block, everything else frozen (and cast to base_dtype when given);
    call after tensor parallelism and before activation checkpointing, compile and FSDP. Returns the adapters made."""
    roles = resolve_targets(list(lora_cfg.targets), model.args)
    modules = adapted_modules(model, roles)
    for linear in modules.values():
        add_adapter(linear, lora_cfg.rank, lora_cfg.alpha, lora_cfg.dropout, lora_cfg.use_rslora)
    adapters = {id(p) for m in modules.values() for p in (m.lora_a.weight, m.lora_b.weight)}
    if experts := [r for r in roles if r in EXPERT_ROLES]:  # no dropout (as peft's; plan.py refuses one to train)
        scaling = adapter_scaling(lora_cfg.rank, lora_cfg.alpha, lora_cfg.use_rslora)
        for unit in model.expert_units():
            for adapter in add_expert_adapters(unit, experts, lora_cfg.rank, scaling):
                adapters.update({id(adapter.lora_a.weight), id(adapter.lora_b.weight)})
    cast: dict[int, nn.Parameter] = {}  # one new parameter per old one: a tied weight stays tied
    for module in model.modules():
        for leaf, p in list(module.named_parameters(recurse=False)):
            if id(p) in adapters:
                continue
            if base_dtype is not None and p.dtype != base_dtype:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.detach().to(base_dtype), requires_grad=False)
                setattr(module, leaf, cast[id(p)])
            else:
                p.requires_grad_(False)
    return len(modules) + (len(experts) * len(model.expert_units()) if experts else 0)


def adapter_names(model: nn.Module) -> list[str]:
    """The adapter parameters' names, in model order."""
    return [n for n, _ in model.named_parameters() if is_adapter(n)]


def base_weight_name(adapter: str) -> str:
    """The name of the weight an adapter parameter adapts (layers.0.attention.wq.lora_a.weight ->
    layers.0.attention.wq.weight)."""
    for key in (ADAPTER_A, ADAPTER_B):
        if f".{key}." in adapter:
            return adapter.replace(f".{key}.", ".")
    raise ValueError(f"{adapter} is not an adapter parameter")


# ---------------------------------------------------------------- peft's format

PEFT_PREFIX = "base_model.model."  # peft's wrapper of a transformers model, as its saved keys begin


def to_peft_name(name: str, args: ModelArgs, experts: tuple[str, ...] = tuple(EXPERT_ROLES)) -> str:
    """An adapter parameter's key in a peft adapter_model.safetensors (experts: the expert roles adapted)."""
    if is_expert_adapter(name):
        return expert_peft_key(name, list(experts))
    base = base_weight_name(name)
    module = (base if is_backend(args) else to_hf_name(base, args)).removesuffix(".weight")  # backend: HF's names
    return f"{PEFT_PREFIX}{module}.{'lora_A' if f'.{ADAPTER_A}.' in name else 'lora_B'}.weight"


def _rope_rows(name: str, args: ModelArgs) -> int | None:
    """Heads whose rows an adapter's B permutes between titanlite's and HF's q/k layouts (models/hf_names.py)."""
    if is_expert_adapter(name) or is_backend(args):
        return None
    return rope_heads(base_weight_name(name), args) if f".{ADAPTER_B}." in name else None


def _interleaved(name: str, args: ModelArgs) -> bool:
    """Whether an expert adapter's B is, in HF's layout, gate and up columns alternating (gpt-oss's gate_up_proj), not
    the gate half then the up half (titanlite's, and the other families')."""
    return ".experts.gate_up_proj.lora_b." in name and ("w1", "w3") in fused_experts(args).values()


def adapted_expert_roles(names) -> tuple[str, ...]:
    """The expert roles among these adapter names, in EXPERT_ROLES' order."""
    return tuple(r for r in EXPERT_ROLES if any(f".feed_forward.{r}." in n for n in names))


def to_peft(adapters: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full adapter tensors by titanlite name -> peft's keys and layout."""
    out, experts = {}, adapted_expert_roles(adapters)
    for name, t in adapters.items():
        if is_expert_adapter(name):
            out[to_peft_name(name, args, experts)] = expert_to_peft(
                t, f".{ADAPTER_A}." in name, _interleaved(name, args)
            )
            continue
        heads = _rope_rows(name, args)
        out[to_peft_name(name, args)] = (
            interleaved_to_half_split(t, heads, args.rope_dim) if heads else t
        ).contiguous()
    return out


def from_peft(
    tensors: dict[str, torch.Tensor], names: list[str], args: ModelArgs, experts: tuple[str, ...] | None = None
) -> dict[str, torch.Tensor]:
    """peft's adapter tensors -> full tensors under the model's adapter names `names` (experts: the expert roles the
    file adapts; None: those of `names`); ValueError naming the first adapter the file lacks or the first tensor the
    model has no adapter for."""
    experts = adapted_expert_roles(names) if experts is None else experts
    by_peft = {to_peft_name(n, args, experts): n for n in names}
    keys = {k.replace(".default.", ".") for k in tensors}  # a file saved with the adapter's name left in
    if missing := [k for k in by_peft if k not in keys]:
        raise ValueError(f"it has no {missing[0]} (and {len(missing) - 1} more missing)")
    if extra := sorted(k for k in keys if k not in by_peft):
        raise ValueError(f"it holds {extra[0]}, which this model's [lora] targets have no adapter for")
    out = {}
    for key, t in tensors.items():
        name = by_peft[key.replace(".default.", ".")]
        if is_expert_adapter(name):
            out[name] = expert_from_peft(t, f".{ADAPTER_A}." in name, args.n_experts, _interleaved(name, args))
            continue
        heads = _rope_rows(name, args)
        out[name] = half_split_to_interleaved(t, heads, args.rope_dim) if heads else t
    return out


def peft_config(roles: list[str], rank: int, alpha: float, dropout: float, base: str, rslora: bool = False) -> dict:
    """adapter_config.json for peft's LoraConfig."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": [r for r in roles if r not in EXPERT_ROLES] or None,
        "target_parameters": [f"mlp.{r}" for r in EXPERT_ROLES if r in roles] or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its base weight (W += scaling * B A) and zero B: the same function, no adapters
    needed to compute it (a plain, unsharded model)."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
            delta = (m.lora_b.weight.float() @ m.lora_a.weight.float()) * m.scaling
            m.weight.copy_((m.weight.float() + delta).to(m.weight.dtype))
            m.lora_b.weight.zero_()
    for unit in model.expert_units() if hasattr(model, "expert_units") else ():
        merge_expert_adapters(unit)


def lora_problem(cfg, args: ModelArgs, sizing_only: bool = False) -> str | None:
    """Why [lora] cannot train this model, or None: an adapter folder without lora.enable, no base to start from, a
    target the model lacks, dropout on the experts' adapters, a base dtype that FSDP cannot gather with the adapters,
    or a last save that would drop the adapters (the adapter folder itself is checked against the model by
    checkpoint.lora_io.check_peft_folder). sizing_only: the dry run, which sizes a backend model's LoRA from its
    config.json alone."""
    lora = cfg.lora
    if not lora.enable:
        if lora.initial_adapter_path:
            return (
                f"lora.initial_adapter_path = {lora.initial_adapter_path!r} is set but lora.enable = false; "
                "set lora.enable = true to train (or continue) those adapters"
            )
        return None
    if not cfg.checkpoint.initial_load_path:
        return (
            "lora.enable = true trains adapters on a frozen base, but checkpoint.initial_load_path = '' gives none "
            "(the base would be random weights); set it to the base model: a HuggingFace folder, a step-N "
            "checkpoint or a consolidated file"
        )
    if is_backend(args) and not args.hf_weights and not sizing_only:
        return (
            f"lora.enable = true trains adapters on a frozen base, but checkpoint.initial_load_path = "
            f"{cfg.checkpoint.initial_load_path!r} holds a config.json and no weights (the base would be random "
            "weights); set it to a folder with the model's *.safetensors"
        )
    try:
        roles = resolve_targets(list(lora.targets), args)
    except ValueError as e:
        return f"lora.targets = {lora.targets}: {e}"
    if lora.dropout and (experts := [r for r in roles if r.startswith("experts.")]):
        return (
            f"lora.dropout = {lora.dropout} with adapters on the experts ({', '.join(experts)}): an expert's input is "
            "not factored out of its grouped matmul, so its adapters take no dropout (as peft's); set lora.dropout = 0"
        )
    if lora.base_dtype == "bfloat16" and cfg.training.mixed_precision_param != "bfloat16":
        return (
            "lora.base_dtype = 'bfloat16' keeps the frozen base in bfloat16, which FSDP gathers with the float32 "
            f"adapters only when both are cast to one dtype; training.mixed_precision_param = "
            f"{cfg.training.mixed_precision_param!r} would not cast them: set it to 'bfloat16', or lora.base_dtype "
            "= 'float32'"
        )
    if cfg.checkpoint.last_save_in_hf:
        return (
            "checkpoint.last_save_in_hf = true writes the base weights without the adapters under LoRA; set it to "
            "false and export the checkpoint: python -m titanlite.checkpoint export --format peft (the adapters) "
            "or --format hf (merged)"
        )
    return None
