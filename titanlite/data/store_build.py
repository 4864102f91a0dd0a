"""Building a token store: each worker (a training rank, or a process of `python -m titanlite.data prepare`)
tokenizes one contiguous share of the documents, so each document is tokenized exactly once; the
first worker then writes the offsets and the manifest and renames the build folder into place.

Stores are found again by a cache key over the store version, the dataset's identity (see
`datasets_io.fingerprint`), the tokenizer's files and the document format: a changed dataset or tokenizer
gets a new store instead of silently reusing a stale one. Build folders are named after the builder's host and
pid, so that a finished build can remove those left by killed builds without touching a live one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable

import numpy as np

from titanlite.data.datasets_io import DatasetSpec, fingerprint
from titanlite.data.store import (
    COUNTED,
    OFFSETS,
    VERSION,
    StoreInfo,
    TokenStore,
    part_names,
    sha256_file,
    token_dtype,
    write_manifest,
)
from titanlite.errors import ConfigError
from titanlite.runtime.run_control import pid_alive

logger = logging.getLogger("titanlite")

BATCH = 256  # documents tokenized per call


def cache_root() -> pathlib.Path:
    """`$TITANLITE_CACHE` or ~/.cache/titanlite (shared with the built-in corpus)."""
    env = os.environ.get("TITANLITE_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "titanlite"


def store_key(spec: DatasetSpec, tokenizer_id: str, encoding: str) -> str:
    """The cache key of the store of `spec` tokenized by the tokenizer with this identity, in this encoding."""
    parts = [f"v{VERSION}", fingerprint(spec), tokenizer_id, encoding]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def store_path(folder: pathlib.Path, spec: DatasetSpec, key: str) -> pathlib.Path:
    """Where the store of this key lives in a stores folder: a readable name plus the key."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", pathlib.Path(spec.name).name or spec.name).strip("_")[:40] or "dataset"
    return folder / f"{slug}-{spec.split}-{key[:16]}"


class Progress:
    """A one-line progress bar (documents, tokens/s, ETA) on stderr; silent when disabled."""

    def __init__(self, total_docs: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total_docs, label, enabled
        self.docs = self.tokens = 0
        self.t0 = self._last = time.perf_counter()

    def update(self, docs: int, tokens: int) -> None:
        """Count finished documents and their tokens; redraw at most twice a second."""
        self.docs += docs
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.5 or self.docs >= self.total):
            self._last = now
            print("\r" + self.line(), end="", file=sys.stderr, flush=True)

    def line(self) -> str:
        """'label: 40% 1,000/2,500 docs, 1.2M tokens, 350k tokens/s, ETA 0:00:04'."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.tokens / dt
        eta = (self.total - self.docs) * dt / max(self.docs, 1)
        pct = 100 * self.docs / max(self.total, 1)
        return (
            f"{self.label}: {pct:3.0f}% {self.docs:,}/{self.total:,} docs, {self.tokens:,} tokens, "
            f"{rate:,.0f} tokens/s, ETA {int(eta) // 60}:{int(eta) % 60:02d}"
        )

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def share(num_docs: int, worker: int, workers: int) -> tuple[int, int]:
    """The contiguous document range [start, stop) of one worker (the first ones get one more)."""
    base, extra = divmod(num_docs, workers)
    start = worker * base + min(worker, extra)
    return start, start + base + (1 if worker < extra else 0)


def build_part(
    table,
    encode: Callable,
    dtype: np.dtype,
    out_dir: pathlib.Path,
    worker: int,
    workers: int,
    progress: Progress | None = None,
    on_batch: Callable | None = None,
) -> dict:
    """Tokenize this worker's share of `table` into part files; returns {documents, tokens, skipped}.

    encode(records: dict of columns) -> list of (tokens, mask or None) or None per skipped record.
    """
    start, stop = share(len(table), worker, workers)
    tok_name, mask_name = part_names(worker)
    lengths, counted, total, skipped = [], [], 0, 0
    with open(out_dir / tok_name, "wb") as ftok, open(out_dir / mask_name, "wb") as fmask:
        for lo in range(start, stop, BATCH):
            hi = min(lo + BATCH, stop)
            batch_tokens = 0
            for item in encode(table[lo:hi], first_index=lo):
                if item is None:
                    skipped += 1
                    continue
                tokens, mask = item
                np.asarray(tokens, dtype=dtype).tofile(ftok)
                if mask is not None:
                    mask = np.asarray(mask, dtype=np.uint8)
                    mask.tofile(fmask)
                    counted.append(int(mask[1:].sum()))
                lengths.append(len(tokens))
                batch_tokens += len(tokens)
            total += batch_tokens
            if progress is not None:
                progress.update(hi - lo, batch_tokens)
            if on_batch is not None:
                on_batch(hi - lo, batch_tokens)
    np.save(out_dir / f"lengths-{worker:05d}.npy", np.asarray(lengths, dtype=np.int64))
    np.save(out_dir / f"counted-{worker:05d}.npy", np.asarray(counted, dtype=np.int64))
    reasons = encode.skip_report() if hasattr(encode, "skip_report") else {}
    return {"documents": len(lengths), "tokens": total, "skipped": skipped, "skipped_reasons": reasons}


def merge_skips(stats: list[dict]) -> dict[str, list[int]]:
    """{reason: [records, first record index]} over every worker's stats."""
    out: dict[str, list[int]] = {}
    for s in stats:
        for reason, (n, first) in s.get("skipped_reasons", {}).items():
            count, earliest = out.get(reason, [0, first])
            out[reason] = [count + n, min(earliest, first)]
    return out


def describe_skips(skips: dict[str, list[int]]) -> str:
    """'3 records with no assistant turn (first: record 17); ...'."""
    return "; ".join(f"{n:,} record(s) with {reason} (first: record {first})" for reason, (n, first) in skips.items())


def store_source(spec, encoder, stats: list[dict]) -> dict:
    """The manifest's record of what a store was built from: the dataset (spec, a DatasetSpec), the tokenizer and
    encoding (encoder), and the records each worker's part skipped (stats)."""
    return {
        "skipped": merge_skips(stats),
        "dataset": spec.name,
        "split": spec.split,
        "text_field": spec.text_field,
        "key": spec.key,
        "config_name": spec.config_name,
        "tokenizer": encoder.tokenizer.identity,
        "tokenizer_path": str(getattr(encoder.tokenizer, "path", "")),
        "encoding": encoder.identity,
    }


def finalize(
    build_dir: pathlib.Path, final: pathlib.Path, key: str, spec, encoder, stats: list[dict], seconds: float
) -> TokenStore:
    """Write offsets and manifest from the parts (stats: build_part's result per worker, in order), then rename the
    build folder to `final` (first worker only)."""
    workers, source, has_mask = len(stats), store_source(spec, encoder, stats), encoder.has_mask
    dtype = token_dtype(encoder.tokenizer.vocab_size)
    lengths = [np.load(build_dir / f"lengths-{w:05d}.npy") for w in range(workers)]
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    if len(all_lengths) == 0:
        why = f": {describe_skips(source['skipped'])}" if source.get("skipped") else ""
        raise ConfigError(
            f"{source.get('key', 'training.dataset')} = {source['dataset']!r}: no document was "
            f"left to train on (every record was skipped{why})"
        )
    offsets = np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int64)
    np.save(build_dir / OFFSETS, offsets)
    if has_mask:
        np.save(
            build_dir / COUNTED, np.concatenate([np.load(build_dir / f"counted-{w:05d}.npy") for w in range(workers)])
        )
    for w in range(workers):
        (build_dir / f"lengths-{w:05d}.npy").unlink()
        (build_dir / f"counted-{w:05d}.npy").unlink()
        if not has_mask:
            (build_dir / part_names(w)[1]).unlink()
    info = StoreInfo(
        key=key,
        source=source,
        dtype=dtype.name,
        num_documents=len(all_lengths),
        num_tokens=int(offsets[-1]),
        part_tokens=tuple(int(x.sum()) for x in lengths),
        has_mask=has_mask,
        offsets_sha256=sha256_file(build_dir / OFFSETS),
        build_seconds=seconds,
    )
    write_manifest(build_dir, info)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(build_dir, final)
    except OSError:  # another job finished the same store first: keep theirs
        shutil.rmtree(build_dir, ignore_errors=True)
    remove_orphans(final)
    return TokenStore(final)


def build_tag() -> str:
    """What names this process's build folders: its host and pid (so that orphans can be told from live builds)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def new_build_dir(final: pathlib.Path, tag: str, setting: str = "") -> pathlib.Path:
    """A fresh, private folder next to `final` to build into; ConfigError naming `setting` (the key or variable
    that chose the folder) when it cannot be created."""
    build = final.parent / f".build-{final.name}-{tag}"
    shutil.rmtree(build, ignore_errors=True)
    try:
        build.mkdir(parents=True)
    except OSError as e:
        raise ConfigError(
            f"{setting or final.parent}: {final.parent} cannot be written ({type(e).__name__}: {e.strerror or e}); "
            f"valid: a folder you can write"
        ) from None
    return build


# Seconds after which another host's build folder, untouched, counts as abandoned (a live build may take 72 h).
ORPHAN_AGE = 7 * 24 * 3600


def remove_orphans(final: pathlib.Path) -> list[pathlib.Path]:
    """Remove the build folders of `final` left by killed builds: this host's whose process is gone, other
    hosts' untouched for ORPHAN_AGE; never a live builder's. Returns what was removed."""
    removed = []
    host = socket.gethostname()
    prefix = f".build-{final.name}-"
    try:
        candidates = [p for p in final.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()]
    except OSError:
        return removed
    for folder in candidates:
        owner, _, pid = folder.name[len(prefix) :].rpartition("-")
        if not pid.isdigit() or not owner:
            continue  # not a name this module writes
        if owner == host:
            stale = not pid_alive(int(pid))
        else:
            stale = time.time() - _last_touched(folder) > ORPHAN_AGE
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        logger.info(f"Removed {len(removed)} build folder(s) of {final.name} left by killed builds")
    return removed


def _last_touched(folder: pathlib.Path) -> float:
    """The newest modification time of the folder and its files (a build appends to its part files)."""
    try:
        return max([folder.stat().st_mtime, *(p.stat().st_mtime for p in folder.iterdir())])
    except OSError:
        return time.time()
