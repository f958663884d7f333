"""Which key signs the checkpoints of a directory, and which one a checkpoint must carry to load.

The key of a job's checkpoints is derived from the job key
(``derive_key(job_key, "checkpoints")``): it outlives attempts and gives nothing back about
the job key. Which one applies:

* **In a rank of a job** (the entrypoint holds the job key: ``current_job_key()``), the job's
  own, for every directory: a Checkpointer signs every checkpoint it saves and restores only
  checkpoints the job signed, never an unsigned one.
* **On the client**, the key of the job a checkpoint belongs to, from this user's keyring
  (``load_key``): the job its directory is named after (``<staging>/<job_id>/checkpoints``,
  the launcher's layout), else the job its marker names. A checkpoint whose marker names a
  job whose key is not here cannot be verified, and is refused.
* **Neither** (a plain ``torchrun`` run, a directory of one's own): no key. Checkpoints are
  written and read unsigned, as plain DCP ones, from directories the caller trusts.
"""

from __future__ import annotations

import os
import re

from sparkgpu import runtime
from sparkgpu.rundir.keyring import current_job_key, derive_key, load_key
from sparkgpu.errors import CheckpointError, ConfigurationError
from sparkgpu.train._checkpoint_signing import SigningKey

__all__ = ["PURPOSE", "rank_key", "keyring_key", "job_of", "signing_key", "required_key"]

PURPOSE = "checkpoints"  # the purpose the checkpoint key is derived for
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # also keeps a marker's claim out of other paths
_JOB_CHECKPOINTS = "checkpoints"  # <run dir or staging URL>/<job_id>/checkpoints


def rank_key() -> SigningKey | None:
    """The checkpoint key of the job this process is a rank of; ``None`` outside a rank."""
    job_key = current_job_key()
    if job_key is None:
        return None
    return SigningKey(derive_key(job_key, PURPOSE), runtime.job_id())


def keyring_key(job_id: str) -> SigningKey | None:
    """The checkpoint key of ``job_id`` from this user's keyring, ``None`` when it is not there."""
    if not _JOB_ID.fullmatch(job_id):
        return None
    try:
        job_key = load_key(job_id)
    except (ConfigurationError, OSError, ValueError):
        return None
    return SigningKey(derive_key(job_key, PURPOSE), job_id)


def job_of(directory: str) -> str | None:
    """The job whose checkpoint directory ``directory`` is, going by the launcher's layout."""
    parent, _, last = _normalized(directory).rpartition("/")
    if last != _JOB_CHECKPOINTS:
        return None
    job = parent.rpartition("/")[2]
    return job if _JOB_ID.fullmatch(job) else None


def signing_key(directory: str) -> SigningKey | None:
    """The key a Checkpointer on the checkpoint directory ``directory`` signs with and requires."""
    own = rank_key()
    if own is not None:
        return own
    job = job_of(directory)
    return keyring_key(job) if job is not None else None


def required_key(directory: str, claimed: str | None = None, path: str | None = None) -> SigningKey | None:
    """The key that checkpoints in the checkpoint directory ``directory`` must be signed
    with, ``None`` when they belong to no job.

    Args:
        directory: The checkpoint directory (``.../checkpoints``).
        claimed: The job that the marker of the checkpoint in question names.
        path: That checkpoint, for the message.

    Raises:
        CheckpointError: It belongs to a job whose key is not on this machine.
    """
    own = rank_key()
    job = job_of(directory)
    if own is not None and (
        (own.job_id is not None and own.job_id in (job, claimed))
        or _normalized(directory) == _normalized(runtime.checkpoint_dir() or "")
    ):
        return own
    found = keyring_key(job) if job is not None else None
    if found is not None:
        return found
    if claimed is None:
        return None
    found = keyring_key(claimed)
    if found is None:
        raise CheckpointError(
            f"checkpoint {path or directory!r} is refused: it is signed by job {claimed!r}, whose key is not on this machine, "
            "so it cannot be verified. Load or register it from the machine and user that launched that job "
            "(its key is in their $SPARKGPU_HOME/keys), or inside the job itself"
        )
    return found


def _normalized(directory: str) -> str:
    directory = os.fspath(directory)
    if directory.startswith("file://"):
        directory = directory[len("file://") :]
    if directory and "://" not in directory:
        directory = os.path.abspath(os.path.expanduser(directory))
    return directory.rstrip("/")
