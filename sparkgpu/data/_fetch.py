"""Bringing one shard from the volume into the cache: download, verify, decompress, place.

A shard becomes visible under its final name only by an atomic rename, after its size and
(when the index has them) hash were checked. Until then it lives in the cache's ``partial``
folder under a name that says which host and process writes it, so a crashed writer's
leftovers can be recognised and removed.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import uuid
from pathlib import Path

from sparkgpu.data.reader import ShardInfo
from sparkgpu.data.volume import Volume
from sparkgpu.errors import DataError

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
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def fetch_shard(volume: Volume, info: ShardInfo, final_path: Path, partial_stem: Path, parts=None) -> None:
    """Downloads one shard to ``final_path``, verified, decompressed, placed atomically.

    A file that fails its check is fetched once more; a second failure is reported.

    Args:
        volume: Where the shard comes from.
        info: The shard's index entry.
        final_path: Where the uncompressed shard must appear.
        partial_stem: Path prefix for the temporary files (``.zip`` / ``.raw`` are appended).
        parts: Thread pool for byte-range downloads (see :meth:`Volume.download`), or ``None``.

    Raises:
        DataError: The shard failed its check twice, or cannot be downloaded.
    """
    failures = []
    for _ in range(2):
        try:
            _fetch_once(volume, info, final_path, partial_stem, parts)
            return
        except ShardCorrupt as exc:
            failures.append(str(exc))
    raise DataError(
        f"shard {info.remote_basename} from volume {volume.url} failed its integrity check twice "
        f"({'; then '.join(failures)}); the copy on the volume is damaged: write the dataset again"
    )


def _fetch_once(volume, info, final_path, partial_stem, parts):
    raw_tmp = Path(f"{partial_stem}.raw")
    zip_tmp = Path(f"{partial_stem}.zip")
    try:
        if info.zip_basename:
            volume.download(info.zip_basename, str(zip_tmp), info.zip_bytes, parts)
            _verify(zip_tmp, info.zip_bytes, info.zip_hashes, info.zip_basename)
            _decompress(info.compression, zip_tmp, raw_tmp)
            zip_tmp.unlink()
            _verify(raw_tmp, info.raw_bytes, {}, info.basename)
        else:
            volume.download(info.basename, str(raw_tmp), info.raw_bytes, parts)
            _verify(raw_tmp, info.raw_bytes, info.raw_hashes, info.basename)
        final_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(raw_tmp, final_path)
    finally:
        for leftover in (raw_tmp, zip_tmp):
            leftover.unlink(missing_ok=True)


def _verify(path: Path, size: int | None, hashes: dict, name: str) -> None:
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise ShardCorrupt(f"{name} has {actual} bytes, the index says {size}")
    algorithm = next((a for a in _HASH_PREFERENCE if a in hashes), None) or next(iter(hashes), None)
    if algorithm is None:
        return
    hasher = _hasher(algorithm)
    if hasher is None:
        return  # an algorithm this host cannot compute; the size check above still ran
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    if hasher.hexdigest() != hashes[algorithm]:
        raise ShardCorrupt(f"{name} has {algorithm} {hasher.hexdigest()}, the index says {hashes[algorithm]}")


def _hasher(algorithm: str):
    if algorithm.startswith("xxh"):
        import xxhash

        factory = getattr(xxhash, algorithm, None)
        return factory() if factory else None
    try:
        return hashlib.new(algorithm)
    except ValueError:
        return None


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
        from streaming.base.compression import decompress

        target.write_bytes(decompress(compression, source.read_bytes()))
    except Exception as exc:
        raise ShardCorrupt(f"{source.name} does not decompress as {compression}: {exc}") from None
