"""MosaicML Streaming's MDS format, encoded from whole Arrow record batches at once.

The bytes are exactly those ``streaming.MDSWriter`` writes (``streaming/base/format/mds``):

* a sample is ``[uint32 size of each variable-size column][each column's bytes]``, columns in
  name order;
* a shard file is ``[uint32 n][uint32 offsets, n + 1 of them, from the file start][the writer's
  config as JSON][samples]``;
* ``index.json`` is ``{"version": 2, "shards": [...]}``, each entry the writer's config plus
  ``samples``, ``raw_data`` and ``zip_data`` (written by :mod:`sparkgpu.data.mds.writer`).

``MDSWriter`` encodes one Python dict at a time; here numpy builds every sample of a record
batch in a few whole-array copies, so fixed-width schemas never loop over rows in Python.

This module runs on Spark executors, shipped by value: at module level it imports only numpy,
pyarrow and the standard library, so executors need nothing from this package installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkgpu.data.mds.columns import IMAGE_SIGNATURES, ColumnKind, ColumnSpec, plan_columns
from sparkgpu.errors import DataError

__all__ = [
    "ColumnSpec",
    "EncodedBatch",
    "plan_columns",
    "encode_batch",
]


@dataclasses.dataclass(frozen=True)
class EncodedBatch:
    """Samples of one record batch, encoded back to back.

    Attributes:
        data: uint8 array holding every sample, one after the other.
        lengths: int64 array, the byte length of each sample.
    """

    data: np.ndarray
    lengths: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Fixed:
    values: np.ndarray  # (n, ...) of any little-endian dtype: row i's bytes are values[i]

    @property
    def width(self) -> int:
        return (
            self.values[:1].nbytes
            if len(self.values)
            else self.values.dtype.itemsize * int(np.prod(self.values.shape[1:]))
        )

    @property
    def lengths(self) -> np.ndarray:
        return np.full(len(self.values), self.width, dtype=np.int64)

    def as_bytes(self) -> np.ndarray:
        """(n, width) uint8 view (or copy) of the values."""
        values = np.ascontiguousarray(self.values)
        return values.view(np.uint8).reshape(len(values), self.width)


@dataclasses.dataclass(frozen=True)
class _Var:
    data: np.ndarray  # uint8; row i is data[offsets[i]:offsets[i + 1]]
    offsets: np.ndarray  # int64, n + 1, offsets[0] == 0

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def encode_batch(batch: pa.RecordBatch, specs: Sequence[ColumnSpec]) -> EncodedBatch:
    """Encodes every row of ``batch`` as an MDS sample.

    Args:
        batch: Arrow record batch holding (at least) the spec's columns.
        specs: Result of :func:`plan_columns`.

    Returns:
        The samples, byte-identical to ``MDSWriter.encode_sample`` of each row.

    Raises:
        DataError: A column holds nulls (MDS has no null), an array column has a row whose
            length does not match its declared shape, or a value does not fit its encoding.
    """
    n = batch.num_rows
    parts: list[_Fixed | _Var] = []
    var_sizes: list[np.ndarray] = []
    for spec in specs:
        index = batch.schema.get_field_index(spec.name)
        if index < 0:
            raise DataError(f"column {spec.name!r} is missing from a record batch with columns {batch.schema.names}")
        pieces = _encode_column(batch.column(index), spec)
        if spec.size is None:
            var_sizes.append(sum(p.lengths for p in pieces))
        parts.extend(pieces)
    if var_sizes:
        header = np.stack(var_sizes, axis=1)
        if header.size and header.max() >= 1 << 32:
            raise DataError("a sample holds a value larger than 4 GiB, which MDS cannot store")
        parts.insert(0, _Fixed(header.astype("<u4")))
    return _assemble(_merge_adjacent_fixed(parts), n)


def _merge_adjacent_fixed(parts: list) -> list:
    merged: list = []
    run: list[_Fixed] = []
    for part in parts + [None]:
        if isinstance(part, _Fixed):
            run.append(part)
            continue
        if run:
            merged.append(run[0] if len(run) == 1 else _Fixed(_pack(run)))
            run = []
        if part is not None:
            merged.append(part)
    return merged


def _pack(parts: list[_Fixed]) -> np.ndarray:
    """Rows of several fixed parts side by side, as (n, total width) uint8.

    A structured dtype with one field per part lets numpy copy each column with its own
    element size (one float32 per row, not four separate bytes).
    """
    n = len(parts[0].values)
    widths = [p.width for p in parts]
    offsets = np.concatenate([[0], np.cumsum(widths)[:-1]]).tolist()
    names = [f"p{i}" for i in range(len(parts))]
    formats = [(p.values.dtype, p.values.shape[1:]) for p in parts]
    packed = np.empty(
        n, dtype=np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": sum(widths)})
    )
    for name, part in zip(names, parts):
        packed[name] = part.values
    return packed.view(np.uint8).reshape(n, sum(widths))


_CHUNK_BYTES = 1 << 20


def _assemble(parts: list, n: int) -> EncodedBatch:
    if len(parts) == 1 and isinstance(parts[0], _Fixed):
        # Every sample has the same layout: one (n, width) matrix is the whole batch.
        rows = parts[0].as_bytes()
        return EncodedBatch(rows.reshape(-1), np.full(n, rows.shape[1], dtype=np.int64))
    parts = [_Fixed(p.as_bytes()) if isinstance(p, _Fixed) else p for p in parts]
    lengths = np.zeros(n, dtype=np.int64)
    for part in parts:
        lengths += part.lengths
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = int(starts[-1])
    out = np.empty(total, dtype=np.uint8)
    # Scatter indices cost 8 bytes per output byte; chunks of rows keep them cache-sized.
    step = max(1, _CHUNK_BYTES * n // max(1, total))
    for first in range(0, n, step):
        last = min(n, first + step)
        position = starts[first:last].copy()  # where the next part of each sample goes
        for part in parts:
            if isinstance(part, _Fixed):
                width = part.values.shape[1]
                if width:
                    out[position[:, None] + np.arange(width)] = part.values[first:last]
                position += width
                continue
            offsets = part.offsets[first : last + 1]
            part_lengths = np.diff(offsets)
            low, high = int(offsets[0]), int(offsets[-1])
            if high > low:
                # Byte j of the part's flat data goes to (its row's position) + (j - row's offset).
                out[np.repeat(position - offsets[:-1], part_lengths) + np.arange(low, high)] = part.data[low:high]
            position += part_lengths
    return EncodedBatch(out, lengths)


def _no_nulls(array: pa.Array, spec: ColumnSpec, what: str = "null values") -> None:
    if array.null_count:
        raise DataError(
            f"column {spec.name!r} has {array.null_count} {what}; MDS has no null: fill them "
            f"(fillna / coalesce({spec.name}, ...)) or filter those rows out before converting"
        )


def _numbers(array: pa.Array, dtype: str, spec: ColumnSpec) -> np.ndarray:
    """Values of a numeric (or bool) array as a contiguous numpy array of ``dtype``."""
    _no_nulls(array, spec)
    if pa.types.is_boolean(array.type):
        values = array.to_numpy(zero_copy_only=False).astype(np.uint8)
    else:
        if np.dtype(array.type.to_pandas_dtype()) != np.dtype(dtype):
            try:
                array = pc.cast(array, pa.from_numpy_dtype(np.dtype(dtype)), safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise DataError(
                    f"column {spec.name!r}: values do not fit {dtype}: {exc}; choose a wider encoding"
                ) from None
        values = array.to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))


def _binary_part(array: pa.Array, spec: ColumnSpec) -> _Var | _Fixed:
    _no_nulls(array, spec)
    array_type = array.type
    if pa.types.is_string_view(array_type) or pa.types.is_binary_view(array_type):
        array = pc.cast(array, pa.large_binary())
        array_type = array.type
    if pa.types.is_fixed_size_binary(array_type):
        width = array_type.byte_width
        data = np.frombuffer(array.buffers()[1], dtype=np.uint8)
        return _Fixed(data[array.offset * width : (array.offset + len(array)) * width].reshape(len(array), width))
    large = pa.types.is_large_string(array_type) or pa.types.is_large_binary(array_type)
    raw_offsets = np.frombuffer(array.buffers()[1], dtype=np.int64 if large else np.int32)
    offsets = raw_offsets[array.offset : array.offset + len(array) + 1].astype(np.int64)
    data_buffer = array.buffers()[2]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.empty(0, np.uint8)
    first = int(offsets[0])
    return _Var(data[first : int(offsets[-1])], offsets - first)


def _check_image_bytes(part, spec: ColumnSpec) -> None:
    """Every value of a ``jpeg``/``png`` column must be a file of that format (stored as is)."""
    signature = np.frombuffer(IMAGE_SIGNATURES[spec.encoding], dtype=np.uint8)
    k = len(signature)
    if isinstance(part, _Fixed):
        rows = part.as_bytes()
        lengths, heads = np.full(len(rows), rows.shape[1]), rows[:, :k]
    else:
        lengths = part.lengths
        short = lengths < k
        # Short values cannot match; read byte 0 for them so no index runs past the data.
        positions = np.where(short[:, None], 0, part.offsets[:-1, None] + np.arange(k))
        heads = part.data[positions] if len(part.data) else np.zeros((len(lengths), k), np.uint8)
    matches = np.all(heads == signature, axis=1) if heads.shape[1] == k else np.zeros(len(lengths), dtype=bool)
    bad = np.flatnonzero((lengths < k) | ~matches)
    if len(bad):
        row = int(bad[0])
        raise DataError(
            f"column {spec.name!r} is written as {spec.encoding!r}, but {len(bad)} of its values are not {spec.encoding.upper()} "
            f"files (the first at row {row} of its batch); store those columns as 'bytes', or re-encode the images first"
        )


def _encode_column(array: pa.Array, spec: ColumnSpec) -> list:
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    kind = spec.kind
    n = len(array)
    if kind in (ColumnKind.SCALAR, ColumnKind.INT):
        assert spec.dtype is not None  # plan_columns gives every number column its dtype
        values = _numbers(array, spec.dtype, spec)
        return [_Fixed(values)]
    if kind in (ColumnKind.STR, ColumnKind.BYTES):
        return [_binary_part(array, spec)]
    if kind is ColumnKind.IMAGE:
        part = _binary_part(array, spec)
        _check_image_bytes(part, spec)
        return [part]
    if kind is ColumnKind.DECIMAL:
        _no_nulls(array, spec)
        return [_binary_part(pc.cast(array, pa.string()), spec)]
    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    _no_nulls(array, spec)
    values, lengths = _flatten_list(array, spec)
    assert spec.dtype is not None  # plan_columns gives every ndarray column its dtype
    numbers = _numbers(values, spec.dtype, spec)
    if kind is ColumnKind.NDARRAY_STATIC:
        assert spec.shape is not None  # and a static one its shape
        per_row = int(np.prod(spec.shape))
        if n and not np.all(lengths == per_row):
            bad = int(np.flatnonzero(lengths != per_row)[0])
            raise DataError(
                f"column {spec.name!r} (encoding {spec.encoding!r}) needs {per_row} values per row, "
                f"row {bad} of a batch has {int(lengths[bad])}; pad or filter such rows, or drop "
                "the shape from the encoding to store each row's own length"
            )
        return [_Fixed(numbers.reshape(n, per_row))]
    return _dynamic_ndarray_parts(numbers, lengths, n)


def _flatten_list(array: pa.Array, spec: ColumnSpec) -> tuple[pa.Array, np.ndarray]:
    """Leaf values of a (possibly nested fixed-size) list array and the count per row."""
    n = len(array)
    if pa.types.is_fixed_size_list(array.type):
        values, per_row = array, 1
        while pa.types.is_fixed_size_list(values.type):
            _no_nulls(values, spec, "null arrays")
            per_row *= values.type.list_size
            values = values.flatten()
        return values, np.full(n, per_row, dtype=np.int64)
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.flatten()
    while pa.types.is_fixed_size_list(values.type):  # ndarray:<dtype>:<shape> fed by list<fixed list>
        offsets = offsets * values.type.list_size
        values = values.flatten()
    _no_nulls(values, spec, "null array elements")
    return values, np.diff(offsets)


def _dynamic_ndarray_parts(numbers: np.ndarray, lengths: np.ndarray, n: int) -> list:
    """NDArray with the dtype in the encoding and the shape in the sample (1-D here).

    Sample layout: ``[ndim << 2 | shape dtype code][shape as that dtype][values]``, the shape
    dtype being the smallest unsigned int that holds the length (NDArray._rightsize_shape_dtype).
    """
    codes = np.zeros(n, dtype=np.uint8)
    codes[lengths >= 1 << 8] = 1
    codes[lengths >= 1 << 16] = 2
    codes[lengths >= 1 << 32] = 3
    header = np.zeros((n, 9), dtype=np.uint8)
    header[:, 0] = (1 << 2) | codes
    header[:, 1:] = lengths.astype("<u8").view(np.uint8).reshape(n, 8)
    header_lengths = 1 + (1 << codes.astype(np.int64))
    header_part: _Fixed | _Var
    if n and np.all(header_lengths == header_lengths[0]):
        header_part = _Fixed(header[:, : int(header_lengths[0])])
    else:
        keep = np.arange(9)[None, :] < header_lengths[:, None]
        header_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(header_lengths, out=header_offsets[1:])
        header_part = _Var(header[keep], header_offsets)
    value_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths * numbers.itemsize, out=value_offsets[1:])
    return [header_part, _Var(numbers.view(np.uint8).reshape(-1), value_offsets)]
