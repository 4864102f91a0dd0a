"""Exports from and to object storage (`--checkpoint s3://...`, `--output s3://...`).

The step folder being exported is copied to a local temporary folder first (the export reads all of it anyway);
the export is written locally as usual and then uploaded, config.json and the index files last, so that a
half-uploaded folder is never read as a model. An existing output is replaced only with --overwrite and only
when it holds a model, as for a local output.
"""

from __future__ import annotations

import fnmatch
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from titanlite.checkpoint.catalog import STEP_PREFIX
from titanlite.checkpoint.consolidated import resolve_step
from titanlite.checkpoint.export_target import MODEL_FILES
from titanlite.errors import ConfigError
from titanlite.storage import describe_failure, download, files_under, is_url, location, remove_tree, upload

LAST = ("config.json", "model.safetensors.index.json", "adapter_config.json")


def check_remote_target(output, folder: bool, overwrite: bool, checkpoint: str) -> None:
    """ConfigError when writing the remote `output` (a folder, or a file for consolidated) would replace or mix with
    what is there, replace the checkpoint, land in a step folder or take a whole bucket."""
    text, source = str(output).rstrip("/"), checkpoint.rstrip("/")
    if "/" not in text.split("://", 1)[1]:
        raise ConfigError(f"--output {text} is a whole bucket; an export replaces its output whole: name a prefix")
    if source == text or source.startswith(text + "/"):
        raise ConfigError(f"--output {output} is or holds the checkpoint being exported (--checkpoint {checkpoint})")
    if any(re.fullmatch(r"(\.tmp-)?" + STEP_PREFIX + r"\d+", part) for part in text.split("://", 1)[1].split("/")):
        raise ConfigError(
            f"--output {output} is or is inside a checkpoint's step folder, which retention deletes whole and a "
            "resume reads; choose an --output outside every step-N folder"
        )
    try:
        names = [] if output.is_file() else list(files_under(output))
        is_a_file = not names and output.is_file()
    except Exception as e:
        raise ConfigError(describe_failure(output, "--output", e)) from None
    if is_a_file:
        if folder or not overwrite:
            what = "it is a file, but this export writes a folder" if folder else "pass --overwrite to replace it"
            raise ConfigError(f"--output {output} already exists: {what}; or choose another --output")
        return
    if names and not folder:
        raise ConfigError(f"--output {output} is a folder (a prefix with objects), but this export writes a file")
    nested = sorted({n.split("/")[0] for n in names if "/" in n})
    held = [n for n in names if "/" not in n and any(fnmatch.fnmatch(n, p) for p in MODEL_FILES)]
    if nested or (names and not held):
        others = nested or names
        raise ConfigError(
            f"--output {output} holds {', '.join(others[:4])}{', ...' if len(others) > 4 else ''} and no model "
            "alone: an export replaces its folder whole, so it writes only into a new or empty prefix, or over a "
            "model folder with --overwrite; choose another --output"
        )
    if held and not overwrite:
        raise ConfigError(
            f"--output {output} already holds a model ({', '.join(held[:4])}); pass --overwrite to replace it "
            "whole, or choose another --output"
        )


@contextmanager
def local_export(checkpoint: str, output: str, folder: bool, overwrite: bool) -> Iterator[tuple[str, str]]:
    """(checkpoint, output) as local paths for an export between two paths either of which may be a URL (folder:
    the output is a folder, not a file); when the block ends without an error, a remote output is uploaded (replacing
    the old one)."""
    remote = location(output, "--output") if is_url(output) else None
    if remote is not None:  # before anything is downloaded
        check_remote_target(remote, folder, overwrite, checkpoint)
    with tempfile.TemporaryDirectory(prefix="titanlite-export-") as work:
        local_checkpoint = checkpoint
        if is_url(checkpoint):
            source = location(checkpoint, "--checkpoint")
            try:
                step = resolve_step(source)
                local_checkpoint = str(download(step, Path(work) / "in" / step.name))
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError(describe_failure(source, "--checkpoint", e)) from None
        if remote is None:
            yield local_checkpoint, output
            return
        local_output = Path(work) / "out" / remote.name
        local_output.parent.mkdir()
        yield local_checkpoint, str(local_output)
        try:
            if remote.is_file():
                remote.unlink()
            remove_tree(remote)
            if local_output.is_dir():
                upload(local_output, remote, last=LAST)
            else:
                remote.fs.put_file(str(local_output), remote.path)
        except Exception as e:
            raise ConfigError(describe_failure(remote, "--output", e)) from None
