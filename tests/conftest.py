"""Session-wide fixtures. Real components only: one Spark Connect server per test session."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_sparkgpu_home(tmp_path_factory, monkeypatch):
    """Every test gets its own SPARKGPU_HOME, so runs, caches and ledgers never leak."""
    from sparkgpu.config import reset_settings

    home = tmp_path_factory.mktemp("sparkgpu-home")
    monkeypatch.setenv("SPARKGPU_HOME", str(home))
    monkeypatch.delenv("SPARKGPU_STAGING_ROOT", raising=False)
    monkeypatch.delenv("SPARKGPU_CACHE_DIR", raising=False)
    monkeypatch.delenv("SPARKGPU_SIMULATE_GPUS", raising=False)
    # Jobs in tests are untracked unless a test asks for tracking (an MLflow run per job is
    # slow); tests/integration/test_tracking_default.py covers the default path.
    monkeypatch.setenv("SPARKGPU_TRACKING", "0")
    reset_settings()
    yield home
    reset_settings()


@pytest.fixture(scope="session")
def spark():
    """A real Spark Connect session on a local server (started once, about 20 s)."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", os.sys.executable)
    session = SparkSession.builder.remote("local[2]").config("spark.sql.shuffle.partitions", "4").getOrCreate()
    yield session
    session.stop()
