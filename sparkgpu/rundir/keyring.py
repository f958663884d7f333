"""The user's job keys: made on the client, kept in a private keyring, held by a job's ranks.

A job's key signs its payload, its ranks' results, its control files and its checkpoints (each
with a key derived for that purpose, :func:`derive_key`). To let ``sparkgpu resume`` continue a
job after the client process died, the key is kept in the user's private keyring
(``$SPARKGPU_HOME/keys/<job_id>``, mode 0600). A rank holds its job's key in memory once its
entrypoint took it (:func:`current_job_key`); how it gets there without passing through an
environment is :mod:`sparkgpu.rundir.key_handover`'s.

Below every sub-package: the launcher, checkpoints and tracking all use it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError

__all__ = [
    "new_key",
    "save_key",
    "load_key",
    "key_file",
    "forget_key",
    "derive_key",
    "hold_job_key",
    "current_job_key",
]

KEYRING_DIR = "keys"  # under $SPARKGPU_HOME

# The key of the job this process is a rank of, once the entrypoint took it (never from the environment).
_held: bytes | None = None


def _keyring() -> Path:
    path = settings().home / KEYRING_DIR
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def key_file(job_id: str, home: Path | None = None) -> Path:
    """Where the key of ``job_id`` is kept, in the keyring under ``home`` (``$SPARKGPU_HOME``)."""
    return (home or settings().home) / KEYRING_DIR / job_id


def forget_key(job_id: str, home: Path | None = None) -> None:
    """Removes the key of ``job_id`` from the keyring (once its run dir is gone)."""
    key_file(job_id, home).unlink(missing_ok=True)


def new_key() -> bytes:
    return secrets.token_bytes(32)


def save_key(job_id: str, key: bytes) -> None:
    path = _keyring() / job_id
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())


def load_key(job_id: str) -> bytes:
    """The key of a job launched from this machine.

    Raises:
        ConfigurationError: the job was launched elsewhere (or its key was deleted).
    """
    try:
        return bytes.fromhex((_keyring() / job_id).read_text().strip())
    except FileNotFoundError:
        raise ConfigurationError(
            f"no signing key for job {job_id} on this machine; resume it from the machine (and user) "
            "that launched it, or launch it again"
        ) from None


def derive_key(key: bytes, purpose: str) -> bytes:
    """A key for one purpose (``"checkpoints"``, ``"control"``, ...) that gives no way back to the job key."""
    return hmac.new(key, f"sparkgpu {purpose}".encode(), hashlib.sha256).digest()


def hold_job_key(key: bytes | None) -> None:
    """Keeps the job key for this rank's own use (:func:`current_job_key`); the entrypoint calls it."""
    global _held
    _held = key or None


def current_job_key() -> bytes | None:
    """The key of the job this process runs a rank of, or ``None`` outside a sparkgpu rank."""
    return _held
