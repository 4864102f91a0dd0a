"""Where an export writes: never over an existing model unless asked, never over a folder of other things or
the checkpoint being exported, never a half-written or mixed output.

An export is written into a temporary sibling of the output (created with the usual permissions, not a
private temp folder's), then moved into place in one rename. With `--overwrite` the old output is moved
aside first and removed only once the new one is in place, so old weights or an old tokenizer are never
left beside new ones, and a failed export leaves the old output as it was and nothing new behind.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from titanlite.checkpoint.catalog import STEP_PREFIX, step_folders
from titanlite.errors import ConfigError

# What makes a folder "hold a model" (weights, its config or its tokenizer).
MODEL_FILES = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "adapter_config.json",
)


TEMPORARY = ".{name}.exporting-{pid}"  # the sibling an export is written into


def shown(path: Path) -> Path:
    """The output a path names for the user: the final folder for an export's temporary sibling, else itself."""
    m = re.fullmatch(r"\.(.+)\.exporting-\d+", path.name)
    return path.with_name(m.group(1)) if m else path


def _looks_like_a_step(output: Path) -> bool:
    """Whether `output` is named step-N (or .tmp-step-N) in a folder that holds step-N checkpoints."""
    step_name = re.fullmatch(r"(\.tmp-)?" + re.escape(STEP_PREFIX) + r"\d+", output.name)
    return bool(step_name) and any(step_folders(output.absolute().parent).values())


def _step_folder_holding(output: Path) -> Path | None:
    """The checkpoint folder (a step-N folder, or any DCP checkpoint) that `output` would be inside: retention
    (checkpoint.keep_latest_k) deletes such folders whole."""
    for place in output.absolute().parents:
        if (place / ".metadata").is_file() or re.fullmatch(re.escape(STEP_PREFIX) + r"\d+", place.name):
            return place
    return None


def check_target(output: Path, folder: bool, overwrite: bool, checkpoint: Path | None = None) -> None:
    """ConfigError when writing `output` (a folder for hf, else a file) would replace or mix with what is there,
    replace the `checkpoint` being exported, land inside a checkpoint's step folder, or cannot be done where it
    is."""
    kind = "folder" if folder else "file"
    if checkpoint is not None and (out := output.resolve()) in (src := Path(checkpoint).resolve(), *src.parents):
        what = "the checkpoint" if out == src else "a folder holding the checkpoint"
        raise ConfigError(
            f"--output {output} is {what} being exported (--checkpoint {checkpoint}): the export would replace "
            f"it; choose another --output"
        )
    if _looks_like_a_step(output):
        raise ConfigError(
            f"--output {output} is named as a checkpoint step beside the step-N folders of {output.absolute().parent}: "
            "retention would count and delete it as one, and a resume would read it; choose another name"
        )
    if (step := _step_folder_holding(output)) is not None:
        raise ConfigError(
            f"--output {output} is inside the checkpoint folder {step}, which retention (checkpoint.keep_latest_k) "
            "deletes whole with whatever it holds, and which a resume reads as a checkpoint; choose an --output "
            "outside every step-N folder"
        )
    place = output.absolute().parent
    while not place.exists():
        place = place.parent
    if not place.is_dir():
        raise ConfigError(
            f"--output {output} cannot be created: {place} is a file, not a folder; choose another --output"
        )
    if not os.access(place, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--output {output} cannot be written: the folder {place} is read-only; choose another --output"
        )
    if output.exists() and output.is_dir() != folder:
        raise ConfigError(
            f"--output {output} is a {'folder' if output.is_dir() else 'file'}, but this export writes a {kind}; "
            f"choose another --output"
        )
    if not output.exists():
        return
    if not folder:
        if overwrite:
            return
        raise ConfigError(
            f"--output {output} already exists ({output.stat().st_size:,} bytes); pass --overwrite to replace it, "
            "or choose another --output"
        )
    held = sorted({p.name for pattern in MODEL_FILES for p in output.glob(pattern)})
    if not held and (others := sorted(p.name for p in output.iterdir())):
        raise ConfigError(
            f"--output {output} holds {', '.join(others[:4])}{', ...' if len(others) > 4 else ''} and no model: an "
            "export replaces its folder whole, so it writes only into a new or empty folder, or over a model "
            "folder with --overwrite; choose another --output"
        )
    if held and not overwrite:
        raise ConfigError(
            f"--output {output} already holds a model ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); "
            "pass --overwrite to replace the whole folder, or choose another --output"
        )


def write_atomically(output: Path, folder: bool, write: Callable[[Path], object]):
    """Call write(tmp) on a temporary sibling of `output`, then put it in place; returns what write returned.

    On any failure the temporary output is removed and `output` is left as it was.
    """
    output = output.absolute()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(TEMPORARY.format(name=output.name, pid=os.getpid()))
    old = output.with_name(f".{output.name}.replaced-{os.getpid()}")
    _remove(tmp)
    if folder:
        tmp.mkdir()  # the umask's permissions, like the files written into it
    try:
        result = write(tmp)
        if folder and output.exists():  # a folder cannot be replaced by a rename: move it aside first
            os.replace(output, old)
        os.replace(tmp, output)  # a file is replaced atomically
    except BaseException:
        _remove(tmp)
        if folder and old.exists() and not output.exists():
            os.replace(old, output)  # put the previous output back
        raise
    _remove(old)
    return result


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
