"""Feature matrices: fixed-width numeric columns gathered straight into one ``(batch, n_features)`` tensor.

``data.dataset(..., features=["f0", "f1", ...] | "f*", target="label")`` yields ``(x, y)``
batches instead of a dict of columns. :func:`resolve_features` checks the request against the
dataset's columns before anything is read; :class:`FeatureGather` then copies, for every
batch, each feature column's bytes from the memory-mapped rows to its place in ``x`` and the
target's bytes to ``y``, in one native pass (:func:`sparkgpu.data._gather.gather_fields`), with
no per-column tensors to stack.

Types. ``x`` has the features' common dtype when they share one (the fast path: the rows'
bytes land in ``x`` as they are). When they differ, ``x`` takes the type torch promotes them to
(``torch.promote_types``: ``float32`` and ``int64`` give ``float32``; ``float16`` and
``float64`` give ``float64``); each dtype is gathered apart, then cast into its columns of
``x``. ``y`` keeps the target's own dtype and shape.

A fixed-shape array column (``ndarray:float32:8``) counts as as many features as it has
values, flattened in C order. Datasets with variable-width columns besides the features are
decoded whole, then the features are concatenated: the same batches, more slowly.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import numpy as np
import torch

from sparkgpu.data import _gather
from sparkgpu.data.mds.reader import Column, Decode
from sparkgpu.errors import ConfigurationError

__all__ = ["FeatureLayout", "resolve_features", "FeatureGather"]


@dataclasses.dataclass(frozen=True)
class FeatureLayout:
    """Which columns make ``x`` (in order) and ``y``.

    Attributes:
        features: The feature columns, in the order of ``x``'s columns.
        target: The target column, or ``None`` (batches are then ``x`` alone).
        dtype: ``x``'s dtype.
        width: ``x``'s number of columns.
    """

    features: tuple[Column, ...]
    target: Column | None
    dtype: torch.dtype
    width: int


def resolve_features(columns: tuple[Column, ...], features, target) -> FeatureLayout:
    """Checks ``features=`` and ``target=`` against a dataset's columns.

    Args:
        columns: The dataset's columns.
        features: Column names (a list or tuple, in ``x``'s order), or one glob pattern such
            as ``"f*"`` (matching columns in the dataset's order).
        target: A column name, or ``None``.

    Raises:
        ConfigurationError: A name is unknown, a pattern matches nothing, a column is not
            fixed-width numeric, or the target is also a feature.
    """
    by_name = {column.name: column for column in columns}
    names = sorted(by_name)
    if isinstance(features, str):
        chosen = [c for c in columns if fnmatch.fnmatchcase(c.name, features)]
        if target is not None:
            chosen = [c for c in chosen if c.name != target]
        if not chosen:
            raise ConfigurationError(
                f"features={features!r} matches no column of the dataset (columns: {names}); "
                "pass a pattern such as 'f*' or a list of column names"
            )
    elif isinstance(features, (list, tuple)) and features and all(isinstance(f, str) for f in features):
        unknown = [f for f in features if f not in by_name]
        if unknown:
            raise ConfigurationError(
                f"features= names {unknown}, which the dataset does not have (columns: {names}); fix the names"
            )
        if len(set(features)) != len(features):
            raise ConfigurationError(f"features={list(features)} names a column twice; name each once")
        chosen = [by_name[f] for f in features]
    else:
        raise ConfigurationError(
            f"features={features!r} must be a non-empty list of column names or a glob pattern such as 'f*'"
        )
    for column in chosen:
        _check_numeric(column, "features")
    target_column = None
    if target is not None:
        if not isinstance(target, str) or target not in by_name:
            raise ConfigurationError(f"target={target!r} is not a column of the dataset (columns: {names})")
        if any(c.name == target for c in chosen):
            raise ConfigurationError(f"target={target!r} is also in features=; leave it out of the features")
        target_column = by_name[target]
        _check_numeric(target_column, "target")
    dtype = _torch_dtype(chosen[0].dtype)
    for column in chosen[1:]:
        dtype = torch.promote_types(dtype, _torch_dtype(column.dtype))
    width = sum(int(np.prod(column.shape or ())) for column in chosen)
    return FeatureLayout(tuple(chosen), target_column, dtype, width)


def _check_numeric(column: Column, what: str) -> None:
    if column.size is None or column.decode is not Decode.FIXED or column.dtype is None:
        raise ConfigurationError(
            f"{what} column {column.name!r} has encoding {column.encoding!r}, which is not fixed-width; "
            f"{what}= takes fixed-width numeric columns (numbers, fixed-shape ndarray): leave it out and "
            "read it from the dict batches of data.dataset() without features="
        )
    if column.dtype.kind not in "biuf":
        raise ConfigurationError(
            f"{what} column {column.name!r} has dtype {column.dtype}, which is not numeric; leave it out of {what}="
        )


def _torch_dtype(dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class FeatureGather:
    """Builds one batch's ``x`` (and ``y``) from (shard, row) pairs.

    Args:
        layout: What :func:`resolve_features` resolved.
        columns: The dataset's columns, in row order.
        pinned: Allocate ``x`` and ``y`` in page-locked memory.
    """

    def __init__(self, layout: FeatureLayout, columns: tuple[Column, ...], pinned: bool = False):
        self.layout = layout
        self.pinned = pinned
        sizes = [column.size for column in columns]
        self.fixed_width = all(size is not None for size in sizes)
        offsets = dict(zip([c.name for c in columns], np.cumsum([0] + [s or 0 for s in sizes[:-1]]).tolist()))
        self.row_bytes = int(sum(s or 0 for s in sizes)) if self.fixed_width else None
        # x is gathered directly when every feature has x's dtype; otherwise one staging
        # buffer per dtype (destinations 1..), cast into x's columns after the gather.
        x_dtype = layout.dtype
        self._groups: list[tuple[np.dtype, list[int]]] = []  # (dtype, x column of each value)
        fields: list[list[int]] = []
        itemsize = torch.empty(0, dtype=x_dtype).element_size()
        column_at = 0
        staged: dict[np.dtype, int] = {}
        for column in layout.features:
            assert column.dtype is not None and column.size is not None and column.shape is not None
            values = int(np.prod(column.shape))
            if _torch_dtype(column.dtype) == x_dtype:
                fields.append([offsets[column.name], column.size, 0, column_at * itemsize, -1])
            else:
                if column.dtype not in staged:
                    staged[column.dtype] = len(self._groups)
                    self._groups.append((column.dtype, []))
                group = staged[column.dtype]
                positions = self._groups[group][1]
                fields.append(
                    [offsets[column.name], column.size, 1 + group, len(positions) * column.dtype.itemsize, -1]
                )
                positions.extend(range(column_at, column_at + values))
            column_at += values
        row_bytes_of = [layout.width * itemsize] + [dt.itemsize * len(pos) for dt, pos in self._groups]
        for field in fields:
            field[4] = row_bytes_of[field[2]]
        target = layout.target
        self._target_dst = 1 + len(self._groups)
        if target is not None:
            assert target.size is not None
            fields.append([offsets[target.name], target.size, self._target_dst, 0, target.size])
        self._fields = _merge(fields)
        self._positions = [_as_index(pos) for _, pos in self._groups]
        self._row_bytes = self.row_bytes or 0  # gather() is used on fixed-width datasets only
        self._x_dtype = torch.empty(0, dtype=x_dtype).numpy().dtype
        self._y_dtype = target.dtype if target is not None else None
        self._y_shape: tuple[int, ...] = (target.shape or ()) if target is not None else ()
        self.batch_row_bytes = layout.width * itemsize + (target.size or 0 if target is not None else 0)
        """Bytes of ``x`` and ``y`` per sample."""

    def gather(self, readers: list, source_ids: np.ndarray | None, rows: np.ndarray):
        """The batch's ``(x, y)`` (``x`` alone without a target), from fixed-width rows.

        Args:
            readers: The :class:`~sparkgpu.data.mds.reader.ShardReader` of each shard the batch reads.
            source_ids: ``int32`` position in ``readers`` of each row (``None``: all from the first).
            rows: ``int64`` row of each sample inside its shard.
        """
        # Per batch: two allocations and one native call; a few microseconds of Python in all.
        n = len(rows)
        x, x_array = self._allocate((n, self.layout.width), self._x_dtype)
        staging = [np.empty((n, dt.itemsize * len(pos)), dtype=np.uint8) for dt, pos in self._groups]
        if self._y_dtype is None:
            y = None
            dsts = [x_array, *staging]
        else:
            y, y_array = self._allocate((n, *self._y_shape), self._y_dtype)
            dsts = [x_array, *staging, y_array]
        _gather.gather_fields(dsts, [r.rows for r in readers], source_ids, rows, self._row_bytes, self._fields)
        for (dtype, _), where, raw in zip(self._groups, self._positions, staging):
            x[:, where] = torch.from_numpy(raw.view(dtype)).to(x.dtype)  # the cast of mixed dtypes
        return x if y is None else (x, y)

    def _allocate(self, shape, dtype: np.dtype) -> tuple[torch.Tensor, np.ndarray]:
        # numpy's allocation and from_numpy cost a fraction of torch.empty and a byte view.
        if self.pinned:
            tensor = torch.empty(shape, dtype=_torch_dtype(dtype), pin_memory=True)
            return tensor, tensor.numpy()
        array = np.empty(shape, dtype=dtype)
        return torch.from_numpy(array), array

    def from_columns(self, batch: dict):
        """The same ``(x, y)`` from a decoded dict batch (datasets with variable-width columns)."""
        layout = self.layout
        parts = [batch[c.name].reshape(len(batch[c.name]), -1).to(layout.dtype) for c in layout.features]
        x = torch.cat(parts, 1)
        if self.pinned:
            x = x.pin_memory()
        if layout.target is None:
            return x
        y = batch[layout.target.name]
        return x, (y.pin_memory() if self.pinned else y)


def _merge(fields: list[list[int]]) -> np.ndarray:
    # Neighbouring columns that are neighbours in x too (f0, f1, ... in row order) become one
    # field: one copy of 128 bytes per row instead of 32 copies of 4.
    merged: list[list[int]] = []
    for field in fields:
        last = merged[-1] if merged else None
        if last is not None and last[2] == field[2] and last[0] + last[1] == field[0] and last[3] + last[1] == field[3]:
            last[1] += field[1]
        else:
            merged.append(list(field))
    return np.array(merged, dtype=np.int64).reshape(-1, 5)


def _as_index(positions: list[int]):
    if positions == list(range(positions[0], positions[-1] + 1)):
        return slice(positions[0], positions[-1] + 1)
    return torch.tensor(positions, dtype=torch.int64)
