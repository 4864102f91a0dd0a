"""Where a dataset's records come from: the built-in corpus, local files and folders (with their splits),
`datasets.save_to_disk` folders and Hub datasets; opened as a stream or as a memory-mapped Arrow table.

Local folders follow the Hub's file-name conventions: a file whose path has a split word (train,
training / validation, valid, val, dev / test, testing, eval) as a component or between separators
(`data/train-00000.parquet`, `valid.jsonl`, `test/part-0.txt`) belongs to that split; a file, or a
folder with no such words, is one unsplit dataset, read whole for whatever split is asked. Metadata
files (`dataset_info.json`, `state.json`, `dataset_dict.json`, hidden files) are never data.

A file that cannot be read is reported naming the file and the line (`bad_record`): not UTF-8, not JSON, a
JSON value that is not a record. `fingerprint` is what token stores (and `datasets`' Arrow copies of local
files) are keyed by.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import re
import time
from dataclasses import dataclass

from titanlite.data.builtin_chat import builtin_chat_path
from titanlite.data.builtin_corpus import SPLITS as BUILTIN_SPLITS
from titanlite.data.builtin_corpus import builtin_corpus_path
from titanlite.data.builtin_preference import builtin_preference_path
from titanlite.errors import ConfigError

logger = logging.getLogger("titanlite")

BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
TEXT_UNITS = {"line": "line", "paragraph": "paragraph", "file": "document"}  # .txt unit -> datasets' sample_by
BUILTIN = {  # embedded datasets, by name
    "builtin": builtin_corpus_path,
    "builtin_chat": builtin_chat_path,
    "builtin_preference": builtin_preference_path,
}
VALID_DATASETS = (
    "valid: 'builtin', 'builtin_chat', 'builtin_preference', an existing .json/.jsonl/.txt/.text/.parquet/.arrow "
    "file, a folder of such files or one written by datasets' save_to_disk, or a Hugging Face Hub dataset name "
    "such as 'owner/name'"
)


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset as the config names it, and how to read its text."""

    name: str  # 'builtin', a local path, or a Hub id
    split: str = "train"
    text_field: str | None = "text"  # None: records are not plain text (chat)
    config_name: str = ""
    text_unit: str = "line"  # .txt files: one document per line, paragraph or file
    key: str = "training.dataset"  # the config key to name in messages


@dataclass(frozen=True)
class LocalData:
    """A resolved local dataset: a datasets builder and the files of the split, or a save_to_disk folder."""

    builder: str  # json, text, parquet, arrow, or 'saved' (datasets.load_from_disk)
    files: tuple[str, ...]


class _ReportedAnyway(logging.Filter):
    """Drops the loaders' 'Failed to ...' error lines: the exception that follows is reported naming the file and
    line, so the log line would only print the problem twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.ERROR and record.getMessage().startswith("Failed to"))


_REPORTED_ANYWAY = _ReportedAnyway()


def _datasets():
    import datasets  # lazy: a second or more to import, and the built-in corpus stream never needs it

    datasets.disable_progress_bars()  # titanlite logs one line per dataset opened instead
    for loader in ("json.json", "parquet.parquet", "arrow.arrow"):
        logging.getLogger(f"datasets.packaged_modules.{loader}").addFilter(_REPORTED_ANYWAY)
    return datasets


def is_local(spec: DatasetSpec) -> bool:
    """True for the embedded datasets and for names that are local files or folders."""
    return spec.name in BUILTIN or pathlib.Path(spec.name).expanduser().exists()


def _split_of(relative: str) -> str | None:
    words = set(re.split(r"[^a-z]+", relative.lower()))
    found = [split for split, names in SPLIT_WORDS.items() if words & set(names)]
    return found[0] if len(found) == 1 else None


def local_splits(spec: DatasetSpec) -> dict[str, list[str]]:
    """The data files of a local file or folder by split; {"": files} for an unsplit one."""
    path = pathlib.Path(spec.name).expanduser()
    if path.is_file():
        return {"": [str(path)]}
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.name not in METADATA_FILES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
        and p.suffix in BUILDERS
    )
    if not files:
        raise ConfigError(f"{spec.key} = {spec.name!r} is a folder with no data files; {VALID_DATASETS}")
    by_split: dict[str, list[str]] = {}
    for p in files:
        by_split.setdefault(_split_of(p.relative_to(path).as_posix()) or "", []).append(str(p))
    if "" in by_split and len(by_split) > 1:
        raise ConfigError(
            f"{spec.key} = {spec.name!r}: some files name a split ({', '.join(sorted(set(by_split) - {''}))}) and "
            f"others do not ({', '.join(pathlib.Path(f).name for f in by_split[''][:3])}); put each file under a "
            f"split name (train-*, validation-*, test-*) or point at one split's files"
        )
    return by_split


def resolve_local(spec: DatasetSpec, split: str | None = None) -> LocalData:
    """The builder and files of a local dataset's split (default: spec.split); ConfigError naming what exists."""
    split = split or spec.split
    if spec.name in BUILTIN:
        if split not in BUILTIN_SPLITS:
            raise ConfigError(f"{spec.key} = {spec.name!r} has splits {list(BUILTIN_SPLITS)}, not {split!r}")
        return LocalData("json", (str(BUILTIN[spec.name](split)),))
    path = pathlib.Path(spec.name).expanduser()
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        return LocalData("saved", (str(path),))
    by_split = local_splits(spec)
    if "" in by_split:
        split = ""
    elif split not in by_split:
        raise ConfigError(
            f"{spec.key} = {spec.name!r} has no {split!r} split: its files are split into "
            f"{sorted(by_split)} (by the split words in their names)"
        )
    files = by_split[split]
    kinds = {BUILDERS.get(pathlib.Path(f).suffix) for f in files}
    if None in kinds:
        raise ConfigError(f"{spec.key} = {spec.name!r} has an unsupported file type; {VALID_DATASETS}")
    if len(kinds) > 1:
        raise ConfigError(f"{spec.key} = {spec.name!r} mixes file formats {sorted(kinds)}; use one format")
    if all(os.path.getsize(f) == 0 for f in files):
        raise ConfigError(f"{spec.key} = {spec.name!r} has no documents (its files are empty)")
    return LocalData(kinds.pop(), tuple(files))


def has_split(spec: DatasetSpec, split: str) -> bool:
    """Whether a dataset has this split by name (Hub datasets: assumed; opening one says otherwise)."""
    if spec.name in BUILTIN:
        return split in BUILTIN_SPLITS
    if not is_local(spec):
        return True
    path = pathlib.Path(spec.name).expanduser()
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        return (path / split).is_dir()
    if path.is_dir() and (path / "state.json").is_file():
        return False
    return split in local_splits(spec)


def _looks_like_path(name: str) -> bool:
    """True for names that cannot be a hub id ('name' or 'owner/name')."""
    return (
        name.startswith(("/", ".", "~"))
        or name.count("/") > 1
        or "\\" in name
        or pathlib.PurePath(name).suffix in BUILDERS
    )


def _open(spec: DatasetSpec, streaming: bool):
    datasets = _datasets()
    t0 = time.perf_counter()
    if is_local(spec):
        local = resolve_local(spec)
        what = f"{len(local.files)} {local.builder} file(s)"
        try:
            if local.builder == "saved":
                ds = datasets.load_from_disk(local.files[0])
                if isinstance(ds, datasets.DatasetDict):
                    if spec.split not in ds:
                        raise ConfigError(
                            f"{spec.key} = {spec.name!r} (a saved DatasetDict) has splits "
                            f"{sorted(ds)}, not {spec.split!r}"
                        )
                    ds = ds[spec.split]
                what = "a datasets.save_to_disk folder"
                ds = ds.to_iterable_dataset() if streaming else ds
            else:
                extra = {"sample_by": TEXT_UNITS[spec.text_unit]} if local.builder == "text" else {}
                if not streaming:  # datasets keys its Arrow copy of local files by their mtime only: key it by ours
                    extra["name"] = f"titanlite-{fingerprint(spec)[:16]}"
                ds = datasets.load_dataset(
                    local.builder, data_files=list(local.files), split="train", streaming=streaming, **extra
                )
        except ConfigError:
            raise
        except OSError as e:
            cache = os.path.abspath(datasets.config.HF_DATASETS_CACHE)
            if e.filename and os.path.abspath(str(e.filename)).startswith(cache + os.sep):
                raise ConfigError(
                    f"HF_DATASETS_CACHE = {cache!r} (where `datasets` keeps its Arrow "
                    f"copy of {spec.key} = {spec.name!r}) cannot be written ({type(e).__name__}: {e.strerror}); "
                    f"valid: a folder you can write, set with the HF_DATASETS_CACHE environment variable"
                ) from None
            raise ConfigError(f"{spec.key} = {spec.name!r}: {bad_record(local, e)}") from None
        except Exception as e:  # malformed files: name the file and the record
            raise ConfigError(f"{spec.key} = {spec.name!r}: {bad_record(local, e)}") from None
    else:
        if _looks_like_path(spec.name):
            raise ConfigError(f"{spec.key} = {spec.name!r}: no such file or directory; {VALID_DATASETS}")
        what = f"Hub dataset (config {spec.config_name or 'default'!r}, split {spec.split!r})"
        try:
            ds = datasets.load_dataset(spec.name, spec.config_name or None, split=spec.split, streaming=streaming)
        except Exception as e:  # the hub raises many kinds: not found, offline, bad split/config...
            raise ConfigError(
                f"{spec.key} = {spec.name!r} is not a local path and could not be loaded from the Hugging Face "
                f"Hub (config {spec.config_name!r}, split {spec.split!r}): {type(e).__name__}: {e}; "
                f"{VALID_DATASETS}"
            ) from e
    size = "" if streaming else f", {len(ds):,} records"
    logger.info(f"Opened {spec.key} = {spec.name!r} ({what}{size}) in {time.perf_counter() - t0:.1f} s")
    return ds


def bad_record(local: LocalData, error: BaseException) -> str:
    """Which file and record of a local dataset cannot be read (found by reading each file plainly)."""
    for f in local.files:
        if local.builder in ("json", "text") and (problem := not_utf8(f)):
            return problem
        try:
            if local.builder == "json" and f.endswith(".jsonl"):
                with open(f, encoding="utf-8") as fh:
                    for line_no, line in enumerate(fh, 1):
                        if line.strip():
                            try:
                                record = json.loads(line)
                            except ValueError as e:
                                return f"line {line_no} of {f} is not a JSON record ({e})"
                            if not isinstance(record, dict):
                                return (
                                    f"line {line_no} of {f} is a JSON {type(record).__name__}, not a record "
                                    f'(one {{"field": value, ...}} object per line)'
                                )
                            try:
                                json.dumps(record, ensure_ascii=False).encode("utf-8")
                            except UnicodeEncodeError as e:
                                return (
                                    f"line {line_no} of {f} holds {e.object[e.start : e.end]!r}, half of a UTF-16 "
                                    f"surrogate pair, which is not text"
                                )
            elif local.builder == "json":
                json.loads(pathlib.Path(f).read_text(encoding="utf-8"))
            elif local.builder == "parquet":
                import pyarrow.parquet as pq  # lazy: comes with datasets, only needed to find a bad file

                pq.read_metadata(f)
        except (OSError, ValueError) as e:
            return f"{f} cannot be read as {local.builder} ({type(e).__name__}: {str(e)[:300]})"
    return f"cannot read it as {local.builder}: {type(error).__name__}: {str(error)[:500]}"


def not_utf8(path: str) -> str | None:
    """'line N of FILE is not valid UTF-8 (...)' for the first such line of a text file, else None."""
    try:
        with open(path, "rb") as fh:
            for line_no, line in enumerate(fh, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as e:
                    return (
                        f"line {line_no} of {path} is not valid UTF-8 (byte {line[e.start : e.start + 1]!r} at "
                        f"column {e.start + 1}); save the file as UTF-8"
                    )
    except OSError as e:
        return f"{path} cannot be read ({type(e).__name__}: {e})"
    return None


def read_error(spec: DatasetSpec, error: BaseException, index: int) -> ConfigError:
    """The error to report when reading the records of a dataset fails at record `index` (a ConfigError as is)."""
    if isinstance(error, ConfigError):
        return error
    where = bad_record(resolve_local(spec), error) if is_local(spec) else f"record {index}: {str(error)[:500]}"
    return ConfigError(f"{spec.key} = {spec.name!r}: {where}")


def open_stream(spec: DatasetSpec):
    """The records of the dataset's split as a `datasets` IterableDataset (read lazily)."""
    return _open(spec, streaming=True)


class RecordTable:
    """Records held in memory, read like a `datasets.Dataset` (len, column_names, a slice gives columns):
    the embedded datasets, so that the default job needs no `datasets` package."""

    def __init__(self, records: list[dict]):
        self.records = records
        self.column_names = sorted({key for record in records for key in record})

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, rows: slice) -> dict[str, list]:
        chosen = self.records[rows]
        return {name: [record.get(name) for record in chosen] for name in self.column_names}


def _read_builtin(spec: DatasetSpec) -> RecordTable:
    with open(resolve_local(spec).files[0], encoding="utf-8") as f:
        return RecordTable([json.loads(line) for line in f if line.strip()])


def open_table(spec: DatasetSpec) -> RecordTable | CheckedTable:
    """The dataset's split as a memory-mapped Arrow table (the embedded datasets: a RecordTable) with its text
    field checked; reading records that turn out malformed raises a ConfigError naming the file and line."""
    ds = _read_builtin(spec) if spec.name in BUILTIN else _open(spec, streaming=False)
    if len(ds) == 0:
        raise ConfigError(f"{spec.key} = {spec.name!r} has no documents")
    if spec.text_field is not None and spec.text_field not in ds.column_names:
        raise ConfigError(
            f"{text_field_key(spec)} = {spec.text_field!r} is not a field of the records of "
            f"{spec.key} = {spec.name!r}; fields: {sorted(ds.column_names)}"
        )
    return ds if isinstance(ds, RecordTable) else CheckedTable(ds, spec)


class CheckedTable:
    """A `datasets.Dataset` read by row ranges (len, column_names, a slice gives columns), whose read errors (a
    line that is not UTF-8, ...) become ConfigErrors naming the file and line."""

    def __init__(self, table, spec: DatasetSpec):
        self.table, self.spec = table, spec
        self.column_names = table.column_names

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, rows: slice) -> dict[str, list]:
        try:
            return self.table[rows]
        except Exception as e:  # Arrow decodes lazily: a bad file fails here, not when opened
            raise read_error(self.spec, e, rows.start or 0) from None


def text_field_key(spec: DatasetSpec) -> str:
    """The config key that names the text field ('training.dataset_text_field' for training data)."""
    return (
        spec.key.rsplit(".", 1)[0] + ".dataset_text_field"
        if spec.key.startswith("training")
        else "training.dataset_text_field"
    )


def text_problem(text, spec: DatasetSpec) -> str | None:
    """Why a record's text field is skipped (a reason for the skip counts), or None for text."""
    if text is None:
        return f"a null '{spec.text_field}' field"
    if not isinstance(text, str):
        return f"a '{spec.text_field}' field holding {type(text).__name__}, not text"
    return None


def fingerprint(spec: DatasetSpec) -> str:
    """What identifies the dataset's content: per file its name, size, modification and change times, inode and
    sampled bytes; the built-in datasets by their whole content; a Hub dataset by its name, split and config."""
    h = hashlib.sha256(repr((spec.name, spec.split, spec.text_field, spec.config_name, spec.text_unit)).encode())
    if spec.name in BUILTIN:  # regenerated per machine with the same bytes: its content, not its mtime
        h.update(pathlib.Path(resolve_local(spec).files[0]).read_bytes())
    elif is_local(spec):
        for f in resolve_local(spec).files:
            for p in [pathlib.Path(f)] if pathlib.Path(f).is_file() else sorted(pathlib.Path(f).rglob("*")):
                if p.is_file():
                    st = p.stat()
                    stat = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                    h.update(f"{p.name}:{':'.join(map(str, stat))}".encode())
                    h.update(_sampled_bytes(str(p), *stat))
    return h.hexdigest()


SAMPLE = 64 * 1024  # bytes hashed at the start, middle and end of each file


@functools.lru_cache(maxsize=65536)  # a job computes a key a few times: read each unchanged file's sample once
def _sampled_bytes(path: str, size: int, *stat: int) -> bytes:
    """The SHA-256 of the first, middle and last SAMPLE bytes of a file (all of it when small): O(1) in its size.

    stat (times, inode) only keys the cache."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 3 * SAMPLE:
            h.update(f.read())
        else:
            for start in (0, (size - SAMPLE) // 2, size - SAMPLE):
                f.seek(start)
                h.update(f.read(SAMPLE))
    return h.digest()
