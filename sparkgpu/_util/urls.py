"""fsspec URLs: telling one from a local path, and the pip package each scheme needs.

Shared by every setting and class that takes "a folder or any fsspec URL" (volumes, the
staging store), so that a missing filesystem always fails the same way: at once, with the
exact ``pip install``.
"""

from __future__ import annotations

import re

from sparkgpu.errors import ConfigurationError, MissingDependencyError

__all__ = ["PACKAGES", "is_url", "scheme_of", "install_command", "check_url"]

# fsspec names the class but not the pip package; users want the command.
PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "az": "adlfs",
    "http": "aiohttp",
    "https": "aiohttp",
    "hf": "huggingface_hub",
}

# RFC 3986 scheme, then "://": "s3://b/k", "file:///tmp/x"; never a relative path or "C:\x".
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(value: str) -> bool:
    """Whether ``value`` is a URL with a scheme rather than a local path."""
    return bool(_URL.match(str(value)))


def scheme_of(url: str) -> str:
    """The URL's scheme, lower-cased; ``"file"`` for a plain path."""
    return str(url).split("://", 1)[0].lower() if is_url(url) else "file"


def install_command(scheme: str) -> str:
    """The ``pip install`` that brings the fsspec filesystem of ``scheme``."""
    return f"pip install {PACKAGES.get(scheme, f'the fsspec filesystem for {scheme}://')}"


def check_url(url: str, feature: str) -> None:
    """Checks that this Python can open ``url``'s filesystem, without connecting to it.

    Args:
        url: A URL with a scheme.
        feature: What needs it, for the error message (e.g. the setting that named the URL).

    Raises:
        MissingDependencyError: The scheme's filesystem package is not installed; the message
            holds the ``pip install``.
        ConfigurationError: fsspec knows no filesystem for the scheme.
    """
    import fsspec

    scheme = scheme_of(url)
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        raise MissingDependencyError(feature, install_command(scheme)) from None
    except ValueError:
        raise ConfigurationError(
            f"{feature}: fsspec knows no filesystem for {scheme}:// in {url!r}; use a local folder or a URL such "
            "as s3://bucket/path, gs://bucket/path, abfs://container/path or file:///mnt/path"
        ) from None
