"""Checksums of checkpoint files: written with every save, verified before a resume.

Each rank records the size and CRC-32 of the files it wrote (`manifest-rank<r>.json`); rank 0 adds
the files it writes last (`.metadata`, `job_config.toml`, `model_args.json`) and merges them into
`manifest.json` before the folder is renamed to `step-N`. Before resuming, every rank checks its
share of the files (by index, round-robin) in parallel; `quick_problems` checks only that the files
are there with their sizes, cheap enough for the pre-launch check.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

MANIFEST = "manifest.json"
_CHUNK = 16 << 20


def file_crc(path: Path) -> int:
    """CRC-32 of a file's bytes (fast enough to check every resume; it is for corruption, not for attacks)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


def _describe(paths: list[Path]) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, file_crc(p)] for p in paths}


def write_rank_manifest(folder: Path, rank: int) -> None:
    """Record this rank's .distcp files of a save that finished (call on every rank)."""
    entries = _describe(sorted(folder.glob(f"__{rank}_*.distcp")))
    tmp = folder / f".manifest-rank{rank}.json.tmp"
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, folder / f"manifest-rank{rank}.json")


def seal(folder: Path, world: int, extra: list[str], timeout: float = 600.0) -> None:
    """Rank 0: merge every rank's manifest (waiting for them) and the extra files into manifest.json."""
    wanted = [folder / f"manifest-rank{r}.json" for r in range(world)]
    deadline = time.monotonic() + timeout
    while not all(p.is_file() for p in wanted) and time.monotonic() < deadline:
        time.sleep(0.05)
    complete = all(p.is_file() for p in wanted)  # else the files of the missing ranks go unchecked
    files: dict[str, list[int]] = {}
    for p in wanted:
        if p.is_file():
            files.update(json.loads(p.read_text()))
            p.unlink()
    files.update(_describe([folder / name for name in extra if (folder / name).is_file()]))
    (folder / MANIFEST).write_text(json.dumps({"files": files, "complete": complete}, indent=1))


def read_manifest(folder: Path) -> dict[str, list[int]] | None:
    """{file: [size, crc]} of a checkpoint, or None when it has no manifest (saved before checksums)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return {MANIFEST: [-1, -1]}  # an unreadable manifest: every check of it fails


def _file_problem(folder: Path, name: str, size: int, crc: int | None) -> str | None:
    """What is wrong with one file of the manifest (crc None: the size only), or None."""
    path = folder / name
    if not path.is_file():
        return f"{name} is missing"
    if path.stat().st_size != size:
        return f"{name} has {path.stat().st_size:,} bytes, not {size:,} (truncated?)"
    if crc is not None and file_crc(path) != crc:
        return f"{name} does not match its checksum (corrupted)"
    return None


def quick_problems(folder: Path) -> list[str]:
    """Missing or wrong-size files (no checksums): what a pre-launch check can afford."""
    files = read_manifest(folder) or {}
    return [p for name, (size, _) in files.items() if (p := _file_problem(folder, name, size, None))]


def rank_problems(folder: Path, rank: int, world: int) -> list[str]:
    """This rank's share of the checks: sizes and checksums of every world-th file."""
    files = sorted((read_manifest(folder) or {}).items())
    return [p for name, (size, crc) in files[rank::world] if (p := _file_problem(folder, name, size, crc))]
