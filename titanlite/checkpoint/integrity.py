"""Checksums of checkpoint files: written with every save, verified before a resume.

Each rank records the size and CRC-32 of the files it wrote (`manifest-rank<r>.json`; on object storage the
store's own digest of each object, its ETag, so that nothing is read back); rank 0 adds
the files it writes last (`.metadata`, `job_config.toml`, `model_args.json`) and merges them into
`manifest.json` before the folder is renamed to `step-N`. Before resuming, every rank checks its
share of the files (by index, round-robin) in parallel; `quick_problems` checks only that the files
are there with their sizes, cheap enough for the pre-launch check.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from titanlite.storage import checksum, is_file, is_remote, mismatch, replace_text

MANIFEST = "manifest.json"


def _describe(paths: list[Path]) -> dict[str, list]:
    return {p.name: checksum(p) for p in paths}


def write_rank_manifest(folder: Path, rank: int) -> None:
    """Record this rank's .distcp files of a save that finished (call on every rank)."""
    entries = _describe(sorted(folder.glob(f"__{rank}_*.distcp")))
    replace_text(folder / f"manifest-rank{rank}.json", json.dumps(entries))


def seal(folder: Path, world: int, extra: list[str], timeout: float = 600.0) -> None:
    """Rank 0: merge every rank's manifest (waiting for them) and the extra files into manifest.json."""
    wanted = [folder / f"manifest-rank{r}.json" for r in range(world)]
    deadline = time.monotonic() + timeout
    pause = 0.5 if is_remote(folder) else 0.05  # each look is a request per rank on object storage
    while not all(is_file(p) for p in wanted) and time.monotonic() < deadline:
        time.sleep(pause)
    complete = all(is_file(p) for p in wanted)  # else the files of the missing ranks go unchecked
    files: dict[str, list[int]] = {}
    for p in wanted:
        if is_file(p):
            files.update(json.loads(p.read_text()))
            p.unlink()
    files.update(_describe([folder / name for name in extra if is_file(folder / name)]))
    (folder / MANIFEST).write_text(json.dumps({"files": files, "complete": complete}, indent=1))


def read_manifest(folder: Path) -> dict[str, list[int]] | None:
    """{file: [size, crc]} of a checkpoint, or None when it has no manifest (saved before checksums)."""
    path = folder / MANIFEST
    if not is_file(path):
        return None
    try:
        return json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return {MANIFEST: [-1, -1]}  # an unreadable manifest: every check of it fails


def quick_problems(folder: Path) -> list[str]:
    """Missing or wrong-size files (no checksums): what a pre-launch check can afford."""
    files = read_manifest(folder) or {}
    return [p for name, (size, _) in files.items() if (p := mismatch(folder / name, size, None))]


def rank_problems(folder: Path, rank: int, world: int) -> list[str]:
    """This rank's share of the checks: sizes and checksums of every world-th file."""
    files = sorted((read_manifest(folder) or {}).items())
    return [p for name, (size, crc) in files[rank::world] if (p := _checked(folder, name, size, crc))]


def _checked(folder: Path, name: str, size: int, recorded) -> str | None:
    """mismatch(), with a file that cannot be asked about (an outage) a problem too: the ranks check in parallel and
    gather their problems, so none may raise alone."""
    try:
        return mismatch(folder / name, size, recorded)
    except Exception as e:
        return f"{name} could not be checked ({type(e).__name__}: {str(e)[:200]})"
