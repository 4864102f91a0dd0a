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

from titanlite.checkpoint.catalog import newest_usable, step_folders
from titanlite.checkpoint.hf_io import load_hf_weights
from titanlite.checkpoint.safe_reading import UnsafeCheckpointError, safe_dcp_load
from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.model_builder import build_model
from titanlite.models.hf_config import hf_folder, is_hf_folder
from titanlite.models.registry import model_args


def resolve_checkpoint(path: str) -> Path:
    """A DCP checkpoint folder: `path` itself, or its newest complete `step-N` sub-folder (a checkpoint root)."""
    p = Path(path).expanduser()
    if (p / ".metadata").is_file() or is_hf_folder(p):
        return p
    info = newest_usable(p, {"model"}) if step_folders(p) else None
    if info is not None:
        return info.path
    what = (
        "does not exist" if not p.exists() else "is neither a DCP checkpoint (no .metadata) nor a folder of step-N ones"
    )
    raise ConfigError(
        f"--checkpoint {path!r} {what}; valid: a step-N checkpoint folder, the checkpoint folder "
        f"holding them (the newest is used), or 'none' for the untrained initial weights"
    )


def inference_model(cfg: JobConfig, vocab_size: int, device: torch.device, mesh=None) -> torch.nn.Module:
    """The model of `cfg` on `device`, sharded over `mesh` for inference (or plain when None); weights empty."""
    args = model_args(cfg.model, vocab_size, cfg.training.seq_len, hf_folder(cfg.checkpoint.initial_load_path))
    model = build_model(cfg, args, mesh, inference=True).model
    model.to_empty(device=device)
    model.init_buffers()
    return model


def load_weights(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Load a HF folder, or the "model" entry of a DCP checkpoint, into the (sharded or plain) model, each
    rank its shard."""
    if is_hf_folder(checkpoint):
        load_hf_weights(model, checkpoint)
        return
    state = {"model": get_model_state_dict(model)}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            safe_dcp_load(state, checkpoint, no_dist=not dist.is_initialized())
    except UnsafeCheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # shape or key mismatches, as long nested errors
        args = model.args
        raise ConfigError(
            f"--checkpoint {str(checkpoint)!r} does not fit the model of this config (dim {args.dim}, "
            f"{args.n_layers} layers, vocab {args.vocab_size}): is it the config the checkpoint was trained "
            f"with? {type(e).__name__}: {str(e)[:500]}"
        ) from e
    set_model_state_dict(model, state["model"])


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
