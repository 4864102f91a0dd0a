"""Start-up inputs named by an object-storage URL (checkpoint.initial_load_path, lora.initial_adapter_path).

A DCP folder is read where it is: every rank reads its own shards through fsspec. A HuggingFace folder, a
consolidated file or a peft adapter folder is read whole by the safetensors and torch readers, which need local
files: it is copied once per machine into a cache (`$TITANLITE_CACHE/remote`, else `~/.cache/titanlite/remote`), the
machine's ranks taking turns on a file lock, and reused while the remote listing (names, sizes, digests) is
unchanged.
A LoRA base is always copied: its identity is a digest of its weight files (base_identity.py).
What a run records of its inputs (job_config.toml, a LoRA checkpoint's lora_base.json) names the URL, never the copy
(`url_of`, `as_given`): a checkpoint exported or resumed on another machine fetches the input again there.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

from titanlite.checkpoint.consolidated import resolve_step
from titanlite.config import JobConfig
from titanlite.data.build import parse_mixture
from titanlite.data.store import MANIFEST
from titanlite.data.store_build import cache_root
from titanlite.errors import ConfigError
from titanlite.storage import checksum, describe_failure, download, files_under, is_file, is_url, location

logger = logging.getLogger("titanlite")


def _listing(path, key: str) -> tuple[bool, dict[str, list]]:
    """(is a single file, {name: [size, digest]}) of a remote input (the digest tells a re-upload of the same size
    apart); ConfigError naming the key when it cannot be read."""
    try:
        if is_file(path):
            return True, {path.name: checksum(path)}
        found = {name: checksum(path / name) for name in files_under(path)}
    except Exception as e:
        raise ConfigError(describe_failure(path, key, e)) from None
    if not found:
        raise ConfigError(f"{key} = {str(path)!r} does not exist (no object under that prefix); check the URL")
    return False, found


def local_copy(url: str, key: str) -> Path:
    """A local copy of the remote file or folder `url` (made, or reused while unchanged), for config key `key`."""
    path = location(url, key)
    single, listing = _listing(path, key)
    target = cache_root() / "remote" / hashlib.sha256(url.encode()).hexdigest()[:16]
    target.mkdir(parents=True, exist_ok=True)
    copy, record = target / "data", target / "listing.json"
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # this machine's other ranks wait for the one copy, then reuse it
        if not (record.is_file() and json.loads(record.read_text()) == {"url": url, "files": listing}):
            record.unlink(missing_ok=True)
            shutil.rmtree(copy, ignore_errors=True)
            t0 = time.perf_counter()
            try:
                download(path, copy)
            except Exception as e:
                shutil.rmtree(copy, ignore_errors=True)
                raise ConfigError(describe_failure(path, key, e)) from None
            record.write_text(json.dumps({"url": url, "files": listing}))
            logger.info(
                f"Copied {key} = {url} to {copy} ({sum(size for size, _ in listing.values()) / 2**20:.1f} MiB in "
                f"{time.perf_counter() - t0:.1f} s)"
            )
    return copy / path.name if single else copy


def local_checkpoint(url: str, key: str = "--checkpoint") -> Path:
    """A copy on this machine of what generate reads whole: the step folder `url` names or the newest committed one
    under it, or a HuggingFace folder."""
    path = location(url, key)
    try:
        if is_file(path / "config.json"):
            return local_copy(url, key)
        step = resolve_step(path)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(describe_failure(path, key, e)) from None
    return local_copy(str(step), key)


def stage_remote_inputs(cfg: JobConfig) -> None:
    """Point checkpoint.initial_load_path and lora.initial_adapter_path at local copies where they name object
    storage (a DCP folder stays remote, read in place, unless it is a LoRA base)."""
    key = "checkpoint.initial_load_path"
    if is_url(cfg.checkpoint.initial_load_path):
        url = cfg.checkpoint.initial_load_path
        path = location(url, key)
        try:
            dcp_folder = is_file(path / ".metadata")
        except Exception as e:
            raise ConfigError(describe_failure(path, key, e)) from None
        if not dcp_folder or cfg.lora.enable:
            cfg.checkpoint.initial_load_path = str(local_copy(url, key))
    if is_url(cfg.lora.initial_adapter_path):
        cfg.lora.initial_adapter_path = str(local_copy(cfg.lora.initial_adapter_path, "lora.initial_adapter_path"))
    for section, key in DATASET_KEYS:
        part = getattr(cfg, section)
        setattr(part, key, _staged_dataset(getattr(part, key), f"{section}.{key}"))


STAGED_KEYS = (("checkpoint", "initial_load_path"), ("lora", "initial_adapter_path"))
DATASET_KEYS = (("training", "dataset"), ("validation", "dataset"))


def _staged_dataset(value: str, key: str) -> str:
    """A dataset setting whose documents in object storage (a jsonl, parquet or text file or folder) name local
    copies, which the job tokenizes into a token store as a local dataset; a token store there stays remote (read
    with ranged reads: data/remote_store.py)."""
    if not value or not any(is_url(name) for name, _ in parse_mixture(value, key)):
        return value
    entries = []
    for name, weight in parse_mixture(value, key):
        if is_url(name):
            path = location(name, key)
            try:
                store = is_file(path / MANIFEST)
            except Exception as e:
                raise ConfigError(describe_failure(path, key, e)) from None
            name = name if store else str(local_copy(name, key))
        entries.append((name, weight))
    return _mixture(entries)


def _mixture(entries: list[tuple[str, float]]) -> str:
    """A dataset setting of these (name, weight) entries: one name alone, or name:weight,..."""
    if len(entries) == 1 and entries[0][1] == 1:
        return entries[0][0]
    return ",".join(f"{name}:{weight:g}" for name, weight in entries)


def url_of(path) -> str:
    """The object-storage URL that a copy made by local_copy (or a path inside it) came from; `path` itself when it
    is not such a copy."""
    text = str(path)
    if not text or is_url(text):
        return text
    root = (cache_root() / "remote").resolve()
    try:
        parts = Path(text).expanduser().resolve().relative_to(root).parts  # (<digest>, "data", ...)
        record = json.loads((root / parts[0] / "listing.json").read_text())
    except (ValueError, IndexError, OSError):
        return text
    if len(parts) < 2 or parts[1] != "data" or not isinstance(record, dict) or "url" not in record:
        return text
    url, inside = str(record["url"]).rstrip("/"), parts[2:]
    single = list(record.get("files", {})) == [url.rsplit("/", 1)[-1]]  # local_copy gave data/<the file's name>
    return "/".join([url, *inside[1 if single else 0 :]])


def as_given(cfg: JobConfig) -> JobConfig:
    """A copy of cfg whose staged inputs (stage_remote_inputs) name their object-storage URLs again: what a run
    writes into its checkpoints."""
    given = copy.deepcopy(cfg)
    for section, key in STAGED_KEYS:
        part = getattr(given, section)
        setattr(part, key, url_of(getattr(part, key)))
    for section, key in DATASET_KEYS:
        part = getattr(given, section)
        value = getattr(part, key)
        if value and (entries := parse_mixture(value, f"{section}.{key}")) and any(url_of(n) != n for n, _ in entries):
            setattr(part, key, _mixture([(url_of(name), weight) for name, weight in entries]))
    return given
