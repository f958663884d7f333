import pickle

import pytest

from sparkgpu import errors
from sparkgpu.errors import RankFailure, WorkerFailedError


@pytest.mark.parametrize(
    "exc",
    [
        errors.SparkGPUError("x"),
        errors.ConfigurationError("bad"),
        errors.CapacityError("none"),
        errors.MissingDependencyError("ray_launch", "pip install 'sparkgpu[ray]'"),
        errors.JobTimeoutError("slow"),
        errors.DataError("corrupt"),
        errors.PayloadSignatureError("forged"),
        WorkerFailedError(
            [RankFailure(1, "ValueError", "boom", "Traceback...\nValueError: boom", timestamp=1.0)],
            "job-1",
            "/runs/job-1/attempts/0/logs",
        ),
    ],
)
def test_every_error_survives_pickling_with_its_message(exc):
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc)
    assert str(again) == str(exc)
    assert isinstance(again, errors.SparkGPUError)


def test_missing_dependency_names_the_install_command():
    exc = errors.MissingDependencyError("@ray_launch", "pip install 'sparkgpu[ray]'")
    assert "pip install 'sparkgpu[ray]'" in str(exc)
    assert isinstance(exc, ImportError)


def test_identical_failures_are_grouped_and_distinct_ones_listed():
    tb = "Traceback (most recent call last):\n  File 'x.py', line 3\nValueError: bad shard 7"
    failures = [RankFailure(r, "ValueError", "bad shard 7", tb, timestamp=10.0 + r) for r in (3, 0, 1)]
    failures.append(
        RankFailure(2, None, "the process died from signal SIGSEGV", exitcode=-11, log_tail="Fatal Python error")
    )
    exc = WorkerFailedError(failures, job_id="j", logs_dir="/runs/j/attempts/0/logs")
    text = str(exc)
    assert exc.ranks == [0, 1, 2, 3]
    assert "ranks 0, 1, 3: ValueError: bad shard 7" in text
    assert text.count("Remote traceback") == 1
    assert "rank 2: the process died from signal SIGSEGV" in text
    assert "Fatal Python error" in text
    assert "First to fail: rank 0 (ValueError)" in text
    assert "Logs of every rank: /runs/j/attempts/0/logs" in text


def test_long_tracebacks_are_truncated_in_the_middle():
    tb = "\n".join(f"  frame {i}" for i in range(500)) + "\nRuntimeError: deep"
    text = str(WorkerFailedError([RankFailure(0, "RuntimeError", "deep", tb)]))
    assert "lines omitted" in text
    assert "frame 0" in text and "RuntimeError: deep" in text
    assert len(text.splitlines()) < 100
