"""Sampling text from a model whose weights may stay sharded; `python -m titanlite.generate` is its CLI.

Under torchrun the model is sharded as `[parallelism]` says (FSDP, or HSDP with
data_parallel_replicate_degree > 1), every block resharded after its forward, so a block's full
weights exist only while it computes (all-gathered on demand). Every rank runs the same forward on
the same tokens; rank 0 picks the next token and broadcasts it. Run as a single process (no
torchrun) the model is a plain, unsharded Transformer. The prompt is run once into a KV cache (every
rank holds the keys and values of all heads), then each new token is one single-token forward;
generate(kv_cache=False) recomputes the whole prefix for every token instead, as before.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from titanlite.checkpoint.base_identity import read as read_lora_base
from titanlite.checkpoint.catalog import newest_usable, read_metadata, step_folders
from titanlite.checkpoint.consolidated import check_model_fits, model_prefix, saved_shapes, unreadable
from titanlite.checkpoint.hf_io import check_hf_weights, load_hf_weights
from titanlite.checkpoint.initial import load_initial_weights
from titanlite.checkpoint.lora_export import lora_base_of
from titanlite.checkpoint.lora_io import load_peft_adapter, lora_differences, peft_settings, saved_lora
from titanlite.checkpoint.parts import ModelPart
from titanlite.checkpoint.resume import model_differences, saved_job_config, saved_model_args
from titanlite.checkpoint.safe_reading import safe_dcp_load
from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.model_builder import build_model
from titanlite.models.eval_mode import eval_mode
from titanlite.models.hf_config import hf_folder, is_hf_folder, missing_weights_note
from titanlite.models.kv_cache import KVCache
from titanlite.models.lora import adapter_names
from titanlite.models.resolve import resolved_model_args

logger = logging.getLogger("titanlite")


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
        what = missing_weights_note(p)
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


def inference_model(
    cfg: JobConfig,
    vocab_size: int,
    device: torch.device,
    meshes=None,
    checkpoint: str | Path | None = None,
) -> torch.nn.Module:
    """The model of `cfg` on `device`, sharded over `meshes` for inference (parallel/dims.py; plain when None) in
    eval mode; weights empty. checkpoint: the weights it will load, checked to fit
    before any memory is allocated."""
    args = resolved_model_args(cfg.model, vocab_size, cfg.training.seq_len, hf_folder(cfg.checkpoint.initial_load_path))
    model = build_model(cfg, args, meshes, inference=True).model
    if checkpoint is not None:
        check_weights_fit(model, checkpoint)
    model.to_empty(device=device)
    model.init_buffers()
    return model.eval()


def check_weights_fit(model: torch.nn.Module, checkpoint: str | Path):
    """ConfigError naming the first tensor of a HF folder or DCP checkpoint that does not fit the model (which may
    still be on the meta device), and the settings the checkpoint was saved with; reads only names and shapes.
    Returns a DCP checkpoint's metadata (None for a HF folder)."""
    if is_hf_folder(checkpoint):
        if not hasattr(model, "load_hf_folder"):  # (a transformers backend model's loader names what is missing)
            check_hf_weights(Path(checkpoint), model.args)
        return None
    path = Path(checkpoint)
    try:
        metadata = read_metadata(path)
    except ValueError as e:
        raise ConfigError(f"--checkpoint {str(path)!r} is not a readable DCP checkpoint: {e}") from None
    lora = read_lora_base(path) is not None
    if lora != bool(adapter_names(model)):
        raise ConfigError(
            f"--checkpoint {str(path)!r} holds LoRA adapters but the config has lora.enable = false; pass the "
            "config it was trained with"
            if lora
            else f"lora.enable = true, but --checkpoint {str(path)!r} holds full weights, not adapters; drop [lora]"
        )
    shapes = {name: tuple(t.shape) for name, t in ModelPart(model, trainable_only=lora).state_dict().items()}
    source = f"--checkpoint {str(path)!r}"
    check_model_fits(shapes, saved_shapes(metadata, model_prefix(metadata)), source, _saved_with(path, model.args))
    return metadata


def load_weights(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Load a HF folder, or the model of a DCP checkpoint, into the (sharded or plain) model, each rank its
    shard; ConfigError naming the first tensor that does not fit, and the settings the checkpoint was saved with."""
    if is_hf_folder(checkpoint):
        model.load_hf_folder(checkpoint) if hasattr(model, "load_hf_folder") else load_hf_weights(model, checkpoint)
        return
    path = Path(checkpoint)
    metadata = check_weights_fit(model, path)
    base = lora_base_of(path)  # a LoRA checkpoint: its base first (checked to be the one it was trained on)
    if base is not None:
        load_initial_weights(model, Path(base["path"]))
    part = ModelPart(model, trainable_only=base is not None)
    model_sd, prefix = part.state_dict(), model_prefix(metadata)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            safe_dcp_load({"model": model_sd} if prefix else model_sd, path, no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise unreadable(path, e) from None
    part.load_state_dict(model_sd)


def settle_lora(cfg: JobConfig, checkpoint: Path | None, given: set[str], vocab_size: int) -> None:
    """Make cfg's [lora] what the adapters were trained with: a LoRA checkpoint's own [lora] (and its recorded base
    as checkpoint.initial_load_path), or a peft folder's settings (lora.initial_adapter_path) on a HuggingFace base
    (a titanlite base is refused: export it as HF first). `given`: the section.key names the command line set.
    ConfigError naming both values when the command line gives another rank, alpha or targets; when lora.enable =
    true has no adapters to read; when the recorded base is gone or changed."""
    lora = cfg.lora
    if checkpoint is not None and not is_hf_folder(checkpoint) and read_lora_base(checkpoint) is not None:
        base = lora_base_of(checkpoint)  # names the base when it moved or changed
        trained = saved_lora(checkpoint)
        if trained is None:
            raise ConfigError(
                f"--checkpoint {str(checkpoint)!r} holds LoRA adapters but no readable job_config.toml: the rank and "
                "alpha they were trained with are unknown"
            )
        if "lora.initial_adapter_path" in given and lora.initial_adapter_path:
            raise ConfigError(
                f"--lora.initial_adapter_path {lora.initial_adapter_path} would replace the adapters --checkpoint "
                f"{str(checkpoint)!r} holds; give one of them"
            )
        args = resolved_model_args(cfg.model, vocab_size, cfg.training.seq_len, hf_folder(base["path"]))
        _adopt(cfg, trained, f"--checkpoint {str(checkpoint)!r}", given, args)
        cfg.checkpoint.initial_load_path = base["path"]
        logger.info(
            f"{checkpoint} holds LoRA adapters (rank {cfg.lora.rank}, alpha {cfg.lora.alpha}): sampling from its "
            f"base {base['path']} with them, unmerged"
        )
        return
    if not lora.enable:
        if lora.initial_adapter_path:
            raise ConfigError(
                f"lora.initial_adapter_path = {lora.initial_adapter_path!r} is set but lora.enable = false; set "
                "--lora.enable true to sample with those adapters"
            )
        return
    if checkpoint is not None and not is_hf_folder(checkpoint):
        raise ConfigError(
            f"lora.enable = true, but --checkpoint {str(checkpoint)!r} holds full titanlite weights and no adapters; "
            "a peft adapter folder (lora.initial_adapter_path) goes on a HuggingFace base: export this one first "
            f"(python -m titanlite.checkpoint export --checkpoint {checkpoint} --format hf --output <folder>) and give "
            "that folder as --checkpoint, or drop --lora.enable to sample from it alone"
        )
    if not lora.initial_adapter_path:
        if checkpoint is None:
            return  # untrained weights: the adapters start as peft's (B = 0), the model is its base
        raise ConfigError(
            f"lora.enable = true samples from a base with adapters, but --checkpoint {str(checkpoint)!r} holds none "
            "and lora.initial_adapter_path = '' names none (the adapters would be uninitialised memory); set "
            "--lora.initial_adapter_path to a peft adapter folder (adapter_config.json + adapter_model.safetensors), "
            "give a LoRA checkpoint, or drop --lora.enable to sample from the base alone"
        )
    folder = Path(lora.initial_adapter_path).expanduser()
    args = resolved_model_args(cfg.model, vocab_size, cfg.training.seq_len, hf_folder(cfg.checkpoint.initial_load_path))
    settings = peft_settings(folder, args)
    trained = replace(
        lora,
        rank=settings["rank"],
        alpha=settings["alpha"],
        use_rslora=settings["use_rslora"],
        targets=settings["targets"],
    )
    _adopt(cfg, trained, f"lora.initial_adapter_path = {str(folder)!r}", given, args)
    cfg.lora.initial_adapter_path = str(folder)
    logger.info(f"Sampling with the LoRA adapters of {folder} (rank {cfg.lora.rank}, alpha {cfg.lora.alpha}), unmerged")


def _adopt(cfg: JobConfig, trained, source: str, given: set[str], args) -> None:
    """cfg.lora := the adapters' own rank, alpha and targets (from `source`); ConfigError when the command line set
    another, a log line when the config file did."""
    for key, then, now in lora_differences(trained, cfg.lora, args):
        if f"lora.{key}" in given:
            raise ConfigError(
                f"--lora.{key} {now} conflicts with {source}, whose adapters were trained with lora.{key} = {then}; "
                f"generate samples with the adapters' own settings: drop --lora.{key}"
            )
        logger.info(f"lora.{key} = {then} as {source} was trained (the config gives {now})")
    kept = {k: getattr(cfg.lora, k) for k in ("dropout", "base_dtype") if f"lora.{k}" in given}
    cfg.lora = replace(trained, enable=True, initial_adapter_path="", **kept)


def load_adapters(model: torch.nn.Module, cfg: JobConfig) -> None:
    """Start the model's adapters from lora.initial_adapter_path (settle_lora set it for a base without them)."""
    if cfg.lora.enable and cfg.lora.initial_adapter_path:
        load_peft_adapter(model, cfg.lora.initial_adapter_path, cfg.lora)


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
    # Shifted so the largest is 0, and T no smaller than the dtype's tiniest normal: a tiny T (1e-300) gives 0 and
    # -inf (greedy, as its limit), never inf - inf = nan.
    logits = logits.float()
    logits = (logits - logits.max()) / max(temperature, torch.finfo(logits.dtype).tiny)
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


@dataclass
class GenerationTiming:
    """How long one generate call took: the prefill (the first forward, giving the first new token) and
    the decode steps after it."""

    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    total_s: float
    kv_cache: bool

    def describe(self) -> str:
        """The log line: 'Generated 64 tokens in 0.41 s (prefill 12 tokens 0.02 s, decode 156.1 tokens/s, KV cache)'."""
        decode_s, decoded = self.total_s - self.prefill_s, self.new_tokens - 1
        rate = f"{decoded / decode_s:.1f} tokens/s" if decoded > 0 and decode_s > 0 else "-"
        return (
            f"Generated {self.new_tokens} tokens in {self.total_s:.2f} s (prefill {self.prompt_tokens} tokens "
            f"{self.prefill_s:.2f} s, decode {rate}, {'KV cache' if self.kv_cache else 'no KV cache'})"
        )


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
    kv_cache: bool = True,
) -> list[int]:
    """The new token ids after `prompt_ids`, stopping after one of stop_ids; call on every rank with the same args.

    kv_cache=False recomputes the whole prefix for every token (the old path, for comparison)."""
    kw = dict(temperature=temperature, top_k=top_k, seed=seed, stop_ids=stop_ids, kv_cache=kv_cache)
    return generate_timed(model, prompt_ids, max_new_tokens, **kw)[0]


@torch.no_grad()
def generate_timed(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids=(),
    kv_cache: bool = True,
) -> tuple[list[int], GenerationTiming]:
    """generate(), and how long its prefill and decode took.

    With the KV cache the prompt is run once (the prefill), then one token per forward; a prompt longer
    than max_seq_len keeps its last max_seq_len tokens, and generation stops (one log line) when the
    sequence would need a position past max_seq_len. Without it every forward sees the whole sequence,
    cropped to its last max_seq_len tokens, and generation goes on. The model runs in eval mode (no dropout)."""
    with eval_mode(model):
        return _generate(model, prompt_ids, max_new_tokens, temperature, top_k, seed, stop_ids, kv_cache)


def _cache(model, max_len: int):
    """An empty KV cache for the model: titanlite's, or a transformers backend model's own."""
    return model.new_cache(max_len) if hasattr(model, "new_cache") else KVCache.for_model(model, max_len)


def _generate(model, prompt_ids, max_new_tokens, temperature, top_k, seed, stop_ids, kv_cache):
    device = model.device if hasattr(model, "new_cache") else model.rope.device
    max_len = model.args.max_seq_len
    generator = torch.Generator(device=device).manual_seed(seed)
    broadcast = dist.is_initialized() and dist.get_world_size() > 1
    tokens = list(prompt_ids)
    if kv_cache and len(tokens) > max_len:
        _log(f"The prompt's {len(tokens)} tokens exceed max_seq_len = {max_len}: keeping its last {max_len}")
        tokens = tokens[-max_len:]
    cache = _cache(model, min(len(tokens) + max_new_tokens, max_len)) if kv_cache else None
    new: list[int] = []
    start = time.perf_counter()
    prefill_s = 0.0
    feed = tokens  # the prefill; then each new token alone
    while len(new) < max_new_tokens:
        if cache is None:
            logits = model(torch.tensor([tokens[-max_len:]], dtype=torch.long, device=device), last_only=True)
        else:
            logits = model(torch.tensor([feed], dtype=torch.long, device=device), cache=cache, last_only=True)
        logits = logits[0, -1].float()
        nxt = sample_next(logits, temperature, top_k, generator)
        if broadcast:  # rank 0 decides: every rank must feed identical tokens to the next forward
            dist.broadcast(nxt, src=0)
        new.append(int(nxt))  # a host sync: the timings below are complete on any device
        tokens.append(new[-1])
        if len(new) == 1:
            prefill_s = time.perf_counter() - start
        if new[-1] in stop_ids:
            break
        if cache is not None and cache.offset == max_len and len(new) < max_new_tokens:
            _log(
                f"Stopped after {len(new)} new tokens: the sequence reached {max_len} positions, the model's limit "
                f"(its context, or what its RoPE scaling reaches); --training.seq_len N raises it to N positions"
            )
            break
        feed = new[-1:]
    timing = GenerationTiming(len(tokens) - len(new), len(new), prefill_s, time.perf_counter() - start, kv_cache)
    return new, timing


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message)
