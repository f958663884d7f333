"""Layout of a checkpoint directory, its completion markers and pruning.

A job's checkpoint directory holds one sub-directory per saved step::

    <directory>/step-0000000099/
        .metadata                 written by torch.distributed.checkpoint (DCP)
        __0_0.distcp, __1_0.distcp  one data file per rank
        _COMPLETE.json            the completion marker, written last

The marker is what makes a checkpoint exist. Rank 0 writes it (temp name, fsync, rename)
only after every rank's data and DCP's own ``.metadata`` are on storage, so a process
killed at any moment leaves either a marked, loadable checkpoint or an unmarked directory
that discovery ignores. DCP's ``.metadata`` alone is not enough: it is written before the
caller learns that every rank's write succeeded, and a kill between the two would leave a
checkpoint that looks finished.

The directory is a local path or an fsspec URL (``s3://...``, ``gs://...``, ``memory://``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

from sparkgpu.errors import CheckpointError
from sparkgpu.store import Store

__all__ = ["MARKER_NAME", "CheckpointInfo", "CheckpointStore", "checkpoint_at"]

logger = logging.getLogger("sparkgpu.train.checkpoint")

MARKER_NAME = "_COMPLETE.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _step_name(step: int) -> str:
    return f"step-{step:010d}"


def _marker_of(name: str) -> str:
    return f"{name}/{MARKER_NAME}"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint, as described by its completion marker.

    Attributes:
        step: The value given to ``save(step)``: the step just finished, counted the way
            the training loop counts (see ``first_step``).
        path: Directory (or URL) holding the checkpoint.
        world_size: Number of ranks that saved it.
        created: Unix time at which it was committed.
        extras: The JSON values passed as ``extras=`` to ``save``.
        has_model: Whether it holds a model state.
        has_optimizer: Whether it holds optimizer state.
        stateful: Names of the other objects saved beside the model (scheduler, loader...).
        has_rng: Whether per-rank RNG states were saved.
        blocking_seconds: How long the training loop was blocked by the save on rank 0.
        write_seconds: From the start of the save to its commit, on rank 0.
        first_step: The step the loop that saved it passes after its first step: 0 when it
            passes the index of the step just finished (``for step in range(...)``), 1 when
            it passes the number of steps done (``step += 1; save(step)``).
    """

    step: int
    path: str
    world_size: int
    created: float
    extras: dict = dataclasses.field(default_factory=dict)
    has_model: bool = False
    has_optimizer: bool = False
    stateful: tuple[str, ...] = ()
    has_rng: bool = False
    blocking_seconds: float | None = None
    write_seconds: float | None = None
    first_step: int = 0

    @property
    def steps_done(self) -> int:
        """Training steps finished when it was saved: what ``restore()`` returns."""
        return self.step + 1 - self.first_step

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("path")
        data["stateful"] = list(self.stateful)
        data["format"] = FORMAT_VERSION
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str) -> "CheckpointInfo":
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields and k != "path"}
        kwargs["stateful"] = tuple(kwargs.get("stateful", ()))
        return cls(path=path, **kwargs)


class CheckpointStore:
    """Lists, commits and prunes the checkpoints under one directory.

    Args:
        directory: Local path, ``file://`` URL or any fsspec URL.

    Raises:
        MissingDependencyError: The URL's filesystem is not installed here.
    """

    def __init__(self, directory: str | os.PathLike):
        directory = os.fspath(directory)
        if directory.startswith("file://"):
            directory = directory[len("file://") :]
        self.directory = directory.rstrip("/") or "/"
        self.store = Store(self.directory, what="the checkpoint directory")
        self.is_local = self.store.is_local

    # -- paths -------------------------------------------------------------------------

    def path_for(self, step: int) -> str:
        return f"{self.directory}/{_step_name(step)}"

    def ensure_directory(self) -> None:
        """Creates the root directory.

        Raises:
            CheckpointError: It cannot be created (permissions, a file in the way, ...).
        """
        try:
            self.store.makedirs()
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the checkpoint directory {self.directory!r} ({exc}); "
                "pass a writable directory to Checkpointer(directory=...)"
            ) from exc

    # -- discovery ---------------------------------------------------------------------

    def _step_dirs(self) -> dict[int, str]:
        found = {}
        for name in self.store.listdir():
            match = _STEP_DIR.match(name)
            if match:
                found[int(match.group(1))] = f"{self.directory}/{name}"
        return found

    def _read_marker(self, path: str, name: str | None = None) -> CheckpointInfo | None:
        """The marker of the checkpoint at ``path``, whose name in the directory is ``name``."""
        try:
            raw = self.store.read_bytes(_marker_of(name or self._name_of(path)))
        except (FileNotFoundError, NotADirectoryError):  # a file named like a step is no checkpoint
            return None
        try:
            data = json.loads(raw)
            return CheckpointInfo.from_json(data, path)
        except (ValueError, TypeError) as exc:
            # The marker is renamed into place whole, so this is damage from outside.
            logger.warning("ignoring checkpoint %s: unreadable completion marker (%s)", path, exc)
            return None

    def _name_of(self, path: str) -> str:
        """The name of the checkpoint at ``path`` (``<directory>/<name>``) inside the directory."""
        return path[len(self.directory) :].lstrip("/")

    def list_complete(self) -> list[CheckpointInfo]:
        """Every complete checkpoint, oldest step first."""
        infos = []
        for step, path in sorted(self._step_dirs().items()):
            info = self._read_marker(path)
            if info is not None and info.step == step:
                infos.append(info)
        return infos

    def latest(self) -> CheckpointInfo | None:
        """The complete checkpoint with the highest step, or ``None``."""
        for step, path in sorted(self._step_dirs().items(), reverse=True):
            info = self._read_marker(path)
            if info is not None and info.step == step:
                return info
        return None

    def get(self, step: int) -> CheckpointInfo | None:
        """The complete checkpoint of ``step``, or ``None`` when there is none."""
        return self._read_marker(self.path_for(step))

    # -- writing -----------------------------------------------------------------------

    def prepare(self, step: int) -> str:
        """Empties the directory of ``step`` so a new save starts from nothing.

        A directory left there by an attempt killed mid-save, or an older checkpoint of
        the same step, is removed marker first: a kill during the removal leaves an
        unmarked directory, never a marked half-deleted one.

        Returns:
            The path of the (now absent) directory.
        """
        path = self.path_for(step)
        try:
            self._remove(_step_name(step))
        except OSError as exc:
            raise CheckpointError(
                f"cannot clear {path!r} for a new checkpoint ({exc}); check write permission "
                "on the checkpoint directory"
            ) from exc
        return path

    def commit(self, info: CheckpointInfo) -> None:
        """Writes the completion marker of ``info.path`` atomically, and durably on a local disk.

        Raises:
            CheckpointError: The marker cannot be written.
        """
        data = json.dumps(info.to_json(), indent=1, sort_keys=True).encode()
        try:
            self.store.write_bytes(_marker_of(self._name_of(info.path)), data, fsync_folder=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot commit checkpoint {info.path!r} ({exc}); check free space and "
                "write permission on the checkpoint directory"
            ) from exc

    def prune(self, keep_last: int | None) -> list[int]:
        """Deletes all but the ``keep_last`` newest complete checkpoints.

        Unmarked directories older than the newest complete checkpoint are leftovers of
        killed saves and go too; newer unmarked ones may be a save in flight and stay.

        Returns:
            The steps whose directories were removed.
        """
        complete = self.list_complete()
        if not complete:
            return []
        newest = complete[-1].step
        keep = {info.step for info in complete[-keep_last:]} if keep_last else {i.step for i in complete}
        removed = []
        for step in sorted(self._step_dirs()):
            if step in keep or step > newest:
                continue
            self._remove(_step_name(step))
            removed.append(step)
        return removed

    def _remove(self, name: str) -> None:
        # The marker first, durably: a kill during the removal leaves an unmarked directory.
        self.store.remove(_marker_of(name), fsync_folder=True)
        self.store.remove(name)

    # -- DCP storage -------------------------------------------------------------------

    def writer(self, path: str, thread_count: int):
        """A DCP ``StorageWriter`` for the checkpoint directory ``path``."""
        if self.is_local:
            from torch.distributed.checkpoint import FileSystemWriter

            return FileSystemWriter(path, sync_files=True, thread_count=thread_count, overwrite=True)
        # DCP picks this same writer itself for URLs; it is only not re-exported.
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # fsspec streams of remote stores have no file descriptor to fsync; a closed
        # upload is durable there.
        return FsspecWriter(path, sync_files=False, thread_count=thread_count, overwrite=True)

    def reader(self, path: str):
        """A DCP ``StorageReader`` for the checkpoint directory ``path``."""
        if self.is_local:
            from torch.distributed.checkpoint import FileSystemReader

            return FileSystemReader(path)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)

    def free_bytes(self) -> int | None:
        """Free space under the directory when it is local, else ``None``."""
        return self.store.free_bytes()


def checkpoint_at(path: str | os.PathLike) -> CheckpointInfo | None:
    """The complete checkpoint in the directory ``path`` (``<directory>/step-0000000900``,
    a local path or an fsspec URL), or ``None`` when it has no completion marker."""
    directory = CheckpointStore(path).directory  # normalised as a checkpoint root is
    parent, _, name = directory.rpartition("/")
    return CheckpointStore(parent or ("/" if directory.startswith("/") else "."))._read_marker(directory, name)
