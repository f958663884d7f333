"""Layout of a checkpoint directory, its completion markers and pruning.

A job's checkpoint directory holds one sub-directory per saved step::

    <directory>/step-0000000099/
        .metadata                 written by torch.distributed.checkpoint (DCP)
        __0_0.distcp, __1_0.distcp  one data file per rank
        _FILES.rank0.json, ...    each rank's signed file list (signed checkpoints only)
        _COMPLETE.json            the completion marker, written last

The marker is what makes a checkpoint exist. Rank 0 writes it (temp name, fsync, rename)
only after every rank's data and DCP's own ``.metadata`` are on storage (each file fsynced,
then the checkpoint's folder and the root), so a process
killed at any moment leaves either a marked, loadable checkpoint or an unmarked directory
that discovery ignores. DCP's ``.metadata`` alone is not enough: it is written before the
caller learns that every rank's write succeeded, and a kill between the two would leave a
checkpoint that looks finished.

Where a key applies (inside a job: ``_checkpoint_keys``), the marker also lists every file
with its BLAKE3 digest and carries an HMAC of the whole (``_checkpoint_signing``): a marker that is
not signed with the key does not make a checkpoint exist. :meth:`CheckpointDirectory.latest`
skips it with a warning, and naming it (:meth:`CheckpointDirectory.get_signed`) is refused.

The directory is a local path or an fsspec URL (``s3://...``, ``gs://...``, ``memory://``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from sparkgpu._util.files import fsync_dir
from sparkgpu._util.urls import is_url
from sparkgpu.errors import CheckpointError
from sparkgpu.store import Store
from sparkgpu.train._checkpoint_keys import required_key
from sparkgpu.train._checkpoint_signing import (
    Manifest,
    SigningKey,
    VerifyingFileSystem,
    check_files,
    claimed_job,
    refusal_of,
    sign_marker,
    verify_marker,
    weights_only_planner,
)

__all__ = [
    "MARKER_NAME",
    "CheckpointInfo",
    "SignedCheckpoint",
    "CheckpointDirectory",
    "checkpoint_at",
    "open_checkpoint",
    "unmarked_in_job",
    "reader_for",
    "check_checkpoint_files",
    # What a load through reader_for needs besides, for readers outside this package.
    "refusal_of",
    "weights_only_planner",
    "SigningKey",
]

logger = logging.getLogger(__name__)

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


class SignedCheckpoint(NamedTuple):
    """A complete checkpoint and, when its marker was verified with a key, what that vouches for."""

    info: CheckpointInfo
    manifest: Manifest | None


class CheckpointDirectory:
    """Lists, commits and prunes the checkpoints under one directory.

    Args:
        directory: Local path, ``file://`` URL or any fsspec URL.
        key: Sign the markers committed with this key, and count only markers signed with it
            as checkpoints; ``None``: write and read them unsigned.

    Raises:
        MissingDependencyError: The URL's filesystem is not installed here.
    """

    def __init__(self, directory: str | os.PathLike, *, key: SigningKey | None = None):
        directory = os.fspath(directory)
        if directory.startswith("file://"):
            directory = directory[len("file://") :]
        self.directory = directory.rstrip("/") or "/"
        self.store = Store(self.directory, what="the checkpoint directory")
        self.is_local = self.store.is_local
        self.key = key

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
        found = self._read_signed(path, name)
        return None if found is None else found.info

    def _read_signed(self, path: str, name: str | None = None, *, refuse: bool = False) -> SignedCheckpoint | None:
        """The checkpoint at ``path``, its marker verified with the key when there is one.

        A marker that does not verify is skipped with a warning, or with ``refuse`` raises
        CheckpointError.
        """
        data = self._marker_data(path, name or self.name_of(path))
        if data is None:
            return None
        try:
            info = CheckpointInfo.from_json(data, path)
        except (ValueError, TypeError) as exc:
            return self._not_genuine(path, f"its completion marker cannot be read ({exc})", refuse)
        if self.key is None:
            return SignedCheckpoint(info, None)
        try:
            manifest = verify_marker(data, self.key.key)
        except CheckpointError as exc:
            return self._not_genuine(path, str(exc), refuse)
        return SignedCheckpoint(info, manifest)

    def _marker_data(self, path: str, name: str) -> dict[str, Any] | None:
        try:
            raw = self.store.read_bytes(_marker_of(name))
        except (FileNotFoundError, NotADirectoryError):  # a file named like a step is no checkpoint
            return None
        try:
            data = json.loads(raw)
        except ValueError as exc:
            # The marker is renamed into place whole, so this is damage from outside.
            logger.warning("ignoring checkpoint %s: unreadable completion marker (%s)", path, exc)
            return None
        if not isinstance(data, dict):
            logger.warning("ignoring checkpoint %s: its completion marker is not a JSON object", path)
            return None
        return data

    @staticmethod
    def _not_genuine(path: str, reason: str, refuse: bool) -> None:
        if refuse:
            raise CheckpointError(
                f"checkpoint {path!r} is refused: {reason}. The job did not write it, or it was changed since; "
                "nothing of it was loaded. Use another checkpoint (restore(step=None) and "
                "sparkgpu.train.latest_checkpoint(<directory>) take the newest genuine one), and check who else "
                "can write to the checkpoint directory"
            )
        logger.warning(
            "ignoring checkpoint %s: %s; the job did not write it, or it was changed since (check who else "
            "can write to the checkpoint directory)",
            path,
            reason,
        )
        return None

    def name_of(self, path: str) -> str:
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
        found = self.latest_signed()
        return None if found is None else found.info

    def latest_signed(self, below: int | None = None) -> SignedCheckpoint | None:
        """The complete checkpoint with the highest step (lower than ``below``), or ``None``."""
        for step, path in sorted(self._step_dirs().items(), reverse=True):
            if below is not None and step >= below:
                continue
            found = self._read_signed(path)
            if found is not None and found.info.step == step:
                return found
        return None

    def get(self, step: int) -> CheckpointInfo | None:
        """The complete checkpoint of ``step``, or ``None`` when there is none."""
        return self._read_marker(self.path_for(step))

    def get_signed(self, step: int) -> SignedCheckpoint | None:
        """The complete checkpoint of ``step``, or ``None`` when there is none.

        Raises:
            CheckpointError: Its marker is not signed with the key.
        """
        found = self._read_signed(self.path_for(step), refuse=True)
        return found if found is not None and found.info.step == step else None

    def check_files(self, checkpoint: SignedCheckpoint, share: int = 0, shares: int = 1) -> list[str]:
        """What is wrong with the files of a signed checkpoint (empty: nothing); the files are
        read, not unpickled. With ``shares`` readers, this one's ``share`` of the files:
        the shares hold about as many bytes each."""
        assert checkpoint.manifest is not None, "only a signed checkpoint lists its files"
        names = _share_out(checkpoint.manifest.files, shares)[share]
        return check_files(self.store, self.name_of(checkpoint.info.path), checkpoint.manifest, names)

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

    def commit(self, info: CheckpointInfo, manifest: Manifest | None = None) -> None:
        """Writes the completion marker of ``info.path`` atomically, and durably on a local disk.

        Args:
            info: What the marker says of the checkpoint.
            manifest: Its files, listed and signed in the marker with the store's key.

        Raises:
            CheckpointError: The marker cannot be written.
        """
        marker = info.to_json()
        if self.key is not None:
            if manifest is None:
                raise CheckpointError(f"cannot commit checkpoint {info.path!r} unsigned: a key signs this directory")
            marker = sign_marker(marker, manifest, self.key.key)
        data = json.dumps(marker, indent=1, sort_keys=True).encode()
        name = self.name_of(info.path)
        try:
            if self.is_local and self.store.durable:
                # Every file was fsynced as it was closed; their names, and the checkpoint's
                # own in the root, are made durable before the marker can be.
                fsync_dir(self.store.path(name))
                fsync_dir(self.store.path(""))
            self.store.write_bytes(_marker_of(name), data, fsync_folder=True)
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

    def reader(self, path: str, manifest: Manifest | None = None):
        """A DCP ``StorageReader`` for the checkpoint directory ``path``; with the ``manifest``
        of its signed marker, one that opens only the files listed there and checks
        ``.metadata`` before DCP unpickles it."""
        return reader_for(path, manifest)

    def free_bytes(self) -> int | None:
        """Free space under the directory when it is local, else ``None``."""
        return self.store.free_bytes()


def _share_out(files: dict[str, tuple[int, str]], shares: int) -> list[list[str]]:
    """The files split into ``shares`` lists of about equal bytes, the same on every rank."""
    lists: list[list[str]] = [[] for _ in range(shares)]
    totals = [0] * shares
    for name, (size, _) in sorted(files.items(), key=lambda item: (-item[1][0], item[0])):
        lightest = totals.index(min(totals))
        lists[lightest].append(name)
        totals[lightest] += size
    return lists


def reader_for(path: str, manifest: Manifest | None = None):
    """A DCP ``StorageReader`` for the checkpoint directory ``path`` (see :meth:`CheckpointDirectory.reader`)."""
    if path.startswith("file://"):
        path = path[len("file://") :]
    if not is_url(path):
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(path)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(path)
    if manifest is not None:
        # A proxy of DCP's own filesystem object, which the reader uses for every file it opens.
        reader.fs = VerifyingFileSystem(reader.fs, manifest, path)  # type: ignore[assignment]
    return reader


def _split(path: str | os.PathLike) -> tuple[str, str, str]:
    """``(directory, parent, name)`` of the checkpoint ``path``, normalised as a checkpoint root is."""
    directory = CheckpointDirectory(path).directory
    parent, _, name = directory.rpartition("/")
    return directory, parent or ("/" if directory.startswith("/") else "."), name


def checkpoint_at(path: str | os.PathLike) -> CheckpointInfo | None:
    """The complete checkpoint in the directory ``path`` (``<directory>/step-0000000900``,
    a local path or an fsspec URL), or ``None`` when it has no completion marker.

    Its marker is read, not verified: :func:`open_checkpoint` verifies it before a load.
    """
    directory, parent, name = _split(path)
    return CheckpointDirectory(parent)._read_marker(directory, name)


def open_checkpoint(path: str | os.PathLike) -> SignedCheckpoint | None:
    """The checkpoint in the directory ``path``, its marker verified where a key applies
    (``_checkpoint_keys.required_key``), or ``None`` when it has no completion marker.

    Raises:
        CheckpointError: It belongs to a job and its marker is not signed with that job's
            key, or that key is not on this machine.
    """
    directory, parent, name = _split(path)
    data = CheckpointDirectory(parent)._marker_data(directory, name)
    key = required_key(parent, claimed_job(data) if data is not None else None, directory)
    if data is None:
        return None
    return CheckpointDirectory(parent, key=key)._read_signed(directory, name, refuse=True)


def unmarked_in_job(path: str | os.PathLike) -> bool:
    """Whether the directory ``path``, which has no completion marker, lies where a key applies:
    a DCP directory there cannot be verified, and is not to be loaded."""
    directory, parent, _ = _split(path)
    return required_key(parent, None, directory) is not None


def check_checkpoint_files(checkpoint: SignedCheckpoint, names: Iterable[str]) -> None:
    """Checks the files ``names`` of a signed checkpoint against its list, hashing them.

    Raises:
        CheckpointError: One is not listed, missing, or differs from its signed hash.
    """
    assert checkpoint.manifest is not None, "only a signed checkpoint lists its files"
    directory, parent, name = _split(checkpoint.info.path)
    names = sorted(set(names))
    problems = [f"{rel} is not among its signed files" for rel in names if rel not in checkpoint.manifest.files]
    listed = [rel for rel in names if rel in checkpoint.manifest.files]
    problems += check_files(CheckpointDirectory(parent).store, name, checkpoint.manifest, listed)
    if problems:
        raise CheckpointError(
            f"checkpoint {directory!r} is refused: {'; '.join(problems[:5])}. The job did not write it, or it was "
            "changed since; nothing of it was loaded. Use another checkpoint, and check who else can write to "
            "the checkpoint directory"
        )
