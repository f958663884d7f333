"""The warm pool's key: a warm zygote is reused only while the code it preloaded is unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparkgpu.launch.backends.local.zygote_client import code_fingerprint


def _package(tmp_path):
    root = tmp_path / "sparkgpu"
    (root / "launch" / "__pycache__").mkdir(parents=True)
    (root / "__init__.py").write_text("__version__ = '1.0'\n")
    (root / "launch" / "entrypoint.py").write_text("def main(): ...\n")
    return root


def test_the_fingerprint_is_stable_while_nothing_changes(tmp_path):
    root = _package(tmp_path)
    assert code_fingerprint(root, ()) == code_fingerprint(root, ())
    (root / "launch" / "__pycache__" / "entrypoint.cpython-311.pyc").write_bytes(b"compiled")
    assert code_fingerprint(root, ()) == code_fingerprint(root, ())  # bytecode is not code


def test_an_edit_or_a_new_file_in_sparkgpu_changes_the_fingerprint(tmp_path):
    root = _package(tmp_path)
    before = code_fingerprint(root, ())
    entry = root / "launch" / "entrypoint.py"
    entry.write_text("def main(): return 1\n")
    edited = code_fingerprint(root, ())
    assert edited != before
    (root / "launch" / "pool.py").write_text("")
    assert code_fingerprint(root, ()) != edited


def test_a_reinstalled_preloaded_distribution_changes_the_fingerprint(tmp_path, monkeypatch):
    root = _package(tmp_path)
    site = tmp_path / "site"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("version = '2.13'\n")
    monkeypatch.syspath_prepend(str(site))
    before = code_fingerprint(root, ("fakepkg",))
    assert before != code_fingerprint(root, ())
    # What `pip install -U` does to the file: new content, a new mtime.
    (site / "fakepkg" / "__init__.py").write_text("version = '2.14'\n")
    stat = os.stat(site / "fakepkg" / "__init__.py")
    os.utime(site / "fakepkg" / "__init__.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert code_fingerprint(root, ("fakepkg",)) != before


def test_by_default_torch_numpy_and_cloudpickle_are_covered(tmp_path):
    root = _package(tmp_path)
    assert len(code_fingerprint()) == 12
    assert code_fingerprint(root) != code_fingerprint(root, ())


def test_by_default_the_whole_sparkgpu_package_is_covered():
    import sparkgpu

    package = Path(sparkgpu.__file__).resolve().parent
    assert code_fingerprint() == code_fingerprint(package)  # not only the folder this module sits in


def test_only_a_job_that_may_restart_gets_a_standby_and_only_once_its_attempt_is_under_way(monkeypatch):
    import subprocess
    import sys
    import time

    from sparkgpu.launch.backends.local import zygote_client
    from sparkgpu.launch.backends.local.warm import WarmBackend
    from sparkgpu.launch.backends.local.backend import LocalAttempt, LocalBackend
    from sparkgpu.spec import JobSpec, Resources, RunPolicy

    started = []
    monkeypatch.setattr(zygote_client, "Standby", lambda python, job_id, preload: started.append(job_id) or object())
    backend = LocalBackend()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:

        def attempt(job_id, max_restarts, age):
            job = JobSpec(
                job_id=job_id, name="t", resources=Resources(2, "cpu"), policy=RunPolicy(max_restarts=max_restarts)
            )
            handle = LocalAttempt(
                attempt=0, process=sleeper, log=open(os.devnull, "wb"), job=job, submitted=time.monotonic() - age
            )
            assert backend.poll(handle) is None
            return handle

        attempt("no-restarts", 0, age=60)
        attempt("just-started", 1, age=0)
        assert started == []  # no restart possible, or its ranks are still starting
        attempt("under-way", 1, age=LocalBackend.standby_delay + 1)
        attempt("under-way", 1, age=LocalBackend.standby_delay + 2)
        assert started == ["under-way"]  # one standby per job
        assert LocalBackend(standby=False)._standbys == {} and WarmBackend().standby is False
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_unknown_backend_name_is_refused_naming_the_known_ones():
    from sparkgpu import distributed
    from sparkgpu.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="'warm_pool'"):
        distributed(gpus=1, gpu_type="cpu", backend="pool")(lambda: None)
    with pytest.raises(ConfigurationError, match="'warm_pool'"):
        distributed(gpus=1, gpu_type="cpu", backend="pools")(lambda: None)
