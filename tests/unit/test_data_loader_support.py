"""Shared helpers of the data loader tests: MDS datasets written with streaming's own MDSWriter."""

from __future__ import annotations

import numpy as np

from sparkgpu.data.storage.volume import Volume

TABULAR_COLUMNS = {**{f"f{i:02d}": "float32" for i in range(4)}, "id": "int64"}


def write_tabular(path, num_samples: int, *, size_limit: int = 1 << 12, compression=None, hashes=None) -> str:
    """Writes samples whose every column is derived from ``id``, so any batch can be checked."""
    from streaming import MDSWriter

    with MDSWriter(
        out=str(path), columns=TABULAR_COLUMNS, size_limit=size_limit, compression=compression, hashes=hashes
    ) as writer:
        for i in range(num_samples):
            writer.write({**{f"f{j:02d}": np.float32(i + j / 4) for j in range(4)}, "id": i})
    return str(path)


def check_tabular_batch(batch) -> np.ndarray:
    """Asserts a batch's columns agree with its ids; returns the ids."""
    ids = batch["id"].numpy()
    for j in range(4):
        np.testing.assert_array_equal(batch[f"f{j:02d}"].numpy(), (ids + j / 4).astype(np.float32))
    return ids.copy()


def collect_ids(loader) -> list[np.ndarray]:
    return [check_tabular_batch(batch) for batch in loader]


class CountingVolume(Volume):
    """A real volume that counts downloads per file and damages, in transit, the first ``corrupt`` reads of shards."""

    def __init__(self, url, corrupt: int = 0):
        super().__init__(url)
        self.downloads: dict[str, int] = {}
        self.corrupt_left = corrupt

    def download(self, relative, local_path, *args, **kwargs):
        hasher = super().download(relative, local_path, *args, **kwargs)
        self.downloads[relative] = self.downloads.get(relative, 0) + 1
        return hasher

    def read_bytes(self, relative, start=None, end=None):
        data = super().read_bytes(relative, start, end)
        if self.corrupt_left > 0 and relative != "index.json":
            self.corrupt_left -= 1
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        return data
