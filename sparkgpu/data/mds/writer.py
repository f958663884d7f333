"""MDS shard files and ``index.json``, cut and named exactly as ``streaming.MDSWriter`` does.

Runs on Spark executors, shipped by value like :mod:`sparkgpu.data.mds.encoding`: numpy, pyarrow and the
standard library at module level; compression libraries only when asked for.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from sparkgpu.data.mds.encoding import ColumnSpec, EncodedBatch, encode_batch
from sparkgpu.errors import ConfigurationError, DataError, MissingDependencyError
from sparkgpu.spec.units import parse_size

__all__ = [
    "DEFAULT_SIZE_LIMIT",
    "ShardWriter",
    "ShardOptions",
    "check_compression",
    "check_hashes",
    "parse_size_limit",
    "index_document",
]

DEFAULT_SIZE_LIMIT = 1 << 26  # MDSWriter's default: 64 MiB of uncompressed samples per shard.

# Compression and hash names exactly as streaming spells them (streaming/base/compression.py,
# hashing.py), computed with the same libraries. Importing streaming itself would pull in torch
# (seconds per Spark Python worker), so the small tables are repeated here.
_COMPRESSIONS: dict[str, tuple[range | None, int | None]] = {  # family -> (allowed levels, default level)
    "br": (range(12), 11),
    "bz2": (range(1, 10), 9),
    "gz": (range(10), 9),
    "snappy": (None, None),
    "zstd": (range(1, 23), 3),
}


def check_compression(compression: str | None) -> str | None:
    """Validates a compression name as streaming spells it (``"zstd"``, ``"zstd:7"``, ``"gz"``).

    Raises:
        ConfigurationError: Unknown algorithm or level; the message lists the valid ones.
    """
    if not compression:
        return None
    family, _, level = str(compression).partition(":")
    valid = f"use one of {sorted(_COMPRESSIONS)}, optionally with a level as in 'zstd:7'"
    if family not in _COMPRESSIONS:
        raise ConfigurationError(f"unknown compression {compression!r}; {valid}")
    levels, _ = _COMPRESSIONS[family]
    if level and (levels is None or not level.isdigit() or int(level) not in levels):
        allowed = "takes no level" if levels is None else f"takes levels {levels.start}..{levels.stop - 1}"
        raise ConfigurationError(f"compression {compression!r}: {family} {allowed}")
    return str(compression)


def _compress(compression: str, data: bytes) -> bytes:
    family, _, level_text = compression.partition(":")
    level = int(level_text) if level_text else _COMPRESSIONS[family][1]
    if family == "gz":
        import gzip

        assert level is not None  # gz has levels, and a default one
        return gzip.compress(data, level)
    if family == "bz2":
        import bz2

        assert level is not None  # so has bz2
        return bz2.compress(data, level)
    # The same third-party modules streaming decompresses with; they may be missing where
    # the shards are written (a Spark executor).
    module_name, package = {
        "zstd": ("zstd", "zstd"),
        "br": ("brotli", "brotli"),
        "snappy": ("snappy", "python-snappy"),
    }[family]
    try:
        module = __import__(module_name)
    except ImportError:
        raise MissingDependencyError(f"{family} compression", f"pip install {package}") from None
    if family == "zstd":
        return module.compress(data, level)
    if family == "br":
        return module.compress(data, quality=level)
    return module.compress(data)


def _hash_functions() -> dict:
    import hashlib

    functions = {
        name: getattr(hashlib, name)
        for name in hashlib.algorithms_available
        if hasattr(hashlib, name) and not name.startswith("shake_")
    }
    try:
        import xxhash
    except ImportError:
        return functions
    functions.update({name: getattr(xxhash, name) for name in xxhash.algorithms_available})
    return functions


def check_hashes(hashes: Iterable[str] | None) -> list[str]:
    """Validates hash names (``"sha1"``, ``"xxh64"``, ...) and returns them sorted, as MDS wants.

    Raises:
        ConfigurationError: An unknown or repeated name.
    """
    if hashes is None:
        return []
    if isinstance(hashes, str):
        hashes = [hashes]
    names = list(hashes)
    known = _hash_functions()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigurationError(f"unknown hash {unknown}; use names such as 'sha1', 'md5', 'xxh64', 'xxh3_64'")
    if len(set(names)) != len(names):
        raise ConfigurationError(f"hashes {names} repeat a name; give each once")
    return sorted(names)


def parse_size_limit(size_limit: int | str | None) -> int | None:
    """Shard size limit in bytes (:func:`sparkgpu.spec.units.parse_size`); ``None``: one shard.

    Raises:
        ConfigurationError: Not a positive size below 4 GiB (sample offsets are uint32).
    """
    if size_limit is None:
        return None
    return parse_size(size_limit, "size_limit (sample offsets are uint32)", maximum=(1 << 32) - 1)


class ShardWriter:
    """Cuts encoded samples into MDS shard files, exactly where ``MDSWriter`` would.

    Args:
        volume: Where files go: a :class:`~sparkgpu.store.Store` (any object with ``write_pieces(relpath, pieces)``).
        subdir: Folder under the volume for this writer's shards ("" for the top).
        specs: Result of :func:`~sparkgpu.data.mds.columns.plan_columns`.
        compression: Name as :func:`check_compression` accepts, or ``None``.
        hashes: Names as :func:`check_hashes` accepts.
        size_limit: Most bytes of samples (plus their offsets) per shard; ``None``: one shard.
    """

    def __init__(
        self,
        volume,
        subdir: str,
        specs: Sequence[ColumnSpec],
        *,
        compression=None,
        hashes=(),
        size_limit=DEFAULT_SIZE_LIMIT,
    ):
        self.volume = volume
        self.subdir = subdir.strip("/")
        self.specs = tuple(specs)
        self.compression = check_compression(compression)
        self.hashes = check_hashes(hashes)
        self.size_limit = parse_size_limit(size_limit)
        self.config = {
            "version": 2,
            "format": "mds",
            "compression": self.compression,
            "hashes": self.hashes,
            "size_limit": self.size_limit,
            "column_names": [s.name for s in self.specs],
            "column_encodings": [s.encoding for s in self.specs],
            "column_sizes": [s.size for s in self.specs],
        }
        self._config_bytes = json.dumps(self.config, sort_keys=True).encode("utf-8")
        self._shard_overhead = 4 + 4 + len(self._config_bytes)  # MDSWriter.extra_bytes_per_shard
        self.shards: list[dict] = []
        self.samples = 0
        self.bytes_written = 0
        self._reset()

    def _reset(self) -> None:
        self._pending: list[np.ndarray] = []
        self._pending_lengths: list[np.ndarray] = []
        self._pending_size = self._shard_overhead

    def write_batch(self, batch: pa.RecordBatch) -> None:
        """Encodes and buffers one record batch, writing every shard it completes."""
        if batch.num_rows:
            self.write_encoded(encode_batch(batch, self.specs))

    def write_encoded(self, encoded: EncodedBatch) -> None:
        """Buffers already encoded samples, writing every shard they complete."""
        data, lengths = encoded.data, encoded.lengths
        row, byte = 0, 0
        n = len(lengths)
        while row < n:
            cumulative = np.cumsum(lengths[row:] + 4)  # each sample also costs its uint32 offset
            if self.size_limit is None:
                take = n - row
            else:
                take = int(np.searchsorted(cumulative, self.size_limit - self._pending_size, side="right"))
                if take == 0:
                    if self._pending:
                        self._flush()
                        continue
                    take = 1  # a sample larger than the limit gets a shard of its own
            nbytes = int(cumulative[take - 1]) - 4 * take
            self._pending.append(data[byte : byte + nbytes])
            self._pending_lengths.append(lengths[row : row + take])
            self._pending_size += int(cumulative[take - 1])
            row += take
            byte += nbytes
            if row < n:
                self._flush()

    def finish(self) -> list[dict]:
        """Writes the last shard and returns the ``index.json`` entries of all shards."""
        if self._pending:
            self._flush()
        return self.shards

    def _relpath(self, basename: str) -> str:
        return f"{self.subdir}/{basename}" if self.subdir else basename

    def _flush(self) -> None:
        lengths = np.concatenate(self._pending_lengths)
        n = len(lengths)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        offsets += 4 + 4 * (n + 1) + len(self._config_bytes)
        if offsets[-1] >= 1 << 32:
            raise DataError(
                "a shard would exceed 4 GiB (MDS offsets are uint32); lower size_limit or split large values"
            )
        pieces: list[bytes | np.ndarray] = [
            np.uint32(n).tobytes(),
            offsets.astype("<u4").tobytes(),
            self._config_bytes,
            *self._pending,
        ]
        raw_basename = f"shard.{len(self.shards):05}.mds"
        raw_size = int(offsets[-1])
        raw_info: dict[str, Any] = {"basename": self._relpath(raw_basename), "bytes": raw_size, "hashes": {}}
        zip_info: dict[str, Any] | None = None
        if self.compression or self.hashes:
            # numpy's stubs give ndarray the buffer protocol (__buffer__) only from Python 3.12;
            # arrays have it at runtime on every version, and bytes.join takes any buffer.
            raw = b"".join(pieces)  # type: ignore[arg-type]
            raw_info["hashes"] = self._digest(raw)
            pieces = [raw]
            if self.compression:
                packed = _compress(self.compression, raw)
                zip_basename = f"{raw_basename}.{self.compression.partition(':')[0]}"
                zip_info = {
                    "basename": self._relpath(zip_basename),
                    "bytes": len(packed),
                    "hashes": self._digest(packed),
                }
                pieces = [packed]
        target = zip_info or raw_info
        self.volume.write_pieces(target["basename"], pieces)
        self.bytes_written += target["bytes"]
        self.samples += n
        self.shards.append({"samples": n, "raw_data": raw_info, "zip_data": zip_info, **self.config})
        self._reset()

    def _digest(self, data: bytes) -> dict:
        functions = _hash_functions()
        return {name: functions[name](data).hexdigest() for name in self.hashes}


def index_document(shards: Sequence[dict], metadata: Mapping | None = None) -> bytes:
    """The bytes of an ``index.json`` listing ``shards`` in order.

    Args:
        shards: Entries from :meth:`ShardWriter.finish`, basenames relative to the index.
        metadata: Optional provenance stored under the top-level key ``"sparkgpu"``, which
            StreamingDataset ignores (it reads only ``version`` and ``shards``).
    """
    document = {"version": 2, "shards": list(shards)}
    if metadata is not None:
        document["sparkgpu"] = dict(metadata)
    return json.dumps(document, sort_keys=True).encode("utf-8")


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """Everything a writer needs besides where to write; small and picklable for executors.

    Attributes:
        specs: Column encodings from :func:`~sparkgpu.data.mds.encoding.plan_columns`.
        compression: Validated compression name or ``None``.
        hashes: Validated, sorted hash names.
        size_limit: Shard size limit in bytes or ``None``.
    """

    specs: tuple[ColumnSpec, ...]
    compression: str | None = None
    hashes: tuple[str, ...] = ()
    size_limit: int | None = DEFAULT_SIZE_LIMIT

    @classmethod
    def create(cls, specs, *, compression=None, hashes=None, size_limit=DEFAULT_SIZE_LIMIT) -> "ShardOptions":
        """Validates the settings as given by a user.

        Raises:
            ConfigurationError: A compression, hash or size limit that MDS does not know.
        """
        return cls(
            tuple(specs), check_compression(compression), tuple(check_hashes(hashes)), parse_size_limit(size_limit)
        )

    def writer(self, volume, subdir: str) -> ShardWriter:
        """A :class:`ShardWriter` with these settings writing under ``volume/subdir``."""
        return ShardWriter(
            volume, subdir, self.specs, compression=self.compression, hashes=self.hashes, size_limit=self.size_limit
        )

    @property
    def columns(self) -> dict[str, str]:
        """Column name -> MDS encoding."""
        return {spec.name: spec.encoding for spec in self.specs}
