"""What a user can import from ``sparkgpu`` itself: every error a call raises, every type it returns."""

from __future__ import annotations

import inspect
import typing

import sparkgpu
from sparkgpu import errors
from sparkgpu.call import Call


def test_every_error_the_package_raises_is_importable_from_sparkgpu():
    raised = [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, sparkgpu.SparkGPUError) and obj.__module__ == errors.__name__
    ]
    assert len(raised) > 10
    missing = [cls.__name__ for cls in raised if getattr(sparkgpu, cls.__name__, None) is not cls]
    assert missing == [], f"errors raised but not importable from sparkgpu: {missing}"
    assert all(cls.__name__ in sparkgpu.__all__ for cls in raised)


def test_the_types_a_call_returns_are_importable_from_sparkgpu():
    for method in ("status", "wait"):
        returned = typing.get_type_hints(getattr(Call, method))["return"]
        assert getattr(sparkgpu, returned.__name__) is returned
    assert sparkgpu.JobStatus(sparkgpu.JobStatus.RUNNING.value) is sparkgpu.JobStatus.RUNNING


def test_every_public_name_resolves():
    unresolved = [name for name in sparkgpu.__all__ if getattr(sparkgpu, name, None) is None]
    assert unresolved == []
