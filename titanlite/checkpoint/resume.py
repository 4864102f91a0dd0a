"""Choosing the checkpoint to resume from, checking it, and saying what a resumed run does differently.

The newest complete checkpoint whose files match their checksums is used; a corrupt one is skipped
with a warning naming the file (nothing is deleted); an explicit `checkpoint.load_step` that is
corrupt is a ConfigError. A checkpoint records its run's config and model shape, so a resume can
refuse a model it cannot hold and list every setting that changed and what happens to it.
"""

from __future__ import annotations

import json
import logging
import pickle
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from titanlite.checkpoint.base_identity import fingerprint
from titanlite.checkpoint.base_identity import read as read_lora_base
from titanlite.checkpoint.catalog import (
    CheckpointInfo,
    candidates,
    checkpoint_folder,
    describe_steps,
    newest_usable,
    read_metadata,
    remove_temporaries,
    require_step,
    wanted_parts,
)
from titanlite.checkpoint.consolidated import check_model_fits, saved_shapes
from titanlite.checkpoint.integrity import quick_problems, rank_problems
from titanlite.checkpoint.lora_io import check_lora_resume
from titanlite.config import JobConfig, load
from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.storage import is_file, is_remote

logger = logging.getLogger("titanlite")

# Model fields that decide the shape of the weights or how they are used.
WEIGHT_FIELDS = (
    "family",
    "dim",
    "n_layers",
    "n_heads",
    "kv_heads",
    "head_dim",
    "ffn_hidden_dim",
    "vocab_size",
    "tie_embeddings",
    "qk_norm",
    "qkv_bias",
)


def problems_everywhere(path: Path) -> list[str]:
    """Every rank checks its share of the checkpoint's files against their checksums; the problems of all."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = rank_problems(path, rank, world)
    if world == 1:
        return mine
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return [p for ranks in everyone for p in ranks]


def intact_checkpoints(folder, load_step: int, wanted: set[str]) -> Iterator[CheckpointInfo]:
    """The checkpoints a resume may use, best first, each checked against its manifest by every rank (call on every
    rank, and take the next one on every rank together). A corrupt one is skipped with a warning (nothing is deleted);
    one that load_step names is a ConfigError."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    box: list = [[], None]  # rank 0 lists the candidates for everyone: (infos, error message)
    if rank == 0:
        try:
            remove_temporaries(folder)
            box[0] = candidates(folder, load_step, wanted)
        except ConfigError as e:
            box[1] = str(e)
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise ConfigError(box[1])
    for info in box[0]:
        problems = problems_everywhere(info.path)
        if not problems:
            yield info
            continue
        what = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        if load_step >= 0:
            raise ConfigError(
                f"checkpoint.load_step = {load_step}: {info.path} is corrupt: {what}; "
                f"complete checkpoints there: {describe_steps(folder)}"
            )
        if rank == 0:
            logger.warning(
                f"Skipping corrupt checkpoint {info.path}: {what}; trying the one before (nothing is deleted)"
            )


def unreadable(error: BaseException) -> str | None:
    """Why a load failed, in one line, when a checkpoint file's bytes are damaged (a saved item that does not unpickle
    or unzip: corruption its manifest could not show); None for any other failure."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
    found = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else [error]
    for e in found:
        damaged = isinstance(e, (pickle.UnpicklingError, EOFError, zipfile.BadZipFile)) or (
            isinstance(e, RuntimeError) and any(w in str(e) for w in ("PytorchStreamReader", "zip archive"))
        )
        if damaged:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or ["damaged bytes"]
            said = next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0])
            return f"a saved item cannot be read ({type(e).__name__}: {said.split('. ')[0][:200]})"
    return None


def saved_model_args(path: Path) -> dict | None:
    """model_args.json of a checkpoint folder, if it has one."""
    try:
        return json.loads((path / "model_args.json").read_text())
    except (OSError, ValueError):
        return None


def saved_job_config(path: Path) -> JobConfig | None:
    """The config of the run that saved a checkpoint (job_config.toml), if it has one and it still loads."""
    saved = path / "job_config.toml"
    if not is_file(saved):
        return None
    try:
        if not is_remote(path):
            return load(["--job.config_file", str(saved)])
        with tempfile.TemporaryDirectory() as local:  # the config loader reads local files
            copy = Path(local) / "job_config.toml"
            copy.write_text(saved.read_text())
            return load(["--job.config_file", str(copy)])
    except ConfigError:
        return None


def check_same_optimizer(path: Path, name: str) -> None:
    """ConfigError when the checkpoint's optimizer state is Muon's and the run's AdamW's (or Adam's), or the other way:
    one cannot take over the other's moments."""
    saved = saved_job_config(path)
    then = saved.optimizer.name if saved else name
    if (then.lower() == "muon") != (name.lower() == "muon"):  # Adam and AdamW keep the same moments
        raise ConfigError(
            f"{path} was saved with optimizer.name = {then!r}, this run has {name!r}: one cannot resume the other's "
            f"state; resume with --checkpoint.exclude_from_loading optimizer to start {name}'s state fresh (the "
            f"weights, schedule and data position are kept), or set optimizer.name = {then!r}"
        )


def model_differences(saved: dict, args: ModelArgs) -> list[str]:
    """'field: checkpoint value -> this run's value' for every weight-relevant field that differs."""
    saved_args = ModelArgs(
        **{k: v for k, v in saved.items() if k in ModelArgs.__dataclass_fields__ and k != "rope_scaling"}
    )
    return [
        f"{f}: {getattr(saved_args, f)} in the checkpoint, {getattr(args, f)} in this run"
        for f in WEIGHT_FIELDS
        if getattr(saved_args, f) != getattr(args, f)
    ]


def check_model_matches(path: Path, args: ModelArgs) -> None:
    """ConfigError when the checkpoint was saved from a model of another shape (incl. tied or not)."""
    saved = saved_model_args(path)
    diff = model_differences(saved, args) if saved else []
    if diff:
        raise ConfigError(
            f"{path} was saved by a model of another shape than this run's ({'; '.join(diff)}); resume with the "
            f"settings it was trained with (its job_config.toml), or start a new run from its weights with "
            f"checkpoint.initial_load_path and a new job.dump_folder"
        )


def _fmt(v) -> str:
    return repr(v)


def describe_changes(
    saved: JobConfig, cfg: JobConfig, step: int, sequence_index: int, replanned, lr: float
) -> list[str]:
    """What differs between the checkpointed run's config and this one, and what happens to each."""
    lines = []

    def changed(section: str, key: str):
        old, new = getattr(getattr(saved, section), key), getattr(getattr(cfg, section), key)
        return (old, new) if old != new else None

    for key in ("lr", "beta1", "beta2", "eps", "weight_decay", "name"):
        if c := changed("optimizer", key):
            lines.append(
                f"optimizer.{key}: {_fmt(c[0])} -> {_fmt(c[1])}: this run's value is used from step "
                f"{step + 1} on" + (f" (lr now {lr:.3e})" if key == "lr" else "")
            )
    sched = []
    for section, key in (
        ("training", "steps"),
        ("lr_scheduler", "warmup_steps"),
        ("lr_scheduler", "decay_type"),
        ("lr_scheduler", "min_lr_factor"),
    ):
        if c := changed(section, key):
            sched.append(f"{section}.{key}: {_fmt(c[0])} -> {_fmt(c[1])}")
    if sched and replanned:
        (new_total, _, decay, min_factor), at = replanned[1], replanned[2]
        lines.append(
            f"{', '.join(sched)}: the schedule is re-planned at step {at}: the lr goes on from {lr:.3e} "
            f"with a {decay} decay to {min_factor} x optimizer.lr at step {new_total} (no jump)"
        )
    if c := changed("training", "global_batch_size"):
        lines.append(
            f"training.global_batch_size: {c[0]} -> {c[1]}: the data position is kept in sequences "
            f"({sequence_index:,} seen); each step now takes {c[1]}"
        )
    if c := changed("training", "local_batch_size"):
        lines.append(
            f"training.local_batch_size: {c[0]} -> {c[1]}: microbatches per step change, the data order and "
            f"the loss do not"
        )
    if c := changed("training", "seq_len"):
        lines.append(
            f"training.seq_len: {c[0]} -> {c[1]}: the data position is kept in tokens; sequences are "
            f"{c[1]} tokens from here on"
        )
    for section, key in (
        ("training", "dataset"),
        ("training", "dataset_split"),
        ("data", "format"),
        ("data", "shuffle"),
        ("training", "seed"),
    ):
        if c := changed(section, key):
            lines.append(
                f"{section}.{key}: {_fmt(c[0])} -> {_fmt(c[1])}: the data position ({sequence_index:,} "
                f"sequences) now counts in another order or dataset: data may repeat or be skipped"
            )
    for section, key in (
        ("parallelism", "data_parallel_shard_degree"),
        ("parallelism", "data_parallel_replicate_degree"),
        ("parallelism", "tensor_parallel_degree"),
    ):
        if c := changed(section, key):
            lines.append(f"{section}.{key}: {c[0]} -> {c[1]}: the model and optimizer are resharded")
    return lines


def check_resume(cfg: JobConfig, args: ModelArgs, model_shapes: dict[str, tuple]) -> None:
    """Before any process starts: ConfigError when the checkpoint a resume would use (load_step, or the
    newest complete one) holds a model of another shape, or when load_step's files are missing or truncated
    (from model_args.json, the DCP metadata and the manifest's sizes; nothing is read beyond them)."""
    c = cfg.checkpoint
    if not c.enable or "model" not in wanted_parts(cfg):
        return
    folder = checkpoint_folder(cfg)
    info = (
        require_step(folder, c.load_step, wanted_parts(cfg))
        if c.load_step >= 0
        else newest_usable(folder, wanted_parts(cfg))
    )
    if info is None:
        return
    if c.load_step >= 0 and (problems := quick_problems(info.path)):
        raise ConfigError(f"checkpoint.load_step = {c.load_step}: {info.path} is corrupt: {'; '.join(problems[:3])}")
    if cfg.lora.enable or read_lora_base(info.path) is not None:
        base = fingerprint(cfg.checkpoint.initial_load_path) if cfg.lora.enable else None
        check_lora_resume(info.path, cfg.lora, base, args)
    check_model_matches(info.path, args)
    hint = "; was it saved with another lora.rank or lora.targets?" if cfg.lora.enable else None
    check_model_fits(model_shapes, saved_shapes(read_metadata(info.path), "model."), str(info.path), hint)
