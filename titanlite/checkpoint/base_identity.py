"""Which base model a LoRA checkpoint was trained on, so that its adapters are never resumed, exported or sampled
on another one.

A LoRA checkpoint holds the adapters, not the base; each save records `lora_base.json`: the base's path
(checkpoint.initial_load_path), its config (a HF folder's config.json, a titanlite checkpoint's model_args.json)
and a fingerprint: a SHA-256 over every byte of its weight files (a HF folder's *.safetensors, a DCP folder's
.metadata and *.distcp, or the one file), so that any changed tensor, however small, makes another base.

Reading 16 GB once costs seconds (docs/lora.md has the measurement): each file is hashed in blocks by a few threads,
and its digest is cached in `$TITANLITE_CACHE/file_digests.json` (default ~/.cache/titanlite) under its path,
size, inode, mtime and ctime (which no one can set back), so later starts, every rank of a node, resumes, generate
and export re-read nothing. Ranks of one node starting together hash a file once (a file lock). No torch.

Checkpoints saved before the full fingerprint (no "scheme" in lora_base.json) are checked as they were made: with
a few bytes sampled per file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from titanlite.errors import ConfigError
from titanlite.storage import is_file, location

logger = logging.getLogger("titanlite")

FILE = "lora_base.json"
SCHEME = "sha256 of every weight file"
CACHE_FILE = "file_digests.json"
BLOCK_BYTES = 64 << 20  # hashed by one thread at a time
READ_BYTES = 8 << 20
RACY_SECONDS = 2.0  # a file changed this recently is not cached: a rewrite within a timestamp tick looks unchanged
SAMPLES_PER_FILE, SAMPLE_BYTES = 16, 4096  # the fingerprint before SCHEME (checkpoints saved by older versions)


def weight_files(path: Path) -> list[Path]:
    """The files a base's weights are read from: a HF folder's *.safetensors, a DCP folder's .metadata and
    *.distcp, or the file itself."""
    if not path.is_dir():
        return [path]
    weights = sorted(path.glob("*.safetensors"))
    if weights:
        return weights
    meta = [path / ".metadata"] if (path / ".metadata").is_file() else []
    return meta + sorted(path.glob("*.distcp"))


def _hash_block(path: Path, start: int, length: int) -> bytes:
    digest = hashlib.sha256()
    buf = bytearray(min(READ_BYTES, max(length, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = length
        while left > 0:
            n = f.readinto(view[: min(len(buf), left)])
            if not n:
                raise OSError(f"{path} became shorter while it was read")
            digest.update(view[:n])
            left -= n
    return digest.digest()


def _hash_file(path: Path, pool: ThreadPoolExecutor) -> str:
    """SHA-256 over the file's size and the SHA-256 of each of its BLOCK_BYTES blocks (hashed in parallel)."""
    size = path.stat().st_size
    starts = range(0, size, BLOCK_BYTES)
    blocks = pool.map(lambda s: _hash_block(path, s, min(BLOCK_BYTES, size - s)), starts)
    digest = hashlib.sha256(str(size).encode())
    for block in blocks:
        digest.update(block)
    return digest.hexdigest()


def _cache_dir() -> Path:
    env = os.environ.get("TITANLITE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "titanlite"


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _read_cache(folder: Path) -> dict:
    try:
        cache = json.loads((folder / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


@contextlib.contextmanager
def _lock(folder: Path, name: str):
    """An exclusive file lock `name` in the cache folder for the block; none where the folder or the file system
    cannot lock (the block then runs unlocked: the worst case is a file hashed twice)."""
    try:
        import fcntl

        handle = open(folder / name, "a")  # noqa: SIM115 (closed below)
    except (ImportError, OSError):
        yield
        return
    with handle:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _remember(folder: Path, key: str, entry: dict) -> None:
    """Add one file's digest to the cache (read, update, replace under a short lock)."""
    with _lock(folder, CACHE_FILE + ".lock"):
        cache = _read_cache(folder)
        cache[key] = entry
        for gone in [k for k in cache if not os.path.exists(k)]:  # files deleted since: forget them
            del cache[gone]
        with contextlib.suppress(OSError):
            tmp = folder / f"{CACHE_FILE}.{os.getpid()}"
            tmp.write_text(json.dumps(cache) + "\n")
            os.replace(tmp, folder / CACHE_FILE)


_warned_unwritable: list[Path] = []


def _writable_cache_dir() -> Path | None:
    """The cache folder, made if needed; None (with one warning) when it cannot be written."""
    folder = _cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return folder
    except OSError as e:
        if folder not in _warned_unwritable:
            _warned_unwritable.append(folder)
            logger.warning(
                f"The LoRA base fingerprint cache {folder} cannot be written ({e.strerror}): every start hashes the "
                f"whole base again; set TITANLITE_CACHE to a writable folder"
            )
        return None


def hash_threads() -> int:
    """Threads hashing a file's blocks: the cores this process may use, at most 8 (past that the disk bounds it)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


def file_digests(files: list[Path]) -> dict[str, str]:
    """SHA-256 (in blocks, see _hash_file) of each file by name, from the cache where the file is unchanged. A file
    not in the cache is hashed under a lock of its own, so ranks of a node hash it once and jobs whose bases are
    cached never wait for another job's hashing."""
    out: dict[str, str] = {}
    folder = _writable_cache_dir()
    cache = _read_cache(folder) if folder is not None else {}
    t0, hashed = time.perf_counter(), 0
    with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
        for f in files:
            key, st = str(f.resolve()), f.stat()
            if (digest := _cached(cache, key, st)) is None and folder is not None:
                lock = f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.lock"
                with _lock(folder, lock):
                    digest = _cached(_read_cache(folder), key, st)  # another rank may have hashed it meanwhile
                    if digest is None:
                        digest, hashed = _hash_and_remember(f, key, st, pool, folder), hashed + st.st_size
            elif digest is None:
                digest, hashed = _hash_file(f, pool), hashed + st.st_size
            out[f.name] = digest
    if hashed > 1 << 30:
        logger.info(
            f"Fingerprinted {hashed / 1e9:.1f} GB of LoRA base weights in {time.perf_counter() - t0:.1f} s "
            f"(cached in {_cache_dir() / CACHE_FILE}: the next start reads nothing)"
        )
    return out


def _cached(cache: dict, key: str, st: os.stat_result) -> str | None:
    entry = cache.get(key)
    return entry["sha256"] if isinstance(entry, dict) and entry.get("stamp") == _stamp(st) else None


def _hash_and_remember(f: Path, key: str, st: os.stat_result, pool, folder: Path) -> str:
    digest = _hash_file(f, pool)
    if _stamp(f.stat()) == _stamp(st) and time.time() - max(st.st_mtime, st.st_ctime) > RACY_SECONDS:
        _remember(folder, key, {"stamp": _stamp(st), "sha256": digest})
    return digest


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fingerprint(path: str | Path) -> dict:
    """{path, config, scheme, tensors, files}: what identifies the base model at `path` (a HF folder, a DCP folder
    or a file): its config and the SHA-256 of every weight file ("files", and over all of them "tensors")."""
    path = Path(path).expanduser()
    config = (_read_json(path / "config.json") or _read_json(path / "model_args.json")) if path.is_dir() else None
    files = file_digests(weight_files(path))
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"path": str(path.resolve()), "config": config, "scheme": SCHEME, "tensors": digest, "files": files}


def _sampled_fingerprint(path: Path) -> str:
    """The fingerprint of checkpoints saved before SCHEME: tensor layouts and bytes sampled from each file."""
    digest = hashlib.sha256()

    def sample(f: Path, start: int) -> None:
        size = f.stat().st_size
        span = max(size - start, 0)
        with open(f, "rb") as fh:
            for i in range(SAMPLES_PER_FILE):
                fh.seek(start + span * i // SAMPLES_PER_FILE)
                digest.update(fh.read(SAMPLE_BYTES))
        digest.update(str(size).encode())

    if not path.is_dir():
        sample(path, 0)
    elif weights := sorted(path.glob("*.safetensors")):
        for f in weights:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            layout = {k: (v["dtype"], v["shape"]) for k, v in sorted(header.items())}
            digest.update(json.dumps(layout, sort_keys=True).encode())
            sample(f, 8 + n)
    else:
        if (path / ".metadata").is_file():
            digest.update((path / ".metadata").read_bytes())
        for f in sorted(path.glob("*.distcp")):
            sample(f, 0)
    return digest.hexdigest()


def write(folder: Path, identity: dict) -> None:
    """Record the base in a checkpoint folder."""
    (folder / FILE).write_text(json.dumps(identity, indent=2) + "\n")


def read(folder: Path) -> dict | None:
    """The base a checkpoint folder records (None: not a LoRA checkpoint)."""
    return _read_json(location(folder) / FILE) if is_file(location(folder) / FILE) else None


def _what_differs(saved: dict, now: dict) -> str:
    if saved.get("config") != now["config"] and isinstance(saved.get("config"), dict) and now["config"]:
        keys = sorted(
            k for k in set(saved["config"]) | set(now["config"]) if saved["config"].get(k) != now["config"].get(k)
        )
        return (
            "its config differs ("
            + ", ".join(f"{k}: {saved['config'].get(k)!r} then, {now['config'].get(k)!r} now" for k in keys[:4])
            + ")"
        )
    then, files = saved.get("files"), now.get("files", {})
    if isinstance(then, dict) and then:
        changed = sorted(n for n in set(then) | set(files) if then.get(n) != files.get(n))
        return f"its weights differ: {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}"
    return "its weights differ"


def check_same_base(saved: dict, now: dict, where: str) -> None:
    """ConfigError naming both bases when `now` is not the base `saved` records."""
    ours = now["tensors"]
    if saved.get("scheme") != SCHEME:  # saved by an older version: compare with the fingerprint it made
        ours = _sampled_fingerprint(Path(now["path"]))
    if saved.get("tensors") == ours and saved.get("config") == now["config"]:
        return
    raise ConfigError(
        f"{where} holds LoRA adapters trained on the base {saved.get('path')} (fingerprint "
        f"{str(saved.get('tensors'))[:12]}); checkpoint.initial_load_path = {now['path']} is another base "
        f"(fingerprint {ours[:12]}: {_what_differs(saved, now)}). Adapters only mean something on their own base: "
        "point checkpoint.initial_load_path at it, or start a new job.dump_folder"
    )
