"""Whole batches decoded at once from memory-mapped MDS shards.

When every column has a fixed width (numbers, fixed-shape arrays), every sample has the same
size, so a batch is one row gather from the shard bodies into one buffer, and each column is
a strided view of that buffer: no per-sample Python at all. Variable-width columns (``str``,
``bytes``, arrays of varying shape, ...) are gathered column by column into packed buffers,
then split.

Image columns (``jpeg``, ``png``, ``pil``) become lists of decoded tensors, except the ones
named in ``encoded=``: those stay lists of the files' bytes (views of one packed buffer), for
the fused crop-and-decode of the loaders' ``decode=`` (:mod:`sparkgpu.data.augment.columns`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from sparkgpu.data import _gather
from sparkgpu.data.mds.reader import _NDARRAY_DTYPE_CODES, Column, Decode, ShardReader
from sparkgpu.errors import MissingDependencyError

__all__ = ["BatchDecoder"]

_SHAPE_DTYPES = ("<u1", "<u2", "<u4", "<u8")  # ndarray shape dtypes by their 2-bit code


class BatchDecoder:
    """Turns (shard, row) pairs into a dict of column values for one batch.

    Args:
        columns: The dataset's columns.
        allocate: ``allocate(nbytes) -> torch.Tensor`` of ``uint8``; where batch buffers come
            from (plain or pinned memory).
        encoded: Image (or bytes) columns to hand over undecoded, as ``memoryview`` objects of
            their encoded bytes.
    """

    def __init__(
        self,
        columns: tuple[Column, ...],
        allocate: Callable[[int], Any] | None,
        encoded: Collection[str] = (),
    ):
        import torch

        self._torch = torch
        self.columns = columns
        self.allocate = allocate
        self.encoded = frozenset(encoded)
        sizes = [column.size for column in columns]
        fixed_sizes = [size for size in sizes if size is not None]
        self.fixed_width = len(fixed_sizes) == len(sizes)
        self.row_bytes: int | None = sum(fixed_sizes) if self.fixed_width else None
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
        row_bytes = self.row_bytes
        assert row_bytes is not None  # views are planned for fixed-width datasets only
        for column in self.columns:
            # Every column of a fixed-width dataset has a dtype, a shape and a size.
            assert column.dtype is not None and column.shape is not None and column.size is not None
            itemsize = column.dtype.itemsize
            aligned = offset % itemsize == 0 and row_bytes % itemsize == 0
            last = views[-1] if views else None
            if (
                last is not None
                and column.shape == ()
                and last.shape == ()
                and last.dtype == column.dtype
                and aligned
                and last.aligned
                and last.offset + itemsize * len(last.names) == offset
            ):
                last.names.append(column.name)
            else:
                views.append(
                    _ColumnView(
                        [column.name],
                        column.dtype,
                        _torch_dtype(self._torch, column.dtype),
                        column.shape,
                        offset,
                        column.size,
                        aligned,
                        row_bytes,
                    )
                )
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
        views, row_bytes = self._views, self.row_bytes
        assert views is not None and row_bytes is not None  # only fixed-width datasets have gathered rows
        n = buffer.numel() // row_bytes
        base = buffer.storage_offset()
        typed = {}
        batch: dict[str, Any] = {}
        for view in views:
            if view.aligned:
                if view.tdtype not in typed:
                    typed[view.tdtype] = buffer.view(view.tdtype)
                view.place(batch, typed[view.tdtype], n, base)
            else:
                # A column at an offset its dtype cannot be viewed at: copy it out.
                # (clone, not contiguous(): a one-row slice counts as contiguous and keeps the row stride)
                raw = buffer.view(n, row_bytes)[:, view.offset : view.offset + view.size].flatten().clone()
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

    def _pack(self, sources, source_ids, starts, lengths, align=None):
        # With ``align`` (the itemsize of the values, 1 included) the spans go into a tensor
        # from ``allocate``, to be viewed as that dtype; without, into a numpy byte buffer.
        offsets = np.cumsum(lengths) - lengths
        packed = self.allocate(max(int(lengths.sum()), align)) if align is not None else None
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
        if column.name in self.encoded:
            # For the fused decoder, which reads buffers: views of the packed bytes, not copies.
            packed = memoryview(array)
            return [packed[o : o + ln] for o, ln in zip(offsets.tolist(), lengths.tolist())]
        blob = array.tobytes()
        items = [blob[o : o + ln] for o, ln in zip(offsets.tolist(), lengths.tolist())]
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
        if column.decode is Decode.IMAGE:
            from sparkgpu.data.images import decode_image_column

            return decode_image_column(column.encoding, items)
        try:
            from streaming.base.format.mds.encodings import mds_decode
        except ImportError:
            raise MissingDependencyError(
                f"Decoding the MDS encoding {column.encoding!r}", "pip install 'sparkgpu[streaming]'"
            ) from None

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
                shape = tuple(head[cursor + 1 : cursor + 1 + ndim * shape_dtype.itemsize].view(shape_dtype).tolist())
                cursor += 1 + ndim * shape_dtype.itemsize
            else:
                shape = column.shape
            dtypes.append(dtype)
            shapes.append(shape)
            header_lengths[i] = cursor - offset
        value_lengths = lengths - header_lengths
        if column.dtype is not None:
            packed, _, _ = self._pack(
                sources, source_ids, starts + header_lengths, value_lengths, align=column.dtype.itemsize
            )
            flat = packed[: int(value_lengths.sum())].view(_torch_dtype(torch, column.dtype))
            parts = torch.split(flat, (value_lengths // column.dtype.itemsize).tolist())
            return [part if len(shape) == 1 else part.reshape(shape) for part, shape in zip(parts, shapes)]
        values = []
        for i in range(n):  # the dtype differs per sample: one small gather each
            one = slice(i, i + 1)
            ids = None if source_ids is None else source_ids[one]
            packed, _, _ = self._pack(
                sources, ids, starts[one] + header_lengths[one], value_lengths[one], align=dtypes[i].itemsize
            )
            values.append(packed[: int(value_lengths[i])].view(_torch_dtype(torch, dtypes[i])).reshape(shapes[i]))
        return values


class _ColumnView:
    """Where one column (or a run of same-typed scalar columns) sits in a gathered row."""

    __slots__ = ("names", "dtype", "tdtype", "shape", "offset", "size", "aligned", "_row_items", "_inner")

    def __init__(self, names, dtype, tdtype, shape, offset, size, aligned, row_bytes):
        self.names, self.dtype, self.tdtype, self.shape = names, dtype, tdtype, shape
        self.offset, self.size, self.aligned = offset, size, aligned
        self._row_items = row_bytes // dtype.itemsize
        self._inner = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))

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
