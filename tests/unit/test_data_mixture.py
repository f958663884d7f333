"""data.dataset(streams=...): mosaic's counts per epoch, which samples, ranks in step, exact resume."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from sparkgpu import data
from sparkgpu.errors import ConfigurationError

SIZES = (100, 250, 60)


def _write(path, stream: int, size: int) -> str:
    from streaming import MDSWriter

    with MDSWriter(
        out=str(path), columns={"id": "int64", "src": "int64", "x": "float32"}, size_limit=1 << 10
    ) as writer:
        for i in range(size):
            writer.write({"id": i, "src": stream, "x": np.float32(stream * 1000 + i)})
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    return [_write(root / f"s{n}", n, size) for n, size in enumerate(SIZES)]


def _pairs(loader) -> list[tuple[int, int]]:
    out = []
    for batch in loader:
        np.testing.assert_array_equal(
            batch["x"].numpy(), (batch["src"] * 1000 + batch["id"]).numpy().astype(np.float32)
        )
        out += list(zip(batch["src"].tolist(), batch["id"].tolist()))
    return out


def _mosaic_counts(folders, weights, epoch_size, seed):
    from streaming.base.stream import Stream as MosaicStream

    streams = [MosaicStream(local=f, **w) for f, w in zip(folders, weights)]
    MosaicStream.apply_weights(streams, np.array(SIZES, dtype=np.int64), epoch_size, seed)
    return [int(s.choose) for s in streams]


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
def test_three_streams_by_proportion_give_mosaics_counts_per_epoch_on_every_rank(folders, shuffle):
    weights = [{"proportion": 0.5}, {"proportion": 0.3}, {"proportion": 0.2}]
    epoch_size, world, seed = 334, 2, 11
    expected = _mosaic_counts(folders, weights, epoch_size, seed)
    assert sum(expected) == epoch_size and expected[2] > SIZES[2]  # the small stream repeats some samples
    streams = [data.Stream(local=f, **w) for f, w in zip(folders, weights)]
    loaders = [
        data.dataset(
            streams=streams, epoch_size=epoch_size, batch_size=16, shuffle=shuffle, seed=seed, rank=r, world_size=world
        )
        for r in range(world)
    ]
    assert loaders[0].counts.tolist() == expected
    for epoch in range(2):
        per_rank = [_pairs(loader) for loader in loaders]
        assert len(per_rank[0]) == len(per_rank[1]) == epoch_size // world
        every = collections.Counter(pair for rank in per_rank for pair in rank)
        for stream, (size, count) in enumerate(zip(SIZES, expected)):
            seen = [every[(stream, i)] for i in range(size)]
            assert sum(seen) == count, f"epoch {epoch}: stream {stream} gave {sum(seen)} samples, not {count}"
            whole, rest = divmod(count, size)
            assert sorted(collections.Counter(seen).items()) == sorted(
                {k: v for k, v in ((whole, size - rest), (whole + 1, rest)) if v}.items()
            )
        if epoch == 0:
            first = per_rank
    assert shuffle == (per_rank != first), "a shuffled mixture changes order each epoch, an ordered one does not"


def test_repeat_choose_and_unweighted_streams_are_absolute(folders):
    streams = [
        data.Stream(local=folders[0], repeat=2),
        data.Stream(local=folders[1], choose=10),
        data.Stream(local=folders[2]),
    ]
    loader = data.dataset(streams=streams, batch_size=32, shuffle=True, rank=0, world_size=1)
    assert (
        loader.counts.tolist() == [200, 10, 60] == _mosaic_counts(folders, [{"repeat": 2}, {"choose": 10}, {}], None, 0)
    )
    counts = collections.Counter(src for src, _ in _pairs(loader))
    assert [counts[s] for s in range(3)] == [200, 10, 60]


def test_epoch_size_without_weights_follows_the_stream_sizes(folders):
    loader = data.dataset(
        streams=[data.Stream(local=f) for f in folders], epoch_size=41, batch_size=8, rank=0, world_size=1
    )
    assert loader.counts.tolist() == _mosaic_counts(folders, [{}, {}, {}], 41, 0)


def test_resume_mid_epoch_gives_exactly_the_rest_on_every_rank(folders):
    streams = [data.Stream(local=f, proportion=p) for f, p in zip(folders, (2, 1, 1))]
    opened = dict(streams=streams, epoch_size=300, batch_size=10, shuffle=True, seed=4, world_size=2)
    for rank in range(2):
        whole = _pairs(data.dataset(**opened, rank=rank))
        first = data.dataset(**opened, rank=rank)
        seen = []
        for batch in first:
            seen += list(zip(batch["src"].tolist(), batch["id"].tolist()))
            if len(seen) == 60:
                break
        resumed = data.dataset(**opened, rank=rank)
        resumed.load_state_dict(first.state_dict())
        assert seen + _pairs(resumed) == whole
    assert (
        _pairs(data.dataset(**opened, rank=1, prefetch_batches=2)) == whole
    )  # decoded ahead on a thread: same batches


def test_bad_mixtures_name_the_fix(folders, tmp_path):
    with pytest.raises(ConfigurationError, match="proportion on every stream or on none"):
        data.dataset(
            streams=[data.Stream(local=folders[0], proportion=1), data.Stream(local=folders[1])],
            batch_size=4,
            rank=0,
            world_size=1,
        )
    with pytest.raises(ConfigurationError, match="epoch_size= applies to relative weights"):
        data.dataset(
            streams=[data.Stream(local=folders[0], repeat=1)], epoch_size=5, batch_size=4, rank=0, world_size=1
        )
    with pytest.raises(ConfigurationError, match="one of proportion, repeat and choose"):
        data.Stream(local=folders[0], proportion=1, choose=3)
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "other"), columns={"id": "int64", "text": "str"}) as writer:
        writer.write({"id": 0, "text": "a"})
    with pytest.raises(ConfigurationError, match="stream 1 has columns.*same columns"):
        data.dataset(
            streams=[data.Stream(local=folders[0]), data.Stream(local=str(tmp_path / "other"))],
            batch_size=4,
            rank=0,
            world_size=1,
        )
    with pytest.raises(ConfigurationError, match="num_workers=-1 must be an integer >= 0"):
        data.dataset(streams=[data.Stream(local=folders[0])], batch_size=4, num_workers=-1, rank=0, world_size=1)
    state = data.dataset(
        streams=[data.Stream(local=folders[0], repeat=1)], batch_size=4, rank=0, world_size=1
    ).state_dict()
    with pytest.raises(ConfigurationError, match="counts"):
        data.dataset(
            streams=[data.Stream(local=folders[0], repeat=2)], batch_size=4, rank=0, world_size=1
        ).load_state_dict(state)


def test_a_one_sample_batch_of_unaligned_columns_decodes(folders):
    # Rows of 20 bytes put the second int64 column at an offset it cannot be viewed at; a mixture
    # often takes a single sample of a stream into a batch.
    batches = list(data.dataset(local=folders[2], batch_size=59, rank=0, world_size=1))
    assert [len(b["src"]) for b in batches] == [59, 1]
    assert batches[1]["src"].tolist() == [2] and batches[1]["id"].tolist() == [59]


def test_streams_on_volumes_each_fill_their_own_cache_folder(folders, tmp_path):
    cache = tmp_path / "cache"
    streams = [
        data.Stream(remote=folders[0], proportion=1),
        data.Stream(remote=folders[1], proportion=1, local=tmp_path / "own"),
    ]
    loader = data.dataset(
        streams=streams, local=cache, epoch_size=120, batch_size=16, shuffle=True, rank=0, world_size=1
    )
    counts = collections.Counter(src for src, _ in _pairs(loader))
    assert [counts[0], counts[1]] == loader.counts.tolist() == [60, 60]
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1 and any((tmp_path / "own").iterdir())
    stats = loader.stats()
    assert (
        stats["downloaded_mb"] > 0 and 0 <= stats["cache_hit_ratio"] <= 1 and stats["batches"] == 8
    )  # prefetching may win every race
    loader.close()


@pytest.mark.parametrize("variable_width", [False, True], ids=["fixed-width", "variable-width"])
def test_workers_split_the_batches_and_resume_exactly(folders, tmp_path, variable_width):
    """Two DataLoader workers: the same batches as in-process, each decoded once, and an exact resume."""
    if variable_width:  # a text column: batches decoded stream by stream, then merged, in the workers
        from streaming import MDSWriter

        roots = []
        for stream, size in enumerate(SIZES):
            columns = {"id": "int64", "src": "int64", "x": "float32", "text": "str"}
            with MDSWriter(out=str(tmp_path / f"v{stream}"), columns=columns, size_limit=1 << 10) as writer:
                for i in range(size):
                    writer.write({"id": i, "src": stream, "x": np.float32(stream * 1000 + i), "text": f"{stream}:{i}"})
            roots.append(str(tmp_path / f"v{stream}"))
    else:
        roots = folders
    streams = [data.Stream(local=f, proportion=p) for f, p in zip(roots, (2, 1, 1))]
    opened = dict(streams=streams, epoch_size=300, batch_size=10, shuffle=True, seed=4, world_size=2, rank=1)
    whole = _pairs(data.dataset(**opened))
    with_workers = data.dataset(**opened, num_workers=2)
    assert _pairs(with_workers) == whole  # worker 0 decodes batches 0, 2, ...; worker 1 the others
    in_process = data.dataset(**opened)
    in_process.set_epoch(1)
    assert _pairs(with_workers) == _pairs(in_process) != whole  # the next epoch, from the same persistent workers
    with_workers.set_epoch(0)
    seen = []
    for batch in with_workers:
        if variable_width:
            assert batch["text"] == [f"{s}:{i}" for s, i in zip(batch["src"].tolist(), batch["id"].tolist())]
        seen += list(zip(batch["src"].tolist(), batch["id"].tolist()))
        if len(seen) == 70:  # an odd number of batches: the resume starts on the other worker
            break
    state = with_workers.state_dict()
    with_workers.close()
    resumed = data.dataset(**opened, num_workers=2)
    resumed.load_state_dict(state)
    assert seen + _pairs(resumed) == whole
    resumed.close()


def test_streams_with_variable_width_columns_give_the_epochs_order(tmp_path):
    # Strings are decoded stream by stream and merged back into the batch's order.
    from streaming import MDSWriter

    folders = []
    for stream, size in enumerate((40, 70, 25)):
        with MDSWriter(
            out=str(tmp_path / f"t{stream}"), columns={"id": "int64", "text": "str"}, size_limit=1 << 9
        ) as writer:
            for i in range(size):
                writer.write({"id": i, "text": f"{stream}:{i}" * (1 + i % 3)})
        folders.append(str(tmp_path / f"t{stream}"))
    loader = data.dataset(
        streams=[data.Stream(local=f, proportion=p) for f, p in zip(folders, (0.5, 0.3, 0.2))],
        epoch_size=150,
        batch_size=7,
        shuffle=True,
        seed=4,
        rank=0,
        world_size=1,
    )
    bases = np.cumsum([0, 40, 70])
    expected = [
        (int(np.searchsorted(bases, m, side="right")) - 1, int(m - bases[np.searchsorted(bases, m, side="right") - 1]))
        for m in loader.epoch_order(0).tolist()
    ]
    seen = []
    for batch in loader:
        assert isinstance(batch["text"], list) and len(batch["text"]) == len(batch["id"])
        for number, text in zip(batch["id"].tolist(), batch["text"]):
            stream = int(text.split(":")[0])
            assert text == f"{stream}:{number}" * (1 + number % 3)  # the text of the same sample as the id
            seen.append((stream, number))
    assert seen == expected
