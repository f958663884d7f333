"""A "volume": where shards live, as any fsspec URL (a local folder, s3://, gs://, abfs://, http(s)://).

The filesystem is chosen by the URL's scheme through fsspec's registry; a scheme whose
package is missing fails at once with the exact ``pip install``.
"""

from __future__ import annotations

import time

from sparkgpu.errors import DataError, MissingDependencyError

__all__ = ["Volume"]

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
            from sparkgpu.errors import ConfigurationError

            raise ConfigurationError(f"cannot read volume {self.url!r} ({exc}); use a local folder or an fsspec URL such as s3://bucket/path") from None
        self.root = self.root.rstrip("/")

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

    def download(self, relative: str, local_path: str) -> None:
        """Copies a file from the volume to a local path (streamed, never held in memory).

        Raises:
            DataError: The file does not exist or cannot be read after the retries.
        """
        self._retrying(relative, lambda: self.fs.get_file(self._path(relative), local_path))

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
