"""Which MDS encoding stores each Arrow column: :class:`ColumnSpec` and :func:`plan_columns`.

The encodings are MosaicML Streaming's (``streaming/base/format/mds/encodings.py``): numbers as
fixed-width scalars, strings and bytes as variable-size values, arrays as ``ndarray`` with the
shape in the encoding (static) or in each sample (dynamic), encoded images verbatim. A type MDS
cannot store is refused with the fix named. :mod:`sparkgpu.data.mds.encoding` encodes record batches with
the plan made here.

Runs on Spark executors, shipped by value like :mod:`sparkgpu.data.mds.encoding`: at module level it
imports only numpy, pyarrow and the standard library.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["ColumnKind", "ColumnSpec", "IMAGE_SIGNATURES", "plan_columns"]


# Scalar encodings and the numpy dtype each stores (streaming's Scalar encodings).
_SCALARS = {
    name: np.dtype(name)
    for name in (
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}
# Value dtypes streaming's NDArray encoding knows (NDArray._value_dtype2int).
_NDARRAY_DTYPES = frozenset(_SCALARS)


class ColumnKind(enum.Enum):
    """How the encoder builds a column's bytes."""

    SCALAR = "scalar"  # fixed-width number; bool stored as uint8
    INT = "int"  # streaming's "int": int64 bytes, decoded as a Python int
    STR = "str"
    BYTES = "bytes"
    DECIMAL = "str_decimal"  # digits as UTF-8, decoded as decimal.Decimal
    NDARRAY_STATIC = "ndarray_static"  # "ndarray:<dtype>:<shape>", fixed size
    NDARRAY_DYNAMIC = "ndarray_dynamic"  # "ndarray:<dtype>", shape stored per sample
    IMAGE = "image"  # encoded image bytes ("jpeg", "png"), stored verbatim


# What every value of an encoded image column starts with.
IMAGE_SIGNATURES = {"jpeg": b"\xff\xd8\xff", "png": b"\x89PNG\r\n\x1a\n"}


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    """How one column is stored.

    Attributes:
        name: Column name.
        encoding: The MDS encoding, as ``index.json`` names it (``"float32"``, ``"str"``,
            ``"ndarray:float32:3,4"``, ...).
        size: Bytes per sample for fixed-size encodings, ``None`` for variable-size ones.
        kind: How the encoder builds the bytes.
        dtype: numpy dtype name of the stored values (numbers and arrays).
        shape: Per-sample shape of static arrays.
    """

    name: str
    encoding: str
    size: int | None
    kind: ColumnKind
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


# --------------------------------------------------------------------------------------------
# Arrow type -> MDS encoding
# --------------------------------------------------------------------------------------------


def plan_columns(schema: pa.Schema, columns=None) -> tuple[ColumnSpec, ...]:
    """Chooses the MDS encoding of every column, before any data is read.

    Defaults: integers and floats keep their width (``int8`` .. ``uint64``, ``float16`` ..
    ``float64``), bool becomes ``uint8``, strings ``str``, binary ``bytes``, decimals
    ``str_decimal``, fixed-size lists and fixed-shape tensors ``ndarray:<dtype>:<shape>``,
    variable-length lists of numbers ``ndarray:<dtype>``.

    Args:
        schema: Arrow schema of the source.
        columns: ``None`` for every column; a sequence of names to keep only those; or a
            mapping name -> encoding that chooses the encoding of the columns it names
            (``None``: the default) while every other column is kept with its default
            encoding, e.g. ``{"image": "jpeg"}`` to store JPEG files as they are beside the
            labels, ``{"emb": "ndarray:float32:128"}`` to give a Spark array column a fixed
            shape, or ``{"label": "int32"}`` to narrow a number. (A mapping never drops a
            column: select columns with a list, or in the source.)

    Returns:
        One spec per column, in name order (the order ``MDSWriter`` stores them in).

    Raises:
        DataError: A column does not exist, or its type cannot be stored; the message names
            the column, its type and the cast that fixes it.
    """
    names = list(schema.names)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise DataError(f"columns {duplicates} appear more than once; rename them (alias) so every name is unique")
    if columns is None:
        wanted = {name: None for name in names}
    elif isinstance(columns, Mapping):
        # Encodings for the named columns; the others keep theirs (a user naming one column's
        # encoding does not mean to lose the rest, e.g. the labels beside {"image": "jpeg"}).
        wanted = {name: None for name in names} | dict(columns)
    elif isinstance(columns, str):
        raise ConfigurationError(
            f"columns must be a list of names or a dict name -> encoding, got the string {columns!r}"
        )
    else:
        wanted = {name: None for name in columns}
    missing = [name for name in wanted if name not in names]
    if missing:
        raise DataError(f"columns {missing} are not in the source; it has {names}")
    if not wanted:
        raise DataError("nothing to convert: the source has no columns")
    specs = []
    for name in sorted(wanted):
        field = schema.field(name)
        encoding = wanted[name]
        specs.append(
            _default_spec(name, field.type) if encoding is None else _override_spec(name, field.type, encoding)
        )
    return tuple(specs)


def _value_type(arrow_type: pa.DataType) -> pa.DataType:
    return arrow_type.value_type if pa.types.is_dictionary(arrow_type) else arrow_type


def _numeric_dtype(arrow_type: pa.DataType) -> str | None:
    """numpy dtype name MDS stores an Arrow number (or bool) as, or None for other types."""
    if pa.types.is_boolean(arrow_type):
        return "uint8"
    if pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type):
        name = np.dtype(arrow_type.to_pandas_dtype()).name
        return name if name in _SCALARS else None
    return None


def _tensor_layout(arrow_type: pa.DataType) -> tuple[str, tuple[int, ...]] | None:
    """(dtype, shape) of a fixed-size list (nested any depth) or fixed-shape tensor of numbers."""
    if isinstance(arrow_type, pa.FixedShapeTensorType):
        if arrow_type.permutation not in (None, list(range(len(arrow_type.shape)))):
            return None
        dtype = _numeric_dtype(arrow_type.value_type)
        return (dtype, tuple(arrow_type.shape)) if dtype else None
    shape = []
    while pa.types.is_fixed_size_list(arrow_type):
        shape.append(arrow_type.list_size)
        arrow_type = arrow_type.value_type
    dtype = _numeric_dtype(arrow_type)
    if not shape or dtype is None or min(shape) < 1:
        return None
    return dtype, tuple(shape)


def _is_var_list(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _is_string(arrow_type: pa.DataType) -> bool:
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type)


def _is_binary(arrow_type: pa.DataType) -> bool:
    return (
        pa.types.is_binary(arrow_type)
        or pa.types.is_large_binary(arrow_type)
        or pa.types.is_fixed_size_binary(arrow_type)
        or pa.types.is_binary_view(arrow_type)
    )


def _ndarray_encoding(dtype: str, shape: tuple[int, ...] | None) -> str:
    return f"ndarray:{dtype}" if shape is None else f"ndarray:{dtype}:{','.join(map(str, shape))}"


def _default_spec(name: str, arrow_type: pa.DataType) -> ColumnSpec:
    value_type = _value_type(arrow_type)
    dtype = _numeric_dtype(value_type)
    if dtype is not None:
        return ColumnSpec(name, dtype, _SCALARS[dtype].itemsize, ColumnKind.SCALAR, dtype)
    if _is_string(value_type):
        return ColumnSpec(name, "str", None, ColumnKind.STR)
    if _is_binary(value_type):
        return ColumnSpec(name, "bytes", None, ColumnKind.BYTES)
    if pa.types.is_decimal(value_type):
        return ColumnSpec(name, "str_decimal", None, ColumnKind.DECIMAL)
    layout = _tensor_layout(value_type)
    if layout is not None:
        dtype, shape = layout
        size = int(np.prod(shape)) * _SCALARS[dtype].itemsize
        return ColumnSpec(name, _ndarray_encoding(dtype, shape), size, ColumnKind.NDARRAY_STATIC, dtype, shape)
    if _is_var_list(value_type):
        dtype = _numeric_dtype(value_type.value_type)
        if dtype is not None:
            return ColumnSpec(name, _ndarray_encoding(dtype, None), None, ColumnKind.NDARRAY_DYNAMIC, dtype)
    raise DataError(f"column {name!r} has type {arrow_type}, which MDS cannot store; {_fix_hint(name, value_type)}")


def _fix_hint(name: str, arrow_type: pa.DataType) -> str:
    if (
        pa.types.is_timestamp(arrow_type)
        or pa.types.is_date(arrow_type)
        or pa.types.is_time(arrow_type)
        or pa.types.is_duration(arrow_type)
    ):
        return (
            f"cast it to a number or a string first, e.g. unix_micros({name}) or "
            f"{name}.cast('string') in Spark, pyarrow.compute.cast({name}, pa.int64()) in Arrow"
        )
    if pa.types.is_struct(arrow_type):
        return (
            f"select its fields as separate columns ({name}.field), or, for a Spark ML vector, "
            f"convert it with pyspark.ml.functions.vector_to_array({name})"
        )
    if _is_var_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        return (
            "only lists of numbers (any depth of fixed-size lists, or one level of variable-length "
            f"list) become arrays; flatten nested lists, or serialize {name} to a string or binary column"
        )
    if pa.types.is_map(arrow_type):
        return f"turn it into a JSON string first, e.g. to_json({name}) in Spark"
    if pa.types.is_null(arrow_type):
        return f"the column holds only nulls; drop {name} or cast it to the type it should have"
    return f"cast {name} to a number, string or binary column first"


def _override_spec(name: str, arrow_type: pa.DataType, encoding: str) -> ColumnSpec:
    """Spec for an encoding the caller chose; checks the column's type can feed it."""
    value_type = _value_type(arrow_type)
    source_dtype = _numeric_dtype(value_type)
    wrong = DataError(
        f"column {name!r} of type {arrow_type} cannot be written with encoding {encoding!r}; "
        "numbers take int8..uint64, float16..float64 or int; strings str or bytes; binary bytes; "
        "decimals str_decimal; lists of numbers ndarray:<dtype> or ndarray:<dtype>:<shape>; "
        "encoded image files (binary) jpeg or png"
    )
    if encoding in _SCALARS:
        if source_dtype is None:
            raise wrong
        return ColumnSpec(name, encoding, _SCALARS[encoding].itemsize, ColumnKind.SCALAR, encoding)
    if encoding == "int":
        if not (pa.types.is_integer(value_type) or pa.types.is_boolean(value_type)):
            raise wrong
        return ColumnSpec(name, "int", 8, ColumnKind.INT, "int64")
    if encoding == "str":
        if not _is_string(value_type):
            raise wrong
        return ColumnSpec(name, "str", None, ColumnKind.STR)
    if encoding == "bytes":
        if not (_is_binary(value_type) or _is_string(value_type)):
            raise wrong
        return ColumnSpec(name, "bytes", None, ColumnKind.BYTES)
    if encoding in IMAGE_SIGNATURES:
        if not _is_binary(value_type):
            raise wrong
        return ColumnSpec(name, encoding, None, ColumnKind.IMAGE)
    if encoding == "str_decimal":
        if not pa.types.is_decimal(value_type):
            raise wrong
        return ColumnSpec(name, "str_decimal", None, ColumnKind.DECIMAL)
    match = re.fullmatch(r"ndarray:(\w+)(?::(\d+(?:,\d+)*))?", encoding)
    if match:
        dtype, shape_text = match.groups()
        if dtype not in _NDARRAY_DTYPES:
            raise DataError(
                f"encoding {encoding!r} of column {name!r}: dtype {dtype!r} is not one of {sorted(_NDARRAY_DTYPES)}"
            )
        layout = _tensor_layout(value_type)
        list_of_numbers = _is_var_list(value_type) and _numeric_dtype(value_type.value_type) is not None
        if layout is None and not list_of_numbers:
            raise wrong
        if shape_text is None:
            if layout is not None and len(layout[1]) > 1:
                raise DataError(
                    f"column {name!r} has shape {layout[1]}; give it in the encoding: {_ndarray_encoding(dtype, layout[1])!r}"
                )
            return ColumnSpec(name, encoding, None, ColumnKind.NDARRAY_DYNAMIC, dtype)
        shape = tuple(int(d) for d in shape_text.split(","))
        if min(shape) < 1:
            raise DataError(f"encoding {encoding!r} of column {name!r}: every dimension must be at least 1")
        if layout is not None and int(np.prod(layout[1])) != int(np.prod(shape)):
            raise DataError(
                f"column {name!r} holds {int(np.prod(layout[1]))} values per row, encoding {encoding!r} wants {int(np.prod(shape))}"
            )
        size = int(np.prod(shape)) * _SCALARS[dtype].itemsize
        return ColumnSpec(name, _ndarray_encoding(dtype, shape), size, ColumnKind.NDARRAY_STATIC, dtype, shape)
    raise wrong
