import time

import pytest

from sparkgpu import runtime
from sparkgpu.rundir import keyring as _keyring
from sparkgpu.rundir.directory import RunDir


@pytest.fixture(autouse=True)
def _fresh_flag(monkeypatch):
    for name in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "SPARKGPU_RUN_DIR",
        "SPARKGPU_CHECKPOINT_DEADLINE",
        "SPARKGPU_ATTEMPT",
        "SPARKGPU_JOB_ID",
        "SPARKGPU_CHECKPOINT_DIR",
    ):
        monkeypatch.delenv(name, raising=False)
    runtime._checkpoint_requested.clear()
    yield
    runtime._checkpoint_requested.clear()


def test_outside_a_job_this_is_rank_zero_of_one():
    assert (runtime.get_global_rank(), runtime.get_local_rank(), runtime.get_world_size()) == (0, 0, 1)
    assert runtime.is_main_process() and runtime.job_id() is None and runtime.checkpoint_dir() is None
    assert runtime.attempt() == 0 and not runtime.should_checkpoint()
    assert runtime.device().type in ("cpu", "cuda")


def test_rank_helpers_follow_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert (runtime.get_global_rank(), runtime.get_local_rank(), runtime.get_world_size()) == (5, 1, 8)
    assert not runtime.is_main_process()


def test_should_checkpoint_turns_true_at_the_deadline(monkeypatch):
    monkeypatch.setenv("SPARKGPU_CHECKPOINT_DEADLINE", repr(time.time() + 3600))
    assert not runtime.should_checkpoint()
    monkeypatch.setenv("SPARKGPU_CHECKPOINT_DEADLINE", repr(time.time() - 1))
    assert runtime.should_checkpoint()
    monkeypatch.delenv("SPARKGPU_CHECKPOINT_DEADLINE")
    assert runtime.should_checkpoint()  # once asked, it stays asked


def test_should_checkpoint_turns_true_when_the_supervisor_writes_the_stop_file(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARKGPU_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("SPARKGPU_ATTEMPT", "2")
    assert not runtime.should_checkpoint()
    (tmp_path / "attempts" / "2").mkdir(parents=True)
    (tmp_path / "attempts" / "2" / "STOP").write_text("budget")  # planted by a writer of the run dir
    assert not runtime.should_checkpoint()
    monkeypatch.setattr(_keyring, "_held", b"k" * 32)  # as the entrypoint holds it in a rank
    RunDir(tmp_path, key=b"k" * 32).write_control(tmp_path / "attempts" / "2" / "STOP", b"budget\n")
    assert runtime.should_checkpoint()


def test_sigterm_becomes_a_checkpoint_request_only_when_asked():
    import os
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert runtime.handle_sigterm_as_checkpoint_request()
        os.kill(os.getpid(), signal.SIGTERM)
        assert runtime.should_checkpoint()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_stop_for_restart_is_not_swallowed_by_except_exception():
    with pytest.raises(runtime.StopForRestart):
        try:
            runtime.stop_for_restart()
        except Exception:  # noqa: BLE001 - what careless training code does
            pytest.fail("StopForRestart must pass through `except Exception`")


def test_the_checkpoint_request_docs_tell_users_to_stop_for_restart_not_return():
    # A rank that returns on a checkpoint request ends the job as succeeded, unfinished.
    doc = " ".join(runtime.should_checkpoint.__doc__.split())
    assert "calls :func:`stop_for_restart` on every rank" in doc
    assert "saves, and returns" not in doc
