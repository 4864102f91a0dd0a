"""Float8 training ([float8], torchao): the blocks' dense linears become torchao's Float8Linear before FSDP wraps them.

Weights keep their names and their dtype (float8 exists only inside each matmul), so checkpoints, exports and
resumes are those of a bf16 run. With tensorwise scaling FSDP may all-gather the weights in float8; their scales are
then computed for all of them at once (`float8_scale_refresh`) whenever the weights change (the run state's
weights-replaced event, `listen_for_new_weights`: the first forward after a load, an optimizer step, a fault-tolerant
heal or sync), over every rank that holds a part of a weight: without it an FSDP
all-gather scales by the amax of its data-parallel ranks' part only, which under tensor parallelism differs between
tp ranks (and a resumed run's first step would differ from the run it resumes).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.run_state import LOADED, RunState

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada and Hopper onwards


def problem(cfg, dims, args=None, device_type: str | None = None, inference: bool = False) -> str | None:
    """Why [float8] cannot train this run, or None (also when it is off). device_type None: the dry run, which
    skips the checks of this machine."""
    if not cfg.float8.enable or inference:
        return None
    if cfg.lora.enable:
        return (
            "float8.enable = true with lora.enable = true is not supported (the adapters sit on the projections "
            "float8 would convert); set one of them to false"
        )
    if device_type is None:
        return None
    if device_type != "cuda":
        return (
            f"float8.enable = true needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"or newer (H100, H200, L4, RTX 4090); this run computes on {device_type!r}: set float8.enable = false"
        )
    if importlib.util.find_spec("torchao") is None:
        return (
            "float8.enable = true needs torchao, which is not installed: pip install torchao (or "
            "pip install -e '.[float8]'), or set float8.enable = false"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < MIN_CAPABILITY:
        return (
            f"float8.enable = true needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer; "
            f"{torch.cuda.get_device_name()} has {major}.{minor}: set float8.enable = false"
        )
    return None


def _float8_module():
    return importlib.import_module("torchao.float8")  # optional: imported only by a run that asks for float8


def apply_float8(model: nn.Module, float8_cfg, tp: int = 1) -> int:
    """Convert the linears `model.float8_linears(tp)` names to torchao's Float8Linear with the configured recipe
    (before tensor parallelism splits them over `tp` ranks); returns how many."""
    ao = _float8_module()
    if float8_cfg.recipe == "tensorwise":
        config = ao.Float8LinearConfig(enable_fsdp_float8_all_gather=float8_cfg.fsdp_float8_all_gather)
    else:
        config = ao.Float8LinearConfig.from_recipe_name(float8_cfg.recipe)
    names = model.float8_linears(tp)
    ao.convert_to_float8_training(model, config=config, module_filter_fn=lambda _module, fqn: fqn in names)
    return len(names)


def float8_scale_refresh(model: nn.Module, float8_cfg) -> Callable[[], None] | None:
    """What to run whenever the weights change, with float8 all-gathers: every float8 weight's scale from the weights
    as they are then (torchao's precompute for FSDP, one pass per device mesh: under tensor parallelism a multi-head
    latent attention's latent projections are sharded over the data-parallel ranks only); None when nothing is
    needed."""
    if not (float8_cfg.enable and float8_cfg.recipe == "tensorwise" and float8_cfg.fsdp_float8_all_gather):
        return None
    precompute = _float8_module().precompute_float8_dynamic_scale_for_fsdp
    by_mesh: dict = {}
    for module in model.modules():
        if type(module).__name__ == "Float8Linear" and isinstance(module.weight, DTensor):
            by_mesh.setdefault(module.weight.device_mesh, []).append(module)
    groups = [nn.ModuleList(modules) for modules in by_mesh.values()]  # in module order: the same on every rank

    def refresh() -> None:
        for group in groups:
            precompute(group)

    return refresh


def at_first_forward(model: nn.Module, refresh: Callable[[], None]) -> None:
    """Run `refresh` once, at the model's next forward, after FSDP's set-up of it: that set-up gives a shard shorter
    than its peers a new local tensor, without the scale a refresh before it kept there (its rank alone would then
    compute the scale itself, a collective the others skip)."""

    def first_forward(module, args):
        handle.remove()
        refresh()

    handle = model.register_forward_pre_hook(first_forward)  # after FSDP's own pre-forward, which comes first


def listen_for_new_weights(state: RunState, model: nn.Module, float8_cfg) -> None:
    """[float8] with float8 all-gathers: every float8 weight's scale recomputed each time the run state's weights are
    replaced; nothing otherwise."""
    refresh = float8_scale_refresh(model, float8_cfg)
    if refresh is not None:
        state.on_weights_replaced(scale_refresher(model, refresh))


def scale_refresher(model: nn.Module, refresh: Callable[[], None]) -> Callable[[str], None]:
    """The weights-replaced listener that runs `refresh`: at once, or after a load at the model's next forward
    (at_first_forward)."""

    def on_new_weights(why: str) -> None:
        if why == LOADED:
            at_first_forward(model, refresh)
        else:
            refresh()

    return on_new_weights
