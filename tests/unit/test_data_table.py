"""The table dataset on real Delta tables (deletion vectors included) and Parquet files."""

from __future__ import annotations

import datetime
import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sparkgpu import data
from sparkgpu.errors import ConfigurationError, DataError
from tests.unit.delta_dv import delete_rows


def clicks(rows: int, start: int = 0) -> pa.Table:
    ids = np.arange(start, start + rows, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "x": (ids * 0.5).astype(np.float32),
            "day": pa.array([f"2026-11-0{1 + i % 3}" for i in range(rows)]),
            "name": [f"user-{i}" for i in ids],
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 2).astype(np.float32)), 2),
        }
    )


def dv_table(tmp_path, rows=600, deleted=(1, 3, 10, 57, 99), storage_type="u") -> tuple[str, set]:
    """A partitioned table with deletion vectors and rows deleted from one file of each day.

    ``storage_type="u"`` (as Databricks writes) keeps the vectors inside the table folder;
    ``"p"`` names them by absolute URI (see :mod:`tests.unit.delta_dv`)."""
    from deltalake import DeltaTable, write_deltalake

    uri = str(tmp_path / "clicks")
    from deltalake import WriterProperties

    write_deltalake(
        uri,
        clicks(rows),
        partition_by=["day"],
        configuration={"delta.enableDeletionVectors": "true"},
        writer_properties=WriterProperties(max_row_group_size=50),
    )  # several row groups per file
    gone = set()
    for add in pa.table(DeltaTable(uri).get_add_actions(flatten=True)).to_pylist():
        path = os.path.join(uri, add["path"])
        ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
        delete_rows(uri, add["path"], list(deleted), storage_type=storage_type)
        gone |= {ids[i] for i in deleted}
    return uri, gone


def ids_of(dataset) -> list[int]:
    return [i for batch in dataset for i in batch["id"].tolist()]


@pytest.mark.parametrize("storage_type", ["u", "p"])  # a path relative to the table (Databricks), an absolute URI
def test_deletion_vectors_and_filter_give_exactly_the_surviving_rows_once_per_rank_split(tmp_path, storage_type):
    from deltalake import DeltaTable

    uri, gone = dv_table(tmp_path, storage_type=storage_type)
    actions = [
        json.loads(line)
        for log in sorted((tmp_path / "clicks" / "_delta_log").glob("*.json"))
        for line in log.read_text().splitlines()
    ]
    descriptors = [a["add"]["deletionVector"] for a in actions if a.get("add", {}).get("deletionVector")]
    assert len(descriptors) == 3 and {d["storageType"] for d in descriptors} == {storage_type}
    if storage_type == "u":  # the vectors are files of the table: <prefix>/deletion_vector_<uuid>.bin
        assert all(len(d["pathOrInlineDv"]) == 2 + 20 for d in descriptors)
        assert sorted(p.parent.name for p in (tmp_path / "clicks").rglob("*.bin")) == ["ab"] * 3
    # deltalake's own engine agrees on which rows the deletion vectors remove.
    assert sorted(pa.table(DeltaTable(uri).scan(columns=["id"])).column("id").to_pylist()) == sorted(
        set(range(600)) - gone
    )
    survivors = {i for i in range(600) if i not in gone and i >= 20}
    orders = []
    for epoch in range(2):
        seen, batches = [], []
        for rank in range(2):
            ds = data.table_dataset(
                uri,
                filter="id >= 20",
                batch_size=16,
                shuffle=True,
                seed=3,
                shuffle_block_size=100,
                rank=rank,
                world_size=2,
            )
            ds.set_epoch(epoch)
            rank_batches = list(ds)
            batches.append(len(rank_batches))
            seen += [i for b in rank_batches for i in b["id"].tolist()]
        assert len(seen) == len(set(seen))  # nothing twice
        assert set(seen) <= survivors and len(survivors) - len(seen) == len(survivors) % 2  # the remainder rule
        assert batches[0] == batches[1]
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled each epoch


def test_to_mds_of_a_table_with_deletion_vectors_leaves_deleted_rows_out(tmp_path):
    uri, gone = dv_table(tmp_path)
    result = data.to_mds(uri, str(tmp_path / "mds"))
    assert result.samples == 600 - len(gone)
    ds = data.dataset(local=str(tmp_path / "mds"), batch_size=64, rank=0, world_size=1)
    assert sorted(ids_of(ds)) == sorted(set(range(600)) - gone)


def test_partition_filter_prunes_files_before_reading(tmp_path):
    uri, gone = dv_table(tmp_path)
    for name in os.listdir(uri):
        if name.startswith("day=2026-11-02"):
            for leaf in os.listdir(os.path.join(uri, name)):
                os.remove(os.path.join(uri, name, leaf))  # never opened: pruned by the partition filter
    ds = data.table_dataset(uri, filter="day = '2026-11-01'", batch_size=50, rank=0, world_size=1)
    assert sorted(ids_of(ds)) == sorted(i for i in range(0, 600, 3) if i not in gone)


def test_row_groups_pruned_by_statistics_and_types(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(clicks(1000), folder / "part-0.parquet", row_group_size=100)
    ds = data.table_dataset(str(folder), filter="id >= 850", batch_size=32, rank=0, world_size=1)
    assert len(ds._units) == 2  # row groups [800, 900) and [900, 1000): the other eight are skipped
    batch = next(iter(ds))
    assert batch["id"].dtype == torch.int64 and batch["x"].dtype == torch.float32
    assert batch["emb"].shape == (32, 2) and batch["emb"][0].tolist() == [850.0, 850.0]
    assert batch["name"][:2] == ["user-850", "user-851"]
    assert sorted(
        ids_of(data.table_dataset(str(folder), filter="id >= 850", batch_size=32, rank=0, world_size=1))
    ) == list(range(850, 1000))


def test_version_and_timestamp_pin_the_table(tmp_path):
    from deltalake import write_deltalake

    uri = str(tmp_path / "t")
    write_deltalake(uri, clicks(100))
    time.sleep(0.05)
    between = datetime.datetime.now(datetime.timezone.utc)
    time.sleep(0.05)
    write_deltalake(uri, clicks(50, start=100), mode="append")
    assert data.table_dataset(uri, batch_size=10, rank=0, world_size=1).num_samples == 150
    assert sorted(ids_of(data.table_dataset(uri, version=0, batch_size=10, rank=0, world_size=1))) == list(range(100))
    assert data.table_dataset(uri, timestamp=between, batch_size=10, rank=0, world_size=1).num_samples == 100
    with pytest.raises(DataError, match="version 7"):
        data.table_dataset(uri, version=7, batch_size=10, rank=0, world_size=1)


def test_nulls_are_refused_naming_the_column_unless_filled(tmp_path):
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "score": pa.array([1.0, None, 3.0])}), path)
    with pytest.raises(DataError, match="'score'.*fill_null"):
        list(data.table_dataset(str(path), batch_size=3, rank=0, world_size=1))
    batch = next(iter(data.table_dataset(str(path), batch_size=3, fill_null={"score": -1.0}, rank=0, world_size=1)))
    assert batch["score"].tolist() == [1.0, -1.0, 3.0]


def test_resume_mid_epoch_yields_exactly_the_rest(tmp_path):
    uri, _ = dv_table(tmp_path)
    full = data.table_dataset(uri, batch_size=16, shuffle=True, seed=5, shuffle_block_size=64, rank=0, world_size=1)
    everything = ids_of(full)
    first = data.table_dataset(uri, batch_size=16, shuffle=True, seed=5, shuffle_block_size=64, rank=0, world_size=1)
    iterator = iter(first)
    head = [i for _ in range(5) for i in next(iterator)["id"].tolist()]
    state = first.state_dict()
    again = data.table_dataset(uri, batch_size=16, shuffle=True, seed=5, shuffle_block_size=64, rank=0, world_size=1)
    again.load_state_dict(state)
    assert head + ids_of(again) == everything
    assert ids_of(again) != everything[: len(everything)]  # next epoch: a different order
    other = data.table_dataset(uri, batch_size=16, shuffle=True, seed=6, shuffle_block_size=64, rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match="seed"):
        other.load_state_dict(state)


@pytest.mark.parametrize("shuffle", [True, False, "fragments"])
def test_dataloader_workers_yield_the_same_batches_in_the_same_order(tmp_path, shuffle):
    uri, _ = dv_table(tmp_path)
    plain = ids_of(data.table_dataset(uri, batch_size=16, shuffle=shuffle, seed=1, rank=0, world_size=1))
    ds = data.table_dataset(uri, batch_size=16, shuffle=shuffle, seed=1, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert [i for b in loader for i in b["id"].tolist()] == plain


def test_bad_arguments_fail_before_reading(tmp_path):
    uri, _ = dv_table(tmp_path)
    with pytest.raises(ConfigurationError, match="no column 'dya'"):
        data.table_dataset(uri, filter="dya = '2026-11-01'", batch_size=4, rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match="not a SQL predicate|not supported"):
        data.table_dataset(uri, filter="id >>> 3", batch_size=4, rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match=r"columns=\['nope'\]"):
        data.table_dataset(uri, columns=["nope"], batch_size=4, rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match="version= and timestamp= apply to Delta"):
        data.table_dataset(str(tmp_path), version=1, batch_size=4, rank=0, world_size=1)


def test_remote_table_files_come_through_the_cache(tmp_path):
    import fsspec

    memory = fsspec.filesystem("memory")
    for part in range(3):
        sink = pa.BufferOutputStream()
        pq.write_table(clicks(200, start=200 * part), sink, row_group_size=50)
        memory.pipe(f"/lake/t/part-{part}.parquet", sink.getvalue().to_pybytes())
    cache = tmp_path / "cache"
    ds = data.table_dataset(
        "memory://lake/t",
        filter="id >= 100",
        batch_size=32,
        shuffle=True,
        seed=2,
        local=str(cache),
        rank=0,
        world_size=1,
    )
    assert sorted(ids_of(ds)) == list(range(100, 600))
    assert sorted(p.name for p in cache.rglob("*.parquet")) == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    # A limit of one file: files are evicted and fetched again as the plan needs them; the rows stay exact.
    small = data.table_dataset(
        "memory://lake/t",
        batch_size=40,
        local=str(tmp_path / "small"),
        rank=0,
        world_size=1,
        cache_limit=max(len(memory.cat(f"/lake/t/part-{i}.parquet")) for i in range(3)) + 10,
    )
    assert ids_of(small) == list(range(600))
    assert len(list((tmp_path / "small").rglob("*.parquet"))) == 1


def test_shuffled_batches_drawing_from_many_row_groups_keep_every_column_of_a_row_together(tmp_path):
    path = tmp_path / "mixed.parquet"
    table = clicks(2000)
    ids = table.column("id").to_numpy()
    table = table.append_column("even", pa.array(ids % 2 == 0)).append_column(
        "at", pa.array(ids, type=pa.timestamp("us"))
    )
    pq.write_table(table, path, row_group_size=70)  # every batch of 64 draws from several row groups
    ds = data.table_dataset(
        str(path), batch_size=64, shuffle=True, seed=7, shuffle_block_size=500, rank=0, world_size=1
    )
    seen = []
    for batch in ds:
        got = batch["id"]
        assert torch.equal(batch["x"], (got * 0.5).float())
        assert torch.equal(batch["emb"], got.float().repeat_interleave(2).reshape(-1, 2))
        assert batch["name"] == [f"user-{i}" for i in got.tolist()]
        assert torch.equal(batch["even"], got % 2 == 0) and torch.equal(batch["at"], got)
        batch["x"] += 1  # batches are writable and share nothing with the next one
        seen += got.tolist()
    assert sorted(seen) == list(range(2000)) and seen != sorted(seen)


def test_fragment_shuffle_reads_row_groups_whole_in_a_random_order_and_mixes_rows_within_each_step(tmp_path):
    uri, gone = dv_table(tmp_path)
    options = dict(batch_size=8, shuffle="fragments", seed=3)
    plain = data.table_dataset(uri, batch_size=8, rank=0, world_size=1)
    groups = [set(g) for g in _row_groups_of(plain)]
    ranks = [data.table_dataset(uri, **options, rank=r, world_size=2) for r in range(2)]
    epochs = []
    for _ in range(2):
        batches = [[b["id"].tolist() for b in rank] for rank in ranks]
        steps = [a + b for a, b in zip(*batches)]  # one step of both ranks: 16 rows of the order
        seen = [i for step in steps for i in step]
        every = {i for g in groups for i in g}
        # Each row once; the remainder rule leaves fewer than world_size rows out of the epoch.
        assert len(set(seen)) == len(seen) and set(seen) <= every and len(every) - len(seen) < 2
        assert not set(seen) & gone
        # Row groups come whole and one after another: each group's rows sit in one stretch of
        # the epoch, widened by less than a step at each end by the shuffle within steps.
        where = {i: p for p, i in enumerate(seen)}
        for group in groups:
            spots = sorted(where[i] for i in group if i in where)
            assert spots[-1] - spots[0] < len(group) + 2 * 16
        # Within a step the order is shuffled, and the layout of groups differs per epoch.
        assert any(step != sorted(step) for step in steps)
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    # Resumable like any order: the rest of an epoch after a saved position.
    first = data.table_dataset(uri, **options, rank=0, world_size=1)
    iterator = iter(first)
    head = [i for _ in range(3) for i in next(iterator)["id"].tolist()]
    again = data.table_dataset(uri, **options, rank=0, world_size=1)
    again.load_state_dict(first.state_dict())
    assert head + ids_of(again) == ids_of(data.table_dataset(uri, **options, rank=0, world_size=1))
    with pytest.raises(ConfigurationError, match="'fragments'"):
        data.table_dataset(uri, batch_size=8, shuffle="rows", rank=0, world_size=1)


def _row_groups_of(dataset) -> list[list[int]]:
    ids = ids_of(dataset)
    bounds = np.cumsum([0, *dataset._sizes.tolist()])
    return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def test_batches_in_order_are_writable_and_a_write_reaches_no_other_batch_or_epoch(tmp_path):
    import warnings

    path = tmp_path / "clicks.parquet"
    pq.write_table(clicks(1000), path, row_group_size=100)
    rows = data.table_dataset(str(path), columns=["id", "x", "emb"], batch_size=64, rank=0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it is handed memory it may not write
        first = list(rows)
        for batch in first:
            batch["x"].mul_(-1)
            batch["emb"].zero_()
    assert [i for b in first for i in b["id"].tolist()] == list(range(1000))
    assert all(bool((b["x"] == -0.5 * b["id"]).all()) and not b["emb"].any() for b in first)
    again = list(rows)  # the next epoch reads the table again, untouched by the writes
    assert all(b["x"].tolist() == (0.5 * b["id"]).tolist() for b in again)
    assert all(b["emb"][:, 0].tolist() == b["id"].float().tolist() for b in again)


def test_row_groups_take_over_the_buffers_arrow_decoded_for_them_and_copy_shared_ones(tmp_path):
    from sparkgpu.data.loaders.table_tensors import UnitColumns

    path = tmp_path / "clicks.parquet"
    pq.write_table(clicks(100), path)
    decoded = pq.read_table(path, columns=["x", "emb"])
    columns = UnitColumns(decoded, own=True)
    buffer = decoded.column("x").chunk(0).buffers()[1]
    assert np.shares_memory(columns.fixed["x"], np.frombuffer(buffer, dtype=np.uint8))  # no copy
    assert columns.fixed["x"].flags.writeable and columns.fixed["emb"].flags.writeable
    values = np.arange(100, dtype=np.float32)
    shared = pa.Array.from_buffers(pa.float32(), 100, [None, pa.py_buffer(values.tobytes())])  # immutable
    assert not shared.buffers()[1].is_mutable
    owned = UnitColumns(pa.table({"x": shared}), own=True).fixed["x"]
    assert owned.flags.writeable and not np.shares_memory(owned, np.frombuffer(shared.buffers()[1], dtype=np.uint8))
    assert owned.view(np.float32).ravel().tolist() == values.tolist()


def test_the_first_batch_locates_only_its_own_stretch_of_the_epoch(tmp_path, monkeypatch):
    # Finding every row's row group for a whole epoch before the first batch would make start-up
    # grow with the table; only the first stretch of batches is located before it, and in order
    # no row is located at all (batches are cut at row group boundaries).
    from sparkgpu.data.loaders import table as table_module

    located = []
    real = table_module.locate
    monkeypatch.setattr(
        table_module, "locate", lambda samples, sizes: located.append(len(samples)) or real(samples, sizes)
    )
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"id": np.arange(200_000, dtype=np.int64)}), path, row_group_size=10_000)
    for shuffle in (False, True, "fragments"):
        rows = data.table_dataset(str(path), batch_size=100, shuffle=shuffle, seed=0, rank=0, world_size=1)
        located.clear()
        batch = next(iter(rows))
        assert located == ([table_module._Reader._STRETCH * 100] if shuffle else []), shuffle
        assert len(batch["id"]) == 100


def test_a_remote_tables_first_batch_reads_its_row_groups_by_range_before_any_whole_file(tmp_path, monkeypatch):
    import struct

    import fsspec

    from sparkgpu.data.storage.table_cache import TableFileCache
    from sparkgpu.data.storage.volume import Volume

    memory = fsspec.filesystem("memory")
    wide = {f"c{i:03d}": np.arange(300, dtype=np.float32) + i for i in range(300)}  # a footer over 64 KB
    footers = []
    for part, day in enumerate(("2026-11-01", "2026-11-02")):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"id": np.arange(300, dtype=np.int64) + 300 * part, **wide}), sink, row_group_size=100)
        raw = sink.getvalue().to_pybytes()
        footers.append(struct.unpack("<i", raw[-8:-4])[0])
        memory.pipe(f"/lake/wide/day={day}/part-0.parquet", raw)
    assert min(footers) > 64 << 10  # the footer takes a second range
    # Whole-file downloads read through read_bytes too (a small file in one request, a large one
    # in ranges), on their own threads: a read is the first batch's when it comes before the end
    # of the first batch's row group read, which comes before any download starts.
    events = []
    read_bytes, download, remote_piece = Volume.read_bytes, Volume.download, TableFileCache.remote_piece

    def ranged(self, relative, start=None, end=None):
        events.append(("range", relative, start, end))
        return read_bytes(self, relative, start, end)

    def whole(self, relative, *args, **kwargs):
        events.append(("file", relative))
        return download(self, relative, *args, **kwargs)

    def row_group_by_range(self, piece):
        fragment = remote_piece(self, piece)
        events.append(("row group read", piece.path))
        return fragment

    monkeypatch.setattr(Volume, "read_bytes", ranged)
    monkeypatch.setattr(Volume, "download", whole)
    monkeypatch.setattr(TableFileCache, "remote_piece", row_group_by_range)
    rows = data.table_dataset(
        "memory://lake/wide",
        columns=["id", "day", "c299"],
        filter="id >= 10 AND id != 15",
        batch_size=20,
        local=str(tmp_path / "cache"),
        rank=0,
        world_size=1,
    )
    iterator = iter(rows)
    first = next(iterator)
    kept = [i for i in range(10, 600) if i != 15]
    assert first["id"].tolist() == kept[:20] and first["day"] == ["2026-11-01"] * 20
    assert first["c299"].tolist() == [float(i % 300 + 299) for i in kept[:20]]
    read = [i for i, e in enumerate(events) if e[0] == "row group read"]
    assert len(read) == 1 and events[read[0]][1].endswith("day=2026-11-01/part-0.parquet")
    assert read[0] < min((i for i, e in enumerate(events) if e[0] == "file"), default=len(events))
    fetched = events[: read[0]]  # the first batch's reads: by range, of its own file only
    assert fetched and all(e[0] == "range" and e[2] is not None and e[3] is not None for e in fetched)
    assert {e[1] for e in fetched} == {"day=2026-11-01/part-0.parquet"}
    rest = [i for batch in iterator for i in batch["id"].tolist()]
    assert first["id"].tolist() + rest == kept
    assert {e[1] for e in events if e[0] == "file"} == {
        "day=2026-11-01/part-0.parquet",
        "day=2026-11-02/part-0.parquet",
    }


def test_the_cache_plan_lists_each_steps_files_once_from_the_row_groups_spans():
    from sparkgpu.data.loaders.table import _files_by_step

    # Row groups 0 and 1 in file 0 (steps 0-1 and 1-2), 2 in file 1 (steps 1-3), 3 in file 2 (step 3).
    steps = _files_by_step(np.array([0, 0, 1, 2]), np.array([0, 1, 1, 3]), np.array([1, 2, 3, 3]), 5)
    assert [s.tolist() for s in steps] == [[0], [0, 1], [0, 1], [1, 2], []]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_script_that_stops_reading_mid_epoch_exits_quietly(tmp_path, shuffle):
    """A loop broken off at the end of a script leaves its iteration open until the interpreter
    exits; closing it then must not print an ignored exception (the read threads' pool)."""
    import subprocess
    import sys

    pq.write_table(clicks(5000), tmp_path / "part-0.parquet", row_group_size=500)
    script = (
        "from sparkgpu import data\n"
        f"rows = data.table_dataset({str(tmp_path)!r}, batch_size=64, shuffle={shuffle}, columns=['id', 'x'])\n"
        "batches = iter(rows)\n"
        "print(len(next(batches)['id']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "64"
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
