"""sparkgpu.data.token_dataset: blocks reassemble the token stream, over ranks, workers and resumes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkgpu import data
from sparkgpu.errors import ConfigurationError

EOS = 0
SEQ = 48


def _documents(count: int, seed: int = 0) -> list[np.ndarray]:
    """Ragged documents whose tokens are their positions in the EOS-free stream plus one: every token
    is unique, so a block tells where in the stream it came from."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 120, count)
    ends = np.cumsum(lengths)
    return [np.arange(end - n + 1, end + 1, dtype=np.int64) for n, end in zip(lengths.tolist(), ends.tolist())]


def _write(path, docs, encoding="ndarray:int64") -> str:
    from streaming import MDSWriter

    # Small shards: many blocks run across a shard boundary.
    with MDSWriter(out=str(path), columns={"ids": encoding, "doc": "int64"}, size_limit=1 << 12) as writer:
        for number, doc in enumerate(docs):
            writer.write({"ids": doc, "doc": number})
    return str(path)


def _stream(docs, eos) -> np.ndarray:
    return np.concatenate([np.append(d, eos) if eos is not None else d for d in docs])


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    docs = _documents(600)
    return _write(tmp_path_factory.mktemp("mds") / "tokens", docs), docs


def _blocks(loader) -> np.ndarray:
    return np.concatenate([batch.numpy() for batch in loader])


@pytest.mark.parametrize("eos_id", [EOS, None], ids=["eos", "no-eos"])
def test_blocks_in_order_are_the_token_stream_with_next_token_targets(tokens, eos_id):
    path, docs = tokens
    stream = _stream(docs, eos_id)
    ds = data.token_dataset(local=path, column="ids", seq_len=SEQ, batch_size=7, eos_id=eos_id, rank=0, world_size=1)
    assert ds.num_tokens == len(stream)
    blocks = _blocks(ds)
    assert blocks.shape == (ds.num_blocks, SEQ + 1) and ds.num_blocks == (len(stream) - 1) // SEQ
    assert blocks.dtype == np.int64
    np.testing.assert_array_equal(blocks[:, :-1].ravel(), stream[: ds.num_blocks * SEQ])  # inputs
    np.testing.assert_array_equal(blocks[:, 1:].ravel(), stream[1 : ds.num_blocks * SEQ + 1])  # targets


def test_disjoint_blocks_without_targets(tokens):
    path, docs = tokens
    stream = _stream(docs, EOS)
    blocks = _blocks(
        data.token_dataset(
            local=path, column="ids", seq_len=SEQ, batch_size=5, eos_id=EOS, targets=False, rank=0, world_size=1
        )
    )
    assert blocks.shape[1] == SEQ
    np.testing.assert_array_equal(blocks.ravel(), stream[: len(blocks) * SEQ])
    assert len(stream) - len(blocks) * SEQ < SEQ  # only the tail after the last whole block is left out


def _positions(blocks: np.ndarray, stream: np.ndarray) -> np.ndarray:
    """Where each block starts in the stream, checking it is exactly that stretch."""
    where = {int(t): p for p, t in enumerate(stream.tolist()) if t != EOS}
    positions = []
    for block in blocks:
        j = int(np.flatnonzero(block != EOS)[0])
        start = where[int(block[j])] - j
        np.testing.assert_array_equal(block, stream[start : start + len(block)])
        positions.append(start)
    return np.array(positions)


def test_shuffled_blocks_over_ranks_cover_the_stream_once_and_ranks_step_together(tokens):
    path, docs = tokens
    stream = _stream(docs, EOS)
    world = 3
    loaders = [
        data.token_dataset(
            local=path,
            column="ids",
            seq_len=SEQ,
            batch_size=4,
            eos_id=EOS,
            shuffle=True,
            seed=5,
            shuffle_block_size=64,
            rank=r,
            world_size=world,
        )
        for r in range(world)
    ]
    per_rank = [_positions(_blocks(loader), stream) for loader in loaders]
    assert len({len(p) for p in per_rank}) == 1 and len({len(loader) for loader in loaders}) == 1
    every = np.sort(np.concatenate(per_rank))
    total = loaders[0].num_blocks
    assert len(np.unique(every)) == len(every) == total - total % world
    assert set(every.tolist()) <= set(range(0, total * SEQ, SEQ))
    in_order = np.concatenate(per_rank)
    assert not np.array_equal(in_order, np.sort(in_order)), "blocks are shuffled"
    again = _positions(
        _blocks(
            data.token_dataset(
                local=path,
                column="ids",
                seq_len=SEQ,
                batch_size=4,
                eos_id=EOS,
                shuffle=True,
                seed=5,
                shuffle_block_size=64,
                rank=1,
                world_size=world,
            )
        ),
        stream,
    )
    np.testing.assert_array_equal(again, per_rank[1])  # the same for the same (seed, epoch)


def test_workers_deliver_the_same_batches_in_the_same_order(tokens):
    path, _ = tokens
    opened = dict(
        local=path,
        column="ids",
        seq_len=SEQ,
        batch_size=6,
        eos_id=EOS,
        shuffle=True,
        seed=1,
        shuffle_block_size=64,
        rank=1,
        world_size=2,
    )
    alone = _blocks(data.token_dataset(**opened))
    with_workers = _blocks(data.token_dataset(**opened, num_workers=2))
    np.testing.assert_array_equal(with_workers, alone)


@pytest.mark.parametrize(
    ("rank", "world", "workers"), [(0, 1, 0), (1, 2, 2)], ids=["one-rank", "rank1-of-2-with-workers"]
)
def test_resume_mid_epoch_continues_at_the_next_token(tokens, rank, world, workers):
    path, _ = tokens
    opened = dict(
        local=path,
        column="ids",
        seq_len=SEQ,
        batch_size=5,
        eos_id=EOS,
        shuffle=True,
        seed=3,
        shuffle_block_size=64,
        rank=rank,
        world_size=world,
        num_workers=workers,
    )
    whole = [b.numpy() for b in data.token_dataset(**opened)]
    first = data.token_dataset(**opened)
    seen = []
    for batch in first:
        seen.append(batch.numpy())
        if len(seen) == 7:
            break
    state = first.state_dict()
    resumed = data.token_dataset(**opened)
    resumed.load_state_dict(state)
    rest = [b.numpy() for b in resumed]
    np.testing.assert_array_equal(np.concatenate(seen + rest), np.concatenate(whole))
    assert resumed.epoch == 1  # then the next epoch, reshuffled
    assert not np.array_equal(_blocks(resumed), np.concatenate(whole))


@pytest.mark.parametrize("native", [True, False], ids=["c-gather", "numpy-gather"])
def test_cut_size_and_shards_kept_mapped_do_not_change_the_blocks(tokens, monkeypatch, native):
    # Blocks are cut several batches at a time from shards kept mapped; one batch per cut and
    # two shards kept (most blocks then reopen a shard) must give the same stream, with the C
    # span gather and with its numpy version.
    from sparkgpu.data import _gather
    from sparkgpu.data.loaders import tokens as token_module

    monkeypatch.setattr(_gather, "_enabled", native and _gather.native_available())

    path, docs = tokens
    stream = _stream(docs, EOS)
    opened = dict(
        local=path, column="ids", seq_len=SEQ, batch_size=3, eos_id=EOS, shuffle=True, seed=5, rank=0, world_size=1
    )
    default = _blocks(data.token_dataset(**opened))
    monkeypatch.setattr(token_module, "_CUT_TOKENS", 1)
    monkeypatch.setattr(token_module, "_KEPT_SHARDS", 2)
    small = data.token_dataset(**opened)
    assert len(small._spec["index"].shards) > 10  # blocks come from many shards, most reopened
    np.testing.assert_array_equal(_blocks(small), default)
    # A shuffle of the in-order blocks: each exactly once.
    expected = stream[(np.arange(small.num_blocks) * SEQ)[:, None] + np.arange(SEQ + 1)]
    np.testing.assert_array_equal(
        np.sort(default.view(f"V{default.itemsize * (SEQ + 1)}").ravel()),
        np.sort(expected.view(f"V{expected.itemsize * (SEQ + 1)}").ravel()),
    )


def test_a_small_cache_of_a_volume_gives_the_same_blocks_and_keeps_no_shard_mapped(tokens, tmp_path):
    # Shards fetched ahead evict shards of the same cut while they are read; a mapping of an
    # evicted shard would hold its disk space beyond the limit, so none outlives its cut.
    path, _ = tokens
    opened = dict(column="ids", seq_len=SEQ, batch_size=3, eos_id=EOS, shuffle=True, seed=7, rank=0, world_size=1)
    local = _blocks(data.token_dataset(local=path, **opened))
    remote = data.token_dataset(remote=path, local=tmp_path / "cache", cache_limit=40_000, **opened)
    np.testing.assert_array_equal(_blocks(remote), local)
    assert remote._source._readers == {}
    dataset_mb = sum(s.raw_bytes for s in remote._spec["index"].shards) / 1e6
    assert remote.stats()["downloaded_mb"] > dataset_mb  # the limit made it evict and fetch shards again
    remote.close()


def test_a_state_from_another_packing_is_refused(tokens):
    path, _ = tokens
    state = data.token_dataset(local=path, column="ids", seq_len=SEQ, batch_size=4, rank=0, world_size=1).state_dict()
    other = data.token_dataset(local=path, column="ids", seq_len=SEQ + 1, batch_size=4, rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match="seq_len"):
        other.load_state_dict(state)


def test_dtype_in_each_value_and_fixed_length_documents(tmp_path):
    docs = _documents(50, seed=2)
    dynamic = _blocks(
        data.token_dataset(
            local=_write(tmp_path / "dyn", [d.astype(np.int32) for d in docs], "ndarray"),
            column="ids",
            seq_len=16,
            batch_size=3,
            eos_id=EOS,
            rank=0,
            world_size=1,
        )
    )
    assert dynamic.dtype == np.int32
    np.testing.assert_array_equal(dynamic[:, :-1].ravel(), _stream(docs, EOS)[: len(dynamic) * 16])
    plain = _blocks(
        data.token_dataset(local=str(tmp_path / "dyn"), column="ids", seq_len=16, batch_size=3, rank=0, world_size=1)
    )
    assert plain.dtype == np.int32  # the values' dtype without an EOS too
    np.testing.assert_array_equal(plain[:, :-1].ravel(), _stream(docs, None)[: len(plain) * 16])
    fixed_docs = [np.arange(i * 8, i * 8 + 8, dtype=np.int32) for i in range(40)]
    fixed = _blocks(
        data.token_dataset(
            local=_write(tmp_path / "fixed", fixed_docs, "ndarray:int32:8"),
            column="ids",
            seq_len=10,
            batch_size=4,
            targets=False,
            rank=0,
            world_size=1,
        )
    )
    np.testing.assert_array_equal(fixed.ravel(), np.arange(320, dtype=np.int32)[: len(fixed) * 10])


def test_bad_input_names_the_fix(tokens, tmp_path):
    path, _ = tokens
    with pytest.raises(ConfigurationError, match="no column 'tokens'.*'ids'"):
        data.token_dataset(local=path, column="tokens", seq_len=8, batch_size=2, rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match="integer arrays"):
        from streaming import MDSWriter

        with MDSWriter(out=str(tmp_path / "floats"), columns={"x": "ndarray:float32"}) as writer:
            writer.write({"x": np.ones(3, np.float32)})
        data.token_dataset(local=str(tmp_path / "floats"), column="x", seq_len=8, batch_size=2, rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match="seq_len"):
        data.token_dataset(local=path, column="ids", seq_len=0, batch_size=2, rank=0, world_size=1)
    small = _write(tmp_path / "u8", [np.ones(4, np.uint8)], "ndarray:uint8")
    with pytest.raises(ConfigurationError, match="eos_id=300 does not fit"):
        data.token_dataset(local=small, column="ids", seq_len=2, batch_size=1, eos_id=300, rank=0, world_size=1)


def test_stats_time_the_wait_and_the_step(tokens):
    path, _ = tokens
    ds = data.token_dataset(local=path, column="ids", seq_len=SEQ, batch_size=4, rank=0, world_size=1)
    for _ in ds:
        torch.ones(1).add_(1)
    stats = ds.stats()
    assert stats["batches"] == len(ds)
    assert 0 < stats["wait_s"] <= stats["step_s"] and 0 < stats["wait_fraction"] <= 1
    assert stats["cache_hit_ratio"] == 1.0 and stats["downloaded_mb"] == 0.0  # a local folder: nothing to download
