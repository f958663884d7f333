"""Control files sealed under the job key: only the job's own processes can stop, cancel or fail it.

The run dir and the staging prefix can be written by more than the job: an S3 prefix shared by a
team, a folder on a shared file system. The files that make the job's processes act (a cancel
request, a stop request, a node's exit record, its end marker, node 0's state of the attempt,
the client's heartbeat) therefore carry a MAC under a key derived from the job key (:func:`seal`), over the
file's place in the run dir and its content. A reader (:func:`unseal`) obeys only a file whose
MAC holds; a forged or damaged one is ignored and reported once, in the log of the process that
found it. A copy of a genuine file in another place does not verify either (the place is in the
MAC); heartbeats carry a count that must grow
(:class:`~sparkgpu.launch.backends.spark.executor.channel.Heartbeat`; the beats between nodes,
:mod:`~sparkgpu.launch.backends.spark.executor.hub`), so that replaying an old beat keeps no dead node alive.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import threading

from sparkgpu.rundir.keyring import derive_key
from sparkgpu._util.report import report

__all__ = ["seal", "unseal", "mac", "pack_files", "unpack_files", "MAC_MARK"]

MAC_MARK = b"\n--sparkgpu-mac "
_forged_seen: set[tuple[str, bytes]] = set()
_lock = threading.Lock()


def mac(key: bytes, place: str, body: bytes) -> str:
    """The hex MAC of ``body`` under the job key, bound to ``place``: what :func:`seal` appends."""
    mac = hmac.new(derive_key(key, "control"), place.encode() + b"\0", hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


def seal(key: bytes, place: str, body: bytes) -> bytes:
    """``body`` followed by its MAC under the job key, bound to ``place`` (the file's name in the run dir)."""
    return body + MAC_MARK + mac(key, place, body).encode() + b"\n"


def unseal(key: bytes | None, place: str, sealed: bytes) -> bytes | None:
    """The body of a file :func:`seal` wrote for ``place``, or ``None`` when its MAC does not hold.

    A file that does not verify is to be treated as absent. It is reported (where
    :func:`sparkgpu._util.report.report` writes: the job's console on the client, the agent's or
    rank's log on a worker) once per job (its key) and place: the jobs one client runs share
    place names, and a writer that changes the file at every poll adds no line.

    Args:
        key: The job key; without it nothing verifies.
        place: The file's name relative to the run dir (:class:`~sparkgpu.rundir.layout.RunLayout`).
        sealed: The file's bytes.
    """
    body, mark, given = sealed.rpartition(MAC_MARK)
    if key and mark and hmac.compare_digest(given.strip(), mac(key, place, body).encode()):
        return body
    seen = (place, hashlib.blake2b(key or b"", digest_size=16).digest())  # the job, not its key
    with _lock:
        first = seen not in _forged_seen
        _forged_seen.add(seen)
    if first:
        why = "no job key to check it with" if not key else "not signed with the job's key (forged or damaged)"
        report(f"ignoring the control file {place}: {why}")
    return None


def pack_files(files: dict[str, bytes]) -> dict[str, str]:
    """Sealed control files as JSON text (base64), by name in the run dir: how they travel together,
    in the client's control object and in node 0's answers to the other nodes."""
    return {rel: base64.b64encode(data).decode() for rel, data in files.items()}


def unpack_files(packed: object) -> tuple[dict[str, bytes], list[str]]:
    """The files :func:`pack_files` packed, and the names of the entries that were not base64
    (skipped). The files are still sealed: whoever reads them checks them."""
    files: dict[str, bytes] = {}
    malformed: list[str] = []
    for rel, text in packed.items() if isinstance(packed, dict) else ():
        try:
            files[str(rel)] = base64.b64decode(text, validate=True)
        except (ValueError, TypeError):
            malformed.append(str(rel))
    return files, malformed
