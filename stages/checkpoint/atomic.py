"""Atomic writes: a killed stage never leaves something that looks complete.

Files are written to a temporary name in the same directory, flushed, fsynced and renamed.
Directories are built under a temporary sibling and swapped in only when complete, so an earlier
result stays intact until its replacement is whole.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

from stages.errors import DiskFullError


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC / EDQUOT, raw or already reported by `disk_full`."""
    return isinstance(exc, DiskFullError) or isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free space on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def disk_full(path: str | os.PathLike, needed_bytes: int | None, cause: BaseException | None = None, *,
              at_least: bool = False) -> DiskFullError:
    """The error of a write into `path` that ran out of space: the path, what the write needed
    (`at_least`: the bytes written when the disk filled) and what is free, and what to do."""
    free = free_bytes(path)
    need = ("size unknown" if needed_bytes is None else
            f"{'more than ' if at_least else ''}{needed_bytes / 1e6:,.1f} MB needed")
    have = f"{free / 1e6:,.1f} MB free there" if free is not None else "free space unknown"
    detail = f" ({cause.strerror})" if isinstance(cause, OSError) and cause.strerror else ""
    return DiskFullError(f"no space left writing {path}{detail}: {need}, {have}; nothing earlier was "
                         "overwritten (the previous checkpoint and results are intact): free space on that "
                         "file system, or move results/ elsewhere, and rerun the same command")


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once at import: setting the umask to read it is not thread-safe (checkpoints are written
# from a background thread while the main thread creates files).
_UMASK = _read_umask()


def _umask() -> int:
    return _UMASK


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Open a temporary file beside `path`; on clean exit fsync it and rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would make outputs private to this user
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as exc:
        written = os.path.getsize(tmp) if is_disk_full(exc) and os.path.exists(tmp) else 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            raise disk_full(path, written, exc, at_least=True) from exc
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write `obj` as indented JSON."""
    with atomic_file(path) as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=_json_default)
        f.write("\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, Mapping):  # a typed settings section (stages.sections)
        return dict(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory beside `path`; on clean exit it replaces `path`.

    On failure the temporary directory is removed and whatever was at `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        written = _bytes_under(tmp) if is_disk_full(exc) else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):  # named after the whole directory, an inner file's error too
            raise disk_full(path, written, exc, at_least=True) from exc
        raise
