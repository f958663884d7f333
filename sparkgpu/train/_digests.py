"""The digest that vouches for each byte of a signed checkpoint: BLAKE3, named in every digest.

A digest is written ``"<algorithm>:<hex>"``. New checkpoints use BLAKE3: it is a cryptographic
hash like SHA-256 at a fraction of its CPU time on one core (``bench_checkpoint.py`` measures
both, ``hash_cpu_seconds``), and a save hashes every byte beside its write. Checkpoints signed before BLAKE3 list bare SHA-256 hex digests; they are read as
``"sha256:<hex>"`` and still verify. Which algorithm applies is part of what the marker's MAC
covers, so no writer of the checkpoint can choose it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol, TypeGuard

import blake3

__all__ = [
    "ALGORITHM",
    "Hasher",
    "new_hasher",
    "finish",
    "digest_of",
    "is_digest",
    "file_entry",
    "files_json",
    "parse_file_entry",
]

_BLAKE3 = "blake3"
_LEGACY = "sha256"
ALGORITHM = _BLAKE3  # what new digests are made with
_HEX = frozenset("0123456789abcdef")


class Hasher(Protocol):
    @property
    def name(self) -> str: ...

    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(like: str | None = None) -> Hasher:
    """A running hash: of the algorithm of the digest ``like`` (one to compare with), else BLAKE3.

    ``hashlib`` and ``blake3`` both release the GIL while they hash a large buffer.
    """
    algorithm = ALGORITHM if like is None else like.partition(":")[0]
    if algorithm == _BLAKE3:
        return blake3.blake3(max_threads=1)  # one core: the write beside it needs the other
    if algorithm == _LEGACY:
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def finish(hasher: Hasher) -> str:
    """The digest of what ``hasher`` read, named by its algorithm."""
    return f"{hasher.name}:{hasher.hexdigest()}"


def digest_of(data: Any, like: str | None = None) -> str:
    """The digest of the bytes ``data`` (in the algorithm of ``like``, when given)."""
    hasher = new_hasher(like)
    hasher.update(data)
    return finish(hasher)


def is_digest(value: Any) -> TypeGuard[str]:
    """Whether ``value`` is a digest this module writes or reads."""
    if not isinstance(value, str):
        return False
    algorithm, _, hexdigest = value.partition(":")
    return algorithm in (_BLAKE3, _LEGACY) and len(hexdigest) == 64 and set(hexdigest) <= _HEX


def file_entry(size: int, digest: str) -> dict[str, Any]:
    """How a marker lists one file."""
    return {"size": size, "digest": digest}


def files_json(files: dict[str, tuple[int, str]]) -> dict[str, dict[str, Any]]:
    """How a marker lists files: ``name -> (size, digest)`` as :func:`file_entry` each, sorted by name."""
    return {name: file_entry(size, digest) for name, (size, digest) in sorted(files.items())}


def parse_file_entry(entry: Any) -> tuple[int, str]:
    """``(size, digest)`` of a listed file; a bare ``"sha256"`` of an older marker is named as such.

    Raises:
        ValueError: The entry is not one :func:`file_entry` (or an older marker) writes.
    """
    if not isinstance(entry, dict):
        raise ValueError("not an entry")
    size = entry.get("size")
    digest = entry.get("digest")
    if digest is None and isinstance(entry.get(_LEGACY), str):
        digest = f"{_LEGACY}:{entry[_LEGACY]}"
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not is_digest(digest):
        raise ValueError("bad size or digest")
    return size, digest
