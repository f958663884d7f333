"""The documents of one MDS column as one flat token array per shard, without a loop per document.

Internal to :mod:`sparkgpu.data.tokens`. A document is one sample's value of an integer
column: ``ndarray:<dtype>`` (ragged, what ``to_mds`` writes for arrays), ``ndarray`` with the
dtype in each value, or a fixed-shape ``ndarray:<dtype>:<shape>`` / scalar integer column.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparkgpu.data import _gather
from sparkgpu.data.reader import _NDARRAY_DTYPE_CODES, Column, Decode, DatasetIndex, ShardReader
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["TokenColumn"]

_DTYPE_CODE = {np.dtype(name): code for code, name in _NDARRAY_DTYPE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class TokenColumn:
    """Where a column's documents sit in each sample, and how to lay them end to end.

    Attributes:
        index: The dataset's index.
        name: The token column.
        eos_id: Token appended after every document, or ``None``.
    """

    index: DatasetIndex
    name: str
    eos_id: int | None

    def __post_init__(self):
        column = self.column
        if column.decode not in (Decode.NDARRAY, Decode.FIXED) or (column.dtype is not None and column.dtype.kind not in "iu"):
            raise ConfigurationError(
                f"column {self.name!r} has encoding {column.encoding!r}; token_dataset needs integer arrays "
                "(write token ids as an int32/int64 array column, e.g. ndarray:int32)"
            )

    @property
    def column(self) -> Column:
        for column in self.index.columns:
            if column.name == self.name:
                return column
        names = [c.name for c in self.index.columns]
        raise ConfigurationError(f"the dataset has no column {self.name!r}; its columns are {names}: pass one of them as column=")

    def spans(self, reader: ShardReader) -> tuple[np.ndarray, np.ndarray, np.dtype]:
        """Byte start and length of every document's values in ``reader``'s shard, and their dtype."""
        data = reader.data
        begins = reader.offsets[:-1].astype(np.int64)
        variable = [c for c in self.index.columns if c.size is None]
        k = len(variable)
        if k:
            heads = data[begins[:, None] + np.arange(4 * k, dtype=np.int64)]
            var_sizes = np.ascontiguousarray(heads).view("<u4").astype(np.int64)
        cursor, var_index = begins + 4 * k, 0
        for column in self.index.columns:
            if column.size is None:
                lengths, var_index = var_sizes[:, var_index], var_index + 1
            else:
                lengths = np.full(len(begins), column.size, dtype=np.int64)
            if column.name == self.name:
                break
            cursor = cursor + lengths
        column = self.column
        if column.decode is Decode.FIXED:
            return cursor, lengths, column.dtype
        dtype = column.dtype
        if dtype is None:  # the dtype is the first byte of every value
            codes = np.unique(data[cursor]) if len(cursor) else np.array([_DTYPE_CODE[np.dtype("int64")]])
            if len(codes) != 1 or int(codes[0]) not in _NDARRAY_DTYPE_CODES:
                raise DataError(f"documents of column {self.name!r} in shard {reader.info.basename} mix dtypes {codes.tolist()}; "
                                "write the column with one dtype (encoding ndarray:int32)")
            dtype = np.dtype(_NDARRAY_DTYPE_CODES[int(codes[0])])
            if dtype.kind not in "iu":
                raise ConfigurationError(f"column {self.name!r} holds {dtype} arrays; token_dataset needs integer token ids")
            cursor, lengths = cursor + 1, lengths - 1
        if column.shape is None:  # then [ndim << 2 | shape dtype code][shape]
            code = data[cursor].astype(np.int64) if len(cursor) else np.zeros(0, np.int64)
            if np.any(code >> 2 != 1):
                raise DataError(f"column {self.name!r} in shard {reader.info.basename} holds arrays of more than one "
                                "dimension; token_dataset reads one 1-D array of token ids per sample")
            header = 1 + (1 << (code & 3))
            cursor, lengths = cursor + header, lengths - header
        return cursor, lengths, dtype

    def counts(self, reader: ShardReader) -> int:
        """Tokens the shard contributes to the stream (documents plus one EOS each)."""
        _, lengths, dtype = self.spans(reader)
        return int(lengths.sum()) // dtype.itemsize + (len(lengths) if self.eos_id is not None else 0)

    def tokens(self, reader: ShardReader) -> np.ndarray:
        """The shard's documents end to end (an EOS after each), as one flat array."""
        starts, lengths, dtype = self.spans(reader)
        n_tokens = lengths // dtype.itemsize
        extra = 1 if self.eos_id is not None else 0
        ends = np.cumsum(n_tokens + extra)
        out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
        if len(out):
            firsts = ends - n_tokens - extra
            _gather.gather_spans(out.view(np.uint8), firsts * dtype.itemsize, [reader.data], None, starts, lengths)
            if extra:
                out[ends - 1] = self.eos_id
        return out
