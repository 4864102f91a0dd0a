"""What a failed checkpoint save tells the user: the cause as the failing ranks saw it, the space a checkpoint
needs and has (on a local disk), and which checkpoint is intact."""

from __future__ import annotations

import errno
import shutil

from titanlite.storage import describe_failure, files_under, is_remote


def is_disk_full(error: BaseException) -> bool:
    """Whether a save failed for lack of space (also when DCP wrapped the OSError in its CheckpointException)."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> WrappedException(exc, ...)
        todo += [
            getattr(e, "__cause__", None),
            getattr(e, "__context__", None),
            getattr(e, "exc", None),
            *(failures.values() if isinstance(failures, dict) else ()),
        ]
    return "No space left on device" in str(error) or "unexpected pos" in str(error)


def first_line(error: BaseException | None, folder) -> str:
    """The error's first line (on object storage, what the store said and what to check)."""
    if error is None:
        return ""
    if is_remote(folder):
        return describe_failure(folder, "checkpoint.folder", _innermost(error)).split(": ", 1)[-1]
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


def _innermost(error: BaseException) -> BaseException:
    """The exception DCP wrapped (CheckpointException holds each rank's as WrappedException.exc)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        error = getattr(inner, "exc", None) or (inner[0] if isinstance(inner, tuple) else error)
    return error


def bytes_in(folder) -> int:
    """The bytes of the files under a folder (0 when it cannot be listed)."""
    try:
        return sum(files_under(folder).values())
    except Exception:  # a folder removed meanwhile, an endpoint that is down
        return 0


def describe(step: int, folder, tmp, partial: int, cause: str, disk_full: bool, previous) -> str:
    """The message of a failed save of `step` whose partial folder `tmp` (of `partial` bytes) was removed;
    previous: the newest complete checkpoint (CheckpointInfo) or None."""
    cause = "no space left on device" if disk_full else cause or "a write failed"
    intact = (
        f"{previous.path.name} is intact and is where a relaunch resumes"
        if previous
        else "there is no earlier complete checkpoint"
    )
    space = ""
    if not is_remote(folder):  # object storage has no free space to compare with
        needed = max(partial, bytes_in(previous.path) if previous else 0)
        free = shutil.disk_usage(folder).free if folder.exists() else 0
        space = f"a checkpoint takes about {needed / 1e9:.2f} GB and {free / 1e9:.2f} GB are free; "
    return (
        f"checkpoint of step {step} could not be written to {folder} ({cause}); {space}the partial {tmp.name} was "
        f"removed; {intact}"
    )
