"""How a job key reaches the job's processes: a pipe to the agent, a private file per rank, never the environment."""

from __future__ import annotations

import io
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
from pyspark.sql.connect.client.core import DefaultChannelBuilder

from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.backends.spark.sessions import PLAINTEXT_ENV, check_key_transport
from sparkgpu.rundir import key_handover
from sparkgpu.rundir.key_handover import (
    RANK_KEY_FILE,
    hand_to_ranks,
    receive_key,
    _runs_since,
    remove_stale_key_folders,
    send_key,
)
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir

KEY = bytes(range(32))


def test_the_agent_reads_its_key_from_the_first_line_of_its_stdin():
    pipe = io.BytesIO()
    send_key(pipe, KEY)
    pipe.write(b'{"A": "1"}\n')  # an early agent's variables come after it
    stream = io.TextIOWrapper(io.BytesIO(pipe.getvalue()))
    assert receive_key(stream) == KEY
    assert stream.readline() == '{"A": "1"}\n'
    assert receive_key(io.StringIO("")) is None  # the launcher sent nothing: the payload check refuses
    assert receive_key(io.StringIO("not a key\n")) is None


def test_each_rank_gets_a_private_file_of_its_own(tmp_path):
    folder = hand_to_ranks(KEY, 3)
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        files = sorted(folder.iterdir())
        assert [f.name for f in files] == [RANK_KEY_FILE.format(local_rank=i) for i in range(3)]
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 and f.read_text() == KEY.hex() for f in files)
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def test_the_key_folder_of_a_killed_process_is_removed_by_the_next_hand_off_and_a_live_one_kept(tmp_path, monkeypatch):
    # An agent SIGKILLed after handing its ranks their keys, before any rank took its file.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    killed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from sparkgpu.rundir.key_handover import hand_to_ranks; "
            "print(hand_to_ranks(bytes(32), 2), flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    left = Path(killed.stdout.readline().strip())
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert sorted(f.name for f in left.iterdir()) == ["rank-0", "rank-1"]  # the key, on disk, for nobody
    unrelated = tmp_path / "sparkgpu-key-notapid"
    unrelated.mkdir()

    assert hand_to_ranks(KEY, 1) and left.exists()  # under ten minutes old: its ranks may still be starting
    monkeypatch.setattr(key_handover, "_MIN_AGE_S", 0.0)  # as if it were older
    live = hand_to_ranks(KEY, 1)  # this process runs: its folder stays while a later hand-off sweeps
    assert not left.exists()
    assert remove_stale_key_folders() == [] and live.exists() and unrelated.exists()
    assert live.parent == tmp_path and live.name.startswith(f"sparkgpu-key-{os.getpid()}-")


def test_a_reused_pid_does_not_keep_a_key_folder_alive():
    # A folder made minutes ago, whose pid now names a process that started after it, is stale.
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert not _runs_since(later.pid, time.time() - 120)
        assert _runs_since(later.pid, time.time())  # made now: that process may have made it
        assert _runs_since(os.getpid(), time.time())
    finally:
        later.kill()
        later.wait()
    assert not _runs_since(later.pid, time.time())  # gone


def test_the_entrypoint_takes_its_key_file_and_removes_it_before_anything_runs(tmp_path):
    rd = RunDir(tmp_path / "job-1")
    rd.create({"job_id": "job-1"}, serialize_payload(len, ((),), {}, []), KEY, [], {"_hydrate.py": b"X = 1\n"})
    folder = hand_to_ranks(KEY, 2)
    env = {**os.environ, "SPARKGPU_JOB_KEY_DIR": str(folder), "LOCAL_RANK": "1"}
    # -I -S: no sparkgpu importable, so the rank stops at its import, after the key and signature steps.
    done = subprocess.run([sys.executable, "-I", "-S", str(rd.air)], env=env, capture_output=True, text=True)
    assert "refusing to run" not in done.stderr  # it found its key: the signature held
    assert sorted(f.name for f in folder.iterdir()) == ["rank-0"]  # its own file went, rank 0's stays
    (folder / "rank-0").unlink()
    folder.rmdir()


def test_a_run_dir_is_private_to_its_user(tmp_path):
    rd = RunDir(tmp_path / "shared-root" / "job-1")
    rd.create({"job_id": "job-1"}, serialize_payload(len, ((),), {}, []), KEY, [])
    rd.prepare_attempt(0)
    folders = [rd.path, rd.checkpoints, *(p for p in rd.path.rglob("*") if p.is_dir())]
    files = [p for p in rd.path.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in folders)


def _session(url: str):
    """A Connect session's client as pyspark builds it from ``url``, not connected."""
    return types.SimpleNamespace(client=types.SimpleNamespace(_builder=DefaultChannelBuilder(url)))


@pytest.mark.parametrize(
    "url, refused",
    [
        ("sc://10.20.30.40:15002", True),
        ("sc://spark.example.com:15002/;user_id=ana", True),
        ("sc://10.20.30.40:15002/;use_ssl=true", False),
        ("sc://10.20.30.40:15002/;use_ssl=true;token=abc", False),
        ("sc://127.0.0.1:15002", False),
        ("sc://localhost:15002", False),
        ("sc://[::1]:15002", False),
    ],
)
def test_a_job_key_goes_to_a_connect_server_only_over_tls_a_token_or_loopback(monkeypatch, url, refused):
    monkeypatch.delenv(PLAINTEXT_ENV, raising=False)
    monkeypatch.delenv("SPARK_CONNECT_AUTHENTICATE_TOKEN", raising=False)
    if refused:
        with pytest.raises(ConfigurationError, match=f"in plaintext.*use_ssl=true;token=.*{PLAINTEXT_ENV}=1"):
            check_key_transport(_session(url), "job-1")
        monkeypatch.setenv(PLAINTEXT_ENV, "1")  # the user accepts the risk on a network they trust
    check_key_transport(_session(url), "job-1")


def test_a_classic_session_is_not_a_connect_channel():
    check_key_transport(types.SimpleNamespace(), "job-1")
