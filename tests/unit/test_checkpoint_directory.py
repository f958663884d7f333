"""The checkpoint directory layout: completion markers decide what exists, pruning keeps k."""

from __future__ import annotations

import json
import os

import pytest

from sparkgpu.errors import CheckpointError
from sparkgpu.train.checkpoint_directory import MARKER_NAME, CheckpointInfo, CheckpointDirectory


def _fake_checkpoint(store: CheckpointDirectory, step: int, *, complete: bool) -> str:
    path = store.prepare(step)
    os.makedirs(path)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(b"data")
    if complete:
        store.commit(CheckpointInfo(step=step, path=path, world_size=1, created=1.0, extras={"s": step}))
    return path


def test_only_marked_checkpoints_are_listed(tmp_path):
    store = CheckpointDirectory(tmp_path)
    _fake_checkpoint(store, 1, complete=True)
    _fake_checkpoint(store, 5, complete=True)
    _fake_checkpoint(store, 9, complete=False)  # a save killed before its commit
    (tmp_path / "notes.txt").write_text("unrelated files are ignored")

    assert [info.step for info in store.list_complete()] == [1, 5]
    latest = store.latest()
    assert latest.step == 5 and latest.extras == {"s": 5}
    assert latest.path == str(tmp_path / "step-0000000005")
    assert store.get(9) is None and store.get(1).step == 1


def test_commit_leaves_no_temporary_file(tmp_path):
    store = CheckpointDirectory(tmp_path)
    path = _fake_checkpoint(store, 3, complete=True)
    assert sorted(os.listdir(path)) == sorted([MARKER_NAME, "__0_0.distcp"])
    assert json.loads(open(os.path.join(path, MARKER_NAME)).read())["step"] == 3


def test_damaged_or_mismatched_marker_is_ignored(tmp_path):
    store = CheckpointDirectory(tmp_path)
    good = _fake_checkpoint(store, 2, complete=True)
    broken = _fake_checkpoint(store, 4, complete=True)
    with open(os.path.join(broken, MARKER_NAME), "w") as f:
        f.write("{not json")
    # A marker copied into another step's directory does not make that step complete.
    moved = store.path_for(6)
    os.makedirs(moved)
    with open(os.path.join(good, MARKER_NAME)) as src, open(os.path.join(moved, MARKER_NAME), "w") as dst:
        dst.write(src.read())

    assert store.latest().step == 2


def test_prepare_replaces_a_leftover_directory_marker_first(tmp_path):
    store = CheckpointDirectory(tmp_path)
    _fake_checkpoint(store, 7, complete=True)
    path = store.prepare(7)
    assert not os.path.exists(path)
    assert store.latest() is None


def test_prune_keeps_newest_complete_and_in_flight_directories(tmp_path):
    store = CheckpointDirectory(tmp_path)
    for step in (1, 3, 5, 7):
        _fake_checkpoint(store, step, complete=True)
    _fake_checkpoint(store, 4, complete=False)  # leftover of a killed save: goes
    _fake_checkpoint(store, 9, complete=False)  # may be a save in flight: stays

    removed = store.prune(keep_last=2)

    assert removed == [1, 3, 4]
    assert sorted(os.listdir(tmp_path)) == ["step-0000000005", "step-0000000007", "step-0000000009"]
    assert store.prune(keep_last=None) == []


def test_missing_directory_lists_nothing(tmp_path):
    store = CheckpointDirectory(tmp_path / "not-yet")
    assert store.list_complete() == [] and store.latest() is None


def test_directory_that_cannot_be_created_names_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="pass a writable directory"):
        CheckpointDirectory(blocker / "ckpt").ensure_directory()


def test_file_url_is_a_local_path(tmp_path):
    store = CheckpointDirectory(f"file://{tmp_path}")
    assert store.is_local and store.directory == str(tmp_path)


def test_fsspec_url_commit_and_prune():
    import fsspec

    fs = fsspec.filesystem("memory")
    store = CheckpointDirectory("memory://store-test/ckpt")
    assert not store.is_local
    store.ensure_directory()
    for step in (1, 2, 3):
        path = store.path_for(step)
        fs.pipe_file(f"{path}/__0_0.distcp", b"data")
        if step != 3:
            store.commit(CheckpointInfo(step=step, path=path, world_size=1, created=1.0))
    assert [i.step for i in store.list_complete()] == [1, 2]
    assert store.prune(keep_last=1) == [1]
    assert [i.step for i in store.list_complete()] == [2]
    fs.rm("/store-test", recursive=True)
