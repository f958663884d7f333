"""What a worker's environment hydration raises is sparkgpu's own error classes.

Hydration runs before sparkgpu may be importable on the worker; the rank then imports sparkgpu
and reports the error, and the client decides from its class whether a restart can help.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sparkgpu
from sparkgpu import errors
from sparkgpu.env import HydrationError, WorkerEnvironmentMismatchError, worker_bootstrap_files
from sparkgpu.launch.rank.entrypoint import _environment_error

REPO_ROOT = Path(sparkgpu.__file__).resolve().parent.parent

# Run in a bare interpreter (-I -S: no site-packages, so no sparkgpu), as the generated _air.py
# does on a worker: load the shipped _hydrate.py by path, fail to hydrate, then import sparkgpu.
_WORKER = r"""
import json, os, sys, types
run_dir, paths = sys.argv[1], sys.argv[2].split(os.pathsep)
try:
    import sparkgpu
except ImportError:
    pass
else:
    raise SystemExit("sparkgpu must not be importable before hydration in this test")
h = sys.modules["_sparkgpu_hydrate"] = types.ModuleType("_sparkgpu_hydrate")
h.__file__ = os.path.join(run_dir, "_hydrate.py")
exec(compile(open(h.__file__, "rb").read(), h.__file__, "exec"), h.__dict__)
client = dict(h.describe_interpreter(), python="3.1.0")
try:
    h.hydrate({"format": 1, "client": client, "entries": [], "store": run_dir}, os.path.join(run_dir, "cache"))
except Exception as exc:
    error = exc
sys.path[:0] = paths  # sparkgpu and its dependencies arrive (with the overlay, in a real job)
from sparkgpu.errors import EnvironmentMismatchError, SparkGPUError
from sparkgpu.launch.rank.entrypoint import _environment_error
import sparkgpu.errors
print(json.dumps({
    "package_binds_it": sparkgpu.errors.EnvironmentMismatchError is type(error),
    "hydrate_class_is_root": type(error) is EnvironmentMismatchError,
    "under_root": isinstance(error, SparkGPUError),
    "reported_as": type(_environment_error(error)).__qualname__,
    "module": type(error).__module__,
}))
"""


def test_hydration_errors_are_the_roots_classes():
    from sparkgpu.env import hydrate

    assert hydrate.HydrationError is errors.HydrationError is HydrationError
    assert hydrate.EnvironmentMismatchError is errors.EnvironmentMismatchError is WorkerEnvironmentMismatchError
    assert issubclass(HydrationError, errors.SparkGPUError)


def test_a_bare_worker_raises_the_classes_sparkgpu_imports_later(tmp_path):
    for name, data in worker_bootstrap_files().items():
        (tmp_path / name).write_bytes(data)
    paths = os.pathsep.join([str(REPO_ROOT), *filter(None, sys.path)])  # what the overlay would bring
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _WORKER, str(tmp_path), paths], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {
        "package_binds_it": True,
        "hydrate_class_is_root": True,
        "under_root": True,
        "reported_as": "EnvironmentMismatchError",
        "module": "sparkgpu.errors",
    }


def test_the_shipped_hydration_module_needs_the_error_module_beside_it(tmp_path):
    (tmp_path / "_hydrate.py").write_bytes(worker_bootstrap_files()["_hydrate.py"])
    code = (
        "import sys, types; h = types.ModuleType('_sparkgpu_hydrate'); h.__file__ = sys.argv[1]; "
        "exec(compile(open(sys.argv[1]).read(), sys.argv[1], 'exec'), h.__dict__)"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(tmp_path / "_hydrate.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "ship sparkgpu.env.worker_bootstrap_files()" in done.stderr


@pytest.mark.parametrize(
    "raised, reported",
    [
        (errors.EnvironmentMismatchError("Python 3.12 vs 3.11"), errors.EnvironmentMismatchError),
        (errors.HydrationError("blob missing"), errors.HydrationError),
        (OSError(28, "No space left on device"), errors.HydrationError),
    ],
)
def test_a_rank_reports_a_failed_hydration_under_its_own_class(raised, reported):
    error = _environment_error(raised)
    assert type(error) is reported
    assert str(error).startswith("the job's environment could not be rehydrated on this worker: ")
