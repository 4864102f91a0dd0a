"""Exports of a LoRA checkpoint, in one process: its adapters as a peft folder, or base + adapters merged into a
HuggingFace folder. Both check first that the base the checkpoint records is still the one at its path."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.checkpoint.base_identity import check_same_base, fingerprint
from titanlite.checkpoint.base_identity import read as read_lora_base
from titanlite.checkpoint.catalog import read_metadata
from titanlite.checkpoint.consolidated import model_prefix
from titanlite.checkpoint.hf_io import save_hf_sharded, warn_dropped_routing_bias
from titanlite.checkpoint.initial import load_initial_weights
from titanlite.checkpoint.lora_io import saved_adapters, trained_nf4_blocks, write_peft
from titanlite.checkpoint.remote_inputs import local_copy
from titanlite.checkpoint.resume import saved_job_config, saved_model_args
from titanlite.data.tokenizers import build_tokenizer
from titanlite.dtypes import TORCH_DTYPES
from titanlite.errors import ConfigError
from titanlite.models.args import args_from_dict
from titanlite.models.family import BACKEND
from titanlite.models.hf_names import is_routing_bias, routing_bias_shapes
from titanlite.models.lora import merge_adapters
from titanlite.models.nf4 import nf4_api, quantized_linears
from titanlite.models.transformers_backend.args import saved_backend_args
from titanlite.storage import is_url


@torch.no_grad()
def dequantize_like_training(model: torch.nn.Module, cfg, step: Path | None) -> int:
    """Replace every weight that a QLoRA run held in NF4 by its dequantized value (quantized whole, in the block
    sizes it was trained with: lora_io.trained_nf4_blocks of the checkpoint `step`, from the run's compute dtype);
    returns how many. The model is plain, or sharded (DTensor weights: every rank gathers each weight in turn)."""
    to_nf4 = nf4_api().to_nf4
    dtype = TORCH_DTYPES[cfg.training.mixed_precision_param]
    blocks = trained_nf4_blocks(read_lora_base(step) if step is not None else None, cfg.lora, model.args)
    linears = quantized_linears(model)
    for name, linear in linears.items():
        w = linear.weight
        full = w.full_tensor() if isinstance(w, DTensor) else w
        q = to_nf4(full.detach().to(dtype), *blocks[f"{name}.weight"])
        value = q.get_original_weight().to(w.dtype)
        if isinstance(w, DTensor):
            value = distribute_tensor(value, w.device_mesh, w.placements, src_data_rank=None)
        w.copy_(value)
    return len(linears)


def nf4_base_note(n: int, cfg) -> str:
    """What a QLoRA checkpoint's export or sampling does with its base."""
    return (
        f"The base was trained in nf4 (QLoRA): its {n} quantized weights are dequantized to "
        f"{cfg.training.mixed_precision_param} as training saw them"
    )


def lora_base_of(step: Path) -> dict | None:
    """The base a LoRA checkpoint records, checked against what its path holds now; None: not a LoRA checkpoint."""
    saved = read_lora_base(step)
    if saved is None:
        return None
    recorded = str(saved.get("path", ""))
    base = local_copy(recorded, f"the LoRA base {step}/lora_base.json names") if is_url(recorded) else Path(recorded)
    if not base.exists():
        raise ConfigError(
            f"{step} holds LoRA adapters trained on the base {base}, which is not there any more: put that base "
            "back at its path (its fingerprint is checked); the adapters alone can still be exported with "
            "--format peft"
        )
    check_same_base(saved, fingerprint(base), str(step))
    return {**saved, "path": str(base)}  # (a base in object storage: this machine's copy of it)


def _run_of(step: Path):
    cfg, saved_args = saved_job_config(step), saved_model_args(step)
    if cfg is None or saved_args is None:
        raise ConfigError(f"--checkpoint {step} has no readable job_config.toml / model_args.json")
    return cfg, saved_backend_args(saved_args) if saved_args.get("family") == BACKEND else args_from_dict(saved_args)


def export_peft(step: Path, output: Path, dtype: torch.dtype | None) -> int:
    """Write a LoRA checkpoint's adapters as a peft folder; returns the number of tensors."""
    if read_lora_base(step) is None:
        raise ConfigError(f"--checkpoint {step} is not a LoRA checkpoint (it has no lora_base.json): nothing to export")
    cfg, args = _run_of(step)
    saved = saved_adapters(step, model_prefix(read_metadata(step)), routing_bias=True)
    if moved_bias := {k: v for k, v in saved.items() if is_routing_bias(k)}:
        warn_dropped_routing_bias(moved_bias, output, stored=bool(routing_bias_shapes(args)))
    adapters = {k: v for k, v in saved.items() if not is_routing_bias(k)}
    return write_peft(output, adapters, args, cfg.lora, str(read_lora_base(step).get("path")), dtype)


@torch.no_grad()
def export_merged(step: Path, output: Path, dtype: torch.dtype | None, max_file_bytes: int, build_model) -> int:
    """Write base + a LoRA checkpoint's adapters merged (W + alpha/r B A) as a HF folder; holds the whole model in
    memory (in float32); returns the number of tensors written. build_model(cfg, args): the run's model with
    its adapters, unsharded, on the meta device (the model builder's, which checkpoint/ does not import)."""
    base = lora_base_of(step)
    cfg, args = _run_of(step)
    model = build_model(cfg, args)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_initial_weights(model, Path(base["path"]))
    adapters = saved_adapters(step, model_prefix(read_metadata(step)), routing_bias=True)
    missing, unexpected = model.load_state_dict(adapters, strict=False)  # the routing bias too: saving warns
    if unexpected:
        raise ConfigError(f"--checkpoint {step} holds {unexpected[0]}, which its [lora] settings do not make")
    if cfg.lora.base_dtype == "nf4":  # the adapters learnt against the 4-bit base: merge into what it computed
        print(
            f"{nf4_base_note(dequantize_like_training(model, cfg, step), cfg)}, and the adapters merged into them in "
            "float32; the export then rounds each merged weight to the export dtype once"
        )
    merge_adapters(model)
    out_dtype = dtype or next(v for k, v in adapters.items() if not is_routing_bias(k)).dtype
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    return save_hf_sharded(model, output, out_dtype, tokenizer, max_file_bytes, started_from=str(base["path"]))
