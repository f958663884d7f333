"""Bringing one shard from the volume into the cache: download, verify, decompress, place.

A shard becomes visible under its final name only by an atomic rename, after its size and
(when the index has them) hash were checked. Until then it lives in the cache's ``partial``
folder under a name that says which host and process writes it, so a crashed writer's
leftovers can be recognised and removed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import threading
import uuid
from pathlib import Path

from sparkgpu._util.process import pid_gone
from sparkgpu.data.mds.reader import ShardInfo
from sparkgpu.data.storage.volume import Volume
from sparkgpu.errors import DataError, MissingDependencyError

__all__ = ["fetch_shard", "partial_token", "is_stale_partial", "ShardCorrupt"]

# Fastest first: verifying one hash is enough to catch a damaged transfer.
_HASH_PREFERENCE = ("xxh3_64", "xxh64", "xxh128", "xxh3_128", "xxh32", "md5", "sha1", "sha256", "sha512")
_CHUNK = 8 << 20
_HOST = socket.gethostname().replace(".", "_")


class ShardCorrupt(Exception):
    """A downloaded file failed its size or hash check (internal; retried, then a DataError)."""


def partial_token() -> str:
    """A name part unique to this host, process and call: ``host.pid.random``."""
    return f"{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def is_stale_partial(name: str) -> bool:
    """True for a partial file written by a process of this host that is no longer alive."""
    parts = name.split(".")
    if len(parts) < 4 or parts[1] != _HOST:
        return False
    try:
        pid = int(parts[2])
    except ValueError:
        return False
    return pid_gone(pid)


def fetch_shard(
    volume: Volume, info: ShardInfo, final_path: Path, partial_stem: Path, parts=None, priority: float = 0.0
) -> None:
    """Downloads one shard to ``final_path``, verified, decompressed, placed atomically.

    A file that fails its check is fetched once more; a second failure is reported.

    Args:
        volume: Where the shard comes from.
        info: The shard's index entry.
        final_path: Where the uncompressed shard must appear.
        partial_stem: Path prefix for the temporary files (``.zip`` / ``.raw`` are appended).
        parts: Thread pool for byte-range downloads (see :meth:`Volume.download`), or ``None``.
        priority: How urgent its ranges are on ``parts``: the step at which it is first needed.

    Raises:
        DataError: The shard failed its check twice, or cannot be downloaded.
    """
    failures = []
    for _ in range(2):
        try:
            _fetch_once(volume, info, final_path, partial_stem, parts, priority)
            return
        except ShardCorrupt as exc:
            failures.append(str(exc))
    raise DataError(
        f"shard {info.remote_basename} from volume {volume.url} failed its integrity check twice "
        f"({'; then '.join(failures)}); the copy on the volume is damaged: write the dataset again"
    )


def _fetch_once(volume, info, final_path, partial_stem, parts, priority):
    raw_tmp = Path(f"{partial_stem}.raw")
    zip_tmp = Path(f"{partial_stem}.zip")
    try:
        if info.zip_basename:
            _download_checked(volume, info.zip_basename, zip_tmp, info.zip_bytes, info.zip_hashes, parts, priority)
            _decompress(info.compression, zip_tmp, raw_tmp)
            zip_tmp.unlink()
            _check_size(raw_tmp, info.raw_bytes, info.basename)
        else:
            _download_checked(volume, info.basename, raw_tmp, info.raw_bytes, info.raw_hashes, parts, priority)
        final_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(raw_tmp, final_path)
    finally:
        for leftover in (raw_tmp, zip_tmp):
            leftover.unlink(missing_ok=True)


def _download_checked(
    volume: Volume, name: str, path: Path, size: int | None, hashes: dict, parts, priority: float
) -> None:
    """Downloads ``name`` to ``path``; its size and hash (computed as the bytes arrive) must match the index."""
    algorithm = next((a for a in _HASH_PREFERENCE if a in hashes), None) or next(iter(hashes), None)
    # An algorithm this host cannot compute leaves the size check alone.
    new_hasher = _hash_factory(algorithm) if algorithm is not None else None
    hasher = volume.download(name, str(path), size, parts, new_hasher=new_hasher, priority=priority)
    _check_size(path, size, name)
    if hasher is not None and hasher.hexdigest() != hashes[algorithm]:
        raise ShardCorrupt(f"{name} has {algorithm} {hasher.hexdigest()}, the index says {hashes[algorithm]}")


def _check_size(path: Path, size: int | None, name: str) -> None:
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise ShardCorrupt(f"{name} has {actual} bytes, the index says {size}")


@functools.cache
def _hash_factory(algorithm: str):
    """A callable making a fresh hash object for ``algorithm``, or ``None`` when this host has none."""
    if algorithm.startswith("xxh"):
        import xxhash

        return getattr(xxhash, algorithm, None)
    try:
        hashlib.new(algorithm)
    except ValueError:
        return None
    return functools.partial(hashlib.new, algorithm)


_zstd_local = threading.local()


def _decompress(compression: str, source: Path, target: Path) -> None:
    family = compression.split(":", 1)[0]
    try:
        if family == "zstd":
            import zstandard

            # Decompressor objects are not thread-safe; one per download thread.
            if not hasattr(_zstd_local, "decompressor"):
                _zstd_local.decompressor = zstandard.ZstdDecompressor()
            with open(source, "rb") as fin, open(target, "wb") as fout:
                _zstd_local.decompressor.copy_stream(fin, fout, read_size=_CHUNK, write_size=_CHUNK)
            return
        try:
            from streaming.base.compression import decompress
        except ImportError:
            raise MissingDependencyError(
                f"Reading {compression}-compressed shards", "pip install 'sparkgpu[streaming]'"
            ) from None
        target.write_bytes(decompress(compression, source.read_bytes()))
    except MissingDependencyError:
        raise
    except Exception as exc:
        raise ShardCorrupt(f"{source.name} does not decompress as {compression}: {exc}") from None
