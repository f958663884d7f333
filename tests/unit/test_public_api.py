"""What a user can import from ``sparkgpu`` itself: every error a call raises, every type it returns."""

from __future__ import annotations

import inspect
import typing

import sparkgpu
from sparkgpu import errors
from sparkgpu.api.call import DistributedFunctionCall


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
        returned = typing.get_type_hints(getattr(DistributedFunctionCall, method))["return"]
        assert getattr(sparkgpu, returned.__name__) is returned
    assert sparkgpu.JobStatus(sparkgpu.JobStatus.RUNNING.value) is sparkgpu.JobStatus.RUNNING


def test_every_public_name_resolves():
    unresolved = [name for name in sparkgpu.__all__ if getattr(sparkgpu, name, None) is None]
    assert unresolved == []


def test_the_serverless_gpu_names_of_an_async_call_are_importable_from_sparkgpu():
    """Code ported from ``serverless_gpu``/``databricks.air`` finds the names its docs use."""
    assert sparkgpu.DistributedFunctionCall is DistributedFunctionCall
    assert callable(sparkgpu.collect_outputs_or_raise)
    assert "run_async" in inspect.signature(sparkgpu.distributed).parameters


def test_run_async_with_register_as_is_refused_at_decoration_time():
    import pytest

    with pytest.raises(sparkgpu.ConfigurationError, match="run_async=True returns before the job ends"):
        sparkgpu.distributed(gpus=1, gpu_type="cpu", run_async=True, register_as="main.models.m")
