"""Document texts in dataset order, streamed (no token store): the built-in corpus read directly, anything
else through `datasets` streaming (see datasets_io for what a dataset name may be). Records whose text field
is null or not a string are skipped and counted, as a token store's build does, so both give the same
documents."""

from __future__ import annotations

import itertools
import json
import logging
import pathlib
from collections.abc import Iterable, Iterator

from titanlite.data.datasets_io import (
    BUILTIN,
    DatasetSpec,
    open_stream,
    read_error,
    resolve_local,
    text_field_key,
    text_problem,
)
from titanlite.data.encoders import SkippedRecords
from titanlite.data.store_build import describe_skips
from titanlite.errors import ConfigError

logger = logging.getLogger("titanlite")


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
        self._warned = False  # the skipped records are logged once, after the first whole pass
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
        """The document texts from document `skip` on (records without text are not documents)."""
        # Read from record 0 even to resume: with skipped records, document k is not record k.
        return itertools.islice(self._texts(self.records()), skip, None)

    def _texts(self, records: Iterable[dict]) -> Iterator[str]:
        """The texts of the records; records without text are skipped, and counted and logged after a whole pass."""
        spec = self.spec
        records = iter(records)
        index, yielded, skipped = 0, 0, SkippedRecords()
        while True:
            try:
                record = next(records, None)
            except Exception as e:  # malformed files only fail when they are read: name the file and the record
                raise read_error(spec, e, index) from None
            if record is None:
                break
            if spec.text_field not in record:
                raise ConfigError(
                    f"{text_field_key(spec)} = {spec.text_field!r} is not a field of the records of "
                    f"{spec.key} = {spec.name!r}; fields: {sorted(record)}"
                )
            text = record[spec.text_field]
            if (problem := text_problem(text, spec)) is not None:
                skipped.add(problem, index)
            else:
                yielded += 1
                yield text
            index += 1
        if not yielded:
            why = f"every record was skipped: {describe_skips(skipped.report())}" if skipped else "it has no records"
            raise ConfigError(f"{spec.key} = {spec.name!r} has no documents ({why})")
        if skipped and not self._warned:
            self._warned = True
            logger.warning(
                f"Skipped {sum(skipped.counts.values()):,} records of {spec.key} = {spec.name!r}: "
                f"{describe_skips(skipped.report())}"
            )


def _read_jsonl(path: pathlib.Path, skip: int) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in itertools.islice(f, skip, None):
            yield json.loads(line)
