"""Finding checkpoints on disk: `step-N` folders, which are complete, which hold what; start-up checks.

A save is written to `.tmp-step-N` and renamed to `step-N` only when every rank has finished, so a
folder named `step-N` with a readable `.metadata` is complete.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from titanlite.checkpoint.safe_reading import UnsafeCheckpointError, load_metadata
from titanlite.config import CHECKPOINT_PARTS, JobConfig
from titanlite.errors import ConfigError

logger = logging.getLogger("titanlite")

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete, readable checkpoint folder and the top-level parts it holds."""

    step: int
    path: Path
    parts: frozenset[str]


def checkpoint_folder(cfg: JobConfig) -> Path:
    """`<job.dump_folder>/<checkpoint.folder>` (an absolute checkpoint.folder is used as is)."""
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def step_folders(folder: Path) -> dict[int, Path]:
    """Folders named step-N in `folder` (complete or not), by step."""
    out = {}
    if folder.is_dir():
        for p in folder.iterdir():
            suffix = p.name[len(STEP_PREFIX) :]
            if p.name.startswith(STEP_PREFIX) and suffix.isdigit() and p.is_dir():
                out[int(suffix)] = p
    return out


def read_metadata(path: Path):
    """The DCP metadata of a checkpoint folder; ValueError saying why when it is missing or unreadable."""
    if not (path / ".metadata").is_file():
        raise ValueError("it has no .metadata file (an incomplete or partial copy)")
    try:
        return load_metadata(path)
    except UnsafeCheckpointError:
        raise  # not merely unreadable: refused, and the run must not fall back past it silently
    except Exception as e:  # truncated or foreign files raise anything from pickle or torch
        raise ValueError(f"its .metadata cannot be read ({type(e).__name__}: {e})") from None


def read_info(path: Path, step: int = -1) -> CheckpointInfo:
    """The parts a checkpoint folder holds; ValueError saying why when it is incomplete or unreadable."""
    metadata = read_metadata(path)
    return CheckpointInfo(step, path, frozenset(k.split(".", 1)[0] for k in metadata.state_dict_metadata))


def complete_checkpoints(folder: Path) -> list[CheckpointInfo]:
    """Every complete, readable checkpoint in the folder, oldest first."""
    out = []
    for step, path in sorted(step_folders(folder).items()):
        try:
            out.append(read_info(path, step))
        except ValueError:
            pass
    return out


def describe_steps(folder: Path) -> str:
    """'2, 4, 6' or 'none', for error messages listing the complete checkpoints."""
    return ", ".join(str(i.step) for i in complete_checkpoints(folder)) or "none"


def require_step(folder: Path, step: int, wanted: set[str]) -> CheckpointInfo:
    """The checkpoint of an exact step holding the wanted parts, else ConfigError naming what exists."""
    path = step_folders(folder).get(step)
    if path is None:
        raise ConfigError(
            f"checkpoint.load_step = {step}: there is no step-{step} in {folder}; "
            f"complete checkpoints there: {describe_steps(folder)}"
        )
    try:
        info = read_info(path, step)
    except ValueError as e:
        raise ConfigError(
            f"checkpoint.load_step = {step}: {path} is not a usable checkpoint: {e}; "
            f"complete checkpoints there: {describe_steps(folder)}"
        ) from None
    missing = sorted(wanted - info.parts)
    if missing:
        raise ConfigError(
            f"checkpoint.load_step = {step}: {path} holds only {sorted(info.parts)} (a model-only "
            f"save?), not {missing}; add them to checkpoint.exclude_from_loading to load it anyway"
        )
    return info


def candidates(folder: Path, load_step: int, wanted: set[str]) -> list[CheckpointInfo]:
    """The checkpoints a resume may use, best first: load_step's only, or every complete one holding the
    wanted parts, newest first (the others are skipped with a warning)."""
    if load_step >= 0:
        return [require_step(folder, load_step, wanted)]
    out = []
    for step, path in sorted(step_folders(folder).items(), reverse=True):
        try:
            info = read_info(path, step)
        except UnsafeCheckpointError:
            raise  # a tampered folder stops the run: no silent fresh start past it
        except ValueError as e:
            logger.warning(f"Skipping checkpoint {path}: {e}")
            continue
        if wanted <= info.parts:
            out.append(info)
        else:
            logger.info(
                f"Skipping checkpoint {path} for resuming: it holds only {sorted(info.parts)} (model-only save)"
            )
    return out


def newest_usable(folder: Path, wanted: set[str]) -> CheckpointInfo | None:
    """The newest complete checkpoint holding the wanted parts; others are skipped with a warning."""
    return next(iter(candidates(folder, -1, wanted)), None)


def wanted_parts(cfg: JobConfig) -> set[str]:
    """The parts a resume restores: every part except checkpoint.exclude_from_loading."""
    return set(CHECKPOINT_PARTS) - set(cfg.checkpoint.exclude_from_loading)


def _check_writable(folder: Path, setting: str) -> None:
    """ConfigError naming the setting when folder cannot be created or written to."""
    probe = folder / f".write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{setting}: cannot write to {folder}: {e.strerror or e}; choose a writable folder") from None


def preflight(cfg: JobConfig) -> None:
    """Checks that need no process group: the dump and checkpoint folders are writable, load_step and
    initial_load_path exist. Raises ConfigError, so a bad setting fails at start-up."""
    c = cfg.checkpoint
    _check_writable(Path(cfg.job.dump_folder), f"job.dump_folder = {cfg.job.dump_folder!r}")
    if c.initial_load_path and not Path(c.initial_load_path).exists():
        raise ConfigError(
            f"checkpoint.initial_load_path = {c.initial_load_path!r} does not exist; valid: a DCP "
            f"checkpoint folder (step-N) or a consolidated state-dict file"
        )
    if not c.enable:
        return
    folder = checkpoint_folder(cfg)
    _check_writable(folder, f"checkpoint.folder = {c.folder!r} (under job.dump_folder = {cfg.job.dump_folder!r})")
    if c.load_step >= 0:
        require_step(folder, c.load_step, wanted_parts(cfg))
