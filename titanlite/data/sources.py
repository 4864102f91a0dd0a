"""Document sources: the texts of `training.dataset` (built-in corpus, local files, hub datasets) in a fixed order."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
from collections.abc import Iterable, Iterator

from titanlite.data.builtin_corpus import SPLITS as BUILTIN_SPLITS
from titanlite.data.builtin_corpus import builtin_corpus_path
from titanlite.errors import ConfigError

_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}
_VALID_DATASETS = (
    "valid: 'builtin', an existing .json/.jsonl/.txt/.text/.parquet file or a directory of such files, "
    "or a Hugging Face Hub dataset name such as 'owner/name'"
)


def load_documents(
    dataset: str, split: str = "train", text_field: str = "text", config_name: str = "", skip: int = 0
) -> Iterator[str]:
    """Return the texts of ``training.dataset``'s documents in a fixed order, from document ``skip`` on.

    ``dataset`` is ``"builtin"`` (the embedded corpus; split ``train`` or ``validation``),
    a local file or directory of .json/.jsonl/.txt/.text/.parquet files (``split`` is
    ignored; a .txt line is one document), or a Hugging Face Hub dataset name read
    with ``config_name`` and ``split``. Everything is streamed, never materialised.
    Bad names raise ValueError at once; a missing text field when it is reached.
    """
    return DocumentSource(dataset, split, text_field, config_name).documents(skip)


class DocumentSource:
    """An opened dataset that can be read from any document index, any number of times.

    Opening a `datasets` dataset is slow (it may even make a network request), so
    the loader opens it once and re-reads it for every epoch and resume.
    """

    def __init__(self, dataset: str, split: str, text_field: str, config_name: str):
        self.dataset, self.text_field = dataset, text_field
        if dataset == "builtin":
            if split not in BUILTIN_SPLITS:
                raise ConfigError(f"training.dataset = 'builtin' has splits {list(BUILTIN_SPLITS)}, not {split!r}")
            self._path = builtin_corpus_path(split)
        else:
            self._records = _open_streaming(dataset, split, config_name)

    def documents(self, skip: int = 0) -> Iterator[str]:
        """Return the document texts from index ``skip`` on."""
        if self.dataset == "builtin":
            records = _read_jsonl(self._path, skip)
        else:
            records = self._records.skip(skip) if skip else self._records
        return _texts(records, self.dataset, self.text_field)


def _read_jsonl(path: pathlib.Path, skip: int) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in itertools.islice(f, skip, None):
            yield json.loads(line)


def _open_streaming(dataset: str, split: str, config_name: str):
    import datasets  # lazy: a second or more to import, and the built-in corpus never needs it

    path = pathlib.Path(dataset).expanduser()
    if path.exists():
        builder, files = _local_data_files(path, dataset)
        if all(os.path.getsize(f) == 0 for f in files):
            raise ConfigError(f"training.dataset = {dataset!r} has no documents (its files are empty)")
        try:
            return datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
        except Exception as e:  # e.g. malformed JSON
            raise ConfigError(
                f"training.dataset = {dataset!r}: cannot read it as {builder}: {type(e).__name__}: {e}"
            ) from e
    if _looks_like_path(dataset):
        raise ConfigError(f"training.dataset = {dataset!r}: no such file or directory; {_VALID_DATASETS}")
    try:
        return datasets.load_dataset(dataset, config_name or None, split=split, streaming=True)
    except Exception as e:  # the hub raises many kinds: not found, offline, bad split/config...
        raise ConfigError(
            f"training.dataset = {dataset!r} is not a local path and could not be loaded from the "
            f"Hugging Face Hub (training.dataset_config = {config_name!r}, training.dataset_split = "
            f"{split!r}): {type(e).__name__}: {e}; {_VALID_DATASETS}"
        ) from e


def _looks_like_path(name: str) -> bool:
    """True for names that cannot be a hub id ('name' or 'owner/name')."""
    return (
        name.startswith(("/", ".", "~"))
        or name.count("/") > 1
        or "\\" in name
        or pathlib.PurePath(name).suffix in _BUILDERS
    )


def _local_data_files(path: pathlib.Path, dataset: str) -> tuple[str, list[str]]:
    """Return the `datasets` builder name and the sorted data files of a local file or directory."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix in _BUILDERS
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ConfigError(f"training.dataset = {dataset!r} is a directory with no data files; {_VALID_DATASETS}")
    kinds = {_BUILDERS.get(p.suffix) for p in files}
    if None in kinds:
        raise ConfigError(f"training.dataset = {dataset!r} has an unsupported file type; {_VALID_DATASETS}")
    if len(kinds) > 1:
        raise ConfigError(f"training.dataset = {dataset!r} mixes file formats {sorted(kinds)}; use one format")
    return kinds.pop(), [str(p) for p in files]


def _texts(records: Iterable[dict], dataset: str, text_field: str) -> Iterator[str]:
    records = iter(records)
    while True:
        try:
            record = next(records, None)
        except Exception as e:  # malformed files only fail when they are read
            raise ConfigError(f"training.dataset = {dataset!r}: cannot read a record: {type(e).__name__}: {e}") from e
        if record is None:
            return
        if text_field not in record:
            raise ConfigError(
                f"training.dataset_text_field = {text_field!r} is not a field of the records of "
                f"training.dataset = {dataset!r}; fields: {sorted(record)}"
            )
        text = record[text_field]
        if text is None:
            text = ""
        elif not isinstance(text, str):
            raise ConfigError(
                f"training.dataset_text_field = {text_field!r} of training.dataset = {dataset!r} "
                f"holds {type(text).__name__}, not text"
            )
        yield text
