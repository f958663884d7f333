"""Byte counts as people read them: ``human_bytes(5_368_709_120) == "5.37 GB"``."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(count: float, digits: int = 2) -> str:
    """``count`` bytes in decimal units (GB, MB, kB) with ``digits`` decimals; under 1 kB in bytes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.{digits}f} {unit}"
    return f"{int(count)} B"
