"""Small file-system helpers shared by the parts that must survive a power loss."""

from __future__ import annotations

import os

__all__ = ["fsync_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes the creation, rename or removal of entries in the folder ``path`` durable.

    A file's own fsync keeps its bytes; the folder's keeps its name pointing at them.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
