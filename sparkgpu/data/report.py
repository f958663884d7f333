"""How fast a volume feeds training: raw download rate, a cold epoch through the cache, a warm one.

``sparkgpu data bench URL`` prints this report; it answers "is my volume the bottleneck,
and how much does the local cache buy me?" on the user's own data and network.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sparkgpu.data.storage.cache import open_cache_entry
from sparkgpu.data.storage.volume import Volume

__all__ = [
    "volume_report",
    "table_report",
    "raw_parallel_download",
    "plot_volume_report",
    "report_rows",
    "REPORT_COLUMNS",
]


def raw_parallel_download(volume: Volume, files: list[str], threads: int, target: Path) -> dict:
    """Downloads ``files`` with ``threads`` plain parallel downloads: the volume's own rate.

    Returns:
        ``{"threads", "bytes", "seconds", "mb_per_s"}``.
    """
    target.mkdir(parents=True, exist_ok=True)

    def fetch(item):
        number, name = item
        local = target / f"{number}.bin"
        volume.download(name, str(local))
        return local.stat().st_size

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(fetch, enumerate(files)))
    seconds = time.perf_counter() - started
    shutil.rmtree(target, ignore_errors=True)
    return {"threads": threads, "bytes": total, "seconds": seconds, "mb_per_s": total / seconds / 1e6}


def volume_report(
    remote: str,
    *,
    local: str | os.PathLike | None = None,
    batch_size: int = 1024,
    shuffle: bool = False,
    download_threads: int = 8,
    storage_options: dict | None = None,
    png: str | os.PathLike | None = None,
    raw_download: Callable[[list[str], Path], dict] | None = None,
) -> dict:
    """Measures one dataset on its volume: raw download, epoch 1 from the volume, epoch 2 from cache.

    Works in a temporary cache folder (removed afterwards), so the user's cache is untouched
    and epoch 1 is really cold.

    Args:
        remote: Volume URL of an MDS dataset.
        local: Folder for the temporary cache (default ``SPARKGPU_CACHE_DIR``): put it on
            the disk training would use.
        batch_size: Samples per batch.
        shuffle: Read in shuffled order.
        download_threads: Parallel downloads, for the raw download and for the loader.
        storage_options: Options for the volume's filesystem.
        png: Where to draw the report as a picture (optional).
        raw_download: Measures the volume's raw rate instead of :func:`raw_parallel_download`:
            called with the files (relative to ``remote``) and a scratch folder, returns a
            dict with at least ``bytes`` and ``mb_per_s`` (a benchmark passes an
            independent client here).

    Returns:
        A dict of figures: ``raw_parallel_download``, ``epoch1_from_volume``,
        ``epoch2_from_cache`` (each with seconds, MB/s and, for epochs, samples/s and the
        wait for the first batch),
        ``epoch1_vs_raw`` and ``epoch2_speedup``.
    """
    from sparkgpu.config import settings
    from sparkgpu.data.loaders.dataset import dataset

    volume = Volume(remote, storage_options)
    root = Path(local) if local is not None else settings().cache_dir
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="sparkgpu-volume-report-", dir=root))
    try:
        _, index = open_cache_entry(scratch / "probe", volume)
        files = [shard.remote_basename for shard in index.shards]
        if raw_download is None:
            raw = raw_parallel_download(volume, files, download_threads, scratch / "raw")
        else:
            raw = raw_download(files, scratch / "raw")
            shutil.rmtree(scratch / "raw", ignore_errors=True)
        loader = dataset(
            remote=remote,
            local=scratch / "cache",
            batch_size=batch_size,
            shuffle=shuffle,
            download_threads=download_threads,
            storage_options=storage_options,
        )
        epochs = [_timed_epoch(loader, raw["bytes"]) for _ in range(2)]
        loader.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _report(
        volume.url,
        len(files),
        index.num_samples,
        raw,
        epochs,
        png,
        batch_size=batch_size,
        shuffle=shuffle,
        download_threads=download_threads,
    )


def table_report(
    remote: str,
    *,
    columns: list[str] | None = None,
    filter=None,
    local: str | os.PathLike | None = None,
    batch_size: int = 1024,
    shuffle: bool = False,
    download_threads: int = 8,
    storage_options: dict | None = None,
    png: str | os.PathLike | None = None,
    raw_download: Callable[[list[str], Path], dict] | None = None,
) -> dict:
    """:func:`volume_report` for a remote Delta table or Parquet folder read by ``table_dataset``.

    The raw download fetches the data files the dataset reads (the live files at the latest
    version, after partition pruning by ``filter``); epoch 1 reads them from the volume through
    a temporary cache, epoch 2 from that cache. ``shards`` counts those files.

    Args:
        remote: URL of the table (``s3://...``); a local table is read in place, with nothing
            to compare.
        columns: Columns to read (default: all).
        filter: Rows to keep, as in :func:`sparkgpu.data.table_dataset`.
        local, batch_size, shuffle, download_threads, storage_options, png, raw_download:
            As in :func:`volume_report`.

    Returns:
        The figures of :func:`volume_report`.

    Raises:
        ConfigurationError: ``remote`` is a local table.
    """
    from sparkgpu.config import settings
    from sparkgpu.data.loaders.table import table_dataset
    from sparkgpu.errors import ConfigurationError

    root = Path(local) if local is not None else settings().cache_dir
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="sparkgpu-table-report-", dir=root))
    try:
        rows = table_dataset(
            remote,
            columns=columns,
            filter=filter,
            batch_size=batch_size,
            shuffle=shuffle,
            local=scratch / "cache",
            download_threads=download_threads,
            storage_options=storage_options,
            rank=0,
            world_size=1,
        )
        if rows._file_cache is None:
            raise ConfigurationError(
                f"{remote} is a local table, read where it is: there is no download to measure; give "
                "its object-store URL, or add --profile s3-like to read it through a simulated S3 link"
            )
        files = [shard.basename for shard in rows._file_cache.index.shards]
        if raw_download is None:
            raw = raw_parallel_download(rows._file_cache.volume, files, download_threads, scratch / "raw")
        else:
            raw = raw_download(files, scratch / "raw")
            shutil.rmtree(scratch / "raw", ignore_errors=True)
        epochs = [_timed_epoch(rows, raw["bytes"]) for _ in range(2)]
        url = rows._file_cache.volume.url
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _report(
        url,
        len(files),
        rows.num_samples,
        raw,
        epochs,
        png,
        batch_size=batch_size,
        shuffle=shuffle,
        download_threads=download_threads,
        kind="table",
    )


def _timed_epoch(batches, volume_bytes: int) -> dict:
    started, samples, first = time.perf_counter(), 0, None
    for batch in batches:
        samples += _batch_len(batch)
        first = first or time.perf_counter() - started
    seconds = time.perf_counter() - started
    return {
        "samples": samples,
        "seconds": seconds,
        "first_batch_s": first,
        "samples_per_s": samples / seconds,
        "mb_per_s": volume_bytes / seconds / 1e6,
    }


def _report(url, files, samples, raw, epochs, png, *, kind="mds", **settings) -> dict:
    report = {
        "remote": url,
        "kind": kind,
        "shards": files,
        "samples": samples,
        "volume_bytes": raw["bytes"],
        **settings,
        "raw_parallel_download": raw,
        "epoch1_from_volume": epochs[0],
        "epoch2_from_cache": epochs[1],
        "epoch1_vs_raw": epochs[0]["mb_per_s"] / raw["mb_per_s"],
        "epoch2_speedup": epochs[0]["seconds"] / epochs[1]["seconds"],
    }
    if png is not None:
        plot_volume_report(report, png)
    return report


REPORT_COLUMNS = ("", "MB/s", "samples/s", "first batch", "% of raw")


def report_rows(report: dict) -> list[tuple[str, ...]]:
    """The report as rows under :data:`REPORT_COLUMNS`: raw download, epoch 1, epoch 2.

    Every rate is in MB of shards per second, so the three rows compare directly.
    """
    raw = report["raw_parallel_download"]
    rows = [(f"raw download ({report['download_threads']} connections)", raw["mb_per_s"], None, None)]
    rows += [
        (name, report[key]["mb_per_s"], report[key]["samples_per_s"], report[key]["first_batch_s"])
        for name, key in (
            ("epoch 1: volume -> cache", "epoch1_from_volume"),
            ("epoch 2: from the cache", "epoch2_from_cache"),
        )
    ]
    return [
        (
            name,
            f"{rate:,.1f}",
            "" if samples is None else f"{samples:,.0f}",
            "" if first is None else f"{first:.2f} s",
            f"{rate / raw['mb_per_s']:.0%}",
        )
        for name, rate, samples, first in rows
    ]


def _batch_len(batch: dict) -> int:
    value = next(iter(batch.values()))
    return len(value)


def plot_volume_report(report: dict, path: str | os.PathLike, extra: dict | None = None) -> None:
    """Draws MB/s of the raw download and of both epochs (plus ``extra`` name -> MB/s bars).

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    from sparkgpu._util.plotting import pyplot

    plt = pyplot("drawing the volume report")
    bars = {
        f"raw parallel download ({report['download_threads']} threads)": report["raw_parallel_download"]["mb_per_s"],
        "epoch 1: volume -> cache -> batches": report["epoch1_from_volume"]["mb_per_s"],
        "epoch 2: from the cache": report["epoch2_from_cache"]["mb_per_s"],
    }
    bars.update(extra or {})
    names = list(bars)[::-1]  # first entry on top
    colors = [
        "tab:gray" if n.startswith("raw") else "tab:green" if n.startswith("epoch") else "tab:blue" for n in names
    ]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(names) + 1.5))
    ax.barh(names, [bars[n] for n in names], color=colors)
    ax.set_xlim(0, max(bars.values()) * 1.15)  # linear from zero: bar lengths compare as rates do
    ax.set_xlabel("MB/s of shards")
    for i, name in enumerate(names):
        ax.text(bars[name], i, f" {bars[name]:,.1f}", va="center", fontsize=9)
    ax.set_title(
        f"{report['samples']:,} samples, {report['volume_bytes'] / 1e6:,.0f} MB in {report['shards']} shards on {report['remote']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
