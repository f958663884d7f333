"""Another user of the machine, under the same shared staging root, can read nothing of a running job and cannot stop it.

The test creates a second OS user (it needs root and ``useradd``; it removes the user after),
starts a job under a world-writable staging root (mode 1777, as a root shared by a team is),
and while the job runs has that user try what a curious or hostile co-tenant would: list the
run dir, read the payload, spec, logs and results, read the environment of every process, and
drop a cancel request and a stop file. Then the job is released and must succeed.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from sparkgpu import distributed
from sparkgpu.config import reset_settings, settings

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None or not os.path.exists("/usr/bin/python3"),
    reason="creating a second OS user needs root, useradd and a system python3",
)

# What the co-tenant runs: the system interpreter, the standard library only.
COTENANT = r"""
import json, os, sys
run_dir = sys.argv[1]
tried = {}
def attempt(name, fn):
    try:
        tried[name] = repr(fn())[:200]
    except OSError as exc:
        tried[name] = "denied: " + type(exc).__name__
attempt("list run dir", lambda: os.listdir(run_dir))
for rel in ("payload.pkl", "spec.json", "_air.py", "state.json", "attempts/0/logs/rank-0.log"):
    attempt("read " + rel, lambda rel=rel: open(os.path.join(run_dir, rel), "rb").read())
attempt("write cancel-request", lambda: open(os.path.join(run_dir, "cancel-request"), "w").write("x"))
attempt("write STOP", lambda: open(os.path.join(run_dir, "attempts", "0", "STOP"), "w").write("x"))
environs = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open("/proc/%s/environ" % pid, "rb") as f:
            data = f.read()
    except OSError:
        continue
    if b"SPARKGPU" in data:
        environs.append(pid)
tried["readable sparkgpu environments"] = environs
print(json.dumps(tried))
"""


@pytest.fixture
def cotenant():
    name = f"sgpu{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=True)


@pytest.fixture
def shared_root(monkeypatch):
    root = Path(tempfile.mkdtemp(prefix="sparkgpu-shared-root-"))
    root.chmod(0o1777)  # every user may create run dirs here, as under /tmp
    monkeypatch.setenv("SPARKGPU_STAGING_ROOT", str(root))
    reset_settings()
    yield root
    reset_settings()
    shutil.rmtree(root, ignore_errors=True)


def wait_for_release(release: str) -> str:
    import os
    import time

    from sparkgpu import runtime

    print(f"rank {runtime.get_global_rank()} waiting", flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.1)
    if runtime.should_checkpoint():
        return "asked to stop"
    return "released"


def test_a_second_user_reads_nothing_of_a_running_job_and_cannot_stop_it(cotenant, shared_root, tmp_path):
    release = tmp_path / "release"  # under pytest's 0700 folder: the co-tenant cannot create it
    job = distributed(gpus=2, gpu_type="cpu", log_ranks="all")(wait_for_release)
    call = job.submit(str(release))
    run_dir = settings().staging_root / call.job_id
    deadline = time.monotonic() + 120
    while not (run_dir / "attempts" / "0" / "logs" / "rank-0.log").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    script = Path(tempfile.mkdtemp()) / "cotenant.py"
    script.write_text(COTENANT)
    script.parent.chmod(0o755)
    script.chmod(0o644)
    try:
        seen = subprocess.run(
            ["/usr/bin/python3", "-I", str(script), str(run_dir)],
            user=cotenant.pw_uid,
            group=cotenant.pw_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
    finally:
        shutil.rmtree(script.parent)
        release.touch()
    assert seen.returncode == 0, seen.stderr
    tried = json.loads(seen.stdout)
    readable = tried.pop("readable sparkgpu environments")
    assert readable == [], f"the co-tenant read the environment of processes {readable}"
    assert all(outcome.startswith("denied") for outcome in tried.values()), tried
    assert call.result(timeout=120) == ["released", "released"]  # nothing it tried stopped the job
    assert not (run_dir / "cancel-request").exists()
    assert oct(run_dir.stat().st_mode & 0o777) == oct(0o700)
