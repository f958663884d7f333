"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from sparkgpu.data import _gather


@pytest.fixture(params=[True, False], ids=["native", "numpy"])
def gather_backend(request):
    """Runs a test with the native gather, then with its numpy version (the native one skipped when not built)."""
    if request.param and not _gather.native_available():
        pytest.skip("sparkgpu._native is not built")
    previous = _gather.set_native_enabled(request.param)
    yield request.param
    _gather.set_native_enabled(previous)
