"""Documents -> rows of ``seq_len`` tokens, best fit decreasing within windows of the epoch's order.

Internal to :mod:`sparkgpu.data.loaders.sft`; works on lengths only, so every rank plans the
whole epoch itself, identically, without reading a token.

1. **Pieces.** Each document of the epoch's order becomes one piece: its first ``seq_len``
   tokens (``overflow="truncate"``), or pieces of ``seq_len`` tokens and a shorter last one
   (``overflow="split"``). Empty documents are left out.
2. **Windows.** The pieces are cut into windows of ``window`` consecutive pieces; each window is
   packed on its own (best fit decreasing: longest piece first, each into the open row whose
   free space is the smallest that fits, else a new row), and its rows are shuffled with the
   epoch's seed. A window keeps the rows close to the order's place in the dataset, so the
   shards a stretch of rows needs stay few (what the shard-aware order is for).
3. **Ranks.** When the rows do not divide by the world size, pieces of the last window's
   fullest rows move into rows of their own until they do (all-padding rows only when no row
   has two pieces left): every rank gets as many rows, and every document is in exactly one
   row of the epoch.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

__all__ = ["PackedRows", "pack_epoch", "best_fit_decreasing", "OVERFLOW"]

OVERFLOW = ("truncate", "split")


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """An epoch's rows: row ``r`` holds pieces ``row_starts[r]:row_starts[r + 1]``, in order.

    Attributes:
        row_starts: ``int64``, one more than there are rows.
        doc: Document (sample id) of each piece.
        offset: Token of its document each piece starts at.
        length: Tokens in each piece.
        last_window: First row of the last window (rows before it do not depend on the world size).
    """

    row_starts: np.ndarray
    doc: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    last_window: int

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1

    def row_tokens(self) -> np.ndarray:
        """Tokens in each row (the rest of ``seq_len`` is padding)."""
        sums = np.concatenate([[0], np.cumsum(self.length)])
        return sums[self.row_starts[1:]] - sums[self.row_starts[:-1]]


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of at most ``capacity`` holding every item, longest item first into the tightest bin.

    Args:
        lengths: Item sizes, each in ``[1, capacity]``.
        capacity: Bin size.

    Returns:
        The item indices of each bin, bins in the order they were opened.
    """
    order = np.argsort(-np.asarray(lengths), kind="stable").tolist()
    sizes = np.asarray(lengths).tolist()
    bins: list[list[int]] = []
    spaces: list[int] = []  # distinct free spaces of open bins, sorted
    holders: dict[int, list[int]] = {}  # free space -> bins with exactly that much free
    for item in order:
        size = sizes[item]
        at = bisect.bisect_left(spaces, size)
        if at < len(spaces):
            space = spaces[at]
            waiting = holders[space]
            target = waiting.pop()
            if not waiting:
                del spaces[at], holders[space]
        else:
            space, target = capacity, len(bins)
            bins.append([])
        bins[target].append(item)
        left = space - size
        if left > 0:
            if left in holders:
                holders[left].append(target)
            else:
                bisect.insort(spaces, left)
                holders[left] = [target]
    return bins


def _pieces(order: np.ndarray, lengths: np.ndarray, seq_len: int, overflow: str):
    doc = np.asarray(order, dtype=np.int64)
    size = lengths[doc].astype(np.int64)
    keep = size > 0
    doc, size = doc[keep], size[keep]
    if overflow == "truncate":
        return doc, np.zeros(len(doc), np.int64), np.minimum(size, seq_len)
    count = -(-size // seq_len)
    piece_doc = np.repeat(doc, count)
    first = np.repeat(np.cumsum(count) - count, count)
    offset = (np.arange(len(piece_doc), dtype=np.int64) - first) * seq_len
    return piece_doc, offset, np.minimum(np.repeat(size, count) - offset, seq_len)


def pack_epoch(
    order: np.ndarray,
    lengths: np.ndarray,
    *,
    seq_len: int,
    overflow: str,
    window: int,
    world_size: int,
    rng: np.random.Generator | None,
) -> PackedRows:
    """Packs the documents of ``order`` into rows (see the module docstring).

    Args:
        order: Document ids in the epoch's order.
        lengths: Tokens of every document, indexed by id.
        seq_len: Tokens per row.
        overflow: ``"truncate"`` or ``"split"`` documents longer than ``seq_len``.
        window: Pieces packed together.
        world_size: The number of rows is made a multiple of it.
        rng: Shuffles each window's rows; ``None`` keeps them in the order they were opened.
    """
    doc, offset, length = _pieces(order, lengths, seq_len, overflow)
    rows: list[list[int]] = []
    last_window = 0
    for begin in range(0, len(doc), window):
        bins = best_fit_decreasing(length[begin : begin + window], seq_len)
        if rng is not None:
            bins = [bins[i] for i in rng.permutation(len(bins)).tolist()]
        last_window = len(rows)
        rows.extend([[begin + i for i in b] for b in bins])
    _divide_rows(rows, last_window, world_size, length)
    counts = np.array([len(r) for r in rows], dtype=np.int64)
    pieces = np.array([p for r in rows for p in r], dtype=np.int64)
    return PackedRows(
        row_starts=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        doc=doc[pieces],
        offset=offset[pieces],
        length=length[pieces],
        last_window=last_window,
    )


def _divide_rows(rows: list[list[int]], first: int, world_size: int, length: np.ndarray) -> None:
    """Moves single pieces of the last window's fullest rows into rows of their own until the
    row count divides by ``world_size``; adds empty rows when none has two pieces."""
    extra = -len(rows) % world_size
    while extra:
        candidates = [r for r in range(first, len(rows)) if len(rows[r]) > 1]
        if not candidates:
            rows.extend([] for _ in range(extra))
            return
        fullest = max(candidates, key=lambda r: (len(rows[r]), -r))
        shortest = min(range(len(rows[fullest])), key=lambda i: (length[rows[fullest][i]], i))
        rows.append([rows[fullest].pop(shortest)])
        extra -= 1
