"""Reading a DCP checkpoint folder without running anything it holds.

DCP's `.metadata` is a pickle, and its default planner loads non-tensor ("bytes") items with
`torch.load(weights_only=False)`: whoever can write a checkpoint folder could make opening it run code, and a
CRC manifest cannot help (the writer writes the manifest too). Every titanlite read of a DCP folder goes
through this module instead:

- `.metadata` is unpickled by an unpickler that knows only DCP's metadata classes, torch's `Size`, dtypes,
  layouts and memory formats, and paths; any other global is refused before anything is built.
- bytes items are loaded with `torch.load(weights_only=True)` (plain containers, numbers, strings, bytes and
  tensors: what titanlite saves for the optimizer's hyperparameters, the lr schedule, the data position and
  the train state).
- tensors were already read with `weights_only=True` by DCP.

A refused file raises UnsafeCheckpointError naming the file and the type; nothing from it has run.
"""

from __future__ import annotations

import io
import pickle
import re

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from titanlite.compat import fsspec_reader_class, set_nested_element
from titanlite.errors import ConfigError
from titanlite.storage import is_remote, location

# (module, name) of every global a DCP .metadata pickle may name (seen in torch 2.11-2.15 checkpoints).
_METADATA_CLASSES = {
    (dcp_metadata.__name__, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
    if hasattr(dcp_metadata, name)
}
_ALLOWED = _METADATA_CLASSES | {
    (dcp_filesystem.__name__, "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # rebuilds torch.strided & co. from their names
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


# Besides torch's weights_only defaults: an empty bytes value is pickled as a call of `bytes` (the CPU run's
# device RNG state is b"").
_SAFE_BYTES_GLOBALS = [bytes]


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file holds something titanlite does not load (it was refused before anything ran)."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.path} holds a pickled {module}.{name}, which is not part of a DCP checkpoint's metadata: "
            "refused without running it (titanlite unpickles only DCP's metadata classes; see docs/checkpoints.md, "
            "'What opening a checkpoint trusts')"
        )


def blocked_global(error: pickle.UnpicklingError) -> str:
    """What torch.load(weights_only=True) refused, in a few words ("a pickled posix.system"), without torch's advice to
    load with weights_only=False."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f"a pickled {found.group(1)}" if found else f"a pickled object ({str(error).splitlines()[0][:120]})"


def load_metadata(path) -> dcp_metadata.Metadata:
    """The `.metadata` of a DCP folder (local or object storage), unpickled with the allow-list above."""
    file = location(path) / ".metadata"
    with file.open("rb") as f:
        metadata = _MetadataUnpickler(f, file).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata: refused")
    return metadata


class _SafeMetadata:
    """DCP's reader with `.metadata` read by the allow-list unpickler (or given, already read so)."""

    def __init__(self, path, metadata: dcp_metadata.Metadata | None = None):
        super().__init__(str(path) if is_remote(path) else path)
        self._metadata, self._where = metadata, path

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files are not something titanlite writes
            raise UnsafeCheckpointError(f"{self._where}: per-rank metadata files are not read")
        metadata = self._metadata or load_metadata(self._where)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` safely."""


def safe_reader(path, metadata: dcp_metadata.Metadata | None = None):
    """The safe DCP storage reader of a local folder, or of an fsspec URL's (FsspecReader)."""
    path = location(path)
    if not is_remote(path):
        return SafeFileSystemReader(path, metadata)
    return type("SafeFsspecReader", (_SafeMetadata, fsspec_reader_class()), {})(path, metadata)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading bytes items with `torch.load(weights_only=True)`."""

    def __init__(self, *args, source: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.source = source

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            with torch.serialization.safe_globals(_SAFE_BYTES_GLOBALS):
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            if "GLOBAL" not in str(e):  # no type was refused: damaged bytes (resume.unreadable), not a hostile item
                raise
            raise UnsafeCheckpointError(
                f"{self.source}: the saved item {read_item.dest_index.fqn!r} holds {blocked_global(e)}, outside the "
                "plain types titanlite saves: refused without running it"
            ) from None
        # What DefaultLoadPlanner.load_bytes does with the value it unpickles itself.
        if self.flatten_state_dict:
            set_nested_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_dcp_load(state_dict, path, **kwargs) -> None:
    """dcp.load of `state_dict` from the DCP folder `path`, running nothing the folder holds; a refused item
    raises its UnsafeCheckpointError (not DCP's CheckpointException around it)."""
    metadata = load_metadata(path)  # refused here, before DCP (which logs and retries a failed read)
    try:
        dcp.load(
            state_dict,
            storage_reader=safe_reader(path, metadata),
            planner=SafeLoadPlanner(source=str(path)),
            **kwargs,
        )
    except dcp.api.CheckpointException as e:  # a BaseException: DCP gathers each rank's failure into one
        for failure, _ in e.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise failure from None
        raise
