"""Where shards and table files live, and their local copies: volumes, object stores, the NVMe cache.

- :mod:`~sparkgpu.data.storage.volume`: a volume, any fsspec URL, read in parallel byte ranges;
  object stores and HTTP through obstore (``_object_store``), the rest through fsspec;
- :mod:`~sparkgpu.data.storage.cache`: the local NVMe cache of a volume's MDS shards, bounded,
  fetched ahead of need in the order the epoch's plan reads them (one shard's download,
  check and atomic placement in ``_fetch``);
- :mod:`~sparkgpu.data.storage.table_cache`: the same cache for the Parquet files of a remote table.
"""
