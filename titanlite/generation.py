"""Sampling text from a model whose weights may stay sharded; `python -m titanlite.generate` is its CLI.

Under torchrun the model is sharded as `[parallelism]` says (FSDP, or HSDP with
data_parallel_replicate_degree > 1), every block resharded after its forward, so a block's full
weights exist only while it computes (all-gathered on demand). Every rank runs the same forward on
the same tokens; rank 0 picks the next token and broadcasts it. Run as a single process (no
torchrun) the model is a plain, unsharded Transformer. There is no KV cache: each new token
recomputes the whole prefix (fine for debug sizes), cropped to the model's max_seq_len.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titanlite.checkpoint.catalog import newest_usable, read_metadata, step_folders
from titanlite.checkpoint.consolidated import check_model_fits, model_prefix, saved_shapes, unreadable
from titanlite.checkpoint.hf_io import load_hf_weights
from titanlite.checkpoint.resume import model_differences, saved_job_config, saved_model_args
from titanlite.checkpoint.safe_reading import safe_dcp_load
from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.model_builder import build_model
from titanlite.models.hf_config import hf_folder, is_hf_folder
from titanlite.models.registry import model_args


def resolve_checkpoint(path: str, given: bool = True) -> Path:
    """A DCP checkpoint folder: `path` itself, or its newest complete `step-N` sub-folder (a checkpoint root);
    or a HuggingFace model folder. `given`: the user named it (else it is the configured default)."""
    p = Path(path).expanduser()
    if (p / ".metadata").is_file() or is_hf_folder(p):
        return p
    steps = step_folders(p)
    info = newest_usable(p, {"model"}) if steps else None
    if info is not None:
        return info.path
    if not p.exists():
        what = "does not exist"
    elif not p.is_dir():
        what = "is a file, not a checkpoint folder"
    elif steps:
        names = ", ".join(s.name for _, s in sorted(steps.items()))
        what = f"holds step-N folders but no complete checkpoint with a model ({names})"
    elif (p / "config.json").is_file():
        what = "has a config.json but no *.safetensors weights (a HuggingFace model folder needs both)"
    elif any(p.glob("*.safetensors")):
        what = "has *.safetensors weights but no config.json (a HuggingFace model folder needs both)"
    else:
        what = "is neither a DCP checkpoint (no .metadata) nor a folder of step-N ones nor a HuggingFace model folder"
    name = (
        f"--checkpoint {path!r}"
        if given
        else f"--checkpoint was not given, and its default <job.dump_folder>/<checkpoint.folder> = {path!r}"
    )
    raise ConfigError(
        f"{name} {what}; valid: a step-N checkpoint folder, the checkpoint folder holding them (the newest "
        f"is used), a HuggingFace model folder, or 'none' for the untrained initial weights"
    )


def inference_model(cfg: JobConfig, vocab_size: int, device: torch.device, mesh=None) -> torch.nn.Module:
    """The model of `cfg` on `device`, sharded over `mesh` for inference (or plain when None); weights empty."""
    args = model_args(cfg.model, vocab_size, cfg.training.seq_len, hf_folder(cfg.checkpoint.initial_load_path))
    model = build_model(cfg, args, mesh, inference=True).model
    model.to_empty(device=device)
    model.init_buffers()
    return model


def load_weights(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Load a HF folder, or the model of a DCP checkpoint, into the (sharded or plain) model, each rank its
    shard; ConfigError naming the first tensor that does not fit, and the settings the checkpoint was saved with."""
    if is_hf_folder(checkpoint):
        load_hf_weights(model, checkpoint)
        return
    path = Path(checkpoint)
    try:
        metadata = read_metadata(path)
    except ValueError as e:
        raise ConfigError(f"--checkpoint {str(path)!r} is not a readable DCP checkpoint: {e}") from None
    model_sd, prefix = get_model_state_dict(model), model_prefix(metadata)
    source = f"--checkpoint {str(path)!r}"
    check_model_fits(model_sd, saved_shapes(metadata, prefix), source, _saved_with(path, model.args))
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            safe_dcp_load({"model": model_sd} if prefix else model_sd, path, no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise unreadable(path, e) from None
    set_model_state_dict(model, model_sd)


def _saved_with(path: Path, args) -> str | None:
    """'; it was saved ...: pass ...' from the model_args.json and job_config.toml of a checkpoint, if it has them."""
    saved, cfg = saved_model_args(path), saved_job_config(path)
    try:
        diff = model_differences(saved, args) if isinstance(saved, dict) else []
    except TypeError:  # a damaged model_args.json: the shapes alone tell
        diff = []
    if cfg is None:
        return f"; it was saved by another model ({'; '.join(diff)})" if diff else None
    return (
        f"; it was saved by another model ({'; '.join(diff) or 'see its model_args.json'}) with model.flavor = "
        f"{cfg.model.flavor!r}: pass --config {path / 'job_config.toml'} (the config it was saved with), or "
        f"--model.flavor {cfg.model.flavor}"
    )


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """One token id (shape (1,)) from 1-D logits: argmax at temperature 0, else softmax(logits / T) over the top k."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids=(),
) -> list[int]:
    """The new token ids after `prompt_ids`, stopping after one of stop_ids; call on every rank with the same args."""
    device = model.rope.device
    max_len = model.args.max_seq_len
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    broadcast = dist.is_initialized() and dist.get_world_size() > 1
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -max_len:])[0, -1].float()
        nxt = sample_next(logits, temperature, top_k, generator)
        if broadcast:  # rank 0 decides: every rank must feed identical tokens to the next forward
            dist.broadcast(nxt, src=0)
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
        if int(nxt) in stop_ids:
            break
    return tokens[0, len(prompt_ids) :].tolist()
