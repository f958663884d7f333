"""Writing local files so that a reader sees them whole or not at all, and so that they survive a power loss.

The one recipe every part of the package uses: write beside the target under a hidden
temporary name (``.<name>.<random>.tmp``: unique across threads, processes and the hosts
sharing a network folder), flush the bytes to disk (``fsync``), rename over the target
(atomic on POSIX) and, where the new name must survive a power loss as well, flush the
folder too. A temporary left by a killed writer is never mistaken for the file
(:func:`is_temporary`). URLs go through :class:`sparkgpu.store.Store`, which uses this for
local paths.

Standard library only: the launch path imports it before anything heavy.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import BinaryIO

__all__ = [
    "atomic_path",
    "atomic_write_bytes",
    "atomic_writer",
    "fsync_dir",
    "is_temporary",
    "temporary_name",
    "try_lock_file",
]


def try_lock_file(path: str | os.PathLike, holder: str, mode: int = 0o600) -> int | None:
    """Takes an exclusive ``flock`` on ``path`` without waiting; the open descriptor, or ``None``
    when another descriptor holds it.

    The lock lasts until the descriptor is closed, and goes with its process however that
    ends; the descriptor is not inherited by child processes. The holder writes ``holder`` (who
    it is) into the file, for whoever finds it locked.

    Args:
        path: The lock file; created with ``mode`` (set exactly, whatever the umask, when this
            process owns the file).
        holder: What to write into the file once it is held.
        mode: The file's permissions.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    with contextlib.suppress(PermissionError):  # another user's file: only its owner may change it
        os.fchmod(fd, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, holder.encode())
    return fd


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes the creation, rename or removal of entries in the folder ``path`` durable.

    A file's own fsync keeps its bytes; the folder's keeps its name pointing at them.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: str | os.PathLike) -> str:
    """A hidden name beside ``path`` to write before renaming, unique even among hosts sharing the folder."""
    folder, name = os.path.split(os.fspath(path))
    return os.path.join(folder, f".{name}.{os.urandom(6).hex()}.tmp")


def is_temporary(name: str) -> bool:
    """Whether the file name (last path component) is a write in progress, or one a killed writer left."""
    base = name.rsplit("/", 1)[-1]
    return base.startswith(".") and base.endswith(".tmp")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = True, fsync_folder: bool = False) -> Iterator[str]:
    """Yields a temporary path for the caller to create; it becomes ``path`` when the block succeeds.

    For writers that want a path rather than an open file (a copy, a download). On an
    exception the temporary is removed and ``path`` keeps what it held before.

    Args:
        path: The file to (re)place; its folder must exist.
        fsync: Flush the bytes to disk before the rename, so a power loss never leaves
            ``path`` naming a file whose content is missing. Off only for caches, mirrors
            and other files that are cheap to get again.
        fsync_folder: Flush the folder after the rename as well, so the new name itself
            survives a power loss (commit points: markers, indexes).
    """
    tmp = temporary_name(path)
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync_folder:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_writer(
    path: str | os.PathLike, *, fsync: bool = True, fsync_folder: bool = False, mode: int = 0o666
) -> Iterator[BinaryIO]:
    """Opens a binary file that appears at ``path``, complete, only when the block succeeds.

    Args are :func:`atomic_path`'s, and ``mode``: the file's permissions (less the umask), set
    when it is created, so that a private file is never readable by others even for a moment.

    Yields:
        The open temporary file.
    """
    with (
        atomic_path(path, fsync=False, fsync_folder=fsync_folder) as tmp,
        os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f,
    ):
        yield f
        if fsync:  # while the file is open: no second open just to flush it
            f.flush()
            os.fsync(f.fileno())


def atomic_write_bytes(
    path: str | os.PathLike, data: bytes, *, fsync: bool = True, fsync_folder: bool = False, mode: int = 0o666
) -> None:
    """Writes ``data`` so that ``path`` appears complete or not at all (see :func:`atomic_writer`)."""
    with atomic_writer(path, fsync=fsync, fsync_folder=fsync_folder, mode=mode) as f:
        f.write(data)
