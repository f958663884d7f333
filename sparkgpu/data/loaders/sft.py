"""``sparkgpu.data.sft_dataset``: tokenized documents packed into rows of ``seq_len`` for fine-tuning.

```python
from sparkgpu import data
sft = data.sft_dataset(remote="s3://b/sft/v1", seq_len=4096, batch_size=8, shuffle=True, seed=0)
for batch in sft:          # input_ids, labels, position_ids: int64 (8, 4096)
    loss = model(**batch, use_cache=False).loss
state = sft.state_dict()   # plain JSON; load_state_dict(state) continues at the next row
```

Reads what :func:`sparkgpu.data.tokenize` writes (any MDS dataset with a token-id column and
a 0/1 loss-mask column of the same lengths). Each epoch:

- **order**: documents in the shard-aware shuffle of :mod:`sparkgpu.data.loaders.order` (by
  ``seed`` and epoch), or in dataset order;
- **rows**: :mod:`sparkgpu.data.loaders.packing` packs them best fit decreasing within windows
  of ``pack_window`` documents into rows of exactly ``seq_len`` tokens, longer documents
  truncated or split (``overflow``); planned from lengths alone, identically on every rank;
- **split**: row ``p`` goes to rank ``p % world_size``; rows are made a multiple of the world
  size, so every document of the epoch is in exactly one row of one rank;
- **batch**: ``input_ids``; ``labels``: the token where the loss mask is 1, else ``-100``, and
  ``-100`` on the first token of every document (its prediction would come from the document
  before it) and on padding; ``position_ids``: 0, 1, ... from the start of every document, and
  again from the start of the padding at a row's end, which is a segment of its own.

Documents are kept apart by ``position_ids`` alone: transformers 5 turns a restart of
``position_ids`` into a block-diagonal mask (``masking_utils.find_packed_sequence_indices``;
flash-attention's varlen path likewise), but only when the model is called **without**
``attention_mask`` and **without a cache**: pass ``use_cache=False`` (Llama's config defaults
to ``use_cache=True``, which builds a cache even in training, and the documents then see each
other). ``attention_mask=True`` adds a 0/1 mask of real tokens for models that need one; HF
models given it stop separating the documents. Flash-attention (``_is_packed_sequence``) looks
for packed documents only in a batch of one row: ``flatten=True`` yields each batch as one
row of ``batch_size * seq_len`` tokens, which every row's restart at 0 keeps apart.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os

import numpy as np
import torch

from sparkgpu.data import _gather
from sparkgpu.data.loaders._token_shards import TokenColumn
from sparkgpu.data.loaders.mds_loader import open_mds
from sparkgpu.data.loaders.metrics import LoaderMetrics
from sparkgpu.data.loaders._base import ReadOptions, ReadSettings, Resumable, StateLayout, WorkerCuts
from sparkgpu.data.loaders._shards import map_shard, open_shard_cache
from sparkgpu.data.loaders.order import DEFAULT_BLOCK_SIZE, EpochOrders, EpochPlan, check_int, epoch_order, locate
from sparkgpu.data.loaders.packing import OVERFLOW, PackedRows, pack_epoch
from sparkgpu.data.mds.reader import INDEX_NAME, ShardReader
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["sft_dataset", "SFTLoader", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_DEFAULT_WINDOW = 4096
# Rows cut at once when single rows are handed out (batch_size=None).
_ROWS_PER_CUT = 32
_KEPT_SHARDS = 32


def sft_dataset(
    remote: str | None = None,
    local: str | os.PathLike | None = None,
    *,
    seq_len: int,
    batch_size: int | None,
    column: str = "input_ids",
    mask_column: str = "loss_mask",
    overflow: str = "truncate",
    pack_window: int = _DEFAULT_WINDOW,
    pad_id: int | None = None,
    attention_mask: bool = False,
    flatten: bool = False,
    shuffle: bool = False,
    seed: int = 0,
    shuffle_block_size: int | None = None,
    drop_last: bool = False,
    num_workers: int = 0,
    cache_limit: int | str | None = None,
    download_threads: int = 8,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict | None = None,
) -> "SFTLoader":
    """Opens a tokenized dataset as packed fine-tuning rows.

    Args:
        remote: Volume URL of the dataset folder, as for :func:`sparkgpu.data.dataset`.
        local: Cache root (with ``remote``) or the dataset folder (without).
        seq_len: Tokens per row.
        batch_size: Rows per batch on each rank; ``None`` yields single rows (1-D tensors).
        column: Token ids, one 1-D integer array per document.
        mask_column: 1 where a token is a target, 0 elsewhere, as long as ``column``'s arrays.
        overflow: Documents longer than ``seq_len``: ``"truncate"`` keeps their first
            ``seq_len`` tokens, ``"split"`` cuts them into pieces packed as documents of their own.
        pack_window: Documents packed together (more: less padding, rows drawn from further apart).
        pad_id: Token id of padding (default: the tokenizer's pad id recorded by ``tokenize``,
            else its EOS id, else 0); padding is never a label.
        attention_mask: Add ``attention_mask`` (1 on tokens, 0 on padding); see the module
            docstring for why HF models should not get one.
        flatten: Yield each batch as one row of ``batch_size * seq_len`` tokens (shape
            ``(1, batch_size * seq_len)``): transformers 5's flash-attention path finds packed
            documents from ``position_ids`` only in a batch of one row.
        shuffle: Shuffle documents (and rows within each window), differently each epoch.
        seed: Seed of the shuffle; every rank must use the same one.
        shuffle_block_size: Documents of neighbouring shards mix within windows of this many
            (default 262144).
        drop_last: Leave out each rank's short last batch of the epoch.
        num_workers: DataLoader worker processes cutting batches (0: in this process).
        cache_limit: Most bytes of shards kept in the cache, as for ``dataset``.
        download_threads: Parallel shard downloads.
        rank: This process's rank (default: from the job).
        world_size: Number of ranks (default: from the job).
        storage_options: Options for the volume's fsspec filesystem.

    Returns:
        An :class:`SFTLoader`.

    Raises:
        ConfigurationError: An invalid argument, or columns that are not token ids and a mask.
        DataError: The dataset cannot be read, or a document's mask differs in length from its ids.
    """
    check_int("seq_len", seq_len, 1)
    check_int("pack_window", pack_window, 1)
    if batch_size is not None:
        check_int("batch_size", batch_size, 1)
    if overflow not in OVERFLOW:
        raise ConfigurationError(f"overflow={overflow!r} must be one of {OVERFLOW}")
    if pad_id is not None:
        check_int("pad_id", pad_id, 0)
    if flatten and batch_size is None:
        raise ConfigurationError("flatten=True joins the rows of a batch into one; pass batch_size=")
    options = ReadOptions.of(locals())
    opened = open_mds(remote, local, dataclasses.replace(options, batch_size=batch_size or _ROWS_PER_CUT))
    ids, mask = TokenColumn(opened.index, column, None), TokenColumn(opened.index, mask_column, None)
    ids.column, mask.column  # noqa: B018 - raise when a column is missing
    spec = opened._source_spec()
    if pad_id is None:
        pad_id = _recorded_pad_id(opened.directory)
    return SFTLoader(
        spec,
        ids,
        mask,
        seq_len=seq_len,
        batch_size=batch_size,
        overflow=overflow,
        pack_window=pack_window,
        pad_id=pad_id,
        attention_mask=attention_mask,
        flatten=flatten,
        options=opened._read_options(),
    )


def _recorded_pad_id(directory) -> int:
    """The pad id (else EOS id) ``tokenize`` recorded in the index, else 0."""
    try:
        with open(os.path.join(directory, INDEX_NAME), "rb") as handle:
            meta = json.load(handle).get("sparkgpu") or {}
    except (OSError, ValueError):
        return 0
    tokenizer = ((meta.get("source") or {}).get("text") or {}).get("tokenizer") or {}
    for key in ("pad_token_id", "eos_token_id"):
        if isinstance(tokenizer.get(key), int):
            return tokenizer[key]
    return 0


class _Documents:
    """Where every document's ids and mask lie (shard, byte offset) and how long it is.

    Built once from every shard's sample headers (both columns' spans, no token read).
    """

    def __init__(self, source: "_ShardSource", ids: TokenColumn, mask: TokenColumn):
        index = source.index
        lengths, id_starts, mask_starts = [], [], []
        dtypes: set = set()
        mask_dtypes: set = set()
        for shard in range(len(index.shards)):
            reader = source.reader(0, shard)
            starts, sizes, dtype = ids.spans(reader)
            m_starts, m_sizes, m_dtype = mask.spans(reader)
            count = sizes // dtype.itemsize
            if not np.array_equal(count, m_sizes // m_dtype.itemsize):
                bad = int(np.flatnonzero(count != m_sizes // m_dtype.itemsize)[0])
                raise DataError(
                    f"document {bad} of shard {reader.info.basename} has {count[bad]} tokens in "
                    f"{ids.name!r} but {m_sizes[bad] // m_dtype.itemsize} values in {mask.name!r}; "
                    "write the mask with one value per token (data.tokenize does)"
                )
            lengths.append(count)
            id_starts.append(starts)
            mask_starts.append(m_starts)
            dtypes.add(dtype)
            mask_dtypes.add(m_dtype)
        if len(dtypes) > 1 or len(mask_dtypes) > 1:
            raise DataError(
                f"shards hold token ids of dtypes {sorted(map(str, dtypes))} / masks of "
                f"{sorted(map(str, mask_dtypes))}; write each column with one dtype"
            )
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.id_starts = np.concatenate(id_starts) if id_starts else np.zeros(0, np.int64)
        self.mask_starts = np.concatenate(mask_starts) if mask_starts else np.zeros(0, np.int64)
        self.dtype, self.mask_dtype = dtypes.pop(), mask_dtypes.pop()
        self.shard_sizes = index.shard_sizes
        source.release()


class _ShardSource:
    """Shards through the cache, mapped while rows are cut from them (as ``token_dataset``'s)."""

    def __init__(self, spec: dict):
        self.index = spec["index"]
        self.cache = open_shard_cache(spec)
        self._evictable = self.cache.volume is not None
        self._readers: collections.OrderedDict[int, ShardReader] = collections.OrderedDict()

    def reader(self, step: int, shard: int) -> ShardReader:
        (path,) = self.cache.acquire(step, np.array([shard], dtype=np.int64))
        return self._open(shard, path)

    def _open(self, shard: int, path) -> ShardReader:
        reader = self._readers.get(shard)
        if reader is None:
            reader = self._readers[shard] = map_shard(self.cache, shard, path)
        self._readers.move_to_end(shard)
        return reader

    def open(self, first_step: int, needs: list[np.ndarray]) -> dict[int, ShardReader]:
        """Maps the shards steps ``first_step, first_step + 1, ...`` read, acquiring each step in turn."""
        opened = {}
        for step, shards in enumerate(needs, first_step):
            for shard, path in zip(shards.tolist(), self.cache.acquire(step, shards)):
                opened[shard] = self._open(shard, path)
        return opened

    def release(self) -> None:
        """Unmaps every shard with a volume (a mapping holds an evicted file's space), else the oldest."""
        keep = 0 if self._evictable else _KEPT_SHARDS
        while len(self._readers) > keep:
            self._readers.popitem(last=False)[1].close()

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self.cache.close()


class SFTLoader(Resumable, ReadSettings):
    """An epoch-by-epoch iterable of packed rows with an exact, JSON-able position.

    Built by :func:`sft_dataset`. Yields dicts of ``int64`` tensors: ``input_ids``, ``labels``,
    ``position_ids`` (and ``attention_mask`` when asked), each ``(batch_size, seq_len)``, or
    ``(seq_len,)`` with ``batch_size=None``.

    Attributes:
        num_documents: Documents in the dataset (empty ones included).
        num_tokens: Their tokens.
        epoch: The epoch the next iteration reads.
        packs_documents: True: a row holds several documents, kept apart by ``position_ids``
            alone, which a model's key/value cache undoes (HF models build one in training when
            ``use_cache`` is on); a Trainer reading this loader turns the cache off.
    """

    packs_documents = True

    def __init__(
        self,
        spec: dict,
        ids: TokenColumn,
        mask: TokenColumn,
        *,
        seq_len,
        batch_size,
        overflow,
        pack_window,
        pad_id,
        attention_mask,
        flatten,
        options: ReadOptions,
    ):
        self._spec, self._ids, self._mask = spec, ids, mask
        self._read_with(options)
        self.seq_len, self.batch_size, self.overflow, self.pack_window = seq_len, batch_size, overflow, pack_window
        self.pad_id, self.attention_mask, self.flatten = pad_id, attention_mask, flatten
        self._source = _ShardSource(spec)
        self._docs = _Documents(self._source, ids, mask)
        if pad_id > np.iinfo(self._docs.dtype).max:
            raise ConfigurationError(f"pad_id={pad_id} does not fit the column's {self._docs.dtype} token ids")
        self.num_documents = len(self._docs.lengths)
        self.num_tokens = int(self._docs.lengths.sum())
        self._rows = EpochOrders(self._pack, per_epoch=self.shuffle)
        self.epoch = 0
        self._consumed = 0
        self.metrics = LoaderMetrics(self.rank)

    # Planning.

    def _pack(self, epoch: int) -> PackedRows:
        order = epoch_order(
            self._docs.shard_sizes,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            block_size=self.shuffle_block_size or DEFAULT_BLOCK_SIZE,
        )
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, 2])) if self.shuffle else None
        return pack_epoch(
            order,
            self._docs.lengths,
            seq_len=self.seq_len,
            overflow=self.overflow,
            window=self.pack_window,
            world_size=self.world_size,
            rng=rng,
        )

    def packed_rows(self, epoch: int | None = None) -> PackedRows:
        """Every rank's rows of ``epoch`` (default: the current one), as pieces of documents."""
        return self._rows.get(self.epoch if epoch is None else epoch)

    def _plan(self, epoch: int, start: int) -> EpochPlan:
        rows = self._rows.get(epoch)
        return self._rank_plan(
            np.arange(rows.num_rows, dtype=np.int64), start, batch_size=self.batch_size or _ROWS_PER_CUT
        )

    # Position.

    def state_dict(self) -> dict:
        """The position after the last batch handed out, as plain JSON (the same on every rank)."""
        return self._saved_state()

    def load_state_dict(self, state: dict) -> None:
        """Continues from a saved position: the next iteration starts at the next unread row.

        Raises:
            ConfigurationError: The state comes from another dataset, packing, shuffle or world size.
        """
        epoch, consumed = self._restored_position(state)
        # Rows before the epoch's last window are the same for any world size; only that
        # window's rows are divided so that every rank gets as many. (A position past 0 is
        # one of the epoch's rows: the epoch is a valid one, planned by _state_extent.)
        rows = self._rows.get(epoch) if consumed else None
        if rows is not None and state.get("world_size") != self.world_size and consumed > rows.last_window:
            raise ConfigurationError(
                f"the saved state was taken with world_size={state.get('world_size')} in the last "
                f"{rows.num_rows - rows.last_window} rows of epoch {epoch}, whose packing depends on the "
                f"world size; resume with world_size={state.get('world_size')}, or start the next epoch "
                "with set_epoch()"
            )
        self.epoch, self._consumed = epoch, consumed

    _layout = StateLayout(
        fields=("seed", "shuffle", "shuffle_block_size", "seq_len", "overflow", "pack_window", "world_size"),
        checked=("seed", "shuffle", "shuffle_block_size", "seq_len", "overflow", "pack_window", "columns", "dataset"),
        counter="rows_consumed",
        marks=("rows_consumed",),
        name="an SFT loader",
    )

    def _state_identity(self) -> dict:
        return {"columns": [self._ids.name, self._mask.name], "dataset": self._spec["index"].fingerprint}

    def _state_extent(self, state: dict) -> tuple[int, str]:
        # The rows of the saved state's epoch (a malformed epoch has none: restore_position refuses it).
        epoch = state.get("epoch")
        rows = self._rows.get(epoch).num_rows if isinstance(epoch, int) and epoch >= 0 else 0
        return rows, f"epoch of {rows} rows"

    def stats(self) -> dict:
        """This rank's loader figures so far (see :class:`sparkgpu.data.loaders.metrics.LoaderMetrics`)."""
        return self.metrics.snapshot(self._source.cache)

    # Iteration.

    def __iter__(self):
        plan = self._begin_epoch()
        rows = self._rows.get(self.epoch)
        start = self._consumed
        if self.num_workers:
            source = iter(
                torch.utils.data.DataLoader(WorkerCuts(self, plan, rows), batch_size=None, num_workers=self.num_workers)
            )
        else:
            source = self.batches(rows, plan, range(plan.num_batches))
        handed = 0
        for batch in self.metrics.timed(source, self._source.cache):
            if self.batch_size is None:
                count = len(batch["input_ids"])
                for i in range(count):
                    handed += 1
                    self._consumed = start + handed * self.world_size
                    yield {key: value[i] for key, value in batch.items()}
            else:
                handed += len(batch["input_ids"])
                self._consumed = start + handed * self.world_size
                yield {key: value.reshape(1, -1) for key, value in batch.items()} if self.flatten else batch
        self.epoch, self._consumed = self.epoch + 1, 0

    def batches(self, rows: PackedRows, plan: EpochPlan, numbers):
        """Yields the batches ``numbers`` of ``plan`` (rows of ``rows``) as dicts of tensors."""
        numbers = list(numbers)
        pieces = [self._pieces(rows, plan.batch(b)) for b in numbers]
        needs = [np.unique(locate(p[0], self._docs.shard_sizes)[0]).astype(np.int64) for p in pieces]
        self._source.cache.set_plan(needs)
        for step, (batch_rows, need) in enumerate(zip(pieces, needs)):
            yield self._cut(step, batch_rows, need)

    def close(self) -> None:
        """Stops background downloads and planning, and frees the shards held in memory."""
        self._rows.close()
        self._source.close()

    def _reopen(self) -> None:
        """In a forked DataLoader worker: a source of its own (the parent's download threads did not come along)."""
        self._source = _ShardSource(self._spec)

    def _pieces(self, rows: PackedRows, row_ids: np.ndarray):
        """Pieces of ``row_ids``: ``(doc, offset, length, batch_row)``, in row order."""
        begins, ends = rows.row_starts[row_ids], rows.row_starts[row_ids + 1]
        per_row = ends - begins
        piece = np.arange(int(per_row.sum()), dtype=np.int64) + np.repeat(
            begins - (np.cumsum(per_row) - per_row), per_row
        )
        return (
            rows.doc[piece],
            rows.offset[piece],
            rows.length[piece],
            np.repeat(np.arange(len(row_ids), dtype=np.int64), per_row),
            len(row_ids),
        )

    def _cut(self, step: int, pieces, need: np.ndarray) -> dict[str, torch.Tensor]:
        doc, offset, length, batch_row, count = pieces
        seq_len, docs = self.seq_len, self._docs
        # Where each piece goes: after the pieces before it in its row.
        row_first = np.searchsorted(batch_row, np.arange(count), side="left")
        ends = np.cumsum(length)
        before_row = np.concatenate([[0], ends])[row_first]
        within = ends - length - before_row[batch_row]
        target = batch_row * seq_len + within
        ids = np.full(count * seq_len, self.pad_id, dtype=docs.dtype)
        mask = np.zeros(count * seq_len, dtype=docs.mask_dtype)
        if len(doc):
            readers = self._source.open(step, [need])
            sources = [_mapped(readers[int(s)]) for s in need]
            shard, _ = locate(doc, docs.shard_sizes)
            source_ids = np.searchsorted(need, shard).astype(np.int32)
            for out, starts, dtype in ((ids, docs.id_starts, docs.dtype), (mask, docs.mask_starts, docs.mask_dtype)):
                size = dtype.itemsize
                _gather.gather_spans(
                    out.view(np.uint8), target * size, sources, source_ids, starts[doc] + offset * size, length * size
                )
            self._source.release()
        # Segments: every piece, and the padding at the end of a row, count positions from 0.
        used = np.bincount(batch_row, weights=length, minlength=count).astype(np.int64)
        first = np.zeros(count * seq_len, dtype=bool)
        first[target] = True
        padded = used < seq_len
        first[np.flatnonzero(padded) * seq_len + used[padded]] = True
        first[np.arange(count) * seq_len] = True
        flat = np.arange(count * seq_len, dtype=np.int64)
        position = flat - np.maximum.accumulate(np.where(first, flat, 0))
        labels = np.where(mask != 0, ids.astype(np.int64), IGNORE_INDEX)
        labels[target] = IGNORE_INDEX  # a document's first token is never predicted from the one before
        shape = (count, seq_len)
        batch = {
            "input_ids": torch.from_numpy(ids.astype(np.int64).reshape(shape)),
            "labels": torch.from_numpy(labels.reshape(shape)),
            "position_ids": torch.from_numpy(position.reshape(shape)),
        }
        if self.attention_mask:
            real = flat % seq_len < used[flat // seq_len]
            batch["attention_mask"] = torch.from_numpy(real.astype(np.int64).reshape(shape))
        return batch


def _mapped(reader: ShardReader) -> np.ndarray:
    assert reader.data is not None, "the shard reader is closed"
    return reader.data
