"""The NVMe cache for the files of a remote table, with the planned prefetch and eviction of MDS shards.

A remote table's Parquet files play the part of shards in :class:`sparkgpu.data.storage.cache.ShardCache`:
the epoch's plan says which files each batch reads, files are downloaded ahead in the order
they are first needed, and at ``cache_limit`` the file needed furthest in the future is evicted
first. Row groups are then read from the local copy. Local tables are read where they are.

The row groups the first batch reads do not wait for their whole files: they are fetched by
byte range (the row group's column chunks and the file's footer, on the download threads),
decoded from memory, and only then do the whole-file downloads start. The first batch then
costs about one row group's transfer instead of one file's, and no more connections are open
at any time than ``download_threads``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import struct

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from sparkgpu._util.files import atomic_write_bytes

__all__ = ["TableFileCache"]

_LISTING = "table-files.json"


class TableFileCache:
    """Local copies of a remote table's data files, fetched ahead of a plan.

    Args:
        url: The table's root URL (the cache entry is named after it).
        root: The root as a path of the dataset's filesystem (what file paths start with).
        files: The data files' paths on that filesystem.
        sizes: Their sizes in bytes.
        storage_options: fsspec options for the volume.
        cache_root: Where cache entries live.
        limit_bytes: Most bytes kept, or ``None``.
        download_threads: Parallel downloads.
    """

    def __init__(self, url, root, files, sizes, storage_options, cache_root, limit_bytes, download_threads):
        from sparkgpu.data.storage import cache as cache_module
        from sparkgpu.data.mds.reader import DatasetIndex, ShardInfo
        from sparkgpu.data.storage.volume import Volume

        prefix = root.rstrip("/") + "/"
        names = [path[len(prefix) :] if path.startswith(prefix) else path.lstrip("/") for path in files]
        self.position = {path: i for i, path in enumerate(files)}
        raw = json.dumps([[n, s] for n, s in zip(names, sizes)]).encode()
        self.index = DatasetIndex(
            shards=tuple(ShardInfo(i, n, 1, int(s), {}) for i, (n, s) in enumerate(zip(names, sizes))),
            columns=(),
            fingerprint=hashlib.sha1(raw).hexdigest(),
        )
        self._volume_of = (url, storage_options)
        self._volume = (os.getpid(), Volume(url, storage_options))
        self.entry = cache_module.entry_dir_for(cache_root, self.volume.url)
        meta = self.entry / cache_module._META
        meta.mkdir(parents=True, exist_ok=True)
        with cache_module._file_lock(meta / "cache.lock"):
            saved = meta / _LISTING
            if not saved.exists() or saved.read_bytes() != raw:
                cache_module._remove_shards(self.entry)  # another table version: cached files may be stale
                atomic_write_bytes(saved, raw, fsync=False)
        self.limit_bytes, self.download_threads = limit_bytes, download_threads
        self._cache = None
        self._ranges: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (pid, pool)

    @property
    def volume(self):
        """The volume, made again in a forked DataLoader worker (its parent's clients do not exist there)."""
        from sparkgpu.data.storage.volume import Volume

        if self._volume[0] != os.getpid():
            self._volume = (os.getpid(), Volume(*self._volume_of))
        return self._volume[1]

    def start(self, steps: list[np.ndarray]) -> None:
        """Starts fetching for a plan: ``steps[i]`` are the file positions batch ``i`` reads."""
        from sparkgpu.data.storage.cache import ShardCache

        self.close()
        self._cache = ShardCache(self.entry, self.index, self.volume, self.limit_bytes, self.download_threads)
        self._cache.set_plan(steps)

    def reached(self, step: int, files: np.ndarray) -> None:
        """Tells the cache that batch ``step`` (reading ``files``) is being built now."""
        self._cache.acquire(step, files)

    def is_local(self, path: str) -> bool:
        """Whether the cache holds the file at ``path`` (a data file of the table) now."""
        return (self.entry / self.index.shards[self.position[path]].basename).exists()

    def remote_piece(self, piece):
        """``piece`` (a row group fragment) read straight from the volume into memory, by byte range.

        The row group's bytes and the file's footer are fetched on up to ``download_threads``
        connections and placed at their offsets in a buffer the size of the file (the rest of
        it is never touched, so never backed by memory), which Arrow then reads as the file.
        """
        shard = self.position[piece.path]
        name, size = self.index.shards[shard].basename, self.index.shards[shard].raw_bytes
        group = piece.metadata.row_group(piece.row_groups[0].id)
        chunks = [group.column(i) for i in range(group.num_columns)]
        starts = [
            c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else c.data_page_offset
            for c in chunks
        ]
        begin = min(starts)
        end = max(start + c.total_compressed_size for start, c in zip(starts, chunks))
        tail = min(size, _TAIL)
        if self._ranges is None or self._ranges[0] != os.getpid():  # (a forked worker makes its own)
            pool = concurrent.futures.ThreadPoolExecutor(self.download_threads, thread_name_prefix="sparkgpu-range")
            self._ranges = (os.getpid(), pool)
        part = max(_MIN_PART, -(-(end - begin) // self.download_threads))
        spans = [(a, min(a + part, end)) for a in range(begin, end, part)] + [(size - tail, size)]
        data = np.zeros(size, dtype=np.uint8)
        volume = self.volume
        for (a, b), got in zip(spans, self._ranges[1].map(lambda span: volume.read_bytes(name, *span), spans)):
            data[a:b] = np.frombuffer(got, dtype=np.uint8)
        (footer,) = struct.unpack("<i", bytes(data[size - 8 : size - 4]))
        if footer + 8 > tail:  # a footer larger than the first guess: fetch the rest of it
            data[size - footer - 8 : size - tail] = np.frombuffer(
                volume.read_bytes(name, size - footer - 8, size - tail), dtype=np.uint8
            )
        return pads.ParquetFileFormat().make_fragment(
            pa.BufferReader(pa.py_buffer(data)),
            partition_expression=piece.partition_expression,
            row_groups=[group_id.id for group_id in piece.row_groups],
        )

    def local_piece(self, piece, needed_at: int):
        """``piece`` (a row group fragment) reading the local copy of its file instead."""
        shard = self.position[piece.path]
        self._cache._ensure(shard, needed_at)
        path = self.entry / self.index.shards[shard].basename
        if not path.exists():  # evicted by another process since: fetch it again
            path = self._cache.refetch(shard)
        return pads.ParquetFileFormat().make_fragment(
            os.fspath(path),
            filesystem=pafs.LocalFileSystem(),
            partition_expression=piece.partition_expression,
            row_groups=[group.id for group in piece.row_groups],
        )

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        if self._ranges is not None and self._ranges[0] == os.getpid():
            self._ranges[1].shutdown(wait=True)
        self._ranges = None


_TAIL = 64 << 10  # bytes fetched from a file's end for its footer: most footers fit
_MIN_PART = 1 << 20  # smallest range of a row group fetched on its own connection
