"""Sizes and durations as users write them, read in one place.

Sizes follow the SI/IEC convention: ``kB``, ``MB``, ``GB``, ``TB``, ``PB`` are powers of 1000
and ``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB`` powers of 1024; the unit letter is read without
regard to case (``"64mb"`` is ``"64MB"``), a bare number is bytes and ``B`` may be left out
(``"1.5T"`` is 1.5 TB). MosaicML Streaming reads ``"64mb"`` as 64 MiB: a ``size_limit`` or
``cache_limit`` carried over from mosaic code means the same thing here when written with
``MiB`` (the defaults are byte counts, identical in both).

Durations: seconds as a number, a :class:`datetime.timedelta`, or a number with one of ``ms``,
``s``, ``m``, ``h``, ``d``, ``w`` (``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``).
"""

from __future__ import annotations

import datetime as _dt
import re
from typing import overload

from sparkgpu.errors import ConfigurationError

__all__ = ["parse_size", "parse_duration"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_FORMS = "an int (bytes) or a string like '200GB' (powers of 1000) or '512MiB' (powers of 1024)"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, None: 1}


def parse_size(value, name: str, *, maximum: int | None = None) -> int:
    """A positive byte count from an int or a string such as ``"200GB"``, ``"512MiB"``, ``"1.5T"``.

    Args:
        value: The size as the user wrote it.
        name: The argument or setting it came from, for the error message.
        maximum: Largest count accepted, if any.

    Raises:
        ConfigurationError: ``value`` is not a size, not positive, or above ``maximum``; the
            message names the accepted forms.
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"{name}={value!r} is not a size; give {_SIZE_FORMS}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        digits, prefix, binary, _ = match.groups()
        if binary and not prefix:
            raise ConfigurationError(f"{name}={value!r} is not a size; give {_SIZE_FORMS}")
        power = " kmgtp".index(prefix.lower() or " ")
        number = int(float(digits) * (1024 if binary else 1000) ** power)
    else:
        raise ConfigurationError(f"{name}={value!r} is not a size; give {_SIZE_FORMS}")
    if number <= 0:
        raise ConfigurationError(f"{name}={value!r} must be a positive number of bytes")
    if maximum is not None and number > maximum:
        raise ConfigurationError(f"{name}={value!r} is {number:,} bytes, above the most accepted ({maximum:,})")
    return number


@overload
def parse_duration(value: None, *, name: str = ...) -> None: ...


@overload
def parse_duration(value: str | float | _dt.timedelta, *, name: str = ...) -> float: ...


def parse_duration(value, *, name: str = "duration") -> float | None:
    """Seconds from ``None``, a number of seconds, a ``timedelta`` or a string like ``"7d"``.

    Raises:
        ConfigurationError: the value is negative or not a duration.
    """
    if value is None:
        return None
    if isinstance(value, _dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        raise ConfigurationError(
            f"{name}={value!r} is not a duration; pass seconds or a string such as '90s', '30m', '12h', '7d'"
        )
    if seconds <= 0:
        raise ConfigurationError(f"{name}={value!r} must be positive")
    return seconds
