"""Job signing keys: made on the client, handed to a job's processes without leaving a trace.

The keyring itself (making, keeping and loading keys, per-purpose keys) is
:mod:`sparkgpu.rundir.keyring`'s. A job's key signs its payload, its ranks' results, its control files
and its checkpoints. The run dir may be on
shared storage, so the key is never written there, and it is never put in a process's
environment or command line, which any process of the same user can read
(``/proc/<pid>/environ``, ``ps e``) for as long as the job runs:

- a node agent reads it from the first line of its stdin, a pipe from its launcher
  (:func:`send_key`, :func:`receive_key`), and makes itself undumpable first
  (:func:`make_undumpable`), so that its memory and descriptors are root's to read;
- the agent hands each rank a file of its own, 0600 in a fresh 0700 folder on local disk, that
  the rank's ``_air.py`` reads and removes before anything else runs (:func:`hand_to_ranks`);
  a rank forked by a warm pool gets it in memory instead. A folder is named by the process
  that made it; one left by a process that no longer runs (an agent SIGKILLed before its
  attempt ended, with the files of ranks that never started) is removed by the next
  :func:`hand_to_ranks` of the same user on that machine (:func:`remove_stale_key_folders`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


__all__ = [
    "rank_secrets",
    "send_key",
    "receive_key",
    "hand_to_ranks",
    "remove_stale_key_folders",
    "make_undumpable",
    "KEY_DIR_ENV",
    "RANK_KEY_FILE",
]

# Names the generated ``_air.py`` reads with the standard library alone (RunLayout has the rest).
KEY_DIR_ENV = "SPARKGPU_JOB_KEY_DIR"
RANK_KEY_FILE = "rank-{local_rank}"
#: A key folder's name: the process that made it, then mkdtemp's random part.
_FOLDER_PREFIX = "sparkgpu-key-{pid}-"
_CLOCK_MARGIN_S = 30.0
#: Seconds a key folder is left alone whoever made it: its ranks take their files within seconds
#: of the hand-off, so a folder this old holds only the files of ranks that never started, even
#: where the temp folder is shared with processes of another pid namespace (a container's).
_MIN_AGE_S = 600.0


def rank_secrets(key: bytes, environ) -> dict[str, str]:
    """Secrets derived from the job key that its ranks hold, as environment variables to set.

    Ray's token authentication (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``): Ray listens on the
    host's external address whatever it is told, so a Ray cluster started inside a job
    (``@ray_launch``, ``ray.init()`` in a rank) admits only the job's own processes. Ray reads
    these once, when it is imported, so they are in place before any rank starts. The token
    gives no way back to the key; a Ray setting the user made is kept.

    Args:
        key: The job key.
        environ: The environment the ranks inherit.
    """
    import hashlib
    import hmac

    if environ.get("RAY_AUTH_MODE") or environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH"):
        return {}
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": hmac.new(key, b"sparkgpu ray token", hashlib.sha256).hexdigest(),
    }


def send_key(stream: IO[bytes], key: bytes) -> None:
    """Writes ``key`` as the first line of a node agent's stdin (:func:`receive_key` reads it)."""
    stream.write(key.hex().encode() + b"\n")
    stream.flush()


def receive_key(stream: IO[str]) -> bytes | None:
    """The key :func:`send_key` wrote, or ``None`` when the launcher sent none (end of input)."""
    line = stream.readline().strip()
    try:
        return bytes.fromhex(line) or None
    except ValueError:
        return None


def hand_to_ranks(key: bytes, local_ranks: int) -> Path:
    """Writes one key file per local rank, 0600 in a new 0700 folder on local disk; returns the folder.

    Each rank's ``_air.py`` reads its own file (:data:`RANK_KEY_FILE`) and removes it; the
    launcher removes the folder, with the files of ranks that never started, when the attempt
    ends. The folder is named to the ranks in :data:`KEY_DIR_ENV`: a name, not the key. Folders
    that processes of this user left behind when they were killed are removed first
    (:func:`remove_stale_key_folders`).
    """
    remove_stale_key_folders()
    folder = Path(tempfile.mkdtemp(prefix=_FOLDER_PREFIX.format(pid=os.getpid())))  # 0700, as mkdtemp makes them
    for local_rank in range(local_ranks):
        path = folder / RANK_KEY_FILE.format(local_rank=local_rank)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex())
    return folder


def remove_stale_key_folders(root: str | Path | None = None) -> list[Path]:
    """Removes this user's key folders in ``root`` (the temp folder) whose maker no longer runs.

    A folder's maker is the pid in its name; it no longer runs when no process has that pid, or
    when the process that has it started after the folder was made (the pid was reused). Folders
    of other users, of running processes, and any younger than ten minutes are left alone.
    Returns the folders removed.
    """
    root = Path(root or tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        pid = _maker_pid(entry.name)
        if pid is None:
            continue
        try:
            made = entry.stat(follow_symlinks=False)
        except OSError:  # removed meanwhile
            continue
        if made.st_uid != uid or not entry.is_dir(follow_symlinks=False) or time.time() - made.st_ctime < _MIN_AGE_S:
            continue
        if _runs_since(pid, made.st_ctime):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)  # a concurrent sweep may remove it first
        if not os.path.exists(entry.path):
            removed.append(Path(entry.path))
            log.info("removed the key folder %s left by process %d, which no longer runs", entry.path, pid)
    return removed


def _maker_pid(name: str) -> int | None:
    prefix = _FOLDER_PREFIX.split("{")[0]
    digits, dash, _ = name[len(prefix) :].partition("-")
    return int(digits) if name.startswith(prefix) and dash and digits.isdigit() else None


def _runs_since(pid: int, made: float) -> bool:
    """Whether the process ``pid`` runs and started before ``made`` (an epoch second), so it may have made it."""
    if not os.path.exists("/proc/self/stat"):  # no /proc (not Linux): alive is all that can be known
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    # Boot time is whole seconds and the wall clock may be stepped after boot: a pid reused within
    # this margin keeps the folder until a later sweep, and a running maker is never taken for gone.
    return started <= made + _CLOCK_MARGIN_S


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return time.time() - time.monotonic()


def make_undumpable(undumpable: bool = True) -> bool:
    """Marks this process undumpable (``PR_SET_DUMPABLE`` 0): its ``/proc`` files (memory, open
    descriptors, environment) become root's, so other processes of the same user cannot read
    the key it holds. A fork inherits the mark; ``undumpable=False`` lifts it (a forked rank,
    which debuggers of its user may attach to as to any other rank). Returns whether it could
    (Linux only)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    # The interpreter's own symbols include libc's: find_library would run ldconfig in a subprocess.
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_dumpable = 4
    return libc.prctl(pr_set_dumpable, 0 if undumpable else 1, 0, 0, 0) == 0
