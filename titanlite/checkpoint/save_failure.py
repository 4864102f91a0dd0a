"""What a failed checkpoint save tells the user: the cause as the failing ranks saw it, the space a checkpoint
needs and has (on a local disk), whether the partial save was removed and which checkpoint is intact (or that the
store could not be asked)."""

from __future__ import annotations

import errno
import shutil

from titanlite.checkpoint.catalog import complete_checkpoints
from titanlite.storage import describe_failure, files_under, is_remote, remove_tree


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


def clean_up(tmp, folder) -> dict:
    """Rank 0 after a failed save: remove the partial folder `tmp` and find the newest complete checkpoint. What
    happened, as the failure message tells it (each ask of an unreachable store is reported, not guessed):
    {"removed": ..., "intact": ..., "intact_bytes": size of the intact one on a local disk}."""
    error = remove_tree(tmp)
    if error is None:
        removed = f"the partial {tmp.name} was removed"
    else:
        never = "it has no commit marker, so no resume uses it" if is_remote(tmp) else "the next start removes it"
        removed = f"the partial {tmp.name} could not be removed ({cause_of(error, folder)}; {never})"
    try:
        complete = complete_checkpoints(folder)
    except Exception as e:
        return {
            "removed": removed,
            "intact": f"which earlier checkpoint is intact is unknown: {folder} could not be listed "
            f"({cause_of(e, folder)})",
            "intact_bytes": 0,
        }
    if not complete:
        return {"removed": removed, "intact": "there is no earlier complete checkpoint", "intact_bytes": 0}
    previous = complete[-1].path
    return {
        "removed": removed,
        "intact": f"{previous.name} is intact and is where a relaunch resumes",
        "intact_bytes": 0 if is_remote(folder) else bytes_in(previous),
    }


def cause_of(error: BaseException, folder) -> str:
    """What went wrong, in one line, once (an error storage.describe_failure described already is not described
    again)."""
    if str(error).startswith("checkpoint.folder = "):  # described already (storage.describe_failure)
        return str(error).split(": ", 1)[-1]
    return first_line(error, folder)


def describe(step: int, folder, partial: int, cause: str, disk_full: bool, after: dict) -> str:
    """The message of a failed save of `step` whose partial folder held `partial` bytes; after: clean_up's account."""
    cause = "no space left on device" if disk_full else cause or "a write failed"
    space = ""
    if not is_remote(folder):  # object storage has no free space to compare with
        needed = max(partial, after["intact_bytes"])
        free = shutil.disk_usage(folder).free if folder.exists() else 0
        space = f"a checkpoint takes about {needed / 1e9:.2f} GB and {free / 1e9:.2f} GB are free; "
    return (
        f"checkpoint of step {step} could not be written to {folder} ({cause}); {space}{after['removed']}; "
        + after["intact"]
    )
