"""The one storage layer: local folders and fsspec URLs show a file whole or not at all."""

from __future__ import annotations

import importlib.util
import os
import pickle

import pytest

from sparkgpu._util.files import atomic_path, atomic_write_bytes, atomic_writer, is_temporary, temporary_name
from sparkgpu.errors import ConfigurationError, MissingDependencyError
from sparkgpu.store import Store


class Cut(Exception):
    """A writer killed halfway."""


def _everything(store: Store) -> list[str]:
    """Every file under the store as its filesystem shows it, temporaries included."""
    if store.is_local:
        return sorted(
            os.path.relpath(os.path.join(folder, name), store.url)
            for folder, _, names in os.walk(store.url)
            for name in names
        )
    return sorted(path[len(store.root) + 1 :] for path in store.fs.find(store.root))


@pytest.fixture(params=["local", "file-url", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        yield Store(tmp_path / "store")
        return
    if request.param == "file-url":
        yield Store((tmp_path / "store").as_uri())
        return
    url = f"memory://store-test/{os.urandom(4).hex()}"
    yield Store(url)
    Store(url).remove("")


def test_a_local_file_is_replaced_whole_or_kept(tmp_path):
    target = tmp_path / "state.json"
    atomic_write_bytes(target, b"old")
    with pytest.raises(Cut):
        with atomic_writer(target) as f:
            f.write(b"half of the new")
            raise Cut
    assert target.read_bytes() == b"old"
    with pytest.raises(Cut):
        with atomic_path(target) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise Cut
    assert os.listdir(tmp_path) == ["state.json"], "the killed writers left no temporary behind"
    atomic_write_bytes(target, b"new", fsync_folder=True)
    assert target.read_bytes() == b"new"


def test_temporary_names_are_hidden_unique_and_recognised(tmp_path):
    names = {temporary_name(tmp_path / "index.json") for _ in range(100)}
    assert len(names) == 100  # two writers of one file never share a temporary
    assert all(is_temporary(name) and os.path.basename(name).startswith(".index.json.") for name in names)
    assert not is_temporary("index.json") and not is_temporary("part-00000/shard.00000.mds")


def test_bytes_round_trip_with_ranges_listing_and_removal(store):
    store.write_bytes("attempts/0/logs/rank-0.log", b"step 1\nstep 2\n")
    store.write_bytes("index.json", b"{}", fsync_folder=True)
    assert store.read_bytes("attempts/0/logs/rank-0.log", 7, 13) == b"step 2"
    assert store.read_bytes("index.json") == b"{}"
    assert store.exists("index.json") and not store.exists("nope.json")
    assert store.listdir() == ["attempts", "index.json"] and store.listdir("missing") == []
    listed = store.list()
    assert sorted(listed) == ["attempts/0/logs/rank-0.log", "index.json"]
    assert listed["attempts/0/logs/rank-0.log"][0] == 14
    assert sorted(store.list("attempts/0", recursive=False)) == []  # only a folder directly under it
    with pytest.raises(FileNotFoundError):
        store.read_bytes("nope.json")

    store.rename("index.json", "old/index.json")
    assert store.read_bytes("old/index.json") == b"{}" and not store.exists("index.json")
    store.remove("attempts")
    store.remove("attempts")  # a missing one is fine
    assert _everything(store) == ["old/index.json"]


def test_a_failed_streamed_write_leaves_nothing(store):
    store.write_bytes("blob.tar", b"complete")
    with pytest.raises(Cut):
        with store.writer("blob.tar") as f:
            f.write(b"half a blob")
            raise Cut
    with pytest.raises(Cut):
        with store.writer("other.tar") as f:
            f.write(b"half")
            raise Cut
    assert store.read_bytes("blob.tar") == b"complete"
    assert _everything(store) == ["blob.tar"], "neither the half file nor a temporary is left"
    with store.writer("other.tar") as f:
        f.write(b"whole")
    assert store.read_bytes("other.tar") == b"whole"


def test_temporaries_are_never_listed(store):
    store.write_bytes("a/kept.json", b"1")
    with store.writer(temporary_name("a/upload")) as f:  # a write in progress, or a killed writer's
        f.write(b"partial")
    assert len(_everything(store)) == 2
    assert list(store.list()) == ["a/kept.json"]


def test_copies_in_and_out_appear_whole(store, tmp_path):
    source = tmp_path / "local.bin"
    source.write_bytes(os.urandom(300_000))
    store.upload(source, "up/local.bin")
    copy = tmp_path / "down" / "copy.bin"
    store.download("up/local.bin", copy)
    assert copy.read_bytes() == source.read_bytes()
    assert os.listdir(copy.parent) == ["copy.bin"]
    with pytest.raises(FileNotFoundError):
        store.download("up/missing.bin", tmp_path / "down" / "missing.bin")
    assert os.listdir(copy.parent) == ["copy.bin"], "a failed download leaves no temporary"


def test_shards_stream_from_buffers(store):
    import numpy as np

    store.write_pieces("part-0/shard.mds", [b"head", memoryview(b"mid"), np.arange(3, dtype=np.uint8)])
    assert store.read_bytes("part-0/shard.mds") == b"headmid\x00\x01\x02"
    store.sync_folders(["part-0", "not-there"])


def test_a_store_pickles_without_its_filesystem(store):
    store.write_bytes("x", b"1")
    assert store.fs is not None or store.is_local
    copy = pickle.loads(pickle.dumps(store))
    assert copy._fs is None and copy.url == store.url
    assert copy.read_bytes("x") == b"1"


def test_paths_and_urls_name_the_same_folder(tmp_path):
    assert Store((tmp_path / "a").as_uri()).url == str(tmp_path / "a")
    assert Store(f"{tmp_path}/a/").child("b/c").path("d") == str(tmp_path / "a" / "b" / "c" / "d")
    assert Store("s3://bucket/prefix/").path("x/y") == "s3://bucket/prefix/x/y"
    assert Store("s3://bucket/prefix").root == "bucket/prefix"


def test_bad_locations_fail_before_anything_is_written():
    with pytest.raises(ConfigurationError, match="the output folder is empty"):
        Store("", what="the output folder")
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(
            MissingDependencyError, match="the checkpoint directory gs://bucket/x .*`pip install gcsfs`"
        ):
            Store("gs://bucket/x", what="the checkpoint directory")
    with pytest.raises(ConfigurationError, match="knows no filesystem for nosuch://"):
        Store("nosuch://bucket/x")
