"""Arrow rows to the batch types of the MDS loader: tensors for numbers, lists for text and bytes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["to_tensors"]


def to_tensors(table: pa.Table, fill_null=None) -> dict:
    """Turns ``table`` into ``{column: tensor or list}``.

    Integers, floats and booleans become tensors of shape ``(rows,)``; fixed-size lists of
    them ``(rows, size)`` tensors; dates and timestamps ``int64`` tensors (their Arrow unit);
    strings and binaries lists of ``str`` / ``bytes``; other lists lists of Python lists.

    Args:
        table: The batch's rows.
        fill_null: Value replacing nulls: one for all columns or ``{column: value}``.

    Raises:
        DataError: A column has nulls and no ``fill_null`` for it.
        ConfigurationError: A column's type has no tensor form (decimals, structs, maps).
    """
    batch = {}
    for name, column in zip(table.column_names, table.columns):
        fill = fill_null.get(name) if isinstance(fill_null, dict) else fill_null
        if column.null_count:
            if fill is None:
                raise DataError(f"column {name!r} has {column.null_count} null values in this batch; pass "
                                f"fill_null={{{name!r}: value}} (or filter them out with filter=\"{name} IS NOT NULL\")")
            column = pc.fill_null(column, pa.scalar(fill).cast(column.type) if not pa.types.is_nested(column.type) else fill)
        batch[name] = _convert(name, column.combine_chunks() if column.num_chunks != 1 else column.chunk(0))
    return batch


def _convert(name: str, array: pa.Array):
    kind = array.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        # Arrow buffers are read-only; the copy makes a tensor the training step may write to.
        return torch.from_numpy(np.array(array.to_numpy(zero_copy_only=False), copy=True))
    if pa.types.is_temporal(kind):
        return torch.from_numpy(np.array(array.cast(pa.int64() if kind.bit_width == 64 else pa.int32()).to_numpy(), copy=True))
    if pa.types.is_dictionary(kind):
        return _convert(name, array.dictionary_decode())
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return array.to_pylist()
    if pa.types.is_fixed_size_list(kind) and (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)):
        if array.flatten().null_count:
            raise DataError(f"column {name!r} has null elements inside its lists; fill them before reading")
        values = array.flatten().to_numpy(zero_copy_only=False)
        return torch.from_numpy(np.array(values.reshape(len(array), kind.list_size), copy=True))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return array.to_pylist()
    raise ConfigurationError(f"column {name!r} has type {kind}, which has no tensor form; leave it out with columns=, "
                             "or cast it in the table (decimals to double, structs to their fields)")
