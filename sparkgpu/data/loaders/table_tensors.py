"""Arrow rows to the batch types of the MDS loader: tensors for numbers, lists for text and bytes.

Integers, floats and booleans become tensors of shape ``(rows,)``; fixed-size lists of them
``(rows, size)`` tensors; dates and timestamps ``int64`` tensors (their Arrow unit); strings and
binaries lists of ``str`` / ``bytes``; other lists lists of Python lists. Decimals, structs and
maps have no batch form and are refused with the column named.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["UnitColumns", "gather_batch", "gather_runs"]


class UnitColumns:
    """One row group's columns, converted once: fixed-width ones as numpy rows, the rest as Arrow.

    A batch then copies its rows out of the row groups it draws from (:func:`gather_batch`)
    instead of an Arrow ``take`` over the concatenated groups and a conversion per batch. Runs
    of consecutive rows (reading in order) are sliced column by column. Rows drawn at random
    (shuffled) come from a row-major copy of the fixed-width columns, made once per row group
    with :meth:`pack`: a batch's rows are then a few cache lines each, and one native pass
    copies every column's bytes of them straight into that column's tensor.

    Args:
        table: The row group's rows (filtered, deletion vectors applied).
        fill_null: Value replacing nulls: one for all columns or ``{column: value}``.
        own: Make the fixed-width columns writable now (on the read thread that builds this),
            so that a batch of consecutive rows is a view of them rather than a copy made when
            the batch is asked for. A buffer Arrow decoded for this read alone (a mutable one)
            is taken over as it is; any other is copied. Each row goes to one batch per epoch,
            so a training step writing to its batch changes no other batch.

    Raises:
        DataError: A column has nulls and no ``fill_null`` for it.
        ConfigurationError: A column's type has no batch form.
    """

    def __init__(self, table: pa.Table, fill_null=None, own: bool = False):
        self.num_rows = table.num_rows
        self.owned = own
        self.names = table.column_names
        self.fixed: dict[str, np.ndarray] = {}  # name -> its rows as a (rows, row_bytes) uint8 array
        self.shapes: dict[str, tuple[np.dtype, tuple]] = {}  # name -> element dtype and shape of one row
        self.other: dict[str, pa.Array] = {}
        for name, column in zip(table.column_names, table.columns):
            array = _filled(name, column, fill_null)
            values = _fixed_width(name, array)
            if values is None:
                _convert(name, array[:0])  # refuses types with no batch form now, not at the first batch
                self.other[name] = array
            else:
                self.shapes[name] = (values.dtype, values.shape[1:])
                row_bytes = values.dtype.itemsize * int(np.prod(values.shape[1:], dtype=np.int64))
                values = _writable(array, values) if own else np.ascontiguousarray(values)
                self.fixed[name] = values.view(np.uint8).reshape(len(values), row_bytes)
        # name -> (word size, first word, end word) in a packed row. Each column starts at a
        # multiple of the largest word (8, 4, 2 or 1 bytes) dividing its width, so a batch splits
        # the packed rows into columns with copies of whole words rather than of single bytes.
        self.layout: dict[str, tuple[int, int, int]] = {}
        width = 0
        for name, column in self.fixed.items():
            size = column.shape[1]
            word = next(w for w in (8, 4, 2, 1) if size % w == 0)
            width = -(-width // word) * word
            self.layout[name] = (word, width // word, (width + size) // word)
            width += size
        self.row_bytes = -(-width // 8) * 8
        # One row per column for gather_fields: (byte offset in a packed row, bytes, column, 0, bytes).
        self.fields = np.array(
            [
                (begin * word, (end - begin) * word, index, 0, (end - begin) * word)
                for index, (word, begin, end) in enumerate(self.layout.values())
            ],
            dtype=np.int64,
        ).reshape(-1, 5)
        self.packed: np.ndarray | None = None

    def pack(self) -> np.ndarray:
        """The fixed-width columns side by side, one row per row: ``(rows, row_bytes)`` uint8."""
        if self.packed is None:
            packed = np.zeros((self.num_rows, self.row_bytes), dtype=np.uint8)
            for name, (word, begin, end) in self.layout.items():
                words = packed.view(_WORDS[word])
                words[:, begin:end] = self.fixed[name].view(_WORDS[word])
            self.packed = packed
        return self.packed


_WORDS = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}


def gather_batch(units: list[UnitColumns], unit_ids: np.ndarray, rows: np.ndarray) -> dict:
    """The batch whose row ``i`` is row ``rows[i]`` of ``units[unit_ids[i]]``: tensors and lists by column.

    Fixed-width columns come from one native pass over the packed rows (:meth:`UnitColumns.pack`)
    that writes each column's bytes straight into that column's own array (``gather_fields``):
    no batch of whole rows to split into columns after. The rest come from an Arrow ``take``.
    For batches of consecutive rows, :func:`gather_runs` is the cheaper way.

    Args:
        units: The row groups the batch draws from.
        unit_ids: Position in ``units`` of each batch row.
        rows: Row of each batch row inside its row group.
    """
    n = len(rows)
    unit_ids = np.ascontiguousarray(unit_ids, dtype=np.int32)
    first = units[0]
    fixed = {name: np.empty((n,) + shape, dtype=dtype) for name, (dtype, shape) in first.shapes.items()}
    if fixed:
        from sparkgpu.data._gather import gather_fields

        gather_fields(
            list(fixed.values()),
            [u.pack() for u in units],
            unit_ids if len(units) > 1 else None,
            rows,
            first.row_bytes,
            first.fields,
        )
    batch = {}
    for name in first.names:
        if name in fixed:
            batch[name] = torch.from_numpy(fixed[name])
        else:
            chunks = pa.chunked_array([u.other[name] for u in units])
            base = np.cumsum([0] + [u.num_rows for u in units[:-1]]).astype(np.int64)
            taken = chunks.take(pa.array(rows + base[unit_ids]))
            batch[name] = _convert(name, taken.combine_chunks() if taken.num_chunks != 1 else taken.chunk(0))
    return batch


def gather_runs(runs: list[tuple[UnitColumns, int, int]]) -> dict:
    """The batch made of rows ``a`` to ``b`` (exclusive) of each ``(unit, a, b)`` of ``runs``, in turn.

    A batch of one run of an owned row group is a view of it; several runs are concatenated.
    """
    n = sum(b - a for _, a, b in runs)
    batch = {}
    first = runs[0][0]
    for name in first.names:
        if name in first.fixed:
            dtype, shape = first.shapes[name]
            pieces = [u.fixed[name][a:b] for u, a, b in runs]
            if len(pieces) > 1:
                out = np.concatenate(pieces)
            else:  # Arrow's buffers are read-only: a batch the step may write to is a copy of them
                out = pieces[0] if first.owned else pieces[0].copy()
            batch[name] = torch.from_numpy(out.view(dtype).reshape((n,) + shape))
        else:
            parts = [u.other[name].slice(a, b - a) for u, a, b in runs]
            batch[name] = _convert(name, pa.concat_arrays(parts) if len(parts) > 1 else parts[0])
    return batch


def _filled(name: str, column: pa.ChunkedArray, fill_null) -> pa.Array:
    fill = fill_null.get(name) if isinstance(fill_null, dict) else fill_null
    if column.null_count:
        if fill is None:
            raise DataError(
                f"column {name!r} has {column.null_count} null values; pass fill_null={{{name!r}: value}} "
                f'(or filter them out with filter="{name} IS NOT NULL")'
            )
        column = pc.fill_null(
            column, pa.scalar(fill).cast(column.type) if not pa.types.is_nested(column.type) else fill
        )
    return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


def _fixed_width(name: str, array: pa.Array) -> np.ndarray | None:
    """The column as a numpy array of fixed-size rows, or None for strings, binaries and lists."""
    kind = array.type
    if pa.types.is_dictionary(kind):
        return _fixed_width(name, array.dictionary_decode())
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return array.to_numpy(zero_copy_only=False)
    if pa.types.is_temporal(kind):
        return array.cast(pa.int64() if kind.bit_width == 64 else pa.int32()).to_numpy()
    if pa.types.is_fixed_size_list(kind) and (
        pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)
    ):
        flat = array.flatten()
        if flat.null_count:
            raise DataError(f"column {name!r} has null elements inside its lists; fill them before reading")
        return flat.to_numpy(zero_copy_only=False).reshape(len(array), kind.list_size)
    return None


def _writable(array: pa.Array, values: np.ndarray) -> np.ndarray:
    """``values`` (what :func:`_fixed_width` made of ``array``) as a writable array of its own.

    Parquet decoding fills new, mutable Arrow buffers that nothing else refers to; numpy views
    of Arrow data are marked read-only all the same. Such a buffer is taken over without a
    copy (the view keeps it alive); shared or immutable buffers (a memory-mapped file, a
    decoded dictionary's values) and converted values are copied.
    """
    flat = array.flatten() if pa.types.is_fixed_size_list(array.type) else array
    if pa.types.is_integer(flat.type) or pa.types.is_floating(flat.type):
        data = flat.buffers()[1]
        if data is not None and data.is_mutable and values.flags.c_contiguous:
            view = np.frombuffer(data, dtype=values.dtype, count=values.size, offset=flat.offset * values.itemsize)
            if view.flags.writeable:
                return view.reshape(values.shape)
    return np.array(values, order="C", copy=True)


def _convert(name: str, array: pa.Array):
    kind = array.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        # Arrow buffers are read-only; the copy makes a tensor the training step may write to.
        return torch.from_numpy(np.array(array.to_numpy(zero_copy_only=False), copy=True))
    if pa.types.is_temporal(kind):
        return torch.from_numpy(
            np.array(array.cast(pa.int64() if kind.bit_width == 64 else pa.int32()).to_numpy(), copy=True)
        )
    if pa.types.is_dictionary(kind):
        return _convert(name, array.dictionary_decode())
    if (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    ):
        return array.to_pylist()
    if pa.types.is_fixed_size_list(kind) and (
        pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)
    ):
        if array.flatten().null_count:
            raise DataError(f"column {name!r} has null elements inside its lists; fill them before reading")
        values = array.flatten().to_numpy(zero_copy_only=False)
        return torch.from_numpy(np.array(values.reshape(len(array), kind.list_size), copy=True))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return array.to_pylist()
    raise ConfigurationError(
        f"column {name!r} has type {kind}, which has no tensor form; leave it out with columns=, "
        "or cast it in the table (decimals to double, structs to their fields)"
    )
