"""Control files obey only the job key: a writer of the run dir without it cannot cancel, stop or fail a job."""

from __future__ import annotations

import json

import pytest

from sparkgpu.rundir import control
from sparkgpu.rundir.control import seal, unseal
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.client.supervisor import Supervisor
from sparkgpu.spec import JobSpec, Resources
from tests.fakes.backend import ScriptedBackend

KEY = b"k" * 32


@pytest.fixture(autouse=True)
def _no_file_reported_yet(monkeypatch):
    """What this worker reported before (another test's job, with the same place names) is not
    this test's to see."""
    monkeypatch.setattr(control, "_forged_seen", set())


def test_a_sealed_body_opens_only_with_its_key_and_in_its_place(capsys):
    sealed = seal(KEY, "attempts/0/STOP", b"budget spent\n")
    assert unseal(KEY, "attempts/0/STOP", sealed) == b"budget spent\n"
    assert unseal(b"x" * 32, "attempts/0/STOP", sealed) is None  # another job's key
    assert unseal(KEY, "attempts/1/STOP", sealed) is None  # a genuine file copied to another place
    assert unseal(KEY, "attempts/0/STOP", sealed.replace(b"budget", b"BUDGET")) is None
    assert unseal(None, "attempts/2/STOP", sealed) is None
    reported = capsys.readouterr().err
    assert "ignoring the control file attempts/1/STOP: not signed with the job's key" in reported
    assert "ignoring the control file attempts/2/STOP: no job key to check it with" in reported


def test_a_forged_file_is_reported_once_not_at_every_poll(capsys):
    for poll in range(5):  # a writer that changes the file at every poll adds no line
        assert unseal(KEY, "attempts/9/spark/CANCEL", b"stop now %d\n" % poll) is None
    assert capsys.readouterr().err.count("attempts/9/spark/CANCEL") == 1
    # The next job this client runs has its own run dir, with the same names in it: its bad file
    # is reported too.
    assert unseal(b"j" * 32, "attempts/9/spark/CANCEL", b"stop the next job now\n") is None
    assert capsys.readouterr().err.count("attempts/9/spark/CANCEL") == 1


def staged(tmp_path) -> tuple[JobSpec, RunDir]:
    job = JobSpec(job_id="job-1", name="job", resources=Resources(2, "cpu"))
    rd = RunDir(tmp_path / "job-1")
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), KEY, [])
    rd.prepare_attempt(0)
    return job, rd


def test_a_planted_cancel_request_cancels_nothing(tmp_path):
    job, rd = staged(tmp_path)
    supervisor = Supervisor(job, rd, ScriptedBackend(["ok"]), KEY)
    rd.cancel_request_file.write_text("cancelled by a co-tenant\n")
    assert not supervisor._cancel_requested()
    rd.write_control(rd.cancel_request_file, b"cancelled by its user\n")
    assert supervisor._cancel_requested()


def test_a_planted_node_exit_fails_no_rank(tmp_path):
    _, rd = staged(tmp_path)
    forged = {"node_rank": 0, "status": 1, "failures": {"0": {"exitcode": 1}}}
    rd.file(RunLayout.node_exits(0, 0)).write_text(json.dumps(forged))
    assert rd.read_node_exits(0) == {}
    rd.write_control(rd.file(RunLayout.node_exits(0, 0)), json.dumps(forged).encode())
    assert list(rd.read_node_exits(0)) == [0]


def test_every_control_file_the_client_writes_is_sealed(tmp_path):
    _, rd = staged(tmp_path)
    control_files = RunLayout.control_files(0)
    assert len(control_files) == 4  # the stop file, Spark's cancel marker, the client's heartbeat, its stacks request
    for rel in control_files:
        path = rd.file(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        rd.write_control(path, b"1\n")
        assert RunDir(rd.path, key=KEY).read_control(path) == b"1\n"
        assert b"--sparkgpu-mac" in path.read_bytes()


def test_a_run_dir_without_its_key_looks_in_the_keyring_once_per_interval_not_at_every_poll(tmp_path, monkeypatch):
    from sparkgpu.rundir import keyring as _keyring
    from sparkgpu.errors import ConfigurationError

    _, staged_dir = staged(tmp_path)
    path = staged_dir.cancel_request_file
    staged_dir.write_control(path, b"cancelled\n")
    looked: list[str] = []

    def missing(job_id: str) -> bytes:
        looked.append(job_id)
        raise ConfigurationError("no key for this job in this user's keyring")

    monkeypatch.setattr(_keyring, "load_key", missing)
    clock = [1000.0]
    monkeypatch.setattr("sparkgpu.rundir.directory.time.monotonic", lambda: clock[0])
    observer = RunDir(staged_dir.path)  # a process that did not launch the job: no key held
    for _ in range(50):  # a poll loop
        assert observer.read_control(path) is None
    assert looked == ["job-1"]
    clock[0] += RunDir.KEYRING_RETRY_SECONDS
    monkeypatch.setattr(_keyring, "load_key", lambda job_id: looked.append(job_id) or KEY)
    assert observer.read_control(path) == b"cancelled\n"  # the key came: found at the next look
    assert looked == ["job-1", "job-1"]
