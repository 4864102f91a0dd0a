"""A token store in object storage (`s3://bucket/prefix/store`, any fsspec URL): opened where it is, each rank
fetching only the byte ranges of the sequences it reads.

The manifest, the document offsets and the chat label counts are read whole at open (8 bytes per document, checked
against the manifest's checksum); the token and mask parts are read in aligned chunks (data.remote_chunk_kib) by
ranged GETs, a window's chunks all at once (`prefetch`: one round trip for a window of many short documents), and
kept in a least-recently-used cache of data.remote_cache_mib per rank, which pays when windows run on through
neighbouring documents (unshuffled pre-training, packed chat data). A read that fails is retried with backoff
(RETRY_DELAYS); then the job stops with one message naming the URL and the byte range, never skipping data.
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from titanlite.data.store import COUNTED, OFFSETS, TokenStore, part_names, read_manifest
from titanlite.errors import ConfigError, DataReadError
from titanlite.storage import location

logger = logging.getLogger("titanlite")

RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0)  # seconds before each retry of a failed read


class ChunkCache:
    """Fetched chunks by (file, chunk index), the least recently used dropped beyond `max_bytes`; counts what it
    fetched (for the loader's benchmark and the tests)."""

    def __init__(self, max_bytes: int, chunk_bytes: int):
        self.max_bytes, self.chunk_bytes, self.held = max_bytes, chunk_bytes, 0
        self.fetched_bytes = self.requests = 0
        self._chunks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()  # the loader's prefetch thread and the main thread may both read

    def get(self, key: tuple[str, int], fetch) -> bytes:
        """The chunk `key`, fetched by `fetch()` when it is not held."""
        with self._lock:
            if key in self._chunks:
                self._chunks.move_to_end(key)
                return self._chunks[key]
        data = fetch()
        self.put(key, data)
        return data

    def has(self, key: tuple[str, int]) -> bool:
        """Whether the chunk is held."""
        with self._lock:
            return key in self._chunks

    def put(self, key: tuple[str, int], data: bytes) -> None:
        """Hold a fetched chunk (counted as fetched)."""
        with self._lock:
            self.fetched_bytes += len(data)
            self.requests += 1
            if key not in self._chunks:
                self._chunks[key] = data
                self.held += len(data)
            while self.held > self.max_bytes and len(self._chunks) > 1:
                _, dropped = self._chunks.popitem(last=False)
                self.held -= len(dropped)


def read_range(path, start: int, end: int) -> bytes:
    """Bytes [start, end) of a remote file, retried with backoff; DataReadError naming the URL when every try
    failed."""
    for attempt, delay in enumerate((*RETRY_DELAYS, None)):
        try:
            data = path.fs.cat_file(path.path, start=start, end=end)
            if len(data) != end - start:
                raise OSError(f"got {len(data)} of {end - start} bytes")
            return data
        except Exception as e:  # botocore, aiohttp and fsspec raise their own types for one outage
            if delay is None:
                raise DataReadError(
                    f"reading {path} (bytes {start}-{end}) failed {attempt + 1} times, the last with "
                    f"{type(e).__name__}: {str(e).strip()[:200]}; the job stops rather than skip data: check the "
                    "object store (AWS_ENDPOINT_URL, credentials, the network) and relaunch to resume"
                ) from None
            logger.warning(f"reading {path} failed ({type(e).__name__}); retrying in {delay:g} s")
            time.sleep(delay)
    raise AssertionError("unreachable")


class RemoteArray:
    """A remote flat file of `count` values of `dtype`, sliced like a memmap: `a[i:j]` reads only its chunks."""

    def __init__(self, path, dtype: np.dtype, count: int, cache: ChunkCache):
        self.path, self.dtype, self.count, self.cache = path, dtype, count, cache
        self.size = count * dtype.itemsize

    def __len__(self) -> int:
        return self.count

    def chunks(self, start: int, stop: int) -> list[tuple[tuple[str, int], int, int]]:
        """(cache key, first byte, end byte) of the chunks that hold values [start, stop)."""
        lo, hi, size = start * self.dtype.itemsize, stop * self.dtype.itemsize, self.cache.chunk_bytes
        if hi <= lo:
            return []
        return [
            ((self.path.path, c), c * size, min(self.size, (c + 1) * size))
            for c in range(lo // size, (hi - 1) // size + 1)
        ]

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, _ = s.indices(self.count)
        lo, hi = start * self.dtype.itemsize, max(start, stop) * self.dtype.itemsize
        pieces = []
        for key, begin, end in self.chunks(start, max(start, stop)):
            data = self.cache.get(key, lambda b=begin, e=end: read_range(self.path, b, e))
            pieces.append(data[max(lo - begin, 0) : hi - begin])
        return np.frombuffer(b"".join(pieces), dtype=self.dtype)


class RemoteTokenStore(TokenStore):
    """A TokenStore whose folder is a URL (see the module doc); its parts are RemoteArrays sharing one cache."""

    def __init__(self, url: str, cache_bytes: int, chunk_bytes: int = 64 << 10, rebuild_hint: str = ""):
        self.path = location(url, "training.dataset")
        self.cache = ChunkCache(cache_bytes, chunk_bytes)
        hint = rebuild_hint or f"build it again with `python -m titanlite.data prepare ... --output {url}`"
        try:
            self.info = info = read_manifest(self.path, hint)
            offsets = self._whole(OFFSETS)
        except (OSError, DataReadError) as e:
            raise ConfigError(f"token store {url} cannot be read: {type(e).__name__}: {e}") from None
        if hashlib.sha256(offsets).hexdigest() != info.offsets_sha256:
            raise ConfigError(f"token store {url} is corrupt: {OFFSETS} does not match its checksum; {hint}")
        self.offsets = np.load(io.BytesIO(offsets))
        if self.offsets.shape != (info.num_documents + 1,) or int(self.offsets[-1]) != info.num_tokens:
            raise ConfigError(f"token store {url} is corrupt: {OFFSETS} does not describe its documents; {hint}")
        self.dtype = np.dtype(info.dtype)
        self._tokens, self._masks = [], []
        for i, n in enumerate(info.part_tokens):
            tok_name, mask_name = part_names(i)
            self._tokens.append(self._part(tok_name, self.dtype, n, hint))
            if info.has_mask:
                self._masks.append(self._part(mask_name, np.dtype(np.uint8), n, hint))
        self._part_starts = np.concatenate([[0], np.cumsum(info.part_tokens, dtype=np.int64)])
        self._counted = np.load(io.BytesIO(self._whole(COUNTED))) if info.has_mask else None

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch the chunks of these token ranges (and their loss masks) that the cache lacks, all at once (fsspec's
        concurrent cat_ranges): a window of many short documents costs one round trip, not one per document."""
        wanted: dict[tuple[str, int], tuple[RemoteArray, int, int]] = {}
        for start, stop in ranges:
            for part, lo, hi in self._spans(start, stop):
                for array in (self._tokens[part], *(self._masks[part : part + 1] if self._masks else ())):
                    for key, begin, end in array.chunks(lo, hi):
                        if key not in wanted and not self.cache.has(key):
                            wanted[key] = (array, begin, end)
        if not wanted:
            return
        arrays = list(wanted.values())
        try:
            got = self.path.fs.cat_ranges(
                [a.path.path for a, _, _ in arrays], [b for _, b, _ in arrays], [e for _, _, e in arrays],
                on_error="return",
            )  # fmt: skip
        except Exception:  # (retried below, one chunk at a time)
            got = [None] * len(arrays)
        for (key, (array, begin, end)), data in zip(wanted.items(), got):
            if not isinstance(data, bytes) or len(data) != end - begin:
                data = read_range(array.path, begin, end)  # retried with backoff; DataReadError at the end
            self.cache.put(key, data)

    def _whole(self, name: str) -> bytes:
        file = self.path / name
        return read_range(file, 0, file.stat().st_size)

    def _part(self, name: str, dtype: np.dtype, count: int, hint: str) -> RemoteArray:
        file = self.path / name
        size = file.stat().st_size
        if size != count * dtype.itemsize:
            raise ConfigError(
                f"token store {self.path} is corrupt: {name} has {size} bytes, not {count * dtype.itemsize}; {hint}"
            )
        return RemoteArray(file, dtype, count, self.cache)
