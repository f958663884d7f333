"""Secrets of a job: read on the client, sealed under the job key, held in the ranks' memory.

A job file names its secrets (an ``air run`` workload's ``secrets: {HF_TOKEN: my_scope/hf_token}``);
each value is read on the client, when the file is read, from a file of the user's own:
``$SPARKGPU_SECRETS_DIR/<scope>/<key>`` (by default ``$SPARKGPU_HOME/secrets/<scope>/<key>``),
which must be readable by its owner only (mode 0600 or stricter). The values then travel the way
the job's payload does, encrypted (AES-256-GCM, from ``cryptography``) under a key derived from
the job key (:func:`seal`): the run dir, a staging store and the payload hold only ciphertext. Each rank decrypts them with the job
key it already holds in memory (:func:`sparkgpu.rundir.keyring.current_job_key`) and keeps them there;
the script reads one with :func:`sparkgpu.runtime.secret`.

A value is never put in a rank's environment (``/proc/<pid>/environ`` is readable by every
process of the user for as long as the job runs, and children inherit it), a command line, a log
or a file of the run dir.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from pathlib import Path
from typing import Mapping

from sparkgpu.errors import ConfigurationError, SparkGPUError

__all__ = ["SECRETS_DIR_ENV", "SecretRef", "parse_secret_refs", "read_secrets", "seal", "unseal", "hold", "secret"]

SECRETS_DIR_ENV = "SPARKGPU_SECRETS_DIR"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PART = re.compile(r"[A-Za-z0-9_.@+-]+")  # one path segment: no '/', no '..' alone (checked below)
_NONCE = 12  # AES-GCM's standard nonce
_CONTEXT = b"sparkgpu job secrets"  # authenticated with the values: a sealed blob of another kind does not open

_held: dict[str, str] = {}
_held_lock = threading.Lock()


class SecretRef(tuple):
    """A secret's ``(scope, key)``, as ``"scope/key"`` names it."""

    __slots__ = ()

    def __new__(cls, scope: str, key: str):
        return super().__new__(cls, (scope, key))

    @property
    def scope(self) -> str:
        return self[0]

    @property
    def key(self) -> str:
        return self[1]

    def __str__(self) -> str:
        return f"{self[0]}/{self[1]}"


def secrets_dir() -> Path:
    """Where secret files are read from: ``$SPARKGPU_SECRETS_DIR``, else ``$SPARKGPU_HOME/secrets``."""
    from sparkgpu.config import settings

    raw = os.environ.get(SECRETS_DIR_ENV)
    return Path(raw).expanduser() if raw else settings().home / "secrets"


def parse_secret_refs(value, source: str, field: str = "secrets") -> dict[str, SecretRef]:
    """The secrets a job file names: ``{NAME: "scope/key"}`` -> ``{NAME: SecretRef}``.

    Raises:
        ConfigurationError: not a mapping of names to ``scope/key`` references.
    """
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{source}: {field} must be a mapping of names to 'scope/key' references, "
            f"e.g. {{HF_TOKEN: my_scope/hf_token}}, got {value!r}"
        )
    refs: dict[str, SecretRef] = {}
    for name, ref in value.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigurationError(f"{source}: {field}: {name!r} is not a name such as HF_TOKEN")
        parts = ref.split("/") if isinstance(ref, str) else []
        if len(parts) != 2 or not all(_PART.fullmatch(p) and p not in (".", "..") for p in parts):
            raise ConfigurationError(
                f"{source}: {field}.{name} must be 'scope/key' (exactly one '/', no spaces), got {ref!r}"
            )
        refs[name] = SecretRef(parts[0], parts[1])
    return refs


def read_secrets(refs: Mapping[str, SecretRef], source: str) -> dict[str, str]:
    """Each secret's value, read from its file under :func:`secrets_dir`.

    Raises:
        ConfigurationError: a file is missing, not the user's, or readable by others; names the
            file and the command that fixes it. No value is ever part of a message.
    """
    root = secrets_dir()
    values: dict[str, str] = {}
    for name, ref in refs.items():
        path = root / ref.scope / ref.key
        try:
            # O_NOFOLLOW: the mode checked below is the file's own, not a link's target elsewhere.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise ConfigurationError(
                f"{source}: secret {name} ({ref}) has no file {str(path)!r}; write it there, readable by you only: "
                f"mkdir -p -m 700 {path.parent} && (umask 077; cat > {path}) (or set {SECRETS_DIR_ENV})"
            ) from None
        except OSError as exc:
            raise ConfigurationError(
                f"{source}: cannot read secret {name} ({ref}) from {str(path)!r} ({exc.strerror})"
            ) from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ConfigurationError(f"{source}: secret {name} ({ref}): {str(path)!r} is not a plain file")
            if info.st_mode & 0o077:
                raise ConfigurationError(
                    f"{source}: secret {name} ({ref}): {str(path)!r} is readable by others "
                    f"(mode {stat.S_IMODE(info.st_mode):04o}); make it yours only: chmod 600 {path}"
                )
            if hasattr(os, "getuid") and info.st_uid != os.getuid():
                raise ConfigurationError(f"{source}: secret {name} ({ref}): {str(path)!r} belongs to another user")
            raw = f.read()
        try:
            values[name] = raw.decode().rstrip("\r\n")  # `echo value > file` adds a newline
        except UnicodeDecodeError:
            raise ConfigurationError(f"{source}: secret {name} ({ref}): {str(path)!r} is not UTF-8 text") from None
    return values


def _cipher(job_key: bytes):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from sparkgpu.rundir.keyring import derive_key

    return AESGCM(derive_key(job_key, "secrets encryption"))


def seal(job_key: bytes, values: Mapping[str, str]) -> bytes:
    """``values`` encrypted and authenticated (AES-256-GCM) under a key derived from the job key."""
    nonce = os.urandom(_NONCE)
    return nonce + _cipher(job_key).encrypt(nonce, json.dumps(dict(values)).encode(), _CONTEXT)


def unseal(job_key: bytes | None, sealed: bytes) -> dict[str, str]:
    """The values :func:`seal` sealed.

    Raises:
        SparkGPUError: no job key here (not a rank of the job), or the sealed bytes were changed.
    """
    from cryptography.exceptions import InvalidTag

    if not job_key:
        raise SparkGPUError("the job's secrets can be opened only in a rank of the job, which holds its key")
    try:
        plain = _cipher(job_key).decrypt(sealed[:_NONCE], sealed[_NONCE:], _CONTEXT)
    except (InvalidTag, ValueError):  # changed bytes, or too few to hold a nonce and a tag
        raise SparkGPUError(
            "the job's sealed secrets do not verify under its key; they were changed on the way"
        ) from None
    return json.loads(plain)


def hold(values: Mapping[str, str]) -> None:
    """Keeps this rank's secrets in its memory, for :func:`secret`."""
    with _held_lock:
        _held.clear()
        _held.update(values)


def secret(name: str) -> str:
    """The value of the job's secret ``name`` (its name in the job file, e.g. ``"HF_TOKEN"``).

    Raises:
        KeyError: the job has no such secret; the message lists the ones it has.
    """
    with _held_lock:
        if name in _held:
            return _held[name]
        known = sorted(_held)
    raise KeyError(
        f"the job has no secret {name!r}; "
        + (f"it has: {', '.join(known)}" if known else "its job file names none (`secrets:`)")
    )
