"""A folder at a local path or behind any fsspec URL, written so that readers never see half a file.

Every part that keeps files somewhere a user names (conversion output, the environment
store, the staging mirror, checkpoints) goes through :class:`Store`, so "put these bytes at
this URL so that a reader sees them whole or not at all" is decided in one place:

* a local folder (a plain path or ``file://``): a hidden temporary beside the target,
  ``fsync``, rename (:mod:`sparkgpu._util.files`); the folder too for commit points;
* an object store (``s3://``, ``gs://``, ``az://``...): one PUT, which publishes the object
  only once it is whole;
* any other fsspec filesystem (``memory://``, ``sftp://``...): a temporary name, then a move.

Names inside a store are relative and ``/``-separated. Reading datasets at speed is
:class:`sparkgpu.data.storage.volume.Volume`'s: obstore for object stores, a store for the rest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from typing import BinaryIO

from sparkgpu._util.files import atomic_path, atomic_writer, fsync_dir, is_temporary, temporary_name
from sparkgpu._util.urls import check_url, is_url, scheme_of
from sparkgpu.errors import ConfigurationError

__all__ = ["Store", "OBJECT_STORE_SCHEMES"]

# Stores on which one PUT is atomic: an object appears whole, or not at all.
OBJECT_STORE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def _fs_class(scheme: str):
    import fsspec

    return fsspec.get_filesystem_class(scheme)


# Fields of an fsspec listing that change with every write, most precise first.
_STAMP_FIELDS = ("mtime", "LastModified", "ETag", "etag", "updated", "generation")


class Store:
    """Files under one folder: a local path, a ``file://`` URL or any fsspec URL.

    Pickles without its filesystem object and opens a new one in a forked process (fsspec's
    asynchronous filesystems do not survive ``fork()``), so Spark executors and DataLoader
    workers can be handed one.

    Args:
        url: The folder.
        storage_options: Passed to fsspec (credentials, endpoint) for URLs.
        durable: Flush local writes to disk (``fsync``) before they become visible. Off only
            for copies that are cheap to make again (a mirror of files kept elsewhere).
        what: What the folder is, for error messages ("the staging store").

    Raises:
        ConfigurationError: ``url`` is empty, or fsspec knows no filesystem for its scheme.
        MissingDependencyError: The scheme's filesystem package is not installed; the
            message holds the ``pip install``.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        storage_options: Mapping | None = None,
        *,
        durable: bool = True,
        what: str = "the folder",
    ):
        url = os.fspath(url)
        if not url:
            raise ConfigurationError(f"{what} is empty; give a local path or a URL such as 's3://bucket/path'")
        if url.startswith("file://"):
            url = url[len("file://") :]
        self.is_local = not is_url(url)
        self.scheme = scheme_of(url)
        if not self.is_local:
            check_url(url, f"{what} {url}")
        self.url = os.path.abspath(os.path.expanduser(url)) if self.is_local else url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.durable = durable
        self._fs = None
        self._fs_pid: int | None = None
        # The folder as its filesystem's paths spell it ("s3://b/k" -> "b/k"), found without connecting.
        self.root = self.url if self.is_local else _fs_class(self.scheme)._strip_protocol(self.url).rstrip("/")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None, "_fs_pid": None}

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- names -------------------------------------------------------------------------

    def path(self, rel: str = "") -> str:
        """The local path or URL of ``rel``."""
        if not rel:
            return self.url
        return os.path.join(self.url, *rel.split("/")) if self.is_local else f"{self.url}/{rel}"

    def child(self, rel: str) -> Store:
        """The store of the sub-folder ``rel``, with the same options."""
        return Store(self.path(rel), self.storage_options, durable=self.durable)

    @property
    def fs(self):
        """The fsspec filesystem of a URL (made again in a forked child)."""
        if self._fs is None or self._fs_pid != os.getpid():
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.url, **self.storage_options)[0]
            self._fs_pid = os.getpid()
        return self._fs

    def _remote(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    @property
    def _atomic_put(self) -> bool:
        return self.scheme in OBJECT_STORE_SCHEMES

    # -- reading -----------------------------------------------------------------------

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """The file's bytes, or its bytes ``[start, end)``.

        Raises:
            FileNotFoundError: There is no such file.
        """
        if not self.is_local:
            if start is None and end is None and self.scheme in ("s3", "s3a"):
                start = 0  # then one ranged GET: s3fs looks the size up first (a HEAD) when neither end is given
            return self.fs.cat_file(self._remote(rel), start=start, end=end)
        with open(self.path(rel), "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))

    def exists(self, rel: str = "") -> bool:
        """Whether ``rel`` exists, as another process may just have written it."""
        if self.is_local:
            return os.path.exists(self.path(rel))
        path = self._remote(rel)
        self.fs.invalidate_cache(path.rsplit("/", 1)[0])  # listings are cached per filesystem
        return self.fs.exists(path)

    def size(self, rel: str) -> int:
        return os.path.getsize(self.path(rel)) if self.is_local else int(self.fs.size(self._remote(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        """Names of the entries directly under ``rel``, sorted; empty when it does not exist."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.path(rel)))
            except (FileNotFoundError, NotADirectoryError):
                return []
        path = self._remote(rel)
        self.fs.invalidate_cache(path)
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    def list(self, rel: str = "", recursive: bool = True) -> dict[str, tuple[int, str]]:
        """Files under ``rel`` (not temporaries): name relative to the store -> ``(size, stamp)``.

        The stamp changes with every write of the file, so a caller can tell what changed
        since its last listing.
        """
        if self.is_local:
            return self._list_local(rel, recursive)
        base = self._remote(rel)
        self.fs.invalidate_cache(base)  # another process's writes must show
        try:
            entries = (
                self.fs.find(base, detail=True) if recursive else {e["name"]: e for e in self.fs.ls(base, detail=True)}
            )
        except FileNotFoundError:
            return {}
        found = {}
        for name, info in entries.items():
            if info.get("type") != "file" or not name.startswith(self.root + "/") or is_temporary(name):
                continue
            stamp = next((str(info[k]) for k in _STAMP_FIELDS if info.get(k) is not None), "")
            found[name[len(self.root) + 1 :]] = (int(info.get("size") or 0), stamp)
        return found

    def _list_local(self, rel: str, recursive: bool) -> dict[str, tuple[int, str]]:
        found = {}
        pending = [rel]
        while pending:
            folder = pending.pop()
            try:
                entries = list(os.scandir(self.path(folder)))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                name = f"{folder}/{entry.name}" if folder else entry.name
                if entry.is_dir(follow_symlinks=False):
                    if recursive:
                        pending.append(name)
                elif not is_temporary(entry.name):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:  # removed since the scan
                        continue
                    found[name] = (stat.st_size, str(stat.st_mtime_ns))
        return found

    def download(self, rel: str, local: str | os.PathLike) -> None:
        """Copies ``rel`` to the local file ``local``, which appears complete or not at all."""
        os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
        with atomic_path(local, fsync=False) as tmp:
            if self.is_local:
                shutil.copyfile(self.path(rel), tmp)
            else:
                self.fs.get_file(self._remote(rel), tmp)

    def free_bytes(self) -> int | None:
        """Free space in a local folder, ``None`` for a URL."""
        return shutil.disk_usage(self.url).free if self.is_local else None

    # -- writing -----------------------------------------------------------------------

    def makedirs(self, rel: str = "") -> None:
        """Creates the folder ``rel`` and its parents (nothing to do on object stores)."""
        if self.is_local:
            os.makedirs(self.path(rel), exist_ok=True)
        else:
            self.fs.makedirs(self._remote(rel), exist_ok=True)

    def _parent_of(self, rel: str) -> None:
        if not self._atomic_put:  # object stores have no folders: no request for nothing
            self.makedirs(rel.rsplit("/", 1)[0] if "/" in rel else "")

    def write_bytes(self, rel: str, data: bytes, *, fsync_folder: bool = False) -> None:
        """Writes ``data`` at ``rel`` so that readers see it whole or not at all.

        Args:
            rel: The file.
            data: Its new content.
            fsync_folder: In a local folder, make the new name itself survive a power loss
                (for commit points: a marker, an index).
        """
        if self.is_local:
            self._parent_of(rel)
            with atomic_writer(self.path(rel), fsync=self.durable, fsync_folder=fsync_folder) as f:
                f.write(data)
        elif self._atomic_put:
            self.fs.pipe_file(self._remote(rel), data)
        else:
            with self._moved_into_place(rel) as tmp:
                self.fs.pipe_file(tmp, data)

    def write_pieces(self, rel: str, pieces: Sequence) -> None:
        """Writes a file from buffers (bytes, memoryviews, numpy arrays) without joining them.

        Not atomic: for files that a later commit point publishes (the shards an index
        lists). Flushed to disk in a local folder, so the commit point never outlives them.
        """
        if self.is_local:
            self._parent_of(rel)
            with open(self.path(rel), "wb") as out:
                for piece in pieces:
                    out.write(piece)
                if self.durable:
                    out.flush()
                    os.fsync(out.fileno())
            return
        self._parent_of(rel)
        with self.fs.open(self._remote(rel), "wb") as out:
            for piece in pieces:
                out.write(memoryview(piece).cast("B"))

    @contextlib.contextmanager
    def writer(self, rel: str) -> Iterator[BinaryIO]:
        """Opens ``rel`` for writing; it appears, whole, only when the block succeeds.

        A ``rel`` that is itself a temporary name (:func:`~sparkgpu._util.files.is_temporary`),
        to be renamed once the content decides the final name, is written in place on URLs.
        """
        if self.is_local:
            self._parent_of(rel)
            with atomic_writer(self.path(rel), fsync=self.durable) as f:
                yield f
        elif is_temporary(rel):
            self._parent_of(rel)
            with self.fs.open(self._remote(rel), "wb") as f:
                yield f
        else:
            # A streamed upload would publish what was written so far if the block failed
            # (fsspec files commit when closed): a temporary keeps failures invisible.
            with self._moved_into_place(rel) as tmp, self.fs.open(tmp, "wb") as f:
                yield f

    def upload(self, local: str | os.PathLike, rel: str) -> None:
        """Puts the local file ``local`` at ``rel`` as one whole file."""
        if self.is_local:
            self._parent_of(rel)
            with atomic_path(self.path(rel), fsync=self.durable) as tmp:
                shutil.copyfile(local, tmp)
        elif self._atomic_put:
            self.fs.put_file(os.fspath(local), self._remote(rel))
        else:
            with self._moved_into_place(rel) as tmp:
                self.fs.put_file(os.fspath(local), tmp)

    @contextlib.contextmanager
    def _moved_into_place(self, rel: str) -> Iterator[str]:
        final = self._remote(rel)
        self.fs.makedirs(final.rpartition("/")[0], exist_ok=True)
        tmp = temporary_name(final)
        try:
            yield tmp
            self.fs.mv(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(tmp)
            raise

    def rename(self, src: str, dst: str) -> None:
        """Moves ``src`` to ``dst``, replacing it (atomic in a local folder)."""
        if self.is_local:
            self._parent_of(dst)
            os.replace(self.path(src), self.path(dst))
        else:
            self._parent_of(dst)
            self.fs.mv(self._remote(src), self._remote(dst))

    def remove(self, rel: str, *, fsync_folder: bool = False) -> None:
        """Removes a file, or a folder with everything in it; a missing one is fine.

        Args:
            rel: What to remove.
            fsync_folder: In a local folder, make the removal survive a power loss.
        """
        if not self.is_local:
            path = self._remote(rel)
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
            return
        path = self.path(rel)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        else:
            return
        if fsync_folder:
            fsync_dir(os.path.dirname(path))

    def sync_folders(self, rels: Sequence[str] = ()) -> None:
        """Flushes the entries of the local folders ``rels`` (those that exist) and of the root
        to disk, so files created in them survive a power loss. Nothing to do for URLs: an
        object exists once its PUT completes."""
        if not self.is_local:
            return
        for rel in rels:
            if os.path.isdir(self.path(rel)):
                fsync_dir(self.path(rel))
        fsync_dir(self.url)
