"""Where checkpoints live: a local (or mounted) folder, or object storage named by an fsspec URL.

`location("s3://bucket/prefix")` is a `UPath` (universal_pathlib over fsspec/s3fs, the `.[s3]` extra) with
pathlib's methods; any other text is a `pathlib.Path`. The operations a pathlib path lacks on object storage
(removing a tree, an exclusive create, a file's age, its checksum) are here, one function each, so the
checkpoint code reads the same for both. Credentials and the endpoint come from the usual AWS variables and
files (AWS_ACCESS_KEY_ID, AWS_PROFILE, AWS_ENDPOINT_URL, ...) through botocore, never from titanlite's config.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import zlib
from pathlib import Path, PurePath

from titanlite.errors import ConfigError

_CHUNK = 16 << 20
INSTALL_HINT = "pip install 'titanlite[s3]' (s3fs and universal_pathlib)"


def is_url(text) -> bool:
    """Whether a configured path names object storage (`scheme://...`, not a local `file://`)."""
    text = str(text)
    return "://" in text and not text.startswith("file://")


def location(text, key: str = "checkpoint.folder"):
    """A Path for a local folder or file, a UPath for an fsspec URL; ConfigError naming `key` when the URL's
    filesystem package is not installed."""
    if not isinstance(text, (str, PurePath)):
        return text  # already a UPath
    if not is_url(text):
        return Path(str(text).removeprefix("file://"))
    if any(c in str(text) for c in "[]*?"):  # fsspec expands them: a removal would reach other prefixes
        raise ConfigError(f"{key} = {str(text)!r}: a URL with [, ], * or ? is not accepted; name the prefix plainly")
    if "@" in str(text).split("://", 1)[1].split("/", 1)[0]:  # s3://KEY:SECRET@bucket would be printed everywhere
        raise ConfigError(
            f"{key}: a URL with credentials in it is not accepted (they would appear in logs and saved configs); "
            "give them in the AWS variables (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...) and the bucket alone in the URL"
        )
    try:
        from upath import UPath

        # Listings are not cached: other ranks and jobs write the same prefixes (manifests, locks, step folders).
        fresh = {"use_listings_cache": False} if str(text).split("://")[0] in ("s3", "s3a", "gs", "gcs") else {}
        path = UPath(str(text), **fresh)
        path.fs  # noqa: B018 - imports the protocol's filesystem package now, not at the first save
    except ImportError as e:
        missing = f"needs a package that is not installed ({e}); {INSTALL_HINT}"
        raise ConfigError(f"{key} = {str(text)!r} {missing}") from None
    except ValueError as e:  # an unknown protocol
        valid = "a local folder or an fsspec URL (s3://, gs://, ...)"
        raise ConfigError(f"{key} = {str(text)!r}: {e}; valid: {valid}") from None
    return path


def is_remote(path) -> bool:
    """Whether a location (a path, or the text of one) is object storage."""
    return is_url(path) if isinstance(path, str) else not isinstance(path, PurePath)


def is_file(path) -> bool:
    """Whether a file exists; on object storage an error other than "not found" (throttling, an outage) is raised,
    not taken for absence (fsspec's own isfile answers False then)."""
    if not is_remote(path):
        return path.is_file()
    try:
        return path.fs.info(path.path)["type"] == "file"
    except FileNotFoundError:
        return False


def remove_tree(path) -> BaseException | None:
    """Remove a folder and everything in it (a prefix's objects); missing is fine. Never raises: the error when
    something could not be removed (an endpoint that went away), else None."""
    if not is_remote(path):
        errors = []
        shutil.rmtree(path, onerror=lambda func, name, info: errors.append(info[1]))
        errors = [e for e in errors if not isinstance(e, FileNotFoundError)]
        return errors[0] if errors else None
    try:
        path.fs.rm(path.path, recursive=True)
    except FileNotFoundError:
        pass
    except Exception as e:  # the endpoint went away: a later save or the next start sees what is left
        return e
    return None


def copy_tree(path, target) -> None:
    """Copy a remote folder's objects to the folder `target` in the same store (server-side: nothing is downloaded)."""
    root, into = path.path.rstrip("/"), target.path.rstrip("/")
    names = list(files_under(path))
    path.fs.copy([f"{root}/{n}" for n in names], [f"{into}/{n}" for n in names])


def fsync_folder(path: Path) -> None:
    """Make a local folder's entries (a rename into it) durable; nothing to do in object storage."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def dcp_writer(path, crcs: dict | None = None):
    """torch.distributed.checkpoint's storage writer for a folder: FileSystemWriter, or FsspecWriter for a URL (which
    fills `crcs` with {file name: CRC-32} of the files it uploads, computed from the bytes as they are written)."""
    from torch.distributed.checkpoint import FileSystemWriter

    if not is_remote(path):
        return FileSystemWriter(path)
    from titanlite.compat import fsspec_writer

    return fsspec_writer(str(path), crcs, sync_files=False)  # an object is durable once its upload returns


def checksum(path, crc: int | None = None, read_parts: bool = False) -> list:
    """[size, checksum] of a file: CRC-32 of the bytes locally. On object storage [size, "etag:..."] (the store's own
    digest, ETag or crc32c/md5, from one metadata request) and the CRC-32 of the bytes as a third item when known:
    `crc`, computed as they were written, or with read_parts read back when the ETag is a multipart upload's (which
    another part size changes)."""
    if not is_remote(path):
        return [path.stat().st_size, _crc(path)]
    size, digest = _digest(path.fs.info(path.path))
    if crc is None and read_parts and digest is not None and "-" in digest:
        crc = _crc(path)
    return [size, digest] if crc is None else [size, digest, crc]


def _digest(info: dict) -> list:
    """[size, "etag:..."] from an object's metadata."""
    digest = info.get("crc32c") or info.get("md5Hash") or info.get("ETag") or info.get("etag") or ""  # content first
    return [int(info["size"]), f"etag:{str(digest).strip(chr(34))}" if digest else None]


def mismatch(path, size: int, recorded, crc: int | None = None) -> str | None:
    """What differs between a file and its manifest entry: size, checksum (None: the size only) and the CRC-32 of an
    object's bytes. An object whose digest is the recorded one is not read; one whose digest differs (another part
    size: a copy by another tool, or a change) is read and its CRC-32 compared, when one was recorded."""
    try:  # one metadata request per object in object storage: its size and its digest
        now = _digest(path.fs.info(path.path)) if is_remote(path) else [path.stat().st_size, None]
    except FileNotFoundError:
        return f"{path.name} is missing"
    actual = now[0]
    if actual != size:
        return f"{path.name} has {actual:,} bytes, not {size:,} (truncated?)"
    if recorded is None or (isinstance(recorded, str) and now[1] == recorded):
        return None
    if isinstance(recorded, int):
        crc = recorded
    elif crc is None:  # a manifest from before CRC-32s of objects were recorded
        if not is_remote(path) or "-" in (now[1] or "-") or "-" in recorded:
            return None  # a local copy, or a multipart upload's ETag (it depends on the part size): sizes only
        return f"{path.name} does not match its checksum (corrupted or replaced)"
    return None if _crc(path) == crc else f"{path.name} does not match its checksum (corrupted or replaced)"


def _crc(path) -> int:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


def create_exclusive(path, text: str) -> bool:
    """Write `text` to `path` only if nothing is there (one writer wins a race); False when something was."""
    if not is_remote(path):
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        try:
            os.link(tmp, path)  # fails when the file exists
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links
            if path.exists():
                return False
            os.replace(tmp, path)
            return True
        finally:
            tmp.unlink(missing_ok=True)
    try:
        path.fs.pipe_file(path.path, text.encode(), mode="create")  # S3's If-None-Match: *
        return True
    except FileExistsError:
        return False
    except OSError as e:
        # 409 ConditionalRequestConflict (two writers at once) and a bare 412 (MinIO, R2): another writer won.
        if e.errno in (errno.EIO, errno.EINVAL) and any(w in str(e) for w in ("onflict", "recondition")):
            return False
        if e.errno != errno.ENOSYS:
            raise
    except (TypeError, NotImplementedError):
        pass
    if path.exists():  # a store without conditional writes: racy at the instant two jobs start (docs say so)
        return False
    path.write_text(text)
    return True


def replace_text(path, text: str) -> None:
    """Write `text` to `path` whole (readers see the old or the new content, never a part)."""
    if is_remote(path):
        path.write_text(text)  # one PUT
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def age(path) -> float:
    """Seconds since a file was last written (its mtime; an object's LastModified, by the store's clock)."""
    if not is_remote(path):
        return time.time() - path.stat().st_mtime
    info = path.fs.info(path.path)
    modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
    if modified is None:
        return 0.0
    return time.time() - (modified.timestamp() if hasattr(modified, "timestamp") else float(modified))


def files_under(path) -> dict[str, int]:
    """{relative name: size} of every file under a folder (an object prefix)."""
    if not is_remote(path):
        return {p.relative_to(path).as_posix(): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    root = path.path.rstrip("/") + "/"
    found = path.fs.find(path.path, detail=True)
    return {name[len(root) :]: int(info["size"]) for name, info in found.items() if name.startswith(root)}


def download(path, into: Path) -> Path:
    """Copy a remote file or folder into the local folder `into` (made if needed); the local copy's path."""
    into.mkdir(parents=True, exist_ok=True)
    if is_file(path):
        target = into / path.name
        path.fs.get_file(path.path, str(target))
        return target
    for name in files_under(path):
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        path.fs.get_file(f"{path.path.rstrip('/')}/{name}", str(target))
    return into


def upload(folder: Path, path, last: tuple[str, ...] = ()) -> None:
    """Copy a local folder's files to a remote folder; the names in `last` go after all others."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    for name in sorted(names, key=lambda n: n in last):
        path.fs.put_file(str(folder / name), f"{path.path.rstrip('/')}/{name}")


def storage_problem(path, key: str) -> str | None:
    """Why a remote folder cannot be written (endpoint down, wrong credentials, no such bucket), naming the key
    and the URL and never a credential; None when a probe object was written and removed."""
    probe = path / f".write-test-{os.uname().nodename}-{os.getpid()}"
    try:
        bucket = path.path.split("/", 1)[0]
        path.fs.info(bucket)  # FileNotFoundError when it is missing (the next call would create it)
        path.fs.makedirs(path.path, exist_ok=True)  # what DCP's writer calls before every save
        probe.write_text(json.dumps({"pid": os.getpid()}))
        if json.loads(probe.read_text())["pid"] != os.getpid() or not is_file(probe):
            raise OSError(f"{probe} did not read back as written")
        path.fs.ls(path.path)  # finding the checkpoints needs listings
        probe.unlink()
        return None
    except Exception as e:
        return describe_failure(path, key, e)


def describe_failure(path, key: str, error: BaseException) -> str:
    """One line for a failed object-storage request: what the store said and what to check."""
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    bucket = str(path).split("://", 1)[-1].split("/", 1)[0]
    if isinstance(error, PermissionError):
        why = f"access to bucket {bucket!r} was denied ({text}); check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE)"
    elif isinstance(error, FileNotFoundError):
        why = f"bucket {bucket!r} does not exist or is not visible with these credentials ({text})"
    elif "connect" in type(error).__name__.lower() or "connect" in text.lower():
        why = f"the object store cannot be reached ({text}); check AWS_ENDPOINT_URL and the network"
    else:
        why = f"{type(error).__name__}: {text}"
    return f"{key} = {str(path)!r}: {why}"
