"""Reading MDS: the index, memory-mapped shards, and whole batches decoded at once.

The format is MosaicML Streaming's MDS (version 2), unchanged. ``index.json`` lists the
shards; each holds ``[num_samples: u32][offsets: (num_samples + 1) x u32][config json][samples]``,
and a sample is ``[u32 size of each variable-width column][column bytes in column order]``.

When every column has a fixed width (numbers, fixed-shape arrays), every sample has the same
size, so a batch is one row gather from the memory-mapped shard bodies into one buffer, and
each column is a strided view of that buffer: no per-sample Python at all. Variable-width
columns (``str``, ``bytes``, arrays of varying shape, ...) are gathered column by column
into packed buffers, then split.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import mmap
import os

import numpy as np

from sparkgpu.data import _gather
from sparkgpu.errors import DataError

__all__ = ["Column", "ShardInfo", "DatasetIndex", "ShardReader", "BatchDecoder", "INDEX_NAME"]

INDEX_NAME = "index.json"

_SCALARS = {
    name: np.dtype(name)
    for name in ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
}
_SCALARS["int"] = np.dtype("int64")
# MDS ndarray headers name value dtypes by these codes (streaming.base.format.mds.encodings).
_NDARRAY_DTYPE_CODES = {
    8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32",
    33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64",
}
_SHAPE_DTYPES = ("<u1", "<u2", "<u4", "<u8")
# Encodings decoded by streaming's own decoder, one sample at a time (images, pickles).
_DELEGATED = {"pil", "jpeg", "png", "jpeg_array", "jpegarray", "list[pil]", "list[jpeg]", "list[png]", "pkl"}


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
            raise DataError(f"{source} is not an MDS index.json ({exc}); point remote/local at a folder written by MDSWriter or sparkgpu.data.to_mds") from None
        if not entries:
            raise DataError(f"{source} lists no shards; the dataset is empty: write it again with data in it")
        shards, columns = [], None
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
    being decoded never loses its shard; the space returns when the reader is dropped.

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
                raise DataError(f"shard {info.basename} at {self.path} has {size} bytes, the index says {info.raw_bytes}")
            self._mmap = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._mmap, dtype=np.uint8)
        (count,) = self.data[:4].view("<u4")
        if count != info.samples:
            raise DataError(f"shard {info.basename} at {self.path} holds {count} samples, the index says {info.samples}")
        self.offsets = self.data[4 : 4 + 4 * (count + 1)].view("<u4")
        self.rows = None
        if row_bytes is not None:
            begin, end = int(self.offsets[0]), int(self.offsets[-1])
            if end - begin != count * row_bytes or end > size:
                raise DataError(f"shard {info.basename} at {self.path} does not hold {count} rows of {row_bytes} bytes")
            self.rows = self.data[begin:end].reshape(count, row_bytes)


class BatchDecoder:
    """Turns (shard, row) pairs into a dict of column values for one batch.

    Args:
        columns: The dataset's columns.
        allocate: ``allocate(nbytes) -> torch.Tensor`` of ``uint8``; where batch buffers come
            from (plain or pinned memory).
    """

    def __init__(self, columns: tuple[Column, ...], allocate):
        import torch

        self._torch = torch
        self.columns = columns
        self.allocate = allocate
        self.fixed_width = all(column.size is not None for column in columns)
        self.row_bytes = sum(column.size for column in columns) if self.fixed_width else None
        self._variable = [column for column in columns if column.size is None]
        self._views = self._plan_views() if self.fixed_width else None

    def decode(self, readers: list[ShardReader], source_ids: np.ndarray | None, rows: np.ndarray) -> dict:
        """Decodes one batch.

        Args:
            readers: The shards the batch draws from.
            source_ids: ``int32`` position in ``readers`` of each sample (``None``: all from
                ``readers[0]``).
            rows: ``int64`` sample index inside its shard, in batch order.

        Returns:
            ``{column name: value}``: a tensor of shape ``(batch, *shape)`` for fixed-width
            and ``str_int``/``str_float`` columns, a list with one item per sample otherwise.
        """
        if self.fixed_width:
            return self._decode_rows(readers, source_ids, rows)
        return self._decode_samples(readers, source_ids, rows)

    # Fixed-width datasets: one gather, then views.

    def _plan_views(self) -> list["_ColumnView"]:
        # Consecutive scalar columns of one dtype become one (batch, k) view split by unbind,
        # which costs one call instead of k.
        views: list[_ColumnView] = []
        offset = 0
        for column in self.columns:
            itemsize = column.dtype.itemsize
            aligned = offset % itemsize == 0 and self.row_bytes % itemsize == 0
            last = views[-1] if views else None
            if (last is not None and column.shape == () and last.shape == () and last.dtype == column.dtype
                    and aligned and last.aligned and last.offset + itemsize * len(last.names) == offset):
                last.names.append(column.name)
            else:
                views.append(_ColumnView([column.name], column.dtype, _torch_dtype(self._torch, column.dtype),
                                         column.shape, offset, column.size, aligned, self.row_bytes))
            offset += column.size
        return views

    def _decode_rows(self, readers, source_ids, rows):
        return self.split_rows(self.gather_rows(readers, source_ids, rows))

    def gather_rows(self, readers, source_ids, rows):
        """For fixed-width datasets: the batch's rows, gathered into one ``uint8`` tensor."""
        n, row_bytes = len(rows), self.row_bytes
        buffer = self.allocate(n * row_bytes)
        _gather.gather_rows(buffer.numpy().reshape(n, row_bytes), [r.rows for r in readers], source_ids, rows)
        return buffer

    def split_rows(self, buffer) -> dict:
        """Views each column of a buffer of gathered rows (see :meth:`gather_rows`) as a tensor."""
        if buffer.storage_offset() % 8 or not buffer.is_contiguous():
            buffer = buffer.clone()  # the views are placed relative to an aligned storage start
        n = buffer.numel() // self.row_bytes
        base = buffer.storage_offset()
        typed = {}
        batch = {}
        for view in self._views:
            if view.aligned:
                if view.tdtype not in typed:
                    typed[view.tdtype] = buffer.view(view.tdtype)
                view.place(batch, typed[view.tdtype], n, base)
            else:
                # A column at an offset its dtype cannot be viewed at: copy it out.
                raw = buffer.view(n, self.row_bytes)[:, view.offset: view.offset + view.size].contiguous()
                batch[view.names[0]] = raw.view(view.tdtype).reshape(n, *view.shape)
        return batch

    # Datasets with variable-width columns: per column, gather spans into packed buffers.

    def _decode_samples(self, readers, source_ids, rows):
        n = len(rows)
        sources = [r.data for r in readers]
        begins = np.empty(n, dtype=np.int64)
        for position, reader in enumerate(readers):
            mask = slice(None) if source_ids is None else source_ids == position
            begins[mask] = reader.offsets[rows[mask]]
        k = len(self._variable)
        header = np.empty(n * 4 * k, dtype=np.uint8)
        head_len = np.full(n, 4 * k, dtype=np.int64)
        _gather.gather_spans(header, np.arange(n, dtype=np.int64) * 4 * k, sources, source_ids, begins, head_len)
        var_sizes = header.view("<u4").reshape(n, k).astype(np.int64)
        cursor = begins + 4 * k
        batch, var_index = {}, 0
        for column in self.columns:
            if column.size is None:
                lengths = var_sizes[:, var_index]
                var_index += 1
            else:
                lengths = np.full(n, column.size, dtype=np.int64)
            batch[column.name] = self._decode_column(column, sources, source_ids, cursor, lengths)
            cursor = cursor + lengths
        return batch

    def _pack(self, sources, source_ids, starts, lengths, align=1):
        offsets = np.cumsum(lengths) - lengths
        packed = self.allocate(max(int(lengths.sum()), align)) if align > 1 else None
        array = packed.numpy() if packed is not None else np.empty(max(int(lengths.sum()), 1), dtype=np.uint8)
        _gather.gather_spans(array, offsets, sources, source_ids, starts, lengths)
        return packed, array, offsets

    def _decode_column(self, column, sources, source_ids, starts, lengths):
        torch = self._torch
        n = len(starts)
        if column.decode is Decode.FIXED:
            packed, _, _ = self._pack(sources, source_ids, starts, lengths, align=column.dtype.itemsize)
            return packed[: n * column.size].view(_torch_dtype(torch, column.dtype)).reshape(n, *column.shape)
        if column.decode is Decode.NDARRAY:
            return self._decode_ndarrays(column, sources, source_ids, starts, lengths)
        _, array, offsets = self._pack(sources, source_ids, starts, lengths)
        blob = array.tobytes()
        items = [blob[o: o + ln] for o, ln in zip(offsets.tolist(), lengths.tolist())]
        if column.decode is Decode.BYTES:
            return items
        if column.decode is Decode.STR:
            return [item.decode("utf-8") for item in items]
        if column.decode is Decode.STR_INT:
            return torch.tensor([int(item) for item in items], dtype=torch.int64)
        if column.decode is Decode.STR_FLOAT:
            return torch.tensor([float(item) for item in items], dtype=torch.float64)
        if column.decode is Decode.STR_DECIMAL:
            from decimal import Decimal

            return [Decimal(item.decode("utf-8")) for item in items]
        if column.decode is Decode.JSON:
            return [json.loads(item) for item in items]
        from streaming.base.format.mds.encodings import mds_decode

        return [mds_decode(column.encoding, item) for item in items]

    def _decode_ndarrays(self, column, sources, source_ids, starts, lengths):
        # Layout per value: [dtype code: 1 if dtype is dynamic][ndim<<2 | shape dtype: 1 and
        # shape, if shape is dynamic][values]. Read the small headers first, then gather all
        # values into one aligned buffer and split it into per-sample tensors (views).
        torch = self._torch
        n = len(starts)
        head_bytes = np.minimum(lengths, 2 + 8 * 63)
        _, head, head_offsets = self._pack(sources, source_ids, starts, head_bytes)
        dtypes, shapes, header_lengths = [], [], np.empty(n, dtype=np.int64)
        for i, offset in enumerate(head_offsets.tolist()):
            cursor = offset
            if column.dtype is None:
                dtype = np.dtype(_NDARRAY_DTYPE_CODES[int(head[cursor])])
                cursor += 1
            else:
                dtype = column.dtype
            if column.shape is None:
                code = int(head[cursor])
                ndim, shape_dtype = code >> 2, np.dtype(_SHAPE_DTYPES[code & 3])
                shape = tuple(head[cursor + 1: cursor + 1 + ndim * shape_dtype.itemsize].view(shape_dtype).tolist())
                cursor += 1 + ndim * shape_dtype.itemsize
            else:
                shape = column.shape
            dtypes.append(dtype)
            shapes.append(shape)
            header_lengths[i] = cursor - offset
        value_lengths = lengths - header_lengths
        if column.dtype is not None:
            packed, _, _ = self._pack(sources, source_ids, starts + header_lengths, value_lengths, align=column.dtype.itemsize)
            flat = packed[: int(value_lengths.sum())].view(_torch_dtype(torch, column.dtype))
            parts = torch.split(flat, (value_lengths // column.dtype.itemsize).tolist())
            return [part if len(shape) == 1 else part.reshape(shape) for part, shape in zip(parts, shapes)]
        values = []
        for i in range(n):  # the dtype differs per sample: one small gather each
            one = slice(i, i + 1)
            ids = None if source_ids is None else source_ids[one]
            packed, _, _ = self._pack(sources, ids, starts[one] + header_lengths[one], value_lengths[one], align=dtypes[i].itemsize)
            values.append(packed[: int(value_lengths[i])].view(_torch_dtype(torch, dtypes[i])).reshape(shapes[i]))
        return values


class _ColumnView:
    """Where one column (or a run of same-typed scalar columns) sits in a gathered row."""

    __slots__ = ("names", "dtype", "tdtype", "shape", "offset", "size", "aligned", "_row_items", "_inner")

    def __init__(self, names, dtype, tdtype, shape, offset, size, aligned, row_bytes):
        self.names, self.dtype, self.tdtype, self.shape = names, dtype, tdtype, shape
        self.offset, self.size, self.aligned = offset, size, aligned
        self._row_items = row_bytes // dtype.itemsize
        self._inner = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))

    def place(self, batch: dict, typed, n: int, base: int) -> None:
        import torch

        first = (base + self.offset) // self.dtype.itemsize
        if len(self.names) > 1:
            block = torch.as_strided(typed, (n, len(self.names)), (self._row_items, 1), first)
            batch.update(zip(self.names, block.unbind(1)))
        else:
            batch[self.names[0]] = torch.as_strided(typed, (n, *self.shape), (self._row_items, *self._inner), first)


_TORCH_DTYPES: dict = {}


def _torch_dtype(torch, dtype: np.dtype):
    if dtype not in _TORCH_DTYPES:
        _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return _TORCH_DTYPES[dtype]
