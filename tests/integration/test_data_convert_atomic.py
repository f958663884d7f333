"""An interrupted conversion never publishes an index; running it again finishes cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from sparkgpu import data
from sparkgpu._util.files import is_temporary
from sparkgpu.data.convert.output import INDEX_NAME, MARKER_NAME
from tests.mosaic import streaming_dataset

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def batches(count: int, rows: int = 500):
    for i in range(count):
        ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        yield pa.record_batch({"id": ids, "x": ids.astype(np.float32) / 7, "name": [f"r{j}" for j in ids]})


SCHEMA = next(batches(1)).schema


def files_under(folder) -> set[str]:
    return {os.path.relpath(os.path.join(root, f), folder) for root, _, names in os.walk(folder) for f in names}


def listed_in_index(folder) -> set[str]:
    index = json.loads((folder / INDEX_NAME).read_text())
    return {shard["raw_data"]["basename"] for shard in index["shards"]}


def read_ids(url: str) -> list[int]:
    dataset = streaming_dataset(local=url, shuffle=False, batch_size=1)
    return [int(dataset[i]["id"]) for i in range(len(dataset))]


def test_source_failing_half_way_leaves_no_index_and_a_rerun_succeeds(tmp_path):
    def failing():
        yield from batches(6)
        raise RuntimeError("the source broke half-way")

    out = tmp_path / "out"
    reader = pa.RecordBatchReader.from_batches(SCHEMA, failing())
    with pytest.raises(Exception, match="the source broke half-way"):
        data.to_mds(reader, str(out), size_limit=4096, progress=False)
    assert not (out / INDEX_NAME).exists()
    assert files_under(out) == {MARKER_NAME}  # shards written before the failure are gone

    result = data.to_mds(
        pa.RecordBatchReader.from_batches(SCHEMA, batches(4)), str(out), size_limit=4096, progress=False
    )
    assert read_ids(result.url) == list(range(2000))
    assert files_under(out) == listed_in_index(out) | {INDEX_NAME}


def test_killed_conversion_leaves_no_index_and_a_rerun_removes_its_shards(tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {REPO!r})
        import numpy as np, pyarrow as pa
        from sparkgpu import data

        def dying():
            for i in range(1000):
                if i == 20:
                    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind can run
                ids = np.arange(i * 500, (i + 1) * 500, dtype=np.int64)
                yield pa.record_batch({{"id": ids, "x": ids.astype(np.float32) / 7, "name": [f"r{{j}}" for j in ids]}})

        schema = next(dying()).schema
        data.to_mds(pa.RecordBatchReader.from_batches(schema, dying()), {str(out)!r}, size_limit=4096, progress=False)
        """
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    left = files_under(out)
    assert INDEX_NAME not in left and MARKER_NAME in left
    stale = {f for f in left if f.endswith(".mds")}
    assert len(stale) > 10  # the killed run did write shards

    result = data.to_mds(
        pa.RecordBatchReader.from_batches(SCHEMA, batches(2)), str(out), size_limit=4096, progress=False
    )
    assert read_ids(result.url) == list(range(1000))
    assert files_under(out) == listed_in_index(out) | {INDEX_NAME}
    assert len(listed_in_index(out)) < len(stale)


def test_index_appears_only_after_every_shard_is_written(tmp_path):
    """While shards are being written no index exists; once it exists every shard it lists does."""
    out = tmp_path / "out"
    seen_index_while_writing = []

    def watched():
        for batch in batches(10):
            seen_index_while_writing.append((out / INDEX_NAME).exists())
            yield batch

    data.to_mds(pa.RecordBatchReader.from_batches(SCHEMA, watched()), str(out), size_limit=4096, progress=False)
    assert seen_index_while_writing and not any(seen_index_while_writing)
    assert all((out / name).exists() for name in listed_in_index(out))
    assert not (out / MARKER_NAME).exists()


def test_overwrite_removes_the_old_index_before_writing_new_shards(tmp_path):
    out = tmp_path / "out"
    data.to_mds(pa.RecordBatchReader.from_batches(SCHEMA, batches(3)), str(out), progress=False)
    index_during_rewrite = []

    def failing():
        index_during_rewrite.append((out / INDEX_NAME).exists())
        yield from batches(1)
        raise RuntimeError("broke while replacing")

    with pytest.raises(Exception, match="broke while replacing"):
        data.to_mds(pa.RecordBatchReader.from_batches(SCHEMA, failing()), str(out), overwrite=True, progress=False)
    assert index_during_rewrite == [False]
    assert not (out / INDEX_NAME).exists()  # the old dataset is gone, never half-replaced


def test_killed_right_after_removing_the_old_index_a_rerun_without_overwrite_finishes(tmp_path):
    """Replacing a dataset: the marker is written before the old index goes, so a crash between
    them leaves a folder a rerun recognises as an interrupted conversion."""
    out = tmp_path / "out"
    data.to_mds(pa.RecordBatchReader.from_batches(SCHEMA, batches(3)), str(out), size_limit=4096, progress=False)
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {REPO!r})
        import numpy as np, pyarrow as pa
        from sparkgpu import data
        from sparkgpu.data.convert import output as convert_output
        from sparkgpu.store import Store

        remove = Store.remove

        def remove_then_die(self, relpath, **kwargs):
            remove(self, relpath, **kwargs)
            if relpath == convert_output.INDEX_NAME:
                os.kill(os.getpid(), signal.SIGKILL)  # power cut right after the old index is gone

        Store.remove = remove_then_die
        ids = np.arange(100, dtype=np.int64)
        batch = pa.record_batch({{"id": ids, "x": ids.astype(np.float32), "name": [str(i) for i in ids]}})
        data.to_mds(pa.RecordBatchReader.from_batches(batch.schema, [batch]), {str(out)!r}, overwrite=True, progress=False)
        """
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    left = files_under(out)
    assert INDEX_NAME not in left and MARKER_NAME in left
    assert any(f.endswith(".mds") for f in left)  # the old shards are still there

    result = data.to_mds(
        pa.RecordBatchReader.from_batches(SCHEMA, batches(2)), str(out), size_limit=4096, progress=False
    )
    assert read_ids(result.url) == list(range(1000))
    assert files_under(out) == listed_in_index(out) | {INDEX_NAME}


def test_shards_and_their_folders_reach_the_disk_before_the_index(tmp_path, monkeypatch):
    out = tmp_path / "out"
    synced = []
    fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), out))
        fsync(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name the files being flushed")
    monkeypatch.setattr(os, "fsync", recording_fsync)
    data.to_mds(pa.RecordBatchReader.from_batches(SCHEMA, batches(6)), str(out), size_limit=4096, progress=False)
    index_flush = next(i for i, name in enumerate(synced) if is_temporary(name) and name.startswith(f".{INDEX_NAME}."))
    before = set(synced[:index_flush])
    shards = listed_in_index(out)
    assert len(shards) > 2
    missing = {s for s in shards if s not in before}
    assert not missing, f"shards listed in the index but not flushed before it: {sorted(missing)}"
    folders = {os.path.dirname(s) for s in shards if os.path.dirname(s)} | {"."}
    assert folders <= before, f"folders not flushed before the index: {sorted(folders - before)}"
    assert "." in synced[index_flush + 1 :], "the index's rename is flushed too"
