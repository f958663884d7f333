"""Signed checkpoints: every file hashed as it is written, listed in a MAC'd completion marker.

A job's checkpoint directory may be on storage that others can write (the staging store),
and loading a checkpoint unpickles DCP's ``.metadata`` and each rank's app state. Signing
makes sure that a writer of the directory cannot make a rank, or the client, run code by
planting a checkpoint or by changing one. Where a key applies (``_checkpoint_keys``):

Saving:

* each rank hashes (BLAKE3, :mod:`._digests`) the files DCP writes for it as it writes them
  (``_checkpoint_writes``: on a helper thread, beside the write of the same bytes), and the
  bytes of its app-state blob; only rank 0 writes the marker, so each rank puts that list,
  MAC'd, beside its files (``_FILES.rank<r>.json``);
* rank 0 checks every rank's list, adds ``.metadata`` (hashed as DCP wrote it) and writes
  the marker with the whole list under ``"signed"`` and an HMAC-SHA256 of the rest under
  ``"mac"`` (:func:`sign_marker`).

Loading:

* the marker's MAC is checked before anything else (:func:`verify_marker`);
* every listed file is hashed, streamed, before anything is unpickled (:func:`check_files`);
* what is unpickled is checked again as it is read, so that a file changed between the
  two reads is refused too: ``.metadata`` is read once and its bytes checked before they
  are unpickled, no file outside the list is opened (:class:`VerifyingFileSystem`), DCP's
  byte items are unpickled with ``weights_only=True`` (:func:`weights_only_planner`), and a
  rank's app blob is checked against its listed hash before ``torch.load``
  (:func:`check_app_blob`).

A checkpoint that fails any check was not written by the job, or was changed since.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import hmac
import io
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from sparkgpu.errors import CheckpointError
from sparkgpu.store import Store
from sparkgpu.train._digests import digest_of, files_json, finish, is_digest, new_hasher, parse_file_entry

__all__ = [
    "METADATA_NAME",
    "SigningKey",
    "Manifest",
    "sign_marker",
    "verify_marker",
    "is_signed",
    "claimed_job",
    "digest_of_file",
    "check_files",
    "check_app_blob",
    "SaveSigner",
    "VerifyingFileSystem",
    "refusal_of",
    "weights_only_planner",
]

logger = logging.getLogger(__name__)

METADATA_NAME = ".metadata"  # DCP's own name for the pickled metadata of a checkpoint
RANK_FILES = "_FILES.rank{rank}.json"
_MARKER_DOMAIN = b"sparkgpu checkpoint marker\n"
_RANK_DOMAIN = b"sparkgpu checkpoint rank files\n"
_CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True)
class SigningKey:
    """The key that signs the checkpoints of one job.

    Attributes:
        key: ``derive_key(job_key, "checkpoints")``; never printed.
        job_id: The job it belongs to, recorded in the markers it signs.
    """

    key: bytes = dataclasses.field(repr=False)
    job_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a signed marker vouches for.

    Attributes:
        files: Name inside the checkpoint -> ``(size, digest)`` of every file DCP wrote.
        app_digests: ``"rank<r>"`` -> digest of that rank's app-state blob.
        job_id: The job whose key signed it.
    """

    files: dict[str, tuple[int, str]]
    app_digests: dict[str, str]
    job_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "files": files_json(self.files),
            "app_digests": dict(sorted(self.app_digests.items())),
            "job_id": self.job_id,
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Raises ValueError on anything but what :meth:`to_json` writes."""
        if not isinstance(data, dict):
            raise ValueError("no file list")
        files = _parse_files(data.get("files"))
        app = data.get("app_digests")
        if app is None:  # signed before digests named their algorithm
            legacy = data.get("app_sha256", {})
            app = {k: f"sha256:{v}" for k, v in legacy.items()} if isinstance(legacy, dict) else None
        if not isinstance(app, dict) or not all(isinstance(k, str) and is_digest(v) for k, v in app.items()):
            raise ValueError("bad app-state digests")
        job_id = data.get("job_id")
        if job_id is not None and not isinstance(job_id, str):
            raise ValueError("bad job id")
        if METADATA_NAME not in files:
            raise ValueError(f"{METADATA_NAME} is not listed")
        return cls(files=files, app_digests=dict(app), job_id=job_id)


def _parse_files(data: Any) -> dict[str, tuple[int, str]]:
    if not isinstance(data, dict):
        raise ValueError("no file list")
    files = {}
    for name, entry in data.items():
        if not _plain_name(name):
            raise ValueError(f"bad file entry {name!r}")
        try:
            files[str(name)] = parse_file_entry(entry)
        except ValueError:
            raise ValueError(f"bad file entry {name!r}") from None
    return files


def _plain_name(name: Any) -> bool:
    """A file name directly inside the checkpoint: no folder, no way out of it."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _mac(key: bytes, domain: bytes, data: dict[str, Any]) -> str:
    # The JSON that a reader parses back serialises to these same bytes: keys sorted, no
    # spaces, floats as their shortest repr, which round-trips.
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hmac.new(key, domain + canonical.encode(), hashlib.sha256).hexdigest()


# -- markers -----------------------------------------------------------------------------


def sign_marker(data: dict[str, Any], manifest: Manifest, key: bytes) -> dict[str, Any]:
    """The marker ``data`` with ``manifest`` under ``"signed"`` and the MAC of both under ``"mac"``."""
    signed = {**data, "signed": manifest.to_json()}
    signed["mac"] = _mac(key, _MARKER_DOMAIN, signed)
    return signed


def is_signed(data: dict[str, Any]) -> bool:
    return "mac" in data or "signed" in data


def claimed_job(data: dict[str, Any]) -> str | None:
    """The job a marker says signed it (not verified: it picks the key to verify with)."""
    signed = data.get("signed")
    job = signed.get("job_id") if isinstance(signed, dict) else None
    return job if isinstance(job, str) else None


def verify_marker(data: dict[str, Any], key: bytes) -> Manifest:
    """The file list of a marker whose MAC is valid under ``key``.

    Raises:
        CheckpointError: The marker is unsigned, its MAC does not match, or its list is
            malformed; the message says which, to follow "checkpoint X is refused: ".
    """
    mac = data.get("mac")
    if not isinstance(mac, str) or "signed" not in data:
        raise CheckpointError("its completion marker is not signed")
    body = {name: value for name, value in data.items() if name != "mac"}
    try:
        expected = _mac(key, _MARKER_DOMAIN, body)
    except (TypeError, ValueError):
        expected = ""
    if not hmac.compare_digest(mac.encode(), expected.encode()):
        raise CheckpointError("the signature of its completion marker does not match the job's key")
    try:
        return Manifest.from_json(data["signed"])
    except ValueError as exc:  # signed by the job, so not expected: a bug rather than an attack
        raise CheckpointError(f"its signed file list cannot be read ({exc})") from None


# -- hashing and checking stored files ---------------------------------------------------


def digest_of_file(store: Store, rel: str, like: str | None = None) -> tuple[int, str]:
    """Size and digest of the stored file ``rel``, read in chunks (never whole into memory).

    Args:
        store: The checkpoint root.
        rel: The file inside it.
        like: A digest to compare with: the result is in its algorithm.

    Raises:
        FileNotFoundError: There is no such file.
    """
    digest = new_hasher(like)
    size = 0
    if store.is_local:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        with open(store.path(rel), "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                digest.update(view[:n])
                size += n
        return size, finish(digest)
    total = store.size(rel)
    while size < total:
        chunk = store.read_bytes(rel, size, min(size + _CHUNK, total))
        if not chunk:
            break
        digest.update(chunk)
        size += len(chunk)
    return size, finish(digest)


def check_files(store: Store, name: str, manifest: Manifest, names: Iterable[str]) -> list[str]:
    """What is wrong with the listed files ``names`` of the checkpoint ``name`` (empty: nothing).

    Never raises: every rank calls it on its share and all must reach the exchange after it.
    """
    problems = []
    for rel in names:
        size, digest = manifest.files[rel]
        try:
            found = digest_of_file(store, f"{name}/{rel}", like=digest)
        except FileNotFoundError:
            problems.append(f"{rel} is missing")
            continue
        except Exception as exc:
            problems.append(f"{rel} cannot be read ({type(exc).__name__}: {exc})")
            continue
        if found[0] != size or not hmac.compare_digest(found[1], digest):
            problems.append(f"{rel} differs from its signed hash")
    return problems


def check_app_blob(manifest: Manifest, key: str, blob: bytes, path: str) -> None:
    """Raises CheckpointError unless ``blob`` is the app state the marker lists under ``key``."""
    expected = manifest.app_digests.get(key)
    if expected is None or not hmac.compare_digest(digest_of(blob, like=expected), expected):
        raise CheckpointError(
            f"checkpoint {path!r} is refused: its {key} training state differs from its signed hash (it was "
            "changed while being read); nothing of it was unpickled. Check who else can write to the checkpoint "
            "directory, and restore again"
        )


# -- saving: signing what was hashed as DCP wrote it -------------------------------------


class SaveSigner:
    """Collects the hashes of one rank's files of one save, taken as DCP writes them, and signs their list.

    The hashing itself is done by the streams DCP writes through (``_checkpoint_writes``), which
    report each file to :meth:`record`.

    Args:
        store: The checkpoint root.
        name: The checkpoint's directory inside it (``step-0000000900``).
        rank: This rank.
        key: The signing key.
        app_digest: Digest of this rank's app-state blob.
    """

    def __init__(self, store: Store, name: str, rank: int, key: SigningKey, app_digest: str):
        self.store = store
        self.name = name
        self.rank = rank
        self.key = key
        self.app_digest = app_digest
        self._written: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()  # DCP writes files from several threads

    def record(self, name: str, size: int, digest: str) -> None:
        """A file of this save, written and hashed (called from DCP's writing threads)."""
        with self._lock:
            self._written[name] = (size, digest)

    def write_rank_files(self, results) -> None:
        """Signs and writes the list of the files DCP's ``write_data`` wrote (its results)."""
        self._write_rank_files(sorted({result.storage_data.relative_path for result in results}))

    def _digest(self, name: str) -> tuple[int, str]:
        with self._lock:
            found = self._written.get(name)
        if found is not None:
            return found
        # A file DCP wrote some other way than through its filesystem object: hashed back,
        # which leaves a moment in which a writer of the directory could change it first.
        logger.warning("%s/%s was not hashed as it was written; hashing it back", self.name, name)
        return digest_of_file(self.store, f"{self.name}/{name}")

    def _write_rank_files(self, names: list[str]) -> None:
        body = {
            "step": self.name,
            "rank": self.rank,
            "files": files_json({name: self._digest(name) for name in names}),
            "app_digest": self.app_digest,
        }
        data = {**body, "mac": _mac(self.key.key, _RANK_DOMAIN, body)}
        self.store.write_bytes(f"{self.name}/{RANK_FILES.format(rank=self.rank)}", json.dumps(data).encode())

    def manifest(self, world_size: int) -> Manifest:
        """On rank 0 once every rank's data and ``.metadata`` are written: the checkpoint's file list.

        Raises:
            CheckpointError: A rank's list is missing, or not signed with the key.
        """
        files: dict[str, tuple[int, str]] = {}
        app: dict[str, str] = {}
        for rank in range(world_size):
            rel = f"{self.name}/{RANK_FILES.format(rank=rank)}"
            try:
                data = json.loads(self.store.read_bytes(rel))
                body = {k: v for k, v in data.items() if k != "mac"}
                expected = _mac(self.key.key, _RANK_DOMAIN, body)
                valid = hmac.compare_digest(str(data.get("mac")).encode(), expected.encode())
                if not valid or data.get("step") != self.name or data.get("rank") != rank:
                    raise ValueError("its signature does not match")
                listed = _parse_files(data["files"])
                if not is_digest(data["app_digest"]):
                    raise ValueError("bad app-state digest")
            except (OSError, ValueError, TypeError, KeyError) as exc:
                raise CheckpointError(
                    f"cannot commit checkpoint {self.name!r}: the file list of rank {rank} ({rel}) is missing "
                    f"or invalid ({exc}); check who else writes to the checkpoint directory"
                ) from exc
            files.update(listed)
            app[f"rank{rank}"] = data["app_digest"]
        # DCP writes .metadata under a temporary name, then renames it.
        with self._lock:
            metadata = self._written.get(METADATA_NAME) or self._written.get(f"{METADATA_NAME}.tmp")
        files[METADATA_NAME] = metadata or self._digest(METADATA_NAME)
        return Manifest(files=files, app_digests=app, job_id=self.key.job_id)


# -- loading: checking what is read ------------------------------------------------------


class VerifyingFileSystem:
    """DCP's filesystem object of one reader, opening only the files a verified marker lists.

    ``.metadata`` is read once, whole, and its bytes are checked against the list before
    DCP unpickles them; data files were hashed whole before the load (:func:`check_files`),
    and what DCP unpickles from them is checked as it is read (:func:`weights_only_planner`,
    :func:`check_app_blob`).
    """

    def __init__(self, fs, manifest: Manifest, path: str):
        self._fs = fs
        self._manifest = manifest
        self._path = path
        self.refusal: CheckpointError | None = None  # DCP wraps what its reader raises: kept here too

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def _refuse(self, message: str) -> CheckpointError:
        self.refusal = self.refusal or CheckpointError(f"checkpoint {self._path!r} is refused: {message}")
        return self.refusal

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        name = os.path.basename(os.fspath(path))
        listed = self._manifest.files.get(name)
        if listed is None or "r" not in mode:
            raise self._refuse(
                f"reading it needs {name}, which its signed file list does not hold; nothing of it was unpickled"
            )
        if name != METADATA_NAME:
            with self._fs.create_stream(path, mode) as stream:
                yield stream
            return
        size, digest = listed
        with self._fs.create_stream(path, mode) as stream:
            data = stream.read(size + 1)  # one byte more tells a longer file
        if len(data) != size or not hmac.compare_digest(digest_of(data, like=digest), digest):
            raise self._refuse(
                f"its {METADATA_NAME} differs from its signed hash (it was changed while being read); nothing "
                "of it was unpickled. Check who else can write to the checkpoint directory, and load it again"
            )
        yield io.BytesIO(data)


def refusal_of(reader) -> CheckpointError | None:
    """Why a DCP reader made by ``reader_for`` with a manifest refused a file, if it did."""
    fs = getattr(reader, "fs", None)
    return fs.refusal if isinstance(fs, VerifyingFileSystem) else None


def weights_only_planner():
    """A DCP load planner that unpickles byte items with ``weights_only=True``: plain data only.

    DCP's own unpickles them with ``weights_only=False``; the Checkpointer's app blobs are
    bytes, which the restricted unpickler takes, and are then checked by their hash.
    """
    return _weights_only_planner_class()()


@functools.cache
def _weights_only_planner_class():
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            plain = torch.load(value, weights_only=True)
            # Handed on as a pickle of our own making, of plain data: safe for DCP's unpickler.
            repickled = io.BytesIO()
            torch.save(plain, repickled)
            repickled.seek(0)
            super().load_bytes(read_item, repickled)

    return WeightsOnlyLoadPlanner
