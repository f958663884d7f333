"""Idempotency keys: a submission with a key this user already used returns that job, not a new one.

A key is claimed once, by the first submission that finished writing its job: a file in the
user's private keyring folder (``$SPARKGPU_HOME/idempotency/<sha256 of the key>``, mode 0600)
holding the job id, linked into place so that of two racing submissions exactly one wins; the
other discards the job it wrote (nothing of it started) and returns the winner's. A claim whose
job's run dir is gone (pruned by ``SPARKGPU_KEEP_RUNS``, removed by hand) no longer holds.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from sparkgpu._util.files import atomic_write_bytes, temporary_name
from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError

__all__ = ["claim_key", "claimed_job"]

_FOLDER = "idempotency"  # under $SPARKGPU_HOME


def _claim_file(key: str) -> Path:
    if not isinstance(key, str) or not key.strip():
        raise ConfigurationError(f"idempotency_key must be a non-empty string, got {key!r}")
    folder = settings().home / _FOLDER
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder / hashlib.sha256(key.encode()).hexdigest()


def claimed_job(key: str) -> str | None:
    """The job that claimed ``key`` and whose run dir still exists; ``None`` if none did."""
    path = _claim_file(key)
    try:
        job_id = path.read_text().strip()
    except FileNotFoundError:
        return None
    if job_id and (settings().staging_root / job_id).is_dir():
        return job_id
    path.unlink(missing_ok=True)  # that job is gone: the key is free again
    return None


def claim_key(key: str, job_id: str) -> str:
    """Claims ``key`` for ``job_id``; returns the job that holds it now (``job_id``, or an earlier one)."""
    path = _claim_file(key)
    temporary = Path(temporary_name(path))
    atomic_write_bytes(temporary, job_id.encode(), mode=0o600)
    try:
        while True:
            try:
                os.link(temporary, path)
                return job_id
            except FileExistsError:
                holder = claimed_job(key)  # drops a claim whose job is gone, then the loop claims it
                if holder is not None:
                    return holder
    finally:
        temporary.unlink()
