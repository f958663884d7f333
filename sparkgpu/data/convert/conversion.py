"""DataFrame / Delta table / Parquet -> MDS shards on a volume, in one call.

```python
from sparkgpu import data
data.to_mds(spark_df, "s3://bucket/feats/v1")                   # from its files, or on the executors
data.to_mds("s3://bucket/tables/clicks", out, version=12)       # Delta via deltalake, no Spark
data.to_mds("/data/parquet_dir", out)                            # Parquet, parallel over files
data.ensure_mds(spark_df, "s3://bucket/mds-cache")               # converts once per data version
```

The output is standard MDS (``streaming.StreamingDataset`` reads it unchanged). The index is
written last and atomically: an interrupted conversion never leaves an index listing missing
shards, and running it again clears what it left and starts over. One conversion writes into a
folder at a time (:mod:`~sparkgpu.data.convert.claim`): a second one started meanwhile waits for
it, then uses its dataset when it converted the same data with the same settings.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable

from sparkgpu.data.convert.claim import DEFAULT_WAIT_S, FolderClaim
from sparkgpu.data.convert.output import OutputFolder
from sparkgpu.data.mds.encoding import plan_columns
from sparkgpu.data.mds.writer import DEFAULT_SIZE_LIMIT, ShardOptions
from sparkgpu.data.tables.resolve import resolve_source
from sparkgpu.errors import ConfigurationError, DataError
from sparkgpu.store import Store
from sparkgpu.spec.units import parse_duration

__all__ = ["ConversionResult", "to_mds", "ensure_mds", "data_fingerprint", "read_conversion", "write_source"]


@dataclasses.dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote (or found already written).

    Attributes:
        url: Output folder; pass it to ``StreamingDataset(remote=...)`` or ``data.dataset``.
        samples: Rows written.
        shards: Shard files written.
        bytes: Bytes of shard files (compressed size when compressed).
        columns: Column name -> MDS encoding.
        fingerprint: Data fingerprint of the source (see :func:`data_fingerprint`).
        source: What was read: type, path or URI, Delta version.
        seconds: Time the conversion took, waiting for another one included (0 when reused
            without waiting).
        reused: True when a complete conversion was found and nothing was written: one that
            :func:`ensure_mds` found, or that another process wrote while this one waited.
        waited: Seconds spent waiting for another conversion into the same folder.
    """

    url: str
    samples: int
    shards: int
    bytes: int
    columns: dict
    fingerprint: str | None
    source: dict
    seconds: float
    reused: bool = False
    waited: float = 0.0

    @property
    def rows_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else float("inf")


def _resolve(source, version, timestamp, storage_options):
    """The source to write: ``source``'s kind decided once (:func:`resolve_source`), then opened
    the way that kind is read."""
    resolved = resolve_source(source, version=version, timestamp=timestamp, storage_options=storage_options)
    if resolved.kind.is_spark:
        from sparkgpu.data.convert.spark import spark_resolved_source

        return spark_resolved_source(resolved)
    from sparkgpu.data.convert.files import file_source

    return file_source(resolved)


def data_fingerprint(source, *, version=None, timestamp=None, storage_options=None) -> str:
    """A hex digest that changes whenever the source's rows may have changed.

    Spark DataFrame: the optimized query plan (expression ids removed), schema and input
    files; for a plain scan of files, its path, columns and filter and the files' own
    fingerprint (below). Delta table: table URI, id and version. Parquet: every file's path, size and
    modification time. Arrow table / pandas: the data itself.

    Args:
        source: Anything :func:`to_mds` accepts.
        version: Delta table version (default: latest).
        timestamp: Delta table as of this time (``datetime`` or ISO-8601 string).
        storage_options: fsspec / deltalake options for remote paths.

    Raises:
        ConfigurationError: The source cannot be fingerprinted (a one-shot Arrow stream).
    """
    return _resolve(source, version, timestamp, storage_options).fingerprint()


def to_mds(
    source,
    out,
    *,
    columns=None,
    compression: str | None = None,
    hashes=None,
    size_limit: int | str | None = DEFAULT_SIZE_LIMIT,
    version: int | None = None,
    timestamp=None,
    overwrite: bool = False,
    max_workers: int | None = None,
    storage_options: dict | None = None,
    progress: bool | None = None,
    wait: float | str | datetime.timedelta = DEFAULT_WAIT_S,
) -> ConversionResult:
    """Converts a Spark DataFrame, Delta table or Parquet files into MDS shards under ``out``.

    Conversions into one folder run one at a time: while another process converts into ``out``,
    this one waits (up to ``wait``, reporting who converts and how far it got), then returns
    that conversion (``reused=True``) when it is of the same data (fingerprint) and settings,
    else converts as if it had started afterwards. A conversion whose process died is taken over
    once its claim on the folder expires (about a minute; at once on the same machine).

    Args:
        source: A Spark DataFrame (classic or Connect): a plain scan of Parquet or Delta files
            (+ column selections and filters) is converted from those files in this process,
            any other plan on the executors (``result.source["via"]`` says which); a path or
            URL of a Delta table (read with deltalake) or of Parquet files, a
            ``deltalake.DeltaTable``, a pyarrow Table / RecordBatchReader, or a pandas DataFrame;
            or any of them already resolved by :func:`~sparkgpu.data.tables.resolve.resolve_source`.
        out: Output folder: local path or fsspec URL. With Spark it must be reachable from
            the executors under the same name.
        columns: ``None`` for all; a list of names to keep only those; or a dict name -> MDS
            encoding for the columns whose encoding you choose (``None`` for the default),
            e.g. ``{"image": "jpeg"}``: every other column is kept with its default encoding.
        compression: ``None`` or a name as streaming spells it: ``"zstd"``, ``"zstd:7"``, ``"gz"``...
        hashes: Hash names recorded per shard, e.g. ``("sha1", "xxh64")``.
        size_limit: Bytes of samples per shard (int, ``"64MiB"`` or ``"64MB"``: see :mod:`sparkgpu.spec.units`); ``None`` for one shard per writer.
        version: Delta table version to read (default: latest).
        timestamp: Read the Delta table as of this time instead.
        overwrite: Replace an existing dataset (or other files) in ``out``.
        max_workers: Parallel writers for non-Spark sources (default: CPU count).
        storage_options: fsspec options (credentials, endpoint) for remote paths.
        progress: Show a progress bar; default: when stderr is a terminal or notebook.
        wait: Longest wait for another conversion into ``out``: seconds or a duration such as
            ``"2h"`` (default one hour); 0 fails at once.

    Returns:
        What was written.

    Raises:
        DataError: A column cannot be stored (raised before anything is written), the data
            holds values MDS cannot represent (nulls, arrays not matching a declared shape),
            or another conversion into ``out`` still runs after ``wait``.
        ConfigurationError: Bad settings, or ``out`` holds a dataset and ``overwrite`` is false.
    """
    started = time.monotonic()
    wait_s = _wait_seconds(wait)
    resolved = _resolve(source, version, timestamp, storage_options)
    options = ShardOptions.create(
        plan_columns(resolved.schema, columns), compression=compression, hashes=hashes, size_limit=size_limit
    )
    # The fingerprint is only recorded here, so its Spark round trips run beside the job.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkgpu-fingerprint") as pool:
        fingerprint = pool.submit(_fingerprint_or_none, resolved)
        volume = Store(out, storage_options, what="the output folder")

        def waited_for(waited: bool) -> ConversionResult | None:
            # Only a conversion this one waited for: a dataset found there at the start is
            # replaced (overwrite=True) or refused, as without any other process.
            return _reusable(volume, options, fingerprint.result()) if waited else None

        return _convert(
            resolved, volume, options, fingerprint, overwrite, max_workers, progress, started, wait_s, waited_for
        )


def ensure_mds(
    source,
    volume_root,
    *,
    columns=None,
    compression: str | None = None,
    hashes=None,
    size_limit: int | str | None = DEFAULT_SIZE_LIMIT,
    version: int | None = None,
    timestamp=None,
    max_workers: int | None = None,
    storage_options: dict | None = None,
    progress: bool | None = None,
    wait: float | str | datetime.timedelta = DEFAULT_WAIT_S,
) -> ConversionResult:
    """Converts ``source`` once per data fingerprint and settings; afterwards returns at once.

    The output goes to ``{volume_root}/mds-{key}``, the key hashing the data fingerprint
    (:func:`data_fingerprint`) and the conversion settings. A complete conversion with the
    same key is returned as is (``reused=True``); an interrupted one is cleared and redone.
    Processes calling it together for the same data and volume convert once: one converts, the
    others wait for it (up to ``wait``) and return its dataset (``reused=True``); one whose
    converting process died takes over once that process's claim expires.
    The other arguments (``columns``, ``compression``, ``hashes``, ``size_limit``, ``version``,
    ``timestamp``, ``max_workers``, ``storage_options``, ``progress``, ``wait``) are those of
    :func:`to_mds`.

    Args:
        source: As for :func:`to_mds`; it must be fingerprintable (not a one-shot stream).
        volume_root: Folder (local or fsspec URL) holding cached conversions.

    Returns:
        The conversion, with ``reused`` telling whether it was already there.

    Raises:
        DataError: As :func:`to_mds`; among others, another process still converts the same
            data after ``wait``.
    """
    started = time.monotonic()
    wait_s = _wait_seconds(wait)
    resolved = _resolve(source, version, timestamp, storage_options)
    options = ShardOptions.create(
        plan_columns(resolved.schema, columns), compression=compression, hashes=hashes, size_limit=size_limit
    )
    fingerprint = resolved.fingerprint()
    settings = json.dumps(
        {
            "fingerprint": fingerprint,
            "columns": options.columns,
            "compression": options.compression,
            "hashes": options.hashes,
            "size_limit": options.size_limit,
        },
        sort_keys=True,
    )
    key = hashlib.sha256(settings.encode("utf-8")).hexdigest()[:24]
    volume = Store(volume_root, storage_options, what="the volume").child(f"mds-{key}")
    # Without a claim: finding a complete conversion writes nothing, so readers need no write access.
    existing = read_conversion(volume.url, storage_options=storage_options)
    if existing is not None and existing.fingerprint == fingerprint and existing.columns == options.columns:
        return dataclasses.replace(existing, reused=True)
    return _convert(
        resolved,
        volume,
        options,
        fingerprint,
        True,
        max_workers,
        progress,
        started,
        wait_s,
        lambda _waited: _reusable(volume, options, fingerprint),
    )


def write_source(
    resolved,
    out,
    *,
    compression: str | None = None,
    hashes=None,
    size_limit: int | str | None = DEFAULT_SIZE_LIMIT,
    overwrite: bool = False,
    max_workers: int | None = None,
    storage_options: dict | None = None,
    progress: bool | None = None,
    wait: float | str | datetime.timedelta = DEFAULT_WAIT_S,
) -> ConversionResult:
    """Writes a source other modules resolved into ``out``, unless ``out`` already holds it.

    ``resolved`` has what the sources of this package have: ``schema`` (of the rows written),
    ``description`` (read after writing), ``fingerprint()`` and ``write(volume, options, *,
    max_workers, progress)``. A complete dataset in ``out`` of the same fingerprint and settings
    is returned as is (``reused=True``); otherwise the folder is claimed and written as
    :func:`to_mds` does (the other arguments are its).
    """
    started = time.monotonic()
    wait_s = _wait_seconds(wait)
    options = ShardOptions.create(
        plan_columns(resolved.schema, None), compression=compression, hashes=hashes, size_limit=size_limit
    )
    fingerprint = resolved.fingerprint()
    volume = Store(out, storage_options, what="the output folder")
    existing = _reusable(volume, options, fingerprint)
    if existing is not None:
        return dataclasses.replace(existing, seconds=time.monotonic() - started)
    return _convert(
        resolved,
        volume,
        options,
        fingerprint,
        overwrite,
        max_workers,
        progress,
        started,
        wait_s,
        lambda _waited: _reusable(volume, options, fingerprint),
    )


def read_conversion(url, *, storage_options: dict | None = None) -> ConversionResult | None:
    """The conversion committed at ``url``, or ``None`` when it holds no complete dataset.

    Works for any MDS dataset; fields this package records (fingerprint, source) are empty
    for datasets others wrote.
    """
    volume = Store(url, storage_options, what="the dataset folder")
    index = OutputFolder(volume, run_id="").read_index()
    if index is None:
        return None
    return _result_of(volume, index)


def _result_of(volume: Store, index: dict) -> ConversionResult:
    meta = index.get("sparkgpu") or {}
    shards = index.get("shards", [])
    columns = dict(zip(shards[0]["column_names"], shards[0]["column_encodings"])) if shards else meta.get("columns", {})
    return ConversionResult(
        url=volume.url,
        samples=sum(s["samples"] for s in shards),
        shards=len(shards),
        bytes=sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in shards),
        columns=columns,
        fingerprint=meta.get("fingerprint"),
        source=meta.get("source", {}),
        seconds=0.0,
    )


def _reusable(volume: Store, options: ShardOptions, fingerprint: str | None) -> ConversionResult | None:
    """The dataset committed in ``volume`` when it is of the data ``fingerprint`` and written with
    ``options``, as a reused result; else ``None``."""
    if fingerprint is None:  # a one-shot stream: nothing says what the other one converted
        return None
    index = OutputFolder(volume, run_id="").read_index()
    if index is None or (index.get("sparkgpu") or {}).get("fingerprint") != fingerprint or not index.get("shards"):
        return None
    first = index["shards"][0]
    written = (
        dict(zip(first["column_names"], first["column_encodings"])),
        first.get("compression"),
        list(first.get("hashes") or []),
        first.get("size_limit"),
    )
    if written != (options.columns, options.compression, list(options.hashes), options.size_limit):
        return None
    return dataclasses.replace(_result_of(volume, index), reused=True)


def _wait_seconds(wait) -> float:
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait == 0:
        return 0.0
    return parse_duration(wait, name="wait")


def _fingerprint_or_none(resolved) -> str | None:
    try:
        return resolved.fingerprint()
    except ConfigurationError:  # one-shot streams: nothing to fingerprint, nothing to cache
        return None


def _convert(
    resolved,
    volume: Store,
    options: ShardOptions,
    fingerprint,
    overwrite,
    max_workers,
    progress,
    started,
    wait_s: float,
    reusable: Callable[[bool], ConversionResult | None],
) -> ConversionResult:
    """Claims ``volume`` (waiting for another conversion into it), writes the shards, commits.

    ``fingerprint`` may be a Future. ``reusable(waited)``, asked once the claim is taken,
    returns a dataset already there to return instead of converting, or ``None``.
    """
    run_id = uuid.uuid4().hex
    claim = FolderClaim(volume, run_id)
    found = claim.acquire(wait_s, reusable)
    if found is not None:
        return dataclasses.replace(found, seconds=time.monotonic() - started, waited=claim.waited_s)
    try:
        folder = OutputFolder(volume, run_id, claim)
        folder.begin(overwrite=overwrite)
        bar = _ProgressBar(volume.url) if _show_progress(progress) else None
        try:
            shards = resolved.write(volume, options, max_workers=max_workers, progress=_Progress(bar, claim))
            if not any(s["samples"] for s in shards):
                raise DataError(f"the source has no rows; nothing was written to {volume.url}")
            if isinstance(fingerprint, concurrent.futures.Future):
                fingerprint = fingerprint.result()
        except BaseException:
            folder.abort()
            raise
        finally:
            if bar is not None:
                bar.close()
        metadata = {
            "fingerprint": fingerprint,
            "source": resolved.description,
            "columns": options.columns,
            "run_id": run_id,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        folder.commit(shards, metadata)
    finally:
        claim.release()
    return ConversionResult(
        url=volume.url,
        samples=sum(s["samples"] for s in shards),
        shards=len(shards),
        bytes=sum((s["zip_data"] or s["raw_data"])["bytes"] for s in shards),
        columns=options.columns,
        fingerprint=fingerprint,
        source=resolved.description,
        seconds=time.monotonic() - started,
        waited=claim.waited_s,
    )


class _Progress:
    """What a source reports as it writes, passed on to the progress bar (when shown) and to the
    claim, whose renewals tell waiting conversions how far this one got. A writer of this
    process stops at its next batch once the claim was taken over."""

    def __init__(self, bar: _ProgressBar | None, claim: FolderClaim):
        self._bar = bar
        self._claim = claim
        self._lock = threading.Lock()
        self._rows = 0
        self._total: int | None = None

    def start(self, total: int | None) -> None:
        self._total = total
        self._claim.note_progress(0, total, "rows")
        if self._bar is not None:
            self._bar.start(total)

    def advance(self, rows: int) -> None:
        with self._lock:
            self._rows += rows
            self._claim.note_progress(self._rows, self._total, "rows")
        self._claim.raise_if_lost()
        if self._bar is not None:
            self._bar.advance(rows)

    def update(self, completed: int, total: int) -> None:
        self._claim.note_progress(completed, total, "Spark tasks")
        if self._bar is not None:
            self._bar.update(completed, total)


def _show_progress(progress: bool | None) -> bool:
    if progress is not None:
        return bool(progress)
    from rich.console import Console

    console = Console(stderr=True)
    return console.is_terminal or console.is_jupyter


class _ProgressBar:
    """A rich progress bar fed with rows (local sources) or Spark tasks (Spark Connect)."""

    def __init__(self, url: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.console import Console

        self._progress = Progress(
            TextColumn("[bold]MDS[/bold] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._progress.add_task(f"rows -> {url}", total=None)
        self._url = url
        self._progress.start()

    def start(self, total: int | None) -> None:
        self._progress.update(self._task, total=total)

    def advance(self, rows: int) -> None:
        self._progress.advance(self._task, rows)

    def update(self, completed: int, total: int) -> None:
        self._progress.update(self._task, description=f"Spark tasks -> {self._url}", completed=completed, total=total)

    def close(self) -> None:
        self._progress.stop()
