"""Signed Lightning checkpoints: one ``.ckpt`` file and a MAC'd marker with its size and digest.

Lightning writes a checkpoint as one ``torch.save`` pickle from rank 0. Saving writes it, then
the marker ``<name>.ckpt.signed.json`` (the commit point): the file's size and digest under
``"signed"``, an HMAC-SHA256 of the marker under the job's checkpoint key under ``"mac"``
(the key of :mod:`._checkpoint_keys`, the hashing and MAC of :mod:`._checkpoint_signing`).
Loading checks the marker's MAC, reads the file once, checks those bytes against the marker
and unpickles exactly them: nothing unverified is unpickled. Where no key applies (outside a
job, a directory of one's own) the marker carries the hash unsigned.
"""

from __future__ import annotations

import hmac
import io
import json
from typing import Any

from sparkgpu import runtime
from sparkgpu.errors import CheckpointError
from sparkgpu.store import Store
from sparkgpu.train._checkpoint_keys import _normalized, rank_key, required_key, signing_key
from sparkgpu.train._checkpoint_signing import _mac, _parse_files
from sparkgpu.train._digests import digest_of, files_json

__all__ = ["MARKER_SUFFIX", "write_signed", "read_verified", "load_verified", "is_committed", "in_job_store", "split"]

MARKER_SUFFIX = ".signed.json"
_DOMAIN = b"sparkgpu lightning checkpoint\n"  # a DCP marker's MAC never passes for one of these


def split(path: str) -> tuple[Store, str]:
    """The store of a checkpoint's folder and the checkpoint's file name in it."""
    folder, _, name = str(path).rstrip("/").rpartition("/")
    return Store(folder or ".", what="the checkpoint folder"), name


def write_signed(path: str, data: bytes, extra: dict[str, Any]) -> None:
    """Writes the checkpoint ``data`` at ``path``, then its marker (signed where a key applies)."""
    store, name = split(path)
    store.write_bytes(name, data)
    key = signing_key(store.url)
    signed: dict[str, Any] = {
        "files": files_json({name: (len(data), digest_of(data))}),
        "job_id": None,
    }
    marker: dict[str, Any] = {**extra, "file": name, "signed": signed}
    if key is not None:
        signed["job_id"] = key.job_id
        marker["mac"] = _mac(key.key, _DOMAIN, marker)
    store.write_bytes(name + MARKER_SUFFIX, json.dumps(marker).encode(), fsync_folder=True)


def is_committed(path: str) -> bool:
    """Whether the checkpoint at ``path`` has its marker (its save finished)."""
    store, name = split(path)
    return store.exists(name + MARKER_SUFFIX)


def in_job_store(path: str) -> bool:
    """Whether ``path`` is inside this rank's job checkpoint store: only the job's own signed checkpoints load there."""
    root = runtime.checkpoint_dir()
    if not root:
        return False
    root, found = _normalized(root), _normalized(str(path))
    return found == root or found.startswith(root + "/")


def read_verified(path: str) -> bytes:
    """The bytes of the checkpoint at ``path``, checked against its marker before anyone unpickles them.

    Raises:
        CheckpointError: no marker (the save did not finish), a marker whose MAC does not match
            the job's key, an unsigned marker where the job's key applies, or a file that
            differs from the marker's hash.
    """
    store, name = split(path)

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path!r} is refused: {why}; nothing of it was unpickled. Check who else can "
            "write to the checkpoint directory, or resume from another checkpoint"
        )

    try:
        marker = json.loads(store.read_bytes(name + MARKER_SUFFIX))
        if not isinstance(marker, dict) or marker.get("file") != name:
            raise ValueError("it names another file")
        signed = marker.get("signed")
        claimed = signed.get("job_id") if isinstance(signed, dict) else None
        listed = _parse_files(signed.get("files") if isinstance(signed, dict) else None)
    except FileNotFoundError:
        raise refuse(f"it has no marker ({name}{MARKER_SUFFIX}): its save did not finish") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise refuse(f"its marker cannot be read ({exc})") from None
    key = required_key(store.url, claimed if isinstance(claimed, str) else None, path)
    if key is None and in_job_store(path):
        key = rank_key()  # an unsigned marker does not make a planted file in the job's store loadable
    if key is not None:
        mac = marker.get("mac")
        body = {k: v for k, v in marker.items() if k != "mac"}
        if not isinstance(mac, str):
            raise refuse("its marker is not signed, and the job's checkpoints must be")
        if not hmac.compare_digest(mac.encode(), _mac(key.key, _DOMAIN, body).encode()):
            raise refuse("the signature of its marker does not match the job's key")
    if name not in listed:
        raise refuse("its marker does not list it")
    size, digest = listed[name]
    data = store.read_bytes(name)
    if len(data) != size or not hmac.compare_digest(digest_of(data, like=digest), digest):
        raise refuse("it differs from the hash in its marker")
    return data


def load_verified(path: str, map_location=None) -> Any:
    """The checkpoint at ``path``, unpickled from bytes :func:`read_verified` checked."""
    import torch

    return torch.load(io.BytesIO(read_verified(path)), map_location=map_location, weights_only=False)
