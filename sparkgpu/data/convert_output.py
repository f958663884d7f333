"""The output folder of a conversion: local or any fsspec URL, committed atomically.

``index.json`` is the commit point. A conversion

1. writes a marker file naming its run (from here on, whatever a crash leaves is known to be
   an interrupted conversion's),
2. removes an old ``index.json`` (so no index ever lists shards being replaced), then clears
   whatever an earlier run left,
3. writes shards (from any number of writers, each in its own sub-folder), each flushed to
   disk (``fsync``) by its writer,
4. removes sub-folders no shard of the index lives in (failed Spark task attempts), and
   flushes the folders' entries to disk,
5. writes ``index.json`` atomically (temporary name + rename locally; one PUT on object stores),
6. removes the marker.

A crash, even a power loss, at any point leaves either a complete index (the shards it lists
on disk) or no index and the marker (the next run clears the folder and starts over, with or
without ``overwrite``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence

from sparkgpu._files import atomic_write_bytes, fsync_dir, is_temporary
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["Volume", "OutputFolder", "INDEX_NAME", "MARKER_NAME"]

INDEX_NAME = "index.json"
MARKER_NAME = ".sparkgpu-writing"


class Volume:
    """A folder on local disk or behind any fsspec URL (``s3://``, ``gs://``, ``memory://``...).

    Pickles without its filesystem object, so Spark executors open their own.

    Args:
        url: Local path, ``file://`` URL or fsspec URL.
        storage_options: Passed to fsspec (credentials, endpoint) for remote URLs.
    """

    def __init__(self, url: str, storage_options: Mapping | None = None):
        url = os.fspath(url)
        if not url:
            raise ConfigurationError("the output folder is empty; give a path or URL such as 's3://bucket/feats/v1'")
        if url.startswith("file://"):
            url = url[len("file://"):]
        self.is_local = "://" not in url
        self.url = os.path.abspath(os.path.expanduser(url)) if self.is_local else url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._fs = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fs"] = None
        return state

    def __repr__(self) -> str:
        return f"Volume({self.url!r})"

    @property
    def fs(self):
        if self._fs is None:
            import fsspec

            self._fs, _ = fsspec.core.url_to_fs(self.url, **self.storage_options)
        return self._fs

    def path(self, relpath: str = "") -> str:
        """Full path or URL of ``relpath`` inside the volume."""
        if not relpath:
            return self.url
        return os.path.join(self.url, relpath) if self.is_local else f"{self.url}/{relpath}"

    def write(self, relpath: str, pieces: Sequence) -> None:
        """Writes a file from buffers (bytes, memoryviews, numpy arrays) without joining them."""
        path = self.path(relpath)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as out:
                for piece in pieces:
                    out.write(piece)
                out.flush()
                # The index is fsynced; without this a power loss could keep it and lose shards it lists.
                os.fsync(out.fileno())
            return
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # a no-op on object stores
        with self.fs.open(path, "wb") as out:
            for piece in pieces:
                out.write(memoryview(piece).cast("B"))

    def write_atomic(self, relpath: str, data: bytes) -> None:
        """Writes a file readers see either whole or not at all."""
        path = self.path(relpath)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write_bytes(path, data, fsync_folder=True)  # the rename itself survives a power loss
            return
        # Object stores publish an object only once its single PUT completes.
        self.fs.pipe_file(path, data)

    def sync_folders(self, relpaths: Sequence[str]) -> None:
        """Flushes to disk the entries of the folders ``relpaths`` (those that are folders) and
        of the volume's root, so files written in them survive a power loss. Object stores
        need nothing: an object exists once its PUT completes."""
        if not self.is_local:
            return
        for relpath in relpaths:
            if os.path.isdir(self.path(relpath)):
                fsync_dir(self.path(relpath))
        fsync_dir(self.url)

    def read_bytes(self, relpath: str) -> bytes | None:
        """The file's content, or ``None`` when it does not exist."""
        path = self.path(relpath)
        try:
            if self.is_local:
                with open(path, "rb") as f:
                    return f.read()
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def exists(self, relpath: str = "") -> bool:
        path = self.path(relpath)
        return os.path.exists(path) if self.is_local else self.fs.exists(path)

    def listdir(self) -> list[str]:
        """Names of the entries directly under the volume (empty when it does not exist)."""
        if self.is_local:
            return sorted(os.listdir(self.url)) if os.path.isdir(self.url) else []
        if not self.fs.exists(self.url):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.url, detail=False))

    def remove(self, relpath: str) -> None:
        """Removes a file or a folder with everything in it; missing is fine."""
        path = self.path(relpath)
        if self.is_local:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=False)
            elif os.path.lexists(path):
                os.remove(path)
            return
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)


class OutputFolder:
    """Begin / commit / abort of one conversion into a volume (see the module docstring).

    Args:
        volume: Where the dataset goes.
        run_id: Unique id of this conversion, recorded in the marker file.
    """

    def __init__(self, volume: Volume, run_id: str):
        self.volume = volume
        self.run_id = run_id

    def read_index(self) -> dict | None:
        """The committed ``index.json`` as a dict, or ``None`` when there is none."""
        data = self.volume.read_bytes(INDEX_NAME)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise DataError(f"{self.volume.path(INDEX_NAME)} is not valid JSON ({exc}); convert again with overwrite=True") from None

    def begin(self, *, overwrite: bool) -> None:
        """Claims the folder for this run, clearing what an interrupted run left behind.

        Raises:
            ConfigurationError: The folder holds a complete dataset and ``overwrite`` is false,
                or it holds files no conversion of this package wrote.
        """
        entries = self.volume.listdir()
        has_index = INDEX_NAME in entries
        if has_index and not overwrite:
            raise ConfigurationError(
                f"{self.volume.url} already holds a complete MDS dataset; pass overwrite=True to "
                "replace it, or write to another folder"
            )
        if entries and not has_index and MARKER_NAME not in entries and not overwrite:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise ConfigurationError(
                f"{self.volume.url} is not empty ({shown}) and was not written by an interrupted "
                "conversion; choose an empty folder, or pass overwrite=True to delete its contents"
            )
        # The marker first: a crash after the old index is gone must still leave a folder that
        # a rerun recognises as an interrupted conversion.
        self.volume.write_atomic(MARKER_NAME, json.dumps({"run_id": self.run_id, "started": time.time()}).encode())
        if has_index:
            self.volume.remove(INDEX_NAME)
        for name in entries:
            if name not in (INDEX_NAME, MARKER_NAME):
                self.volume.remove(name)

    def commit(self, shards: Sequence[dict], metadata: Mapping) -> None:
        """Publishes ``index.json`` listing ``shards``, after removing unlisted sub-folders.

        Raises:
            DataError: Another conversion claimed the folder while this one ran.
        """
        from sparkgpu.data.mds_writer import index_document

        self._check_still_ours()
        listed = {shard[key]["basename"].split("/", 1)[0] for shard in shards for key in ("raw_data", "zip_data") if shard.get(key)}
        for name in self.volume.listdir():
            if name not in listed and name not in (MARKER_NAME, INDEX_NAME) and not is_temporary(name):
                self.volume.remove(name)
        # Writers fsynced the shards' bytes; their names live in these folders.
        self.volume.sync_folders(sorted(listed))
        self.volume.write_atomic(INDEX_NAME, index_document(shards, metadata))
        self.volume.remove(MARKER_NAME)

    def abort(self) -> None:
        """Removes this run's shards after a failure; keeps the marker so a later run may clear
        anything a still-running writer adds afterwards."""
        marker = self.volume.read_bytes(MARKER_NAME)
        if marker is None or json.loads(marker).get("run_id") != self.run_id:
            return
        for name in self.volume.listdir():
            if name != MARKER_NAME:
                self.volume.remove(name)

    def _check_still_ours(self) -> None:
        marker = self.volume.read_bytes(MARKER_NAME)
        owner = json.loads(marker).get("run_id") if marker else None
        if owner != self.run_id:
            raise DataError(
                f"another conversion started writing to {self.volume.url} while this one ran "
                f"(run {owner!r}, this one {self.run_id!r}); run one conversion per folder at a time"
            )
