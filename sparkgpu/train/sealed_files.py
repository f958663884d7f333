"""Folders of files sealed into a job's checkpoint store: copied, hashed, listed in a MAC'd marker.

A framework that saves checkpoints in its own format (a Hugging Face ``Trainer``'s
``checkpoint-N`` folders, whose optimizer, scheduler and RNG files are unpickled on load) gets
the same guarantee as :class:`~sparkgpu.train.Checkpointer`: a writer of the store can neither
plant a checkpoint nor change one. Layout in the store::

    <store>/checkpoint-<N>/<the framework's files, sub-folders included>
    <store>/checkpoint-<N>/_SEALED.json     {"format", "step", "signed": {"files", "job_id"}, "mac"}

Files are copied first and hashed; the marker, written last, makes the folder count. Nothing needs to be flushed to disk for that:
a file that a crash left short or empty fails its hash on restore, and the next older checkpoint
is used. Restoring copies every file back to a local folder, hashing the very
bytes it writes, so what the framework then unpickles is what the job sealed. The key is the
one Checkpointer uses (``derive_key(job_key, "checkpoints")``), under a domain of its own, so
a marker of one kind never passes for the other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import shutil
from typing import Any

from sparkgpu.errors import CheckpointError
from sparkgpu.store import Store
from sparkgpu.train._checkpoint_keys import keyring_key, rank_key
from sparkgpu.train._checkpoint_signing import SigningKey
from sparkgpu.train._digests import files_json, finish, new_hasher, parse_file_entry

__all__ = [
    "SEALED_MARKER",
    "TRAINER_FOLDER",
    "SealedFolder",
    "sealed_name",
    "step_of",
    "copy_hashed",
    "write_marker",
    "read_marker",
    "restore_folder",
    "sealed_folders",
    "latest_sealed",
    "job_key_for_sealing",
    "client_key",
]

logger = logging.getLogger(__name__)

SEALED_MARKER = "_SEALED.json"
TRAINER_FOLDER = "hf"  # <checkpoint_dir>/hf: a Trainer's sealed checkpoints, beside Checkpointer's step-N
FORMAT_VERSION = 1
_DOMAIN = b"sparkgpu sealed folder\n"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 8 << 20

SealedFolder = dict  # rel path -> (size, digest), the files a marker vouches for


def sealed_name(step: int) -> str:
    """The folder of the checkpoint at ``step`` (the Trainer's own name, ``checkpoint-<step>``)."""
    return f"checkpoint-{step}"


def step_of(name: str) -> int | None:
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def job_key_for_sealing() -> SigningKey | None:
    """The key of the job this process is a rank of (``None`` outside a job)."""
    return rank_key()


def client_key(job_id: str) -> SigningKey | None:
    """The key of ``job_id`` from this user's keyring, for the client to read its checkpoints."""
    return keyring_key(job_id)


def _safe_rel(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def _mac(key: bytes, body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hmac.new(key, _DOMAIN + canonical.encode(), hashlib.sha256).hexdigest()


def copy_hashed(local: str | os.PathLike, store: Store, rel: str) -> tuple[int, str]:
    """Copies the local file ``local`` to ``rel`` in ``store``; returns its size and digest.

    A copy, never a hard link: the framework may write the same path again (a step saved anew
    after a restart), and a link would carry that write into the sealed file.

    Args:
        local: The file.
        store: The checkpoint store.
        rel: Its name there.
    """
    digest = new_hasher()
    size = 0
    with open(local, "rb", buffering=0) as src, store.writer(rel) as dst:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            size += len(chunk)
    return size, finish(digest)


def write_marker(store: Store, name: str, step: int, files: SealedFolder, key: SigningKey) -> None:
    """Seals ``name`` in ``store``: its marker lists ``files`` under a MAC by ``key``."""
    signed = {
        "files": files_json(files),
        "job_id": key.job_id,
    }
    body = {"format": FORMAT_VERSION, "step": step, "signed": signed}
    marker = {**body, "mac": _mac(key.key, body)}
    store.write_bytes(f"{name}/{SEALED_MARKER}", json.dumps(marker, indent=1).encode(), fsync_folder=True)


def read_marker(store: Store, name: str, key: SigningKey) -> tuple[int, SealedFolder]:
    """The step and file list of the sealed folder ``name``, once its marker's MAC checks out.

    Raises:
        CheckpointError: No marker, not valid JSON, a MAC that does not match, or a
            malformed list; the message says which.
    """
    try:
        data = json.loads(store.read_bytes(f"{name}/{SEALED_MARKER}"))
    except FileNotFoundError:
        raise CheckpointError("it has no seal (its save never finished, or it was not written by the job)") from None
    except ValueError:
        raise CheckpointError("its seal is not valid JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("mac"), str):
        raise CheckpointError("its seal is not signed")
    body = {k: v for k, v in data.items() if k != "mac"}
    try:
        expected = _mac(key.key, body)
    except (TypeError, ValueError):
        expected = ""
    if not hmac.compare_digest(data["mac"].encode(), expected.encode()):
        raise CheckpointError("the signature of its seal does not match the job's key")
    step, signed = body.get("step"), body.get("signed")
    if not isinstance(step, int) or step_of(name) != step or not isinstance(signed, dict):
        raise CheckpointError("its seal names another step")
    files: SealedFolder = {}
    for rel, entry in (signed.get("files") or {}).items():
        try:
            if not _safe_rel(rel):
                raise ValueError("not a path inside the folder")
            files[rel] = parse_file_entry(entry)
        except ValueError:
            raise CheckpointError(f"its seal lists a bad entry {rel!r}") from None
    return step, files


def restore_folder(store: Store, name: str, files: SealedFolder, local: str | os.PathLike) -> None:
    """Copies the sealed files ``files`` of ``name`` into the local folder ``local``, each checked.

    Every file is hashed from the bytes written locally, so nothing unpickled later can differ
    from what the seal lists. ``local`` is replaced: it ends holding exactly ``files``.

    Raises:
        CheckpointError: A file is missing or differs from the seal; ``local`` is removed.
    """
    local = os.fspath(local)
    staging = f"{local}.restoring-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for rel, (size, expected) in files.items():
            target = os.path.join(staging, *rel.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            digest, written = new_hasher(like=expected), 0
            with open(target, "wb") as out:
                for chunk in _read_chunks(store, f"{name}/{rel}", size):
                    digest.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
            if written != size or not hmac.compare_digest(finish(digest), expected):
                raise CheckpointError(f"its file {rel!r} differs from the one the job sealed")
        shutil.rmtree(local, ignore_errors=True)
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        os.rename(staging, local)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _read_chunks(store: Store, rel: str, size: int):
    try:
        if store.is_local:
            with open(store.path(rel), "rb", buffering=0) as f:
                # One byte past the listed size shows a file that grew.
                while chunk := f.read(min(_CHUNK, size + 1)):
                    yield chunk
                    size -= len(chunk)
                    if size < 0:
                        return
            return
        offset, total = 0, store.size(rel)
        while offset < total:
            chunk = store.read_bytes(rel, offset, min(offset + _CHUNK, total))
            if not chunk:
                return
            yield chunk
            offset += len(chunk)
    except FileNotFoundError:
        raise CheckpointError(f"its file {rel!r} is missing") from None


def sealed_folders(store: Store) -> list[tuple[int, str]]:
    """``(step, name)`` of every folder that looks like a sealed checkpoint, newest first (unverified)."""
    found = [(step, name) for name in store.listdir() if (step := step_of(name)) is not None]
    return sorted(found, reverse=True)


def latest_sealed(store: Store, key: SigningKey) -> tuple[int, str, SealedFolder] | None:
    """The newest folder whose seal verifies under ``key`` (its files are checked on restore).

    Folders whose seal fails are skipped with a warning: a crash between the files and the
    marker leaves one, and so does a writer of the store who is not the job.
    """
    for step, name in sealed_folders(store):
        try:
            _, files = read_marker(store, name, key)
        except CheckpointError as exc:
            logger.warning("checkpoint %s is skipped: %s", store.path(name), exc)
            continue
        return step, name, files
    return None
