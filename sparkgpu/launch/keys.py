"""Job signing keys, kept on the client only.

A job's key signs its payload; workers get it through their environment. The run dir may be
on shared storage, so the key is never written there. To let ``sparkgpu resume`` continue a
job after the client process died, the key is also kept in the user's private keyring
(``$SPARKGPU_HOME/keys/<job_id>``, mode 0600).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError

__all__ = ["new_key", "save_key", "load_key", "rank_secrets", "RAY_TOKEN_ENV"]

# A secret derived from the job key that the ranks keep (they never see the key itself).
RAY_TOKEN_ENV = "SPARKGPU_RAY_TOKEN"


def _keyring() -> Path:
    path = settings().home / "keys"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


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


def rank_secrets(key: bytes) -> dict[str, str]:
    """Secrets derived from the job key that its ranks may hold, as environment variables.

    ``SPARKGPU_RAY_TOKEN``: the token of the Ray cluster a ``@ray_launch`` job starts, so that
    only the job's own processes get into it. Knowing it gives no way back to the key.
    """
    import hashlib
    import hmac

    return {RAY_TOKEN_ENV: hmac.new(key, b"sparkgpu ray token", hashlib.sha256).hexdigest()}
