"""``sparkgpu.data.token_dataset``: ragged token arrays packed into fixed-length blocks.

```python
from sparkgpu import data
tok = data.token_dataset(remote="s3://b/tokens-mds", column="ids", seq_len=4096, batch_size=8, eos_id=2)
for block in tok:                       # int tensor (8, 4097)
    inputs, targets = block[:, :-1], block[:, 1:]
```

The stream. Documents (one integer array per sample) are laid end to end in dataset order,
with ``eos_id`` after each one when given. Block ``b`` is ``stream[b * seq_len : b * seq_len
+ seq_len + 1]``: ``seq_len + 1`` tokens, so that inputs and next-token targets come from one
block, and consecutive blocks overlap by one token, so every token of the stream is a target
exactly once (litdata's ``TokensLoader`` cuts disjoint blocks of ``block_size`` tokens and
the documented recipe passes ``block_size=seq_len + 1``, which leaves the token at each
boundary out of the targets). ``targets=False`` gives disjoint blocks of ``seq_len``.
Blocks run across document and shard boundaries; tokens after the last whole block are left
out.

Order and split. Blocks play the part of samples in :mod:`sparkgpu.data.loaders.order`: a block
belongs to the shard its first token is in, the epoch's order is that module's shard-aware
shuffle (or the stream's order), and position ``p`` goes to rank ``p % world_size``. The
position is "blocks consumed", so a resume continues exactly at the next token, with any
world size.

Opening the dataset reads every shard's sample headers once to count its tokens (the index
does not record them); for a remote volume this downloads the shards into the cache.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import torch

from sparkgpu.data import _gather
from sparkgpu.data.loaders._token_shards import ShardDocuments, TokenColumn
from sparkgpu.data.loaders.metrics import LoaderMetrics
from sparkgpu.data.loaders.mds_loader import open_mds
from sparkgpu.data.loaders._base import ReadOptions, ReadSettings, Resumable, StateLayout, WorkerCuts
from sparkgpu.data.loaders._shards import map_shard, open_shard_cache
from sparkgpu.data.loaders.order import DEFAULT_BLOCK_SIZE, EpochPlan, check_int, epoch_order
from sparkgpu.data.mds.reader import ShardReader
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["token_dataset", "TokenLoader"]

# Shards whose document tables are kept between cuts (a shuffled order draws blocks from every
# shard of its window at once); a local folder's stay mapped as well.
_KEPT_SHARDS = 32
# Blocks are cut this many tokens at a time (at least one batch): the per-cut work in Python
# (one search per shard, one native gather) is then small beside the copy.
_CUT_TOKENS = 1 << 21


def token_dataset(
    remote: str | None = None,
    local: str | os.PathLike | None = None,
    *,
    column: str,
    seq_len: int,
    batch_size: int,
    eos_id: int | None = None,
    targets: bool = True,
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
) -> "TokenLoader":
    """Opens an MDS dataset of token ids as batches of fixed-length blocks.

    Args:
        remote: Volume URL of the dataset folder, as for :func:`sparkgpu.data.dataset`.
        local: Cache root (with ``remote``) or the dataset folder (without), as for ``dataset``.
        column: The column holding each document's token ids (a 1-D integer array).
        seq_len: Tokens of input per block.
        batch_size: Blocks per batch on each rank.
        eos_id: Token put after every document (``None``: documents run straight on).
        targets: Blocks of ``seq_len + 1`` tokens overlapping by one (inputs and next-token
            targets); ``False``: disjoint blocks of ``seq_len``.
        shuffle: Shuffle blocks, differently each epoch, the same for the same seed.
        seed: Seed of the shuffle; every rank must use the same one.
        shuffle_block_size: Blocks of neighbouring shards mix within windows of this many
            blocks (default 262144).
        drop_last: Leave out each rank's short last batch of the epoch.
        num_workers: DataLoader worker processes cutting batches (0: in this process).
        cache_limit: Most bytes of shards kept in the cache, as for ``dataset``.
        download_threads: Parallel shard downloads.
        rank: This process's rank (default: from the job).
        world_size: Number of ranks (default: from the job).
        storage_options: Options for the volume's fsspec filesystem.

    Returns:
        A :class:`TokenLoader` yielding ``int`` tensors of shape ``(batch, seq_len + 1)``
        (``(batch, seq_len)`` with ``targets=False``) in the column's dtype.

    Raises:
        ConfigurationError: An argument is invalid, or ``column`` is not integer arrays.
        DataError: The dataset cannot be read.
    """
    check_int("seq_len", seq_len, 1)
    if eos_id is not None:
        check_int("eos_id", eos_id, 0)
    # open_mds() checks and opens everything the two loaders share (volume, cache, rank).
    opened = open_mds(remote, local, ReadOptions.of(locals()))
    tokens = TokenColumn(opened.index, column, eos_id)
    tokens.column  # noqa: B018 - raises when the column is missing
    spec = opened._source_spec()
    return TokenLoader(
        spec,
        tokens,
        seq_len=seq_len,
        width=seq_len + (1 if targets else 0),
        options=opened._read_options(),
    )


class _TokenSource:
    """Shards of tokens through the cache, mapped while cut, with their document tables kept.

    A block is cut straight from the mapped shard file as a few spans (one per document it
    covers). A shard's document table costs a read of every sample header, so the most recent
    ``_KEPT_SHARDS`` tables are kept, however randomly their blocks are visited. A mapping of a
    shard evicted from the cache holds its disk space, so with a volume only the shards of the
    current cut stay mapped; a local folder keeps its kept shards mapped too.
    """

    def __init__(self, spec: dict, tokens: TokenColumn):
        self.index, self.tokens = spec["index"], tokens
        self.cache = open_shard_cache(spec)
        self._evictable = self.cache.volume is not None
        self._documents: collections.OrderedDict[int, ShardDocuments] = collections.OrderedDict()
        self._readers: dict[int, ShardReader] = {}

    def reader(self, step: int, shard: int) -> ShardReader:
        (path,) = self.cache.acquire(step, np.array([shard], dtype=np.int64))
        return map_shard(self.cache, shard, path)

    def open(self, first_step: int, needs: list[np.ndarray]) -> dict[int, tuple[ShardReader, ShardDocuments]]:
        """Maps the shards that steps ``first_step, first_step + 1, ...`` read (``needs``), in step order.

        Every step is acquired from the cache in turn, so prefetching and eviction follow the
        plan; a shard is mapped right after its step's acquire, and stays readable to the end
        of the cut even if a later step's fetch evicts it.
        """
        opened = {}
        for step, shards in enumerate(needs, first_step):
            paths = self.cache.acquire(step, shards)
            for shard, path in zip(shards.tolist(), paths):
                if shard in opened:
                    continue
                reader = self._readers.get(shard)
                if reader is None:
                    reader = self._readers[shard] = map_shard(self.cache, shard, path)
                documents = self._documents.get(shard)
                if documents is None:
                    documents = self._documents[shard] = self.tokens.documents(reader)
                self._documents.move_to_end(shard)
                opened[shard] = (reader, documents)
        return opened

    def release(self) -> None:
        """After a cut: forgets the oldest document tables beyond ``_KEPT_SHARDS`` and unmaps
        shards (all of them with a volume, those without a kept table otherwise)."""
        while len(self._documents) > _KEPT_SHARDS:
            self._documents.popitem(last=False)
        for shard in [s for s in self._readers if self._evictable or s not in self._documents]:
            self._readers.pop(shard).close()

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._documents.clear()
        self.cache.close()


class TokenLoader(Resumable, ReadSettings):
    """An epoch-by-epoch iterable of token blocks with an exact, JSON-able position.

    Built by :func:`token_dataset`.

    Attributes:
        num_tokens: Tokens in the stream (documents plus EOS tokens).
        num_blocks: Blocks in an epoch (all ranks together).
        epoch: The epoch the next iteration reads.
    """

    def __init__(
        self,
        spec: dict,
        tokens: TokenColumn,
        *,
        seq_len,
        width,
        options: ReadOptions,
    ):
        self._spec, self._tokens = spec, tokens
        self.seq_len, self.width = seq_len, width
        self._read_with(options)
        self._source = _TokenSource(spec, tokens)
        counts = np.array(
            [tokens.counts(self._source.reader(0, s)) for s in range(len(spec["index"].shards))], dtype=np.int64
        )
        self._shard_ends = np.cumsum(counts)
        self._shard_starts = self._shard_ends - counts
        self.num_tokens = int(self._shard_ends[-1])
        # A column written as plain ``ndarray`` carries the dtype in each value: the first shard's.
        self.dtype = tokens.column.dtype or np.dtype(tokens.spans(self._source.reader(0, 0))[2])
        self._check_eos()
        self.num_blocks = max(0, (self.num_tokens - (width - seq_len)) // seq_len)
        first_tokens = np.arange(self.num_blocks, dtype=np.int64) * seq_len
        self._blocks_per_shard = np.bincount(
            np.searchsorted(self._shard_ends, first_tokens, side="right"), minlength=len(counts)
        ).astype(np.int64)
        self.epoch = 0
        self._consumed = 0
        self.metrics = LoaderMetrics(self.rank)

    def _check_eos(self) -> None:
        eos = self._tokens.eos_id
        if eos is None:
            return
        limit = np.iinfo(self.dtype).max
        if eos > limit:
            raise ConfigurationError(
                f"eos_id={eos} does not fit the column's {self.dtype} tokens; pass an id below {limit + 1}"
            )

    # Position.

    def state_dict(self) -> dict:
        """The position after the last batch handed out, as plain JSON (the same on every rank)."""
        return self._saved_state()

    def load_state_dict(self, state: dict) -> None:
        """Continues from a saved position: the next iteration starts at the next unread block.

        Raises:
            ConfigurationError: The state comes from another dataset, column, packing or shuffle.
        """
        self.epoch, self._consumed = self._restored_position(state)

    _layout = StateLayout(
        fields=("seed", "shuffle", "shuffle_block_size", "seq_len", "width", "num_tokens"),
        checked=(
            "seed",
            "shuffle",
            "shuffle_block_size",
            "seq_len",
            "width",
            "num_tokens",
            "eos_id",
            "column",
            "dataset",
        ),
        counter="blocks_consumed",
        marks=("blocks_consumed",),
        name="a token loader",
    )

    def _state_identity(self) -> dict:
        return {"eos_id": self._tokens.eos_id, "column": self._tokens.name, "dataset": self._spec["index"].fingerprint}

    def _state_extent(self, state: dict) -> tuple[int, str]:
        return self.num_blocks, f"stream of {self.num_blocks} blocks"

    def stats(self) -> dict:
        """This rank's loader figures so far (see :class:`sparkgpu.data.loaders.metrics.LoaderMetrics`)."""
        return self.metrics.snapshot(self._source.cache)

    # Iteration.

    def __iter__(self):
        plan, start = self._begin_epoch(), self._consumed
        if self.num_workers:
            source = iter(
                torch.utils.data.DataLoader(WorkerCuts(self, plan), batch_size=None, num_workers=self.num_workers)
            )
        else:
            source = self.batches(plan, range(plan.num_batches))
        yield from self._hand_out(plan, start, self.metrics.timed(source, self._source.cache))

    def batches(self, plan: EpochPlan, numbers):
        """Yields the blocks of ``plan``'s batches ``numbers`` as tensors.

        Several batches are cut at once (about ``_CUT_TOKENS`` tokens) into one buffer, and
        handed out as views of it.
        """
        firsts = [plan.batch(b) * self.seq_len for b in numbers]
        needs = [self._shards(f) for f in firsts]
        self._source.cache.set_plan(needs)
        per_cut = max(1, _CUT_TOKENS // (self.batch_size * self.width))
        for step in range(0, len(firsts), per_cut):
            cut = torch.from_numpy(self._cut(step, firsts[step : step + per_cut], needs[step : step + per_cut]))
            ends = np.cumsum([len(f) for f in firsts[step : step + per_cut]]).tolist()
            for begin, end in zip([0] + ends[:-1], ends):
                yield cut[begin:end]

    def close(self) -> None:
        """Stops background downloads and frees the shards held in memory."""
        self._source.close()

    def _reopen(self) -> None:
        """In a forked DataLoader worker: a source of its own (the parent's download threads did not come along)."""
        self._source = _TokenSource(self._spec, self._tokens)

    def _plan(self, epoch: int, start: int) -> EpochPlan:
        order = epoch_order(
            self._blocks_per_shard,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            block_size=self.shuffle_block_size or DEFAULT_BLOCK_SIZE,
        )
        return self._rank_plan(order, start)

    def _shards(self, firsts: np.ndarray) -> np.ndarray:
        lo = np.searchsorted(self._shard_ends, firsts, side="right")
        hi = np.searchsorted(self._shard_ends, firsts + self.width - 1, side="right")
        return np.unique(np.concatenate([lo, hi]))

    def _cut(self, first_step: int, firsts: list[np.ndarray], needs: list[np.ndarray]) -> np.ndarray:
        """Blocks starting at stream positions ``firsts`` (one array per step), one row each.

        Each block is split at shard and document boundaries into spans of the shard files,
        copied by one native gather per shard; EOS tokens are written between them.
        """
        starts = np.concatenate(firsts)
        width, itemsize = self.width, self.dtype.itemsize
        out = np.empty((len(starts), width), dtype=self.dtype)
        if not len(starts):
            return out
        flat = out.reshape(-1)
        shards = self._source.open(first_step, needs)
        # One (block, shard) pair for every shard a block has tokens in: most blocks have one.
        lo = np.searchsorted(self._shard_ends, starts, side="right")
        hi = np.searchsorted(self._shard_ends, starts + width - 1, side="right")
        span = hi - lo + 1
        row = np.repeat(np.arange(len(starts), dtype=np.int64), span)
        shard = np.arange(len(row), dtype=np.int64) - np.repeat(np.cumsum(span) - span - lo, span)
        begins = np.maximum(starts[row], self._shard_starts[shard])
        ends = np.minimum(starts[row] + width, self._shard_ends[shard])
        keep = ends > begins  # drops empty shards a block runs across
        row, shard, begins, ends = row[keep], shard[keep], begins[keep], ends[keep]
        base = row * width + (begins - starts[row])  # where each pair's tokens go in ``flat``
        order = np.argsort(shard, kind="stable")
        cuts = np.flatnonzero(np.diff(shard[order])) + 1
        for group in np.split(order, cuts):
            number = int(shard[group[0]])
            reader, documents = shards[number]
            if documents.dtype != self.dtype:
                raise DataError(
                    f"shard {reader.info.basename} holds {documents.dtype} tokens but earlier shards "
                    f"hold {self.dtype}; write the column {self._tokens.name!r} with one dtype"
                )
            local_begins = begins[group] - self._shard_starts[number]
            local_ends = ends[group] - self._shard_starts[number]
            owner, offset, byte_starts, counts = documents.pieces(local_begins, local_ends)
            assert reader.data is not None, "the shard reader is closed"
            _gather.gather_spans(
                flat.view(np.uint8),
                (base[group][owner] + offset) * itemsize,
                [reader.data],
                None,
                byte_starts,
                counts * itemsize,
            )
            if self._tokens.eos_id is not None:
                owner, offset = documents.eos_positions(local_begins, local_ends)
                flat[base[group][owner] + offset] = self._tokens.eos_id
        self._source.release()
        return out
