"""The output folder of a conversion (a :class:`~sparkgpu.store.Store`), committed atomically.

``index.json`` is the commit point. A conversion, holding the folder's claim
(:mod:`~sparkgpu.data.convert.claim`: one conversion per folder at a time),

1. writes a marker file naming its run (from here on, whatever a crash leaves is known to be
   an interrupted conversion's),
2. removes an old ``index.json`` (so no index ever lists shards being replaced), then clears
   whatever an earlier run left,
3. writes shards (from any number of writers, each in its own sub-folder), each flushed to
   disk (``fsync``) by its writer,
4. removes sub-folders no shard of the index lives in (failed Spark task attempts), and
   flushes the folders' entries to disk,
5. checks that its claim is still its own, and writes ``index.json`` atomically (temporary
   name + rename locally; one PUT on object stores),
6. removes the marker.

Claim files are left alone throughout: the claim's holder releases them.

A crash, even a power loss, at any point leaves either a complete index (the shards it lists
on disk) or no index and the marker (the next run clears the folder and starts over, with or
without ``overwrite``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

from sparkgpu._util.files import is_temporary
from sparkgpu.data.convert.claim import FolderClaim, is_claim
from sparkgpu.errors import ConfigurationError, DataError
from sparkgpu.store import Store

__all__ = ["OutputFolder", "INDEX_NAME", "MARKER_NAME"]

INDEX_NAME = "index.json"
MARKER_NAME = ".sparkgpu-writing"


class OutputFolder:
    """Begin / commit / abort of one conversion into a folder (see the module docstring).

    Args:
        store: Where the dataset goes.
        run_id: Unique id of this conversion, recorded in the marker file.
        claim: This conversion's claim on the folder, taken before :meth:`begin`; ``None``
            only for reading.
    """

    def __init__(self, store: Store, run_id: str, claim: FolderClaim | None = None):
        self.store = store
        self.run_id = run_id
        self.claim = claim

    def _entries(self) -> list[str]:
        return [name for name in self.store.listdir() if not is_claim(name)]

    def _read(self, name: str) -> bytes | None:
        try:
            return self.store.read_bytes(name)
        except FileNotFoundError:
            return None

    def read_index(self) -> dict | None:
        """The committed ``index.json`` as a dict, or ``None`` when there is none."""
        data = self._read(INDEX_NAME)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise DataError(
                f"{self.store.path(INDEX_NAME)} is not valid JSON ({exc}); convert again with overwrite=True"
            ) from None

    def begin(self, *, overwrite: bool) -> None:
        """Claims the folder for this run, clearing what an interrupted run left behind.

        Raises:
            ConfigurationError: The folder holds a complete dataset and ``overwrite`` is false,
                or it holds files no conversion of this package wrote.
            DataError: Another conversion took the claim over.
        """
        if self.claim is not None:
            self.claim.check_held()
        entries = self._entries()
        has_index = INDEX_NAME in entries
        if has_index and not overwrite:
            raise ConfigurationError(
                f"{self.store.url} already holds a complete MDS dataset; pass overwrite=True to "
                "replace it, or write to another folder"
            )
        if entries and not has_index and MARKER_NAME not in entries and not overwrite:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise ConfigurationError(
                f"{self.store.url} is not empty ({shown}) and was not written by an interrupted "
                "conversion; choose an empty folder, or pass overwrite=True to delete its contents"
            )
        # The marker first: a crash after the old index is gone must still leave a folder that
        # a rerun recognises as an interrupted conversion.
        self.store.write_bytes(
            MARKER_NAME, json.dumps({"run_id": self.run_id, "started": time.time()}).encode(), fsync_folder=True
        )
        if has_index:
            self.store.remove(INDEX_NAME)
        for name in entries:
            if name not in (INDEX_NAME, MARKER_NAME):
                self.store.remove(name)

    def commit(self, shards: Sequence[dict], metadata: Mapping) -> None:
        """Publishes ``index.json`` listing ``shards``, after removing unlisted sub-folders.

        Raises:
            DataError: Another conversion claimed the folder while this one ran.
        """
        from sparkgpu.data.mds.writer import index_document

        self._check_still_ours()
        listed = {
            shard[key]["basename"].split("/", 1)[0]
            for shard in shards
            for key in ("raw_data", "zip_data")
            if shard.get(key)
        }
        for name in self._entries():
            if name not in listed and name not in (MARKER_NAME, INDEX_NAME) and not is_temporary(name):
                self.store.remove(name)
        # Writers fsynced the shards' bytes; their names live in these folders.
        self.store.sync_folders(sorted(listed))
        self.store.write_bytes(INDEX_NAME, index_document(shards, metadata), fsync_folder=True)
        self.store.remove(MARKER_NAME)

    def abort(self) -> None:
        """Removes this run's shards after a failure; keeps the marker so a later run may clear
        anything a still-running writer adds afterwards. A run whose claim was taken over
        leaves the folder to its new holder."""
        marker = self._read(MARKER_NAME)
        if marker is None or json.loads(marker).get("run_id") != self.run_id:
            return
        if self.claim is not None:
            try:
                self.claim.check_held()
            except DataError:
                return
        for name in self._entries():
            if name != MARKER_NAME:
                self.store.remove(name)

    def _check_still_ours(self) -> None:
        if self.claim is not None:
            self.claim.check_held()
        marker = self._read(MARKER_NAME)
        owner = json.loads(marker).get("run_id") if marker else None
        if owner != self.run_id:
            raise DataError(
                f"another conversion started writing to {self.store.url} while this one ran "
                f"(run {owner!r}, this one {self.run_id!r}); run one conversion per folder at a time"
            )
