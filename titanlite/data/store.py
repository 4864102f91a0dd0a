"""The token store: a dataset tokenized once, as flat token files with a document-offset index, memory-mapped.

    <store>/store.json        format, version, cache key, what it was built from, dtype, counts, parts
    <store>/offsets.npy       int64, num_documents + 1: where each document starts in the token stream
    <store>/tokens-00000.bin  the tokens of a contiguous range of documents, each [BOS] ... [EOS]
    <store>/mask-00000.bin    (chat data) uint8 per token: 1 where the token counts in the loss as a label
    <store>/counted.npy       (chat data) int64 per document: its counted labels (mask without its first token)

The parts concatenated in order are the token stream of all documents in dataset order, whatever
number of workers wrote them, so a store built by 1 rank and one built by N hold the same stream.
Flat files rather than Arrow: global token k is one memmap index away, and reading a sequence copies
exactly its tokens (Arrow would add a row lookup and list offsets per document).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass

import numpy as np

from titanlite.errors import ConfigError

FORMAT = "titanlite-token-store"
VERSION = 1
MANIFEST = "store.json"
OFFSETS = "offsets.npy"
COUNTED = "counted.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def part_names(index: int) -> tuple[str, str]:
    """File names of part `index`: (tokens, loss mask)."""
    return f"tokens-{index:05d}.bin", f"mask-{index:05d}.bin"


def sha256_file(path: pathlib.Path) -> str:
    """The SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class StoreInfo:
    """What store.json says: identity, origin and shape of a store."""

    key: str
    source: dict  # what it was built from: dataset, split, text field, tokenizer, format
    dtype: str
    num_documents: int
    num_tokens: int
    part_tokens: tuple[int, ...]  # tokens in each part
    has_mask: bool
    offsets_sha256: str
    build_seconds: float


class TokenStore:
    """A finished store, opened read-only: global token ranges, document offsets and loss masks.

    Opening checks the manifest, the version, every file's size and the offsets' checksum, so a
    foreign, truncated or half-written store is refused with a message that says how to rebuild it.
    """

    def __init__(self, path: str | pathlib.Path, rebuild_hint: str = ""):
        self.path = pathlib.Path(path)
        hint = rebuild_hint or f"delete {self.path} and run the job again (or `python -m titanlite.data prepare`)"
        self.info = read_manifest(self.path, hint)
        info = self.info
        self.dtype = np.dtype(info.dtype)
        offsets_path = self.path / OFFSETS
        _expect_size(offsets_path, 128, None, hint)  # .npy header; the exact shape is checked below
        if sha256_file(offsets_path) != info.offsets_sha256:
            raise ConfigError(
                f"token store {self.path} is corrupt: {OFFSETS} does not match its checksum in {MANIFEST}; {hint}"
            )
        self.offsets = np.load(offsets_path, mmap_mode="r")
        if self.offsets.shape != (info.num_documents + 1,) or int(self.offsets[-1]) != info.num_tokens:
            raise ConfigError(
                f"token store {self.path} is corrupt: {OFFSETS} does not describe "
                f"{info.num_documents} documents of {info.num_tokens} tokens; {hint}"
            )
        self._tokens, self._masks = [], []
        for i, n in enumerate(info.part_tokens):
            tok_name, mask_name = part_names(i)
            self._tokens.append(_memmap(self.path / tok_name, self.dtype, n, hint))
            if info.has_mask:
                self._masks.append(_memmap(self.path / mask_name, np.dtype(np.uint8), n, hint))
        self._part_starts = np.concatenate([[0], np.cumsum(info.part_tokens, dtype=np.int64)])
        self._counted = None
        if info.has_mask:
            _expect_size(self.path / COUNTED, 128, None, hint)
            self._counted = np.load(self.path / COUNTED, mmap_mode="r")
            if self._counted.shape != (info.num_documents,):
                raise ConfigError(
                    f"token store {self.path} is corrupt: {COUNTED} does not have one entry per document; {hint}"
                )

    @property
    def num_documents(self) -> int:
        return self.info.num_documents

    @property
    def num_tokens(self) -> int:
        return self.info.num_tokens

    def document_lengths(self) -> np.ndarray:
        """Tokens of every document (BOS and EOS included), int64."""
        return np.diff(self.offsets)

    def counted_labels(self) -> np.ndarray:
        """Labels that count in the loss per document (its loss mask without the first token)."""
        if self._counted is None:
            return self.document_lengths() - 1
        return np.asarray(self._counted)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream of all documents (int64 copy)."""
        return self._read(self._tokens, start, stop)

    def mask(self, start: int, stop: int) -> np.ndarray:
        """Loss mask [start, stop) of the stream (all ones for a plain-text store)."""
        if not self._masks:
            return np.ones(stop - start, dtype=np.uint8)
        return self._read(self._masks, start, stop)

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Get ready to read these token ranges (a store on disk: nothing to do; data/remote_store.py fetches them
        together)."""

    def _read(self, parts: list[np.ndarray], start: int, stop: int) -> np.ndarray:
        out = [parts[part][lo:hi] for part, lo, hi in self._spans(start, stop)]
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)

    def _spans(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(part, first, end) of each part's share of the stream's tokens [start, stop), in part-local indices."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside the store's {self.num_tokens} tokens")
        out = []
        part = int(np.searchsorted(self._part_starts, start, side="right")) - 1
        while start < stop:
            base, end = int(self._part_starts[part]), int(self._part_starts[part + 1])
            take = min(stop, end)
            if take > start:
                out.append((part, start - base, take - base))
            start = take
            part += 1
        return out


def read_manifest(path: pathlib.Path, hint: str) -> StoreInfo:
    """The store.json of a store folder; ConfigError naming the folder when it is missing, foreign or stale."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise ConfigError(
            f"{path} is not a titanlite token store (no {MANIFEST}): an unfinished build or another "
            f"kind of folder; {hint}"
        )
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"token store {path}: {MANIFEST} cannot be read ({e}); {hint}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a titanlite token store ({MANIFEST} has no format {FORMAT!r}); {hint}")
    if data.get("version") != VERSION:
        raise ConfigError(
            f"token store {path} has version {data.get('version')!r}; this titanlite reads version {VERSION}; {hint}"
        )
    try:
        return StoreInfo(
            key=data["key"],
            source=data["source"],
            dtype=data["dtype"],
            num_documents=int(data["num_documents"]),
            num_tokens=int(data["num_tokens"]),
            part_tokens=tuple(int(n) for n in data["part_tokens"]),
            has_mask=bool(data["has_mask"]),
            offsets_sha256=data["offsets_sha256"],
            build_seconds=float(data.get("build_seconds", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"token store {path}: {MANIFEST} is incomplete ({type(e).__name__}: {e}); {hint}") from None


def write_manifest(path: pathlib.Path, info: StoreInfo) -> None:
    """Write store.json (the last file of a build: a store without it is unfinished)."""
    data = {"format": FORMAT, "version": VERSION, **{k: getattr(info, k) for k in info.__dataclass_fields__}}
    data["part_tokens"] = list(info.part_tokens)
    (path / MANIFEST).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _expect_size(path: pathlib.Path, minimum: int, exact: int | None, hint: str) -> None:
    if not path.is_file():
        raise ConfigError(f"token store {path.parent} is corrupt: {path.name} is missing; {hint}")
    size = path.stat().st_size
    if size < minimum or (exact is not None and size != exact):
        want = f"{exact:,} bytes" if exact is not None else f"at least {minimum} bytes"
        raise ConfigError(
            f"token store {path.parent} is corrupt: {path.name} has {size:,} bytes, not {want} (truncated?); {hint}"
        )


def _memmap(path: pathlib.Path, dtype: np.dtype, count: int, hint: str) -> np.ndarray:
    _expect_size(path, 0, count * dtype.itemsize, hint)
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
