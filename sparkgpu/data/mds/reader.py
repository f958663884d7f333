"""Reading MDS: the index, its columns, and memory-mapped shards.

The format is MosaicML Streaming's MDS (version 2), unchanged. ``index.json`` lists the
shards; each holds ``[num_samples: u32][offsets: (num_samples + 1) x u32][config json][samples]``,
and a sample is ``[u32 size of each variable-width column][column bytes in column order]``.
Batches are decoded from these shards by :mod:`sparkgpu.data.mds.decode`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import mmap
import os

import numpy as np

from sparkgpu.errors import DataError

__all__ = ["Column", "Decode", "ShardInfo", "DatasetIndex", "ShardReader", "INDEX_NAME"]

INDEX_NAME = "index.json"

_SCALARS = {
    name: np.dtype(name)
    for name in (
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
_SCALARS["int"] = np.dtype("int64")
# MDS ndarray headers name value dtypes by these codes (streaming.base.format.mds.encodings).
_NDARRAY_DTYPE_CODES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
# Encodings decoded to uint8 (C, H, W) tensors by sparkgpu.data.images.
_IMAGES = {"pil", "jpeg", "png"}
# Encodings decoded by streaming's own decoder, one sample at a time (image lists, pickles).
_DELEGATED = {"jpeg_array", "jpegarray", "list[pil]", "list[jpeg]", "list[png]", "pkl"}


class Decode(enum.Enum):
    """How a column becomes a batch value."""

    FIXED = "fixed"  # tensor of shape (batch, *shape)
    NDARRAY = "ndarray"  # list of tensors (shape or dtype varies per sample)
    BYTES = "bytes"  # list of bytes
    STR = "str"  # list of str
    STR_INT = "str_int"  # int64 tensor
    STR_FLOAT = "str_float"  # float64 tensor
    STR_DECIMAL = "str_decimal"  # list of decimal.Decimal
    JSON = "json"  # list of parsed objects
    IMAGE = "image"  # list of uint8 (C, H, W) tensors
    DELEGATED = "delegated"  # list of whatever streaming's decoder returns


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of an MDS dataset.

    Attributes:
        name: Column name.
        encoding: MDS encoding string, e.g. ``"float32"`` or ``"ndarray:int32:4,4"``.
        size: Byte size of every value when fixed, else ``None``.
        decode: How the column is decoded.
        dtype: numpy dtype of the values when the encoding fixes it.
        shape: Shape of one value when the encoding fixes it (``()`` for scalars).
    """

    name: str
    encoding: str
    size: int | None
    decode: Decode
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, name: str, encoding: str, size: int | None) -> "Column":
        """Builds a column from the index's ``column_names/encodings/sizes`` entries.

        Raises:
            DataError: The encoding is unknown or disagrees with its declared size.
        """
        base, _, config = encoding.partition(":")
        if encoding in _SCALARS:
            column = cls(name, encoding, _SCALARS[encoding].itemsize, Decode.FIXED, _SCALARS[encoding], ())
        elif base == "ndarray":
            column = cls._parse_ndarray(name, encoding, config)
        elif encoding in ("bytes", "str", "str_int", "str_float", "str_decimal", "json"):
            column = cls(name, encoding, None, Decode(encoding))
        elif encoding in _IMAGES:
            column = cls(name, encoding, None, Decode.IMAGE)
        elif encoding in _DELEGATED:
            column = cls(name, encoding, None, Decode.DELEGATED)
        else:
            raise DataError(
                f"column {name!r} has encoding {encoding!r}, which is not an MDS encoding this reader "
                "knows; rewrite the dataset with a standard MDS encoding (numbers, ndarray, str, bytes, json, images)"
            )
        if column.size != size:
            raise DataError(
                f"column {name!r} ({encoding}) declares size {size}, but that encoding is "
                f"{'variable' if column.size is None else f'{column.size} bytes'}; the index is damaged: rewrite the dataset"
            )
        return column

    @classmethod
    def _parse_ndarray(cls, name: str, encoding: str, config: str) -> "Column":
        dtype_name, _, shape_text = config.partition(":")
        dtype = np.dtype(dtype_name) if dtype_name else None
        if dtype is not None and dtype.name not in _NDARRAY_DTYPE_CODES.values():
            raise DataError(f"column {name!r} has encoding {encoding!r} with an unsupported dtype {dtype_name!r}")
        shape = tuple(int(d) for d in shape_text.split(",")) if shape_text else None
        if dtype is not None and shape is not None:
            return cls(name, encoding, int(np.prod(shape)) * dtype.itemsize, Decode.FIXED, dtype, shape)
        return cls(name, encoding, None, Decode.NDARRAY, dtype, shape)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard as the index describes it.

    Attributes:
        position: Position of the shard in the index.
        basename: Path of the uncompressed shard relative to the dataset root.
        samples: Number of samples in the shard.
        raw_bytes: Size of the uncompressed shard.
        raw_hashes: ``{algorithm: hex digest}`` of the uncompressed shard (may be empty).
        zip_basename: Path of the compressed shard, when the dataset is compressed.
        zip_bytes: Size of the compressed shard.
        zip_hashes: ``{algorithm: hex digest}`` of the compressed shard.
        compression: Compression name (``"zstd"``, ``"zstd:7"``, ...) or ``None``.
    """

    position: int
    basename: str
    samples: int
    raw_bytes: int
    raw_hashes: dict
    zip_basename: str | None = None
    zip_bytes: int | None = None
    zip_hashes: dict = dataclasses.field(default_factory=dict)
    compression: str | None = None

    @property
    def remote_basename(self) -> str:
        """The file to fetch from the volume: the compressed one when there is one."""
        return self.zip_basename or self.basename


@dataclasses.dataclass(frozen=True)
class DatasetIndex:
    """A parsed ``index.json``: the shards and the columns they share.

    Attributes:
        shards: Every shard, in index order.
        columns: The columns, in MDS order (sorted by name by the writer).
        fingerprint: SHA-1 of the index bytes; identifies the dataset version.
    """

    shards: tuple[ShardInfo, ...]
    columns: tuple[Column, ...]
    fingerprint: str

    @property
    def num_samples(self) -> int:
        return sum(shard.samples for shard in self.shards)

    @property
    def shard_sizes(self) -> np.ndarray:
        """Samples per shard, as ``int64``."""
        return np.array([shard.samples for shard in self.shards], dtype=np.int64)

    @property
    def fixed_width(self) -> bool:
        """True when every sample has the same byte size (every column is fixed)."""
        return all(column.size is not None for column in self.columns)

    @classmethod
    def parse(cls, raw: bytes, source: str, allow_unsafe_types: bool = False) -> "DatasetIndex":
        """Parses and validates an MDS ``index.json``.

        Args:
            raw: The file's bytes.
            source: Where the index came from, for error messages.
            allow_unsafe_types: Accept ``pkl`` columns (unpickling runs arbitrary code).

        Raises:
            DataError: Not an MDS v2 index, shards disagree on columns, or unsafe columns.
        """
        try:
            obj = json.loads(raw)
            entries = obj["shards"]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(
                f"{source} is not an MDS index.json ({exc}); point remote/local at a folder written by MDSWriter or sparkgpu.data.to_mds"
            ) from None
        if not entries:
            raise DataError(f"{source} lists no shards; the dataset is empty: write it again with data in it")
        shards: list[ShardInfo] = []
        columns: tuple[Column, ...] | None = None
        for position, entry in enumerate(entries):
            if entry.get("format") != "mds" or entry.get("version") != 2:
                raise DataError(
                    f"shard {position} in {source} is format {entry.get('format')!r} version {entry.get('version')!r}; "
                    "only MDS version 2 is supported: convert the dataset with sparkgpu.data.to_mds"
                )
            layout = (tuple(entry["column_names"]), tuple(entry["column_encodings"]), tuple(entry["column_sizes"]))
            if columns is None:
                columns = tuple(Column.parse(*spec) for spec in zip(*layout))
                first_layout = layout
            elif layout != first_layout:
                raise DataError(
                    f"shard {entry['raw_data']['basename']} in {source} has columns {layout[0]} {layout[1]}, "
                    f"unlike the first shard's {first_layout[0]} {first_layout[1]}; write the dataset again with one schema"
                )
            shards.append(_shard_info(position, entry))
        assert columns is not None  # set by the first shard, and there is at least one
        for column in columns:
            if column.encoding == "pkl" and not allow_unsafe_types:
                raise DataError(
                    f"column {column.name!r} is pickled ('pkl'), and unpickling runs arbitrary code; "
                    "pass allow_unsafe_types=True if you trust the data"
                )
        return cls(tuple(shards), columns, hashlib.sha1(raw).hexdigest())


def _shard_info(position: int, entry: dict) -> ShardInfo:
    raw, zipped = entry["raw_data"], entry.get("zip_data")
    return ShardInfo(
        position=position,
        basename=raw["basename"],
        samples=int(entry["samples"]),
        raw_bytes=int(raw["bytes"]),
        raw_hashes=dict(raw.get("hashes") or {}),
        zip_basename=zipped["basename"] if zipped else None,
        zip_bytes=int(zipped["bytes"]) if zipped else None,
        zip_hashes=dict(zipped.get("hashes") or {}) if zipped else {},
        compression=entry.get("compression") if zipped else None,
    )


class ShardReader:
    """A memory-mapped shard.

    The mapping stays valid after the file is evicted (unlinked) from the cache, so a batch
    being decoded never loses its shard; the disk space returns only when the reader is
    closed (and no batch still views its pages), so readers must not outlive their use.

    Attributes:
        info: The shard's index entry.
        data: The whole file as a read-only ``uint8`` array.
        offsets: ``uint32`` start of each sample in the file, plus the end of the last.
        rows: For fixed-width datasets, the sample bodies as ``(samples, row_bytes)``.
    """

    def __init__(self, path: str | os.PathLike, info: ShardInfo, row_bytes: int | None):
        self.info = info
        self.path = os.fspath(path)
        with open(self.path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size != info.raw_bytes or size < 8:
                raise DataError(
                    f"shard {info.basename} at {self.path} has {size} bytes, the index says {info.raw_bytes}"
                )
            self._mmap: mmap.mmap | None = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        # None once closed (see close()); a reader is used only while open.
        self.data: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)
        (count,) = self.data[:4].view("<u4")
        if count != info.samples:
            raise DataError(
                f"shard {info.basename} at {self.path} holds {count} samples, the index says {info.samples}"
            )
        self.offsets: np.ndarray | None = self.data[4 : 4 + 4 * (count + 1)].view("<u4")
        self.rows: np.ndarray | None = None
        if row_bytes is not None:
            begin, end = int(self.offsets[0]), int(self.offsets[-1])
            if end - begin != count * row_bytes or end > size:
                raise DataError(f"shard {info.basename} at {self.path} does not hold {count} rows of {row_bytes} bytes")
            self.rows = self.data[begin:end].reshape(count, row_bytes)

    def close(self) -> None:
        """Unmaps the shard; an evicted file's disk space returns with the last view of its pages.

        The mapping is released by reference count, not ``mmap.close()``, because a batch may
        still hold a view of it (closing then would fail); it goes when that batch does.
        """
        self.data = self.offsets = self.rows = None
        self._mmap = None
