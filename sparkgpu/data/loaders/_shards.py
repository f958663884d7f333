"""A loader's shards on local disk: the cache they come through, and one shard mapped from it.

Every loader of MDS shards (the MDS loader's producers, mixtures' streams, the token and SFT
loaders) opens its cache from the same description of where the shards are, and maps a
shard the cache has handed out the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

from sparkgpu.data.mds.reader import ShardReader
from sparkgpu.data.storage.cache import ShardCache
from sparkgpu.data.storage.volume import Volume

__all__ = ["SHARD_SOURCE", "open_shard_cache", "map_shard"]

# Where a loader's shards are and how its cache fetches them: the keys of the description
# open_shard_cache takes (and the MDS loader's attributes of these names).
SHARD_SOURCE = ("index", "directory", "volume_url", "storage_options", "cache_limit", "download_threads")


def open_shard_cache(source: Mapping) -> ShardCache:
    """The cache of the shards ``source`` describes (:data:`SHARD_SOURCE`); it fetches from the
    volume when there is one (``volume_url``), and evicts only then (``cache.volume`` is set)."""
    volume = Volume(source["volume_url"], source["storage_options"]) if source["volume_url"] else None
    return ShardCache(source["directory"], source["index"], volume, source["cache_limit"], source["download_threads"])


def map_shard(cache: ShardCache, shard: int, path, row_bytes: int | None = None) -> ShardReader:
    """Maps shard ``shard`` where ``cache.acquire`` put it (``path``); fetches it again when another
    process evicted it between the acquire and the open."""
    info = cache.index.shards[shard]
    try:
        return ShardReader(path, info, row_bytes)
    except FileNotFoundError:  # evicted by another process between acquire and open
        return ShardReader(cache.refetch(shard), info, row_bytes)
