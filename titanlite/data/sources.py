"""Document texts in dataset order, streamed (no token store): the built-in corpus read directly, anything
else through `datasets` streaming (see datasets_io for what a dataset name may be)."""

from __future__ import annotations

import itertools
import json
import pathlib
from collections.abc import Iterable, Iterator

from titanlite.data.datasets_io import (
    BUILTIN,
    DatasetSpec,
    bad_record,
    is_local,
    open_stream,
    record_text,
    resolve_local,
    text_field_key,
)
from titanlite.errors import ConfigError


def load_documents(
    dataset: str, split: str = "train", text_field: str = "text", config_name: str = "", skip: int = 0
) -> Iterator[str]:
    """The texts of a dataset's documents in a fixed order, from document `skip` on (streamed).

    Bad names raise ConfigError at once; a missing text field when it is reached.
    """
    return DocumentSource(DatasetSpec(dataset, split, text_field, config_name)).documents(skip)


class DocumentSource:
    """An opened dataset that can be read from any document index, any number of times.

    Opening a `datasets` dataset is slow (it may even make a network request), so the loader opens it
    once and re-reads it for every epoch and resume.
    """

    def __init__(self, spec: DatasetSpec):
        self.spec = spec
        if spec.name in BUILTIN:
            self._path = pathlib.Path(resolve_local(spec).files[0])
        else:
            self._records = open_stream(spec)

    def records(self, skip: int = 0) -> Iterator[dict]:
        """The raw records from index `skip` on."""
        if self.spec.name in BUILTIN:
            return _read_jsonl(self._path, skip)
        return iter(self._records.skip(skip) if skip else self._records)

    def documents(self, skip: int = 0) -> Iterator[str]:
        """The document texts from index `skip` on."""
        return _texts(self.records(skip), self.spec, skip)


def _read_jsonl(path: pathlib.Path, skip: int) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in itertools.islice(f, skip, None):
            yield json.loads(line)


def _texts(records: Iterable[dict], spec: DatasetSpec, first_index: int) -> Iterator[str]:
    records = iter(records)
    index = first_index
    while True:
        try:
            record = next(records, None)
        except Exception as e:  # malformed files only fail when they are read: name the file and the record
            where = bad_record(resolve_local(spec), e) if is_local(spec) else f"record {index}: {str(e)[:500]}"
            raise ConfigError(f"{spec.key} = {spec.name!r}: {where}") from None
        if record is None:
            return
        if spec.text_field not in record:
            raise ConfigError(
                f"{text_field_key(spec)} = {spec.text_field!r} is not a field of the records of "
                f"{spec.key} = {spec.name!r}; fields: {sorted(record)}"
            )
        text = record_text(record[spec.text_field], spec, index)
        index += 1
        yield text
