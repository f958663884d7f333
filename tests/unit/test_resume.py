"""`sparkgpu resume` continues a job only when no client still drives it (real client processes)."""

import io
import json
import os
import subprocess
import sys

import pytest

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError, JobStateError
from sparkgpu.rundir.keyring import save_key
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu._util.process import ProcessRef
from sparkgpu.launch.client.resume import client_is_gone, resume_job
from sparkgpu.rundir.directory import RunDir
from sparkgpu.spec import JobSpec, Resources
from tests.fakes.backend import ScriptedBackend

KEY = b"k" * 32


@pytest.fixture
def live_client():
    """A real process standing in for the client that launched the job and still runs."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def client_record(pid: int, host: str | None = None) -> dict:
    record = ProcessRef.of(pid).record()
    if host is not None:  # a client on another machine: its pid cannot be looked up here
        record.update(host=host, machine=f"{host}/boot/pid:[1]")
    return record


def interrupted_job(client: dict | None, status: str = "running", backend: str = "fake") -> RunDir:
    """A run dir as a client leaves it when it stops mid-attempt: attempt 0 still "running"."""
    job = JobSpec(job_id="job-1", name="train", resources=Resources(2, "cpu"), backend=backend)
    rd = RunDir(settings().staging_root / job.job_id)
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), KEY, [])
    save_key(job.job_id, KEY)
    state = {
        "job_id": job.job_id,
        "status": status,
        "backend": backend,
        "restarts": 0,
        "preemptions": 0,
        "created_at": 0.0,
        "client": client,
        "attempts": [{"attempt": 0, "started_at": 1.0, "ended_at": None, "status": "running"}],
    }
    atomic_write_bytes(rd.state_file, json.dumps(state).encode())
    return rd


def test_resume_refuses_while_the_client_that_drives_the_job_is_alive(live_client):
    rd = interrupted_job(client_record(live_client.pid))
    backend = ScriptedBackend(["hang", "ok"])
    with pytest.raises(ConfigurationError) as err:
        resume_job("job-1", backend=backend, out=io.StringIO())
    message = str(err.value)
    assert f"pid {live_client.pid}" in message and "--force" in message
    assert backend.submitted_env == []  # refused before anything started
    assert json.loads(rd.state_file.read_text())["attempts"][0]["status"] == "running"  # untouched


def test_resume_continues_once_the_client_is_gone():
    rd = interrupted_job(client_record(dead_pid()))
    assert resume_job("job-1", backend=ScriptedBackend(["hang", "ok"]), out=io.StringIO())[0]["attempt"] == 1
    state = json.loads(rd.state_file.read_text())
    assert [a["status"] for a in state["attempts"]] == ["lost", "succeeded"]
    assert state["client"]["pid"] == os.getpid()  # the resuming process drives it now


def test_force_resumes_even_while_the_client_is_alive(live_client):
    interrupted_job(client_record(live_client.pid))
    assert resume_job("job-1", backend=ScriptedBackend(["hang", "ok"]), out=io.StringIO(), force=True)


def test_a_client_on_another_host_cannot_be_checked_so_resume_needs_force():
    interrupted_job(client_record(dead_pid(), host="some-other-host"))
    with pytest.raises(ConfigurationError, match="(?s)some-other-host.*cannot be checked from here.*--force"):
        resume_job("job-1", backend=ScriptedBackend(["hang", "ok"]), out=io.StringIO())


def test_a_job_that_ended_is_resumed_whatever_its_client_does(live_client):
    # A policy stop ends the call, not the process (a notebook kernel lives on): resume is its documented next step.
    interrupted_job(client_record(live_client.pid), status="stopped")
    assert resume_job("job-1", backend=ScriptedBackend(["hang", "ok"]), out=io.StringIO())


def test_a_reused_pid_does_not_pass_for_the_client(live_client):
    client = client_record(live_client.pid)
    assert not client_is_gone(client)
    assert client_is_gone(
        {**client, "pid_started": str(int(client["pid_started"]) - 3600)}
    )  # same pid, another process
    assert client_is_gone(client_record(dead_pid()))
    assert not client_is_gone(None) and not client_is_gone(client_record(live_client.pid, host="some-other-host"))
    assert not client_is_gone({"host": client["host"], "pid": live_client.pid})  # no machine recorded: cannot tell


def test_two_resumes_never_both_supervise_a_job():
    # Another `sparkgpu resume` (or an attach that took the job over) is running it: it holds the lock.
    rd = interrupted_job(client_record(dead_pid()))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from sparkgpu.rundir.directory import RunDir\n"
            "from sparkgpu.launch.client.supervision_lock import SupervisionLock\n"
            "assert SupervisionLock(RunDir(sys.argv[1])).acquire()\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n",
            str(rd.path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        backend = ScriptedBackend(["hang", "ok"])
        with pytest.raises(JobStateError, match=f"already supervised by pid {holder.pid} on "):
            resume_job("job-1", backend=backend, out=io.StringIO(), force=True)  # force skips the client check only
        assert backend.submitted_env == []  # refused before anything started
        assert json.loads(rd.state_file.read_text())["attempts"][0]["status"] == "running"  # untouched
    finally:
        holder.kill()
        holder.wait()
    # The holder died: its lock went with it.
    assert resume_job("job-1", backend=ScriptedBackend(["hang", "ok"]), out=io.StringIO())[0]["attempt"] == 1
