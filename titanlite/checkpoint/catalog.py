"""Finding checkpoints on disk or in object storage: `step-N` folders, which are complete, which hold what;
start-up checks.

On a local or mounted folder a save is written to `.tmp-step-N` and renamed to `step-N` only when every rank has
finished, so a folder named `step-N` with a readable `.metadata` is complete. Object storage has no rename: a save
is written to `step-N` itself and is complete only once its commit marker (`.committed`, written last) is there.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from titanlite.checkpoint.safe_reading import UnsafeCheckpointError, load_metadata
from titanlite.config import CHECKPOINT_PARTS, JobConfig
from titanlite.errors import ConfigError
from titanlite.storage import (
    copy_tree,
    describe_failure,
    is_file,
    is_remote,
    is_url,
    location,
    remove_tree,
    storage_problem,
)

logger = logging.getLogger("titanlite")

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
ABANDONED_PREFIX = "abandoned-step-"  # a full checkpoint newer than the one a run resumed from, set aside
COMMITTED = ".committed"  # written last into a step folder: on object storage, what makes it complete


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete, readable checkpoint folder and the top-level parts it holds."""

    step: int
    path: Path
    parts: frozenset[str]


def checkpoint_folder(cfg: JobConfig):
    """`<job.dump_folder>/<checkpoint.folder>` (an absolute checkpoint.folder or a URL such as s3://bucket/prefix
    is used as is): a Path, or a UPath for object storage."""
    if is_url(cfg.checkpoint.folder):
        return location(cfg.checkpoint.folder)
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def step_folders(folder: Path) -> dict[int, Path]:
    """Folders named step-N in `folder` (complete or not), by step."""
    out = {}
    try:
        listed = list(folder.iterdir()) if folder.is_dir() else []
    except (FileNotFoundError, NotADirectoryError):
        if not is_remote(folder):
            raise
        listed = []  # a prefix whose last object went between the two calls (rank 0's pre-launch probe): empty
    except Exception as e:
        if not is_remote(folder):
            raise
        raise ConfigError(describe_failure(folder, "checkpoint.folder", e)) from None
    if listed:
        for p in listed:
            suffix = p.name[len(STEP_PREFIX) :]
            if p.name.startswith(STEP_PREFIX) and suffix.isdigit() and p.is_dir():
                out[int(suffix)] = p
    return out


def read_metadata(path: Path, committed: bool = True, key: str = "checkpoint.folder"):
    """The DCP metadata of a checkpoint folder; ValueError saying why when it is missing or unreadable (in object
    storage also without its commit marker, unless committed=False: a DCP folder other tools wrote); ConfigError
    naming `key` when object storage cannot be asked (an outage is not an absence)."""
    try:
        has_metadata = is_file(path / ".metadata")
        has_marker = not (committed and is_remote(path)) or is_file(path / COMMITTED)
    except Exception as e:
        raise ConfigError(describe_failure(path, key, e)) from None
    if not has_metadata:
        raise ValueError("it has no .metadata file (an incomplete or partial copy)")
    if not has_marker:
        raise ValueError(
            f"it has no commit marker ({COMMITTED}): a save that did not finish (a later save of this step replaces "
            f"it; a copy of a local checkpoint saved without the marker is made usable by adding an empty {COMMITTED})"
        )
    try:
        return load_metadata(path)
    except UnsafeCheckpointError:
        raise  # not merely unreadable: refused, and the run must not fall back past it silently
    except Exception as e:  # truncated or foreign files raise anything from pickle or torch
        if is_remote(path) and not isinstance(e, (EOFError, ValueError, pickle.UnpicklingError)):
            raise ConfigError(describe_failure(path, key, e)) from None
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
        except UnsafeCheckpointError:
            pass  # never counted (the resume refuses it, naming it)
        except ConfigError:
            raise  # object storage that cannot be asked: not a checkpoint to pass over
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
    except ConfigError:
        raise
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
        except ConfigError:
            raise  # a tampered folder or an unreachable store stops the run: no silent fresh start past it
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
    """ConfigError naming the setting when folder cannot be created or written to (a probe object on object
    storage: the endpoint, the credentials and the bucket are checked before launch)."""
    if is_remote(folder):
        if problem := storage_problem(folder, setting):
            raise ConfigError(problem)
        return
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
    if c.initial_load_path and not is_url(c.initial_load_path) and not Path(c.initial_load_path).exists():
        raise ConfigError(
            f"checkpoint.initial_load_path = {c.initial_load_path!r} does not exist; valid: a DCP "
            f"checkpoint folder (step-N) or a consolidated state-dict file"
        )
    if not c.enable:
        return
    folder = checkpoint_folder(cfg)
    where = f"checkpoint.folder = {c.folder!r} (under job.dump_folder = {cfg.job.dump_folder!r})"
    _check_writable(folder, "checkpoint.folder" if is_remote(folder) else where)
    if c.load_step >= 0:
        require_step(folder, c.load_step, wanted_parts(cfg))


def remove_checkpoint(path) -> None:
    """Remove a step folder; in object storage its commit marker first, so that a removal cut short leaves a folder
    that no resume uses (raises when the marker cannot be removed)."""
    if is_remote(path):
        (path / COMMITTED).unlink(missing_ok=True)
    remove_tree(path)


def remove_old(folder, keep_latest_k: int, load_step: int, saved_steps: set[int]) -> None:
    """Retention: keep the newest keep_latest_k complete checkpoints, the newest full one and the one load_step
    names; remove the others (saved_steps: the steps this run wrote, for the log)."""
    if keep_latest_k <= 0:
        return
    complete = complete_checkpoints(folder)  # unreadable or partial folders are never counted or removed
    if len(complete) <= keep_latest_k:
        return
    keep = {i.step for i in complete[-keep_latest_k:]} | {load_step}  # a requeue may be told to load it again
    full = [i.step for i in complete if set(CHECKPOINT_PARTS) <= i.parts]
    if full:  # the newest checkpoint a resume can use survives model-only saves
        keep.add(full[-1])
    for info in complete:
        if info.step not in keep:
            remove_checkpoint(info.path)
            earlier = "" if info.step in saved_steps else "; written by an earlier run"
            logger.info(f"Removed old checkpoint {info.path} (checkpoint.keep_latest_k = {keep_latest_k}{earlier})")


def set_aside_newer(folder, step: int) -> None:
    """Move every full checkpoint newer than `step` (the one this run resumed from; -1: none) to
    `abandoned-step-N`, which no resume and no retention counts: else a later resume would go back to them, and
    keep_latest_k would count them as the newest and remove this run's own saves. Logged; raises when one cannot be
    moved (in object storage a copy of its objects within the store, then their removal, commit marker first)."""
    newer = [i for i in complete_checkpoints(folder) if i.step > step and set(CHECKPOINT_PARTS) <= i.parts]
    for info in newer:
        target, n = folder / f"{ABANDONED_PREFIX}{info.step}", 1
        while target.exists():
            n += 1
            target = folder / f"{ABANDONED_PREFIX}{info.step}-{n}"
        if is_remote(folder):
            copy_tree(info.path, target)
            remove_checkpoint(info.path)
        else:
            os.rename(info.path, target)
        logger.warning(
            f"Set {info.path.name} aside as {target}: it is newer than the step this run resumes from "
            f"({step if step >= 0 else 'none'}), so a later resume would go back to it and keep_latest_k would count "
            f"it before this run's saves; move it back to resume from it, or delete it"
        )


def remove_temporaries(folder) -> None:
    """Delete saves that never completed (a crash, a kill or a full disk during a save); rank 0, at start. In object
    storage they are step-N folders without the commit marker."""
    if is_remote(folder):
        _remove_uncommitted(folder)
        return
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if p.name.startswith(TMP_PREFIX):
            logger.warning(f"Removing incomplete checkpoint {p} (a save that did not finish)")
            shutil.rmtree(p, ignore_errors=True)


def _remove_uncommitted(folder) -> None:
    """Object storage: remove the step-N folders without the commit marker (a save that did not finish); one that
    cannot be removed is left (no resume counts it) with a warning."""
    try:
        partial = [p for p in folder.iterdir() if p.name.startswith(STEP_PREFIX) and not (p / COMMITTED).exists()]
    except FileNotFoundError:
        return
    for p in partial:
        logger.warning(f"Removing incomplete checkpoint {p} (a save that did not finish: no {COMMITTED})")
        if (error := remove_tree(p)) is not None:
            logger.warning(f"Could not remove {p} ({type(error).__name__}: {error}); no resume counts it")
