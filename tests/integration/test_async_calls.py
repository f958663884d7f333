"""`fn.submit(...)` and `sparkgpu.attach(job_id)` on real processes: several jobs at once,
cancelling, and, for jobs their caller supervises (``detach=False``), reattaching from another
process to a live or killed client. Detached jobs, which outlive their caller, are in
``test_detached_jobs.py``."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time

import pytest

from sparkgpu import (
    DistributedFunctionCall,
    SerializationError,
    WorkerFailedError,
    attach,
    collect_outputs_or_raise,
    distributed,
    runtime,
)
from sparkgpu.config import settings
from sparkgpu.errors import CallNotFinishedError, ConfigurationError, JobCancelledError
from sparkgpu.launch.client.supervisor import JobStatus
from tests.integration.processes import assert_no_orphans, start_client, wait_for

pytestmark = pytest.mark.integration


@distributed(gpus=1, gpu_type="cpu")
def meet(me: str, other: str, where: str):
    """Returns only once the other job's rank has run too: two such jobs finish only side by side."""
    import pathlib

    folder = pathlib.Path(where)
    (folder / me).touch()
    print(f"{me} waiting for {other}", flush=True)
    deadline = time.monotonic() + 120
    while not (folder / other).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{other} never ran beside {me}")
        time.sleep(0.05)
    return me, runtime.job_id()


@distributed(gpus=1, gpu_type="cpu")
def forever():
    print("started", flush=True)
    time.sleep(600)


@distributed(gpus=1, gpu_type="cpu")
def fails():
    raise ValueError("bad batch 7")


def _started(call: DistributedFunctionCall) -> bool:
    return "started" in call.logs()


def test_two_submitted_jobs_run_at_once_and_return_their_results(tmp_path):
    first = meet.submit("a", "b", str(tmp_path))
    second = meet.submit("b", "a", str(tmp_path))  # submit returned at once: "a" still waits for "b"
    assert first.job_id != second.job_id
    assert first.status() in (JobStatus.PENDING, JobStatus.RUNNING)
    assert first.result(timeout=120) == [("a", first.job_id)]
    assert second.result(timeout=120) == [("b", second.job_id)]
    assert first.status() is second.status() is JobStatus.SUCCEEDED
    assert first.logs() == "[rank0] a waiting for b\n"
    assert first.run_dir.path != second.run_dir.path


def test_submit_validates_before_it_returns():
    import threading

    with pytest.raises(SerializationError):
        meet.submit(threading.Lock(), "x", "y")
    assert not list(settings().staging_root.glob("*/state.json"))  # nothing was started


def test_result_times_out_cancel_stops_the_ranks_and_logs_follow(tmp_path):
    call = forever.submit()
    assert wait_for(lambda: _started(call), within=90), "the rank never started"
    with pytest.raises(CallNotFinishedError, match="still running"):
        call.result(timeout=0.5)
    assert call.status() is JobStatus.RUNNING
    followed = tmp_path / "followed.txt"
    with open(followed, "w") as out:
        import threading

        follower = threading.Thread(target=call.logs, kwargs={"follow": True, "out": out})
        follower.start()
        assert call.cancel() is JobStatus.CANCELLED
        follower.join(30)
    assert not follower.is_alive()  # following ends with the job
    assert followed.read_text() == "[rank0] started\n"
    with pytest.raises(JobCancelledError):
        call.result()
    state = json.loads(call.run_dir.state_file.read_text())
    assert state["status"] == "cancelled" and state["attempts"][0]["status"] == "cancelled"
    assert_no_orphans(call.run_dir.path, within=15)


def test_a_failing_rank_raises_as_distributed_does():
    call = fails.submit()
    with pytest.raises(WorkerFailedError, match="bad batch 7") as err:
        call.result(timeout=120)
    assert isinstance(err.value.__cause__, ValueError)
    # Read back by another observer from the run dir: the same failure, the same cause.
    observer = DistributedFunctionCall(call.job_id, call.run_dir)
    with pytest.raises(WorkerFailedError, match="bad batch 7") as again:
        observer.result()
    assert isinstance(again.value.__cause__, ValueError) and again.value.ranks == [0]


def test_a_run_async_sweep_returns_calls_at_once_and_collects_every_result_before_raising(tmp_path):
    """The serverless_gpu way: ``run_async=True`` makes ``.distributed()`` return the call."""
    sweep = meet.with_overrides(run_async=True)
    first, second = sweep.distributed("a", "b", str(tmp_path)), sweep.distributed("b", "a", str(tmp_path))
    assert isinstance(first, DistributedFunctionCall) and first.job_id != second.job_id
    assert collect_outputs_or_raise([first, second], timeout=120) == [
        [("a", first.job_id)],
        [("b", second.job_id)],
    ]
    assert collect_outputs_or_raise(first) == [("a", first.job_id)]

    failing = fails.with_overrides(run_async=True).distributed()
    slow = meet.with_overrides(run_async=True).distributed("c", "c", str(tmp_path))
    with pytest.raises(WorkerFailedError, match="bad batch 7"):
        collect_outputs_or_raise([failing, slow], timeout=120)
    assert slow.done(), "the sweep's other job is waited for before the failure is raised"


def test_attach_to_a_job_of_this_process_returns_its_call_and_unknown_ids_fail():
    call = forever.with_overrides(detach=False).submit()  # supervised by this process
    try:
        assert attach(call.job_id) is call
    finally:
        call.cancel()
    with pytest.raises(ConfigurationError, match="sparkgpu jobs"):
        attach("no-such-job")


# -- another client process ------------------------------------------------------------------
LIVE_CLIENT = textwrap.dedent("""
    import sys, time
    from sparkgpu import distributed
    from sparkgpu.errors import JobCancelledError

    @distributed(gpus=1, gpu_type="cpu")
    def quick(x):
        return x * 2

    @distributed(gpus=1, gpu_type="cpu")
    def forever():
        print("started", flush=True)
        time.sleep(600)

    # Supervised by this client (detach=False), not by processes of their own.
    quick, forever = quick.with_overrides(detach=False), forever.with_overrides(detach=False)
    done, waited, left = quick.submit(21), forever.submit(), forever.submit()
    done.wait()
    print(done.job_id, waited.job_id, left.job_id, flush=True)
    try:
        waited.result()
    except JobCancelledError:
        print("cancelled from elsewhere", flush=True)
    # `left` still runs: exiting cancels it.
""")


def test_attach_observes_a_live_client_and_cancels_through_it(tmp_path, _isolated_sparkgpu_home):
    client = start_client(tmp_path, _isolated_sparkgpu_home, LIVE_CLIENT, stdout=subprocess.PIPE, text=True)
    try:
        done_id, waited_id, left_id = client.stdout.readline().split()
        done, waited = attach(done_id), attach(waited_id)
        assert done.result(timeout=30) == [42]  # read from the run dir, signed by the client's key
        assert wait_for(lambda: _started(waited), within=90), "the rank never started"
        assert waited.status() is JobStatus.RUNNING
        assert waited._thread is None  # observed: the live client still supervises it
        assert waited.cancel(timeout=120) is JobStatus.CANCELLED
        with pytest.raises(JobCancelledError):
            waited.result()
        out, _ = client.communicate(timeout=120)
        assert client.returncode == 0 and "cancelled from elsewhere" in out
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    left = attach(left_id)
    assert left.status() is JobStatus.CANCELLED  # the client's exit cancelled the job it still ran
    for job_id in (waited_id, left_id):
        assert_no_orphans(settings().staging_root / job_id, within=15)


KILLED_CLIENT = textwrap.dedent("""
    import os, time
    from sparkgpu import distributed, runtime

    @distributed(gpus=1, gpu_type="cpu")
    def train():
        marker = os.path.join(runtime.checkpoint_dir(), "progress")
        if os.path.exists(marker):
            return ("resumed", runtime.attempt(), open(marker).read())
        with open(marker, "w") as f:
            f.write("500")
        print("checkpointed", flush=True)
        time.sleep(600)

    call = train.with_overrides(detach=False).submit()  # supervised by this client, which dies
    print(call.job_id, flush=True)
    call.wait()
""")


def test_attach_takes_over_a_job_whose_client_was_killed(tmp_path, _isolated_sparkgpu_home):
    client = start_client(tmp_path, _isolated_sparkgpu_home, KILLED_CLIENT, stdout=subprocess.PIPE, text=True)
    try:
        job_id = client.stdout.readline().strip()
        run_dir = settings().staging_root / job_id
        assert wait_for(lambda: (run_dir / "checkpoints" / "progress").exists(), within=90), "never checkpointed"
    finally:
        client.kill()  # SIGKILL: no exit hook runs
        client.wait()
    assert_no_orphans(run_dir, within=15)
    call = attach(job_id)
    assert call._thread is not None  # taken over: this process supervises it now
    # Another observer that saw the dead client too cannot take over a second time.
    assert DistributedFunctionCall(job_id, call.run_dir)._lock_supervision() is False
    assert DistributedFunctionCall(job_id, call.run_dir)._take_over_if_abandoned() is False
    assert call.result(timeout=120) == [("resumed", 1, "500")]
    state = json.loads((run_dir / "state.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["lost", "succeeded"]
    assert state["client"]["pid"] == os.getpid()


def test_sparkgpu_cancel_ends_a_job_whose_client_was_killed_without_running_it_again(
    tmp_path, _isolated_sparkgpu_home, capsys
):
    from sparkgpu.cli import main

    client = start_client(tmp_path, _isolated_sparkgpu_home, KILLED_CLIENT, stdout=subprocess.PIPE, text=True)
    try:
        job_id = client.stdout.readline().strip()
        run_dir = settings().staging_root / job_id
        assert wait_for(lambda: (run_dir / "checkpoints" / "progress").exists(), within=90), "never checkpointed"
    finally:
        client.kill()
        client.wait()
    started = time.monotonic()
    assert main(["cancel", job_id, "--timeout", "60"]) == 0
    assert time.monotonic() - started < 30
    assert f"job {job_id} is cancelled" in capsys.readouterr().out
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "cancelled"
    assert [a["status"] for a in state["attempts"]] == ["cancelled"]  # no second attempt ran
    assert not (run_dir / "cancel-request").exists()  # done: a later resume is not cancelled again
