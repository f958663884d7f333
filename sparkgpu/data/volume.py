"""A "volume": where shards live, as any fsspec URL (a local folder, s3://, gs://, abfs://, http(s)://).

The filesystem is chosen by the URL's scheme through fsspec's registry; a scheme whose
package is missing fails at once with the exact ``pip install``.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

from sparkgpu.errors import ConfigurationError, DataError, MissingDependencyError

__all__ = ["Volume", "DEFAULT_PART_BYTES"]

DEFAULT_PART_BYTES = 16 << 20

# fsspec names the class but not the pip package; users want the command.
_PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "abfss": "adlfs",
    "az": "adlfs", "http": "aiohttp", "https": "aiohttp", "hf": "huggingface_hub",
}


class Volume:
    """Read access to a dataset folder on any fsspec filesystem.

    Args:
        url: Dataset folder URL (``s3://bucket/feats/v1``, ``/mnt/data/feats``, ...).
        storage_options: Extra options for the filesystem (credentials, endpoints).
        retries: Further tries of a failed download before it is reported.

    Raises:
        MissingDependencyError: The filesystem for the URL's scheme is not installed.
        ConfigurationError: The URL's scheme is unknown.
    """

    def __init__(self, url: str, storage_options: dict | None = None, retries: int = 2):
        import fsspec

        self.url = str(url).rstrip("/")
        self.retries = retries
        scheme = self.url.split("://", 1)[0] if "://" in self.url else "file"
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except ImportError:
            package = _PACKAGES.get(scheme, f"the fsspec filesystem for {scheme}://")
            raise MissingDependencyError(f"reading {scheme}:// volumes", f"pip install {package}") from None
        except ValueError as exc:
            raise ConfigurationError(f"cannot read volume {self.url!r} ({exc}); use a local folder or an fsspec URL such as s3://bucket/path") from None
        self.root = self.root.rstrip("/")
        # Whether the store answers byte-range reads; None until the first ranged download.
        self.ranges_supported: bool | None = None
        self._probe = threading.Lock()

    def __repr__(self) -> str:
        return f"Volume({self.url!r})"

    def _path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def read_bytes(self, relative: str) -> bytes:
        """Returns a whole (small) file, such as ``index.json``.

        Raises:
            DataError: The file does not exist or cannot be read after the retries.
        """
        return self._retrying(relative, lambda: self.fs.cat_file(self._path(relative)))

    def download(self, relative: str, local_path: str, size: int | None = None, pool=None, part_bytes: int = DEFAULT_PART_BYTES) -> None:
        """Copies a file from the volume to a local path (streamed, never held in memory whole).

        Given the file's ``size`` and a thread ``pool``, a file of two parts or more is fetched
        as byte ranges on the pool: files then complete one after another in the order they
        were asked for, at the speed of all the connections together, instead of all at once
        at the end. Stores that ignore ranges (some plain HTTP servers) get whole-file
        downloads from the first such answer on.

        Args:
            relative: Path of the file inside the dataset folder.
            local_path: Where to write it.
            size: The file's size in bytes, when known.
            pool: ``concurrent.futures`` executor for the ranges.
            part_bytes: Size of one range. Ranges cost a copy and a request each: on a small
                machine they cut the wait for the first shard but lower the total rate, so
                only files of two parts or more (MDS's default 64 MB shards) use them.

        Raises:
            DataError: The file does not exist or cannot be read after the retries.
        """
        if pool is None or size is None or size < 2 * part_bytes or self.ranges_supported is False:
            self._retrying(relative, lambda: self.fs.get_file(self._path(relative), local_path))
            return
        starts = list(range(0, size, part_bytes))
        with open(local_path, "wb") as handle:
            handle.truncate(size)
        fd = os.open(local_path, os.O_WRONLY)
        futures = []
        try:
            if self.ranges_supported is None:
                with self._probe:  # one probe per volume: an ignoring server sends whole files
                    if self.ranges_supported is None:
                        self.ranges_supported = self._part(relative, fd, starts[0], min(part_bytes, size))
                        # Queue the rest before other files waiting for the probe queue theirs.
                        starts = starts[1:] if self.ranges_supported else []
                        futures = [pool.submit(self._part, relative, fd, start, min(start + part_bytes, size)) for start in starts]
                        starts = []
            if self.ranges_supported:
                futures += [pool.submit(self._part, relative, fd, start, min(start + part_bytes, size)) for start in starts]
                concurrent.futures.wait(futures)  # all settle before the file closes
                ranged = all(future.result() for future in futures)
            else:
                ranged = False
        finally:
            concurrent.futures.wait(futures)
            os.close(fd)
        if not ranged:
            self.ranges_supported = False
            self._retrying(relative, lambda: self.fs.get_file(self._path(relative), local_path))

    def _part(self, relative: str, fd: int, start: int, end: int) -> bool:
        data = self._retrying(relative, lambda: self.fs.cat_file(self._path(relative), start=start, end=end))
        if len(data) != end - start:
            return False  # the store ignored the range and sent something else
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, start)
            view, start = view[written:], start + written
        return True

    def _retrying(self, relative, action):
        for attempt in range(self.retries + 1):
            try:
                return action()
            except FileNotFoundError:
                raise DataError(f"{relative} is missing from volume {self.url}; is the URL the dataset's folder, and was the dataset written completely?") from None
            except Exception as exc:  # network filesystems raise their own types (aiohttp, botocore, ...)
                if attempt == self.retries:
                    raise DataError(f"reading {relative} from volume {self.url} failed {attempt + 1} times: {type(exc).__name__}: {exc}") from exc
                time.sleep(0.2 * 2**attempt)
