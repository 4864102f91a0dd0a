"""What the LoRA base fingerprint costs at start (titanlite/checkpoint/base_identity.py): SHA-256 of every byte of
the base's weight files, cached by file state.

    python benchmarks/lora_fingerprint.py [--gb 16] [--files 4] [--folder DIR] [--keep]

Writes a folder shaped like an 8B model's HF weights (--files safetensors files, --gb in all; Qwen3 8B and Llama 3.1
8B are 16.4 and 16.1 GB in bf16, in 5 and 4 files), then fingerprints it three times, as a LoRA job's start does:
- from disk: the files evicted from the page cache first (posix_fadvise DONTNEED), the first start after a copy;
- from the page cache: the files just read (a base the machine read recently), the hashing alone;
- cached: the digests from $TITANLITE_CACHE/file_digests.json, the start of every later run, resume, generate and
  export (a stat of each file).
The folder (and its cache entries) are removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from titanlite.checkpoint import base_identity  # noqa: E402 (after the path)

CHUNK = 64 << 20


def write_folder(folder: Path, total_bytes: int, files: int) -> None:
    """`files` safetensors files of one uint8 tensor each, total_bytes in all (random bytes, one block repeated)."""
    folder.mkdir(parents=True)
    block = os.urandom(CHUNK)
    per_file = total_bytes // files
    for i in range(files):
        header = json.dumps({"w": {"dtype": "U8", "shape": [per_file], "data_offsets": [0, per_file]}}).encode()
        header += b" " * (-len(header) % 8)
        with open(folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors", "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            left = per_file
            while left:
                n = min(left, CHUNK)
                f.write(block[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
    (folder / "config.json").write_text("{}\n")


def evict(folder: Path) -> bool:
    """Drop the folder's files from the page cache; False where the OS cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def forget(folder: Path) -> None:
    """Remove the folder's files from the digest cache."""
    cache = base_identity._cache_dir() / base_identity.CACHE_FILE
    if not cache.is_file():
        return
    entries = json.loads(cache.read_text())
    prefix = str(folder.resolve()) + os.sep
    cache.write_text(json.dumps({k: v for k, v in entries.items() if not k.startswith(prefix)}))


def timed(folder: Path) -> tuple[float, dict]:
    t0 = time.perf_counter()
    identity = base_identity.fingerprint(folder)
    return time.perf_counter() - t0, identity


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=16.0, help="total size of the weight files, in GB (1e9 bytes)")
    p.add_argument("--files", type=int, default=4, help="safetensors files")
    p.add_argument("--folder", default="", help="where to write the folder (default: a new temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the folder")
    opts = p.parse_args(argv)
    total = int(opts.gb * 1e9)
    parent = Path(opts.folder or tempfile.mkdtemp(prefix="lora-fingerprint-"))
    folder = parent / "base"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  {base_identity.hash_threads()} hashing threads  load average {load}")
    try:
        t0 = time.perf_counter()
        write_folder(folder, total, opts.files)
        print(f"wrote {total / 1e9:.2f} GB in {opts.files} files to {folder} in {time.perf_counter() - t0:.1f} s")
        time.sleep(base_identity.RACY_SECONDS + 0.1)  # files changed just now are never cached
        rows = []
        if evict(folder):
            rows.append(("from disk (first start after a copy)", *timed(folder)))
        forget(folder)  # the next pass hashes again, from the page cache
        rows.append(("from the page cache (hashing alone)", *timed(folder)))
        rows.append(("cached digests (every later start)", *timed(folder)))
        assert len({r[2]["tensors"] for r in rows}) == 1
        for what, seconds, _ in rows:
            rate = f"{total / seconds / 1e9:6.2f} GB/s" if not what.startswith("cached") else ""
            print(f"{what:40s} {seconds:8.3f} s  {rate}")
    finally:
        if not opts.keep:
            forget(folder)
            shutil.rmtree(parent if not opts.folder else folder, ignore_errors=True)


if __name__ == "__main__":
    main()
