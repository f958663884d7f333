"""Sizes and durations: one reading of every spelling users write, in every place that takes one."""

import datetime as dt

import pytest

from sparkgpu.config import Settings
from sparkgpu.data.mds.writer import parse_size_limit
from sparkgpu.errors import ConfigurationError
from sparkgpu.spec.units import parse_duration, parse_size


@pytest.mark.parametrize(
    "value, expected",
    [
        (4096, 4096),
        ("100", 100),
        ("100b", 100),
        ("64MB", 64_000_000),
        ("64mb", 64_000_000),  # case does not change the unit
        ("64 kB", 64_000),
        ("1.5T", 1_500_000_000_000),
        ("64MiB", 64 << 20),
        ("64mib", 64 << 20),
        ("2GiB", 2 << 30),
        ("1KiB", 1024),
    ],
)
def test_decimal_and_binary_units(value, expected):
    assert parse_size(value, "x") == expected


@pytest.mark.parametrize("value", ["", "MB", "iB", "5iB", "-1MB", "1.2.3GB", "ten", "64MBs", True, 1.5, None, 0, "0GB"])
def test_bad_sizes_name_the_accepted_forms(value):
    with pytest.raises(ConfigurationError, match="cache_limit") as info:
        parse_size(value, "cache_limit")
    assert "MiB" in str(info.value) or "positive" in str(info.value)


def test_a_size_above_the_maximum_says_how_many_bytes_it_is():
    with pytest.raises(ConfigurationError, match="4,294,967,296 bytes"):
        parse_size("4GiB", "size_limit", maximum=(1 << 32) - 1)


def test_every_place_that_takes_a_size_reads_it_the_same_way(monkeypatch):
    """The settings and to_mds's size_limit disagreed on "64MB" (decimal vs binary) before."""
    settings = Settings.from_env({"SPARKGPU_CACHE_LIMIT": "64MB", "SPARKGPU_ENV_SIZE_LIMIT": "64MiB"})
    assert settings.cache_limit_bytes == parse_size_limit("64MB") == 64_000_000
    assert settings.env_size_limit == parse_size_limit("64MiB") == 64 << 20
    with pytest.raises(ConfigurationError, match="uint32"):
        parse_size_limit("5GB")


@pytest.mark.parametrize(
    "value, seconds",
    [
        (None, None),
        (90, 90.0),
        ("90s", 90.0),
        ("250ms", 0.25),
        ("30m", 1800.0),
        ("12h", 43200.0),
        ("7d", 604800.0),
        ("1w", 604800.0),
        (dt.timedelta(minutes=2), 120.0),
    ],
)
def test_durations(value, seconds):
    assert parse_duration(value) == seconds
