"""Where the documents of one MDS token column lie in each shard, without a loop per document.

Internal to :mod:`sparkgpu.data.loaders.tokens`. A document is one sample's value of an integer
column: ``ndarray:<dtype>`` (ragged, what ``to_mds`` writes for arrays), ``ndarray`` with the
dtype in each value, or a fixed-shape ``ndarray:<dtype>:<shape>`` / scalar integer column.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparkgpu.data.mds.reader import _NDARRAY_DTYPE_CODES, Column, Decode, DatasetIndex, ShardReader
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["TokenColumn", "ShardDocuments"]

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
        if column.decode not in (Decode.NDARRAY, Decode.FIXED) or (
            column.dtype is not None and column.dtype.kind not in "iu"
        ):
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
        raise ConfigurationError(
            f"the dataset has no column {self.name!r}; its columns are {names}: pass one of them as column="
        )

    def spans(self, reader: ShardReader) -> tuple[np.ndarray, np.ndarray, np.dtype]:
        """Byte start and length of every document's values in ``reader``'s shard, and their dtype."""
        data, offsets = reader.data, reader.offsets
        assert data is not None and offsets is not None, "the shard reader is closed"
        begins = offsets[:-1].astype(np.int64)
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
            assert column.dtype is not None  # fixed-width arrays have their dtype in the encoding
            return cursor, lengths, column.dtype
        dtype = column.dtype
        if dtype is None:  # the dtype is the first byte of every value
            codes = np.unique(data[cursor]) if len(cursor) else np.array([_DTYPE_CODE[np.dtype("int64")]])
            if len(codes) != 1 or int(codes[0]) not in _NDARRAY_DTYPE_CODES:
                raise DataError(
                    f"documents of column {self.name!r} in shard {reader.info.basename} mix dtypes {codes.tolist()}; "
                    "write the column with one dtype (encoding ndarray:int32)"
                )
            dtype = np.dtype(_NDARRAY_DTYPE_CODES[int(codes[0])])
            if dtype.kind not in "iu":
                raise ConfigurationError(
                    f"column {self.name!r} holds {dtype} arrays; token_dataset needs integer token ids"
                )
            cursor, lengths = cursor + 1, lengths - 1
        if column.shape is None:  # then [ndim << 2 | shape dtype code][shape]
            code = data[cursor].astype(np.int64) if len(cursor) else np.zeros(0, np.int64)
            if np.any(code >> 2 != 1):
                raise DataError(
                    f"column {self.name!r} in shard {reader.info.basename} holds arrays of more than one "
                    "dimension; token_dataset reads one 1-D array of token ids per sample"
                )
            header = 1 + (1 << (code & 3))
            cursor, lengths = cursor + header, lengths - header
        return cursor, lengths, dtype

    def counts(self, reader: ShardReader) -> int:
        """Tokens the shard contributes to the stream (documents plus one EOS each)."""
        _, lengths, dtype = self.spans(reader)
        return int(lengths.sum()) // dtype.itemsize + (len(lengths) if self.eos_id is not None else 0)

    def documents(self, reader: ShardReader) -> "ShardDocuments":
        """Where each document of ``reader``'s shard starts, in the shard's stream and in its file."""
        byte_starts, lengths, dtype = self.spans(reader)
        n_tokens = lengths // dtype.itemsize
        extra = 1 if self.eos_id is not None else 0
        ends = np.cumsum(n_tokens + extra)
        return ShardDocuments(starts=ends - n_tokens - extra, lengths=n_tokens, byte_starts=byte_starts, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class ShardDocuments:
    """One shard's documents as spans of its stream; a block is cut as a few spans of the file.

    Attributes:
        starts: Token position of each document in the shard's stream (EOS tokens counted).
        lengths: Tokens of each document (its EOS not counted).
        byte_starts: Byte offset of each document's first token in the shard file.
        dtype: The tokens' dtype.
    """

    starts: np.ndarray
    lengths: np.ndarray
    byte_starts: np.ndarray
    dtype: np.dtype

    def pieces(self, begins: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Splits stream ranges ``[begins[i], ends[i])`` (non-empty, inside the shard) at document ends.

        Returns:
            ``(range, offset, byte_start, tokens)`` per piece: the range it belongs to, its token
            offset from that range's begin, where its tokens start in the file, and how many
            there are (0 for a piece that is only an EOS position).
        """
        first = np.searchsorted(self.starts, begins, side="right") - 1
        last = np.searchsorted(self.starts, ends - 1, side="right") - 1
        per_range = last - first + 1
        owner = np.repeat(np.arange(len(begins), dtype=np.int64), per_range)
        doc = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(per_range) - per_range - first, per_range)
        doc_start = self.starts[doc]
        lo = np.maximum(begins[owner], doc_start)
        hi = np.minimum(ends[owner], doc_start + self.lengths[doc])
        return (
            owner,
            lo - begins[owner],
            self.byte_starts[doc] + (lo - doc_start) * self.dtype.itemsize,
            np.maximum(hi - lo, 0),
        )

    def eos_positions(self, begins: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(range, offset)`` of every EOS token inside the ranges (the token after each document)."""
        eos = self.starts + self.lengths
        first = np.searchsorted(eos, begins, side="left")
        last = np.searchsorted(eos, ends, side="left")
        per_range = last - first
        owner = np.repeat(np.arange(len(begins), dtype=np.int64), per_range)
        doc = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(per_range) - per_range - first, per_range)
        return owner, eos[doc] - begins[owner]
