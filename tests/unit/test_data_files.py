"""The files dataset: a volume folder split over ranks and workers, shuffled, cached, resumable."""

from __future__ import annotations

import fsspec
import pytest
import torch

from sparkgpu import data
from sparkgpu.errors import ConfigurationError, DataError


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "images"
    for i in range(23):
        (root / f"class{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"class{i % 3}" / f"img{i:02d}.jpg").write_bytes(f"image {i}".encode())
    (root / "README.txt").write_text("not an image")
    return root


def test_ranks_split_every_epoch_disjointly_and_reshuffle(folder):
    epochs = []
    for epoch in range(2):
        parts = []
        for rank in range(2):
            ds = data.files_dataset(str(folder), "**/*.jpg", shuffle=True, seed=1, rank=rank, world_size=2)
            ds.set_epoch(epoch)
            parts.append([name for name, _ in ds])
        assert len(parts[0]) == len(parts[1]) == 11  # 23 files: one left out by the remainder rule
        assert not set(parts[0]) & set(parts[1])
        epochs.append(parts[0] + parts[1])
    assert epochs[0] != epochs[1]
    assert all(name.endswith(".jpg") for name in epochs[0])


def test_local_folder_is_read_in_place_and_as_bytes(folder):
    ds = data.files_dataset(str(folder), "class1/*.jpg", rank=0, world_size=1)
    pairs = list(ds)
    assert [name for name, _ in pairs] == sorted(f"class1/img{i:02d}.jpg" for i in range(1, 23, 3))
    assert pairs[0][1] == str(folder / "class1" / "img01.jpg")
    name, raw = next(iter(data.files_dataset(str(folder), "class1/*.jpg", as_bytes=True, rank=0, world_size=1)))
    assert raw == b"image 1"


def test_remote_files_come_through_the_cache_and_transform(folder, tmp_path):
    memory = fsspec.filesystem("memory")
    for path in folder.rglob("*.jpg"):
        memory.pipe(f"/vol/{path.relative_to(folder)}", path.read_bytes())
    cache = tmp_path / "cache"
    ds = data.files_dataset(
        "memory://vol",
        "**/*.jpg",
        local=cache,
        transform=lambda name, raw: (name, raw.decode()),
        as_bytes=True,
        rank=0,
        world_size=1,
    )
    got = dict(ds)
    assert got == {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*.jpg")}
    assert len([p for p in cache.rglob("*.jpg")]) == 23  # landed in the cache


def test_resume_mid_epoch_and_workers(folder):
    everything = [n for n, _ in data.files_dataset(str(folder), "**/*.jpg", shuffle=True, seed=4, rank=0, world_size=1)]
    ds = data.files_dataset(str(folder), "**/*.jpg", shuffle=True, seed=4, rank=0, world_size=1)
    iterator = iter(ds)
    head = [next(iterator)[0] for _ in range(7)]
    again = data.files_dataset(str(folder), "**/*.jpg", shuffle=True, seed=4, rank=0, world_size=1)
    again.load_state_dict(ds.state_dict())
    assert head + [n for n, _ in again] == everything
    loader = torch.utils.data.DataLoader(
        data.files_dataset(str(folder), "**/*.jpg", shuffle=True, seed=4, rank=0, world_size=1),
        batch_size=None,
        num_workers=2,
    )
    assert sorted(n for n, _ in loader) == sorted(everything)
    with pytest.raises(ConfigurationError, match="seed"):
        data.files_dataset(str(folder), "**/*.jpg", shuffle=True, seed=5, rank=0, world_size=1).load_state_dict(
            ds.state_dict()
        )


def test_no_match_is_an_error(folder):
    with pytest.raises(DataError, match=r"no file .* matches pattern='\*\*/\*.png'"):
        data.files_dataset(str(folder), "**/*.png", rank=0, world_size=1)
