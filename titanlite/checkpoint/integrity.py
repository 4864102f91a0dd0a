"""Checksums of checkpoint files: written with every save, verified before a resume.

Each rank records the size and CRC-32 of the files it wrote (`manifest-rank<r>.json`; on object storage the
store's own digest of each object, its ETag, and the CRC-32 of its bytes computed as DCP's writer wrote them, so
that nothing is read back); rank 0 adds the files it writes last (`.metadata`, `job_config.toml`,
`model_args.json`) and merges them into `manifest.json` before the folder is renamed to `step-N`. Objects' CRC-32s
go under the manifest's own key "crc32" (readers that predate it see the manifest they know). Before resuming,
every rank checks its share of the files (by index, round-robin) in parallel: an object whose ETag is the recorded
one is not read; one whose ETag differs (a multipart upload's depends on its part size) is read and its CRC-32
compared. `quick_problems` checks only that the files are there with their sizes, cheap enough for the pre-launch
check.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from titanlite.storage import checksum, is_file, is_remote, mismatch, replace_text

MANIFEST = "manifest.json"


def _describe(paths: list[Path], crcs: dict[str, int] | None = None) -> dict[str, list]:
    return {p.name: checksum(p, (crcs or {}).get(p.name), read_parts=True) for p in paths}


def write_rank_manifest(folder: Path, rank: int, crcs: dict[str, int] | None = None) -> None:
    """Record this rank's .distcp files of a save that finished (call on every rank); crcs: {name: CRC-32} of the
    objects as the writer uploaded them (storage.dcp_writer)."""
    entries = _describe(sorted(folder.glob(f"__{rank}_*.distcp")), crcs)
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
    crc32 = {name: entry.pop(2) for name, entry in files.items() if len(entry) > 2}
    manifest = {"files": files, "complete": complete, **({"crc32": crc32} if crc32 else {})}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def read_manifest(folder: Path) -> dict[str, list] | None:
    """{file: [size, checksum, CRC-32 of an object or None]} of a checkpoint, or None when it has no manifest (saved
    before checksums)."""
    path = folder / MANIFEST
    if not is_file(path):
        return None
    try:
        manifest = json.loads(path.read_text())
        crc32 = manifest.get("crc32", {})
        return {name: [size, digest, crc32.get(name)] for name, (size, digest) in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {MANIFEST: [-1, -1, None]}  # an unreadable manifest: every check of it fails


def quick_problems(folder: Path) -> list[str]:
    """Missing or wrong-size files (no checksums): what a pre-launch check can afford."""
    files = read_manifest(folder) or {}
    return [p for name, (size, *_) in files.items() if (p := mismatch(folder / name, size, None))]


def rank_problems(folder: Path, rank: int, world: int) -> list[str]:
    """This rank's share of the checks: sizes and checksums of every world-th file."""
    files = sorted((read_manifest(folder) or {}).items())
    return [p for name, entry in files[rank::world] if (p := _checked(folder, name, *entry))]


def _checked(folder: Path, name: str, size: int, recorded, crc: int | None) -> str | None:
    """mismatch(), with a file that cannot be asked about (an outage) a problem too: the ranks check in parallel and
    gather their problems, so none may raise alone."""
    try:
        return mismatch(folder / name, size, recorded, crc)
    except Exception as e:
        return f"{name} could not be checked ({type(e).__name__}: {str(e)[:200]})"
