"""Where a table's files are: a local path or an fsspec URL, as a pyarrow filesystem; Delta or Parquet.

Shared by the conversion of files to MDS (:mod:`sparkgpu.data.convert.files`), the Delta reader
(:mod:`sparkgpu.data.tables.delta`) and the table dataset (:mod:`sparkgpu.data.tables.source`);
which of the two a path is, :func:`~sparkgpu.data.tables.resolve.resolve_source` decides once.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.dataset as pads

from sparkgpu.errors import DataError

__all__ = ["arrow_filesystem", "is_delta_table", "open_parquet_dataset"]


def arrow_filesystem(path: str, storage_options: dict | None):
    """``(filesystem, root)`` for pyarrow: ``(None, absolute path)`` for a local path or ``file://``
    URL, else the URL's fsspec filesystem wrapped for pyarrow and the path inside it."""
    if "://" not in path or path.startswith("file://"):
        local = path[len("file://") :] if path.startswith("file://") else path
        return None, os.path.abspath(os.path.expanduser(local))
    import fsspec
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    return PyFileSystem(FSSpecHandler(fs)), root


def open_parquet_dataset(path: str, storage_options: dict | None) -> pads.Dataset:
    """The Parquet files at ``path`` (one file, or a folder with hive partitions) as a pyarrow dataset.

    Raises:
        DataError: nothing there reads as Parquet, or the folder holds no Parquet file.
    """
    filesystem, root = arrow_filesystem(path, storage_options)
    try:
        dataset = pads.dataset(root, format="parquet", filesystem=filesystem, partitioning="hive")
    except (FileNotFoundError, pa.ArrowInvalid, OSError) as exc:
        raise DataError(
            f"cannot read {path} as Parquet ({exc}); give a Delta table, a folder of Parquet files or one file"
        ) from None
    if not dataset.files:
        raise DataError(f"{path} holds no Parquet files")
    return dataset


def is_delta_table(path: str, storage_options: dict | None = None) -> bool:
    """Whether ``path`` is the root of a Delta table (it has a ``_delta_log``)."""
    if "://" not in path or path.startswith("file://"):
        local = path[len("file://") :] if path.startswith("file://") else path
        return os.path.isdir(os.path.join(os.path.expanduser(local), "_delta_log"))
    import fsspec

    fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    return fs.exists(f"{root.rstrip('/')}/_delta_log")
