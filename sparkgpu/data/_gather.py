"""The copies every batch is made of, in C when ``sparkgpu._native`` is built, else numpy.

``gather_rows`` copies fixed-size rows, ``gather_spans`` variable-size byte spans,
``gather_fields`` chosen byte ranges of fixed-size rows into dense buffers of their own (a
feature matrix and its target); all take
rows from several shards at once and write them in the batch's order into a buffer the
caller allocated (pinned, when asked). The native versions check every index before they
release the GIL and split large batches across threads; ``benchmarks/bench_loader.py``
measures them against these numpy versions, and a native path stays only where it wins.
"""

from __future__ import annotations

import os

import numpy as np

try:
    from sparkgpu import _native
except ImportError:  # built without a C compiler: the numpy paths below do the same work
    _native = None

__all__ = [
    "native_available",
    "set_native_enabled",
    "native_enabled",
    "gather_rows",
    "gather_spans",
    "gather_fields",
]

_enabled = _native is not None
_THREADS = max(1, min(8, os.cpu_count() or 1))


def native_available() -> bool:
    """True when the C extension was built and imports."""
    return _native is not None


def native_enabled() -> bool:
    """True when batches are gathered by the C extension (built and not switched off)."""
    return _enabled


def set_native_enabled(enabled: bool) -> bool:
    """Switches the C gathers on or off (benchmarks compare both); returns the previous value.

    Args:
        enabled: Use the C extension when it is built.
    """
    global _enabled
    previous = _enabled
    _enabled = bool(enabled) and _native is not None
    return previous


def gather_rows(dst: np.ndarray, sources: list[np.ndarray], source_ids: np.ndarray | None, rows: np.ndarray) -> None:
    """Copies row ``rows[i]`` of ``sources[source_ids[i]]`` into row ``i`` of ``dst``.

    Args:
        dst: Writable C-contiguous ``uint8`` array of shape ``(n, row_bytes)`` (or larger).
        sources: One ``uint8`` array of shape ``(rows_in_shard, row_bytes)`` per shard.
        source_ids: ``int32`` shard position of each row, or ``None`` when all come from
            ``sources[0]``.
        rows: ``int64`` row index inside its shard, one per batch row.

    Raises:
        IndexError: A row or shard index is out of range.
    """
    n = len(rows)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if source_ids is not None:
        source_ids = np.ascontiguousarray(source_ids, dtype=np.int32)
    if _enabled:
        _native.gather_rows(dst, sources, source_ids, rows, dst.shape[1], _THREADS)
        return
    out = dst[:n]
    if source_ids is None or len(sources) == 1:
        _check_rows(rows, len(sources[0]))
        np.take(sources[0], rows, axis=0, out=out, mode="clip")
        return
    for position, source in enumerate(sources):
        mask = source_ids == position
        picked = rows[mask]
        _check_rows(picked, len(source))
        out[mask] = np.take(source, picked, axis=0, mode="clip")


def gather_fields(
    dsts: list[np.ndarray],
    sources: list[np.ndarray],
    source_ids: np.ndarray | None,
    rows: np.ndarray,
    row_bytes: int,
    fields: np.ndarray,
) -> None:
    """Copies byte ranges of fixed-size rows straight into their own dense buffers.

    For every field ``(src_offset, length, dst_index, dst_offset, dst_row_bytes)`` (one row of
    the ``int64`` array ``fields``), bytes ``[src_offset, src_offset + length)`` of row
    ``rows[i]`` of ``sources[source_ids[i]]`` go to ``dsts[dst_index]`` at byte
    ``i * dst_row_bytes + dst_offset``: one pass builds a ``(batch, n_features)`` matrix and
    its target from the rows, without gathering whole rows first.

    Args:
        dsts: Writable C-contiguous arrays (any dtype: their bytes are written), one per destination.
        sources: One ``uint8`` array of shape ``(rows_in_shard, row_bytes)`` per shard.
        source_ids: ``int32`` shard position of each row, or ``None`` for ``sources[0]``.
        rows: ``int64`` row index inside its shard, one per batch row.
        row_bytes: Bytes of one source row.
        fields: ``int64`` array of shape ``(n_fields, 5)``.

    Raises:
        IndexError: A row, shard or field lies outside its source or destination.
    """
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    fields = np.ascontiguousarray(fields, dtype=np.int64).reshape(-1, 5)
    if source_ids is not None:
        source_ids = np.ascontiguousarray(source_ids, dtype=np.int32)
    if _enabled:
        _native.gather_fields(dsts, sources, source_ids, rows, row_bytes, fields, _THREADS)
        return
    n = len(rows)
    whole = np.empty((n, row_bytes), dtype=np.uint8)
    gather_rows(whole, sources, source_ids, rows)
    for src_offset, length, dst_index, dst_offset, dst_row_bytes in fields.tolist():
        dst = dsts[dst_index].reshape(-1).view(np.uint8)
        if src_offset + length > row_bytes or dst_offset + length > dst_row_bytes or n * dst_row_bytes > dst.size:
            raise IndexError("a field does not fit its row or its destination")
        target = dst.reshape(-1)[: n * dst_row_bytes].reshape(n, dst_row_bytes)
        target[:, dst_offset : dst_offset + length] = whole[:, src_offset : src_offset + length]


def _check_rows(rows: np.ndarray, limit: int) -> None:
    # take(mode="clip") is the fast mode but would clamp a bad index silently.
    if len(rows) and (rows.min() < 0 or rows.max() >= limit):
        raise IndexError(f"row index outside a shard of {limit} rows")


def gather_spans(
    dst: np.ndarray,
    dst_offsets: np.ndarray,
    sources: list[np.ndarray],
    source_ids: np.ndarray | None,
    starts: np.ndarray,
    lengths: np.ndarray,
) -> None:
    """Copies ``sources[source_ids[i]][starts[i]:starts[i] + lengths[i]]`` to ``dst`` at ``dst_offsets[i]``.

    Args:
        dst: Writable 1-D ``uint8`` array.
        dst_offsets: ``int64`` offset in ``dst`` of each span.
        sources: 1-D ``uint8`` arrays, one per shard.
        source_ids: ``int32`` shard position of each span, or ``None`` for ``sources[0]``.
        starts: ``int64`` byte offset of each span in its source.
        lengths: ``int64`` byte length of each span.

    Raises:
        IndexError: A span lies outside its source or does not fit in ``dst``.
    """
    starts, lengths, dst_offsets = (np.ascontiguousarray(a, dtype=np.int64) for a in (starts, lengths, dst_offsets))
    if source_ids is not None:
        source_ids = np.ascontiguousarray(source_ids, dtype=np.int32)
    if _enabled:
        _native.gather_spans(dst, dst_offsets, sources, source_ids, starts, lengths, _THREADS)
        return
    groups = (
        [(sources[0], slice(None))]
        if source_ids is None
        else [(source, source_ids == position) for position, source in enumerate(sources)]
    )
    for source, mask in groups:
        st, ln, of = starts[mask], lengths[mask], dst_offsets[mask]
        if not len(st):
            continue
        if st.min() < 0 or (st + ln).max() > len(source) or (of + ln).max() > len(dst):
            raise IndexError("a span lies outside its shard or the batch buffer")
        total = int(ln.sum())
        # Flat position k of span i maps to source[st_i + j] and dst[of_i + j], j = k - first_k(i).
        first = np.cumsum(ln) - ln
        within = np.arange(total, dtype=np.int64) - np.repeat(first, ln)
        dst[np.repeat(of, ln) + within] = source[np.repeat(st, ln) + within]
