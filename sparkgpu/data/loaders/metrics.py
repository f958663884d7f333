"""What a loader costs the training step: its own metrics, from ``ds.stats()`` and in the job's run.

Each loader times two things per batch: how long the training loop waited inside ``next()``
(the wait) and how long it spent between two requests (the step, wait included). A loader
that keeps up has a wait fraction near 0; a loader the GPU waits on has one near 1. The
cache adds how many shard reads found their shard on disk (hit ratio) and how fast the
rest arrived.

Inside a job with tracking, every ``SPARKGPU_DATA_METRICS_INTERVAL`` seconds (default 30)
each rank appends its figures for the interval to its spool file, which the client forwards
to the job's MLflow run (no rank writes to the store itself)::

    data/wait_s/rank_<r>            mean wait per batch, seconds
    data/step_s/rank_<r>            mean time between two requests, seconds
    data/wait_fraction/rank_<r>     wait / step over the interval
    data/cache_hit_ratio/rank_<r>   shard reads served from disk / all shard reads
    data/download_mbps/rank_<r>     MB downloaded per second of the interval

Their step is the number of batches this loader has handed out.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkgpu.tracking.spool import SpoolWriter

__all__ = ["LoaderMetrics"]

_logger = logging.getLogger(__name__)


class _Window:
    """Sums over a stretch of batches."""

    def __init__(self, now: float, cache_hits: int, cache_misses: int, downloaded: int):
        self.started = now
        self.batches = 0
        self.wait = self.step = 0.0
        self.hits0, self.misses0, self.downloaded0 = cache_hits, cache_misses, downloaded

    def figures(self, now: float, hits: int, misses: int, downloaded: int) -> dict:
        reads = (hits - self.hits0) + (misses - self.misses0)
        elapsed = max(now - self.started, 1e-9)
        return {
            "batches": self.batches,
            "wait_s": self.wait / self.batches if self.batches else 0.0,
            "step_s": self.step / self.batches if self.batches else 0.0,
            "wait_fraction": self.wait / self.step if self.step > 0 else 0.0,
            "cache_hit_ratio": (hits - self.hits0) / reads if reads else 1.0,
            "download_mbps": (downloaded - self.downloaded0) / 1e6 / elapsed,
        }


class LoaderMetrics:
    """Times one rank's loader and reports it (``stats()``; the job's run every interval).

    Args:
        rank: The rank the figures are keyed by.
        interval: Seconds between two reports to the job's run; default
            ``SPARKGPU_DATA_METRICS_INTERVAL``.
    """

    def __init__(self, rank: int, interval: float | None = None):
        if interval is None:
            from sparkgpu.config import settings

            interval = settings().data_metrics_interval
        self.rank, self.interval = rank, interval
        self.batches = 0
        self._total = _Window(time.perf_counter(), 0, 0, 0)
        self._window: _Window | None = None  # the current interval's, from the first batch on
        self._writer: SpoolWriter | None = None  # the job's spool writer, looked up on the first report
        self._in_job: bool | None = None

    def timed(self, batches, cache=None):
        """Yields ``batches``, timing the wait for each and the step around it.

        Args:
            batches: The loader's batch iterator.
            cache: The :class:`~sparkgpu.data.storage.cache.ShardCache` the batches come through
                (or a list of them), for hit ratio and download rate.
        """
        caches = cache if isinstance(cache, (list, tuple)) else [cache] if cache is not None else []
        clock = time.perf_counter
        iterator = iter(batches)
        asked = clock()
        if self._window is None:
            self._window = _Window(asked, *self._cache_counts(caches))
        try:
            while True:
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                got = clock()
                wait = got - asked
                yield batch
                now = clock()  # the next request: the step is from the last request to this one
                step = now - asked
                for window in (self._total, self._window):
                    window.batches += 1
                    window.wait += wait
                    window.step += step
                self.batches += 1
                asked = now
                if now - self._window.started >= self.interval:
                    self._report(now, caches)
        finally:
            close = getattr(iterator, "close", None)
            if close:
                close()

    def snapshot(self, cache=None) -> dict:
        """The figures since the loader was opened: ``batches``, ``wait_s``, ``step_s``,
        ``wait_fraction``, ``cache_hit_ratio``, ``download_mbps`` and ``downloaded_mb``."""
        caches = cache if isinstance(cache, (list, tuple)) else [cache] if cache is not None else []
        hits, misses, downloaded = self._cache_counts(caches)
        figures = self._total.figures(time.perf_counter(), hits, misses, downloaded)
        figures["downloaded_mb"] = downloaded / 1e6
        return figures

    @staticmethod
    def _cache_counts(caches) -> tuple[int, int, int]:
        return (sum(c.hits for c in caches), sum(c.misses for c in caches), sum(c.downloaded_bytes for c in caches))

    def _report(self, now: float, caches) -> None:
        counts = self._cache_counts(caches)
        assert self._window is not None  # timed() opens the window before its first report
        figures = self._window.figures(now, *counts)
        self._window = _Window(now, *counts)
        if self._in_job is None:
            from sparkgpu.tracking.spool import job_spool_writer

            self._writer = job_spool_writer()
            self._in_job = self._writer is not None
        if not self._in_job:
            return
        assert self._writer is not None  # in a job exactly when there is a writer
        timestamp = int(time.time() * 1000)
        records = [
            (f"data/{name}/rank_{self.rank}", float(value), self.batches, timestamp)
            for name, value in figures.items()
            if name != "batches"
        ]
        try:
            self._writer.write(metrics=records)
        except OSError as exc:  # a full disk must not stop training over a metric
            _logger.warning("sparkgpu: could not record data loader metrics: %s", exc)
