"""The host's GPU queue: order by class then by arrival, stale entries ignored, preemption requests judged by their target.

Each waiting job is a real process holding its entry's flock, as a second user's job would be.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.scheduling.gpu_lease import lease_gpus, to_preempt
from sparkgpu.launch.scheduling.gpu_queue import GpuHolder, GpuQueue, PreemptionRequest, QueueEntry, pending_request
from sparkgpu.spec.priority import Priority

WAITER = """
import sys, time
from pathlib import Path
from sparkgpu.launch.scheduling.gpu_queue import GpuQueue, QueueEntry
from sparkgpu.spec.priority import Priority
root, job, priority, order = sys.argv[1:5]
queue = GpuQueue(Path(root))
queue.enter(QueueEntry(job, Priority.parse(priority), 2, float(order), gpu_kind="simulated-gpu"))
print(queue.entry.file_name, flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


@pytest.fixture
def waiters(tmp_path):
    started: list[subprocess.Popen] = []

    def start(job: str, priority: str, order: float) -> tuple[subprocess.Popen, str]:
        process = subprocess.Popen(
            [sys.executable, "-c", WAITER, str(tmp_path), job, priority, str(order)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        assert process.stdout is not None
        return process, process.stdout.readline().strip()

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.mark.parametrize(
    "given, expected",
    [
        ("best_effort", Priority.BEST_EFFORT),
        ("BEST_EFFORT", Priority.BEST_EFFORT),
        ("best-effort", Priority.BEST_EFFORT),
        ("Critical", Priority.CRITICAL),
        ("NORMAL", Priority.NORMAL),
        (None, Priority.NORMAL),
    ],
)
def test_priority_takes_our_and_databricks_spellings(given, expected):
    assert Priority.parse(given) is expected


@pytest.mark.parametrize("bad", ["urgent", 2, "", True])
def test_an_unknown_priority_names_the_accepted_ones(bad):
    with pytest.raises(ConfigurationError, match="use 'best_effort', 'normal' or 'critical'"):
        Priority.parse(bad)


def test_waiting_jobs_are_ordered_by_class_then_by_arrival(tmp_path, waiters):
    waiters("late-normal", "normal", 20.0)
    waiters("early-best-effort", "best_effort", 1.0)
    waiters("early-normal", "normal", 10.0)
    waiters("late-critical", "critical", 30.0)
    queue = GpuQueue(tmp_path)
    assert [e.job_id for e in queue.live_entries()] == [
        "late-critical",
        "early-normal",
        "late-normal",
        "early-best-effort",
    ]
    assert {job: place for job, (_, place) in queue.positions().items()} == {
        "late-critical": 1,
        "early-normal": 2,
        "late-normal": 3,
        "early-best-effort": 4,
    }
    queue.enter(QueueEntry("me", Priority.NORMAL, 1, 15.0, gpu_kind="simulated-gpu"))
    try:
        assert [e.job_id for e in queue.ahead()] == ["late-critical", "early-normal"]
    finally:
        queue.leave()
    assert "me" not in queue.positions()


def test_the_entry_of_a_dead_process_holds_nobody_up(tmp_path, waiters):
    dead, name = waiters("dead", "critical", 1.0)
    waiters("alive", "normal", 2.0)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    queue = GpuQueue(tmp_path)
    assert (queue.queue_dir / name).exists()  # its file outlives it ...
    assert [e.job_id for e in queue.live_entries()] == ["alive"]  # ... but not its place
    assert not (queue.queue_dir / name).exists()  # ours, so it was cleared away


def test_a_forged_entry_file_not_held_by_a_process_is_ignored(tmp_path):
    queue = GpuQueue(tmp_path)
    forged = QueueEntry("forged", Priority.CRITICAL, 2, 0.0, gpu_kind="simulated-gpu")
    (queue.queue_dir / forged.file_name).write_text(forged.to_json())
    assert queue.live_entries() == []


def test_an_entry_keeps_the_json_keys_every_version_writes():
    entry = QueueEntry("job", Priority.NORMAL, 1, 5.0, gpu_kind="simulated-gpu", pid=7, host="h", uid=3)
    written = json.loads(entry.to_json())
    assert written["pool"] == "simulated-gpu" and "gpu_kind" not in written  # clients of two versions share the queue
    assert QueueEntry.from_json(entry.to_json()) == entry
    assert entry.file_name == "simulated-gpu.job.7.json"


def _request(tmp_path, target: str, requester: str, entry_name: str) -> None:
    queue = GpuQueue(tmp_path)
    (queue.preempt_dir / f"{target}.{requester}.json").write_text(
        PreemptionRequest(target, requester, entry_name).to_json()
    )


def test_only_a_live_critical_job_first_in_the_queue_may_ask_a_best_effort_job_to_give_way(tmp_path, waiters):
    critical, entry = waiters("urgent", "critical", 5.0)
    _request(tmp_path, "background", "urgent", entry)
    found = pending_request(tmp_path, "background", Priority.BEST_EFFORT, "simulated-gpu")
    assert found is not None and found[0].requester_job_id == "urgent" and found[1].priority is Priority.CRITICAL

    # The same request never stops a normal or critical job, nor a job on other GPUs.
    assert pending_request(tmp_path, "background", Priority.NORMAL, "simulated-gpu") is None
    assert pending_request(tmp_path, "background", Priority.CRITICAL, "simulated-gpu") is None
    assert pending_request(tmp_path, "background", Priority.BEST_EFFORT, "gpu") is None
    # Nor a job it does not name.
    assert pending_request(tmp_path, "other", Priority.BEST_EFFORT, "simulated-gpu") is None

    # Once the requester is gone (it got its GPUs, gave up or died), its request is void.
    critical.kill()
    critical.wait()
    assert pending_request(tmp_path, "background", Priority.BEST_EFFORT, "simulated-gpu") is None


def test_a_request_naming_a_normal_or_second_in_line_entry_is_ignored(tmp_path, waiters):
    _, normal_entry = waiters("ordinary", "normal", 1.0)
    _request(tmp_path, "background", "ordinary", normal_entry)
    assert pending_request(tmp_path, "background", Priority.BEST_EFFORT, "simulated-gpu") is None

    waiters("first", "critical", 1.0)
    _, second = waiters("second", "critical", 2.0)
    _request(tmp_path, "victim", "second", second)
    assert pending_request(tmp_path, "victim", Priority.BEST_EFFORT, "simulated-gpu") is None

    # A request whose fields disagree with the entry it points at (a forged requester) is ignored too.
    _request(tmp_path, "victim2", "someone-else", second)
    assert pending_request(tmp_path, "victim2", Priority.BEST_EFFORT, "simulated-gpu") is None
    _request(tmp_path, "victim3", "first", "../../etc/passwd")
    assert pending_request(tmp_path, "victim3", Priority.BEST_EFFORT, "simulated-gpu") is None


def test_a_freed_gpu_goes_to_the_higher_class_though_it_asked_later(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKGPU_GPU_LOCK_DIR", str(tmp_path))
    from sparkgpu.config import settings

    settings.cache_clear()
    holder = lease_gpus(["0"], 1, "holder", wait=5, simulated=True)
    got: list[str] = []

    def wait_for(job: str, priority: Priority) -> None:
        lease = lease_gpus(["0"], 1, job, wait=30, simulated=True, priority=priority)
        got.append(job)
        time.sleep(0.3)
        lease.release()

    low = threading.Thread(target=wait_for, args=("background", Priority.BEST_EFFORT))
    low.start()
    while "background" not in GpuQueue(tmp_path).positions():
        time.sleep(0.05)
    high = threading.Thread(target=wait_for, args=("ordinary", Priority.NORMAL))
    high.start()
    while "ordinary" not in GpuQueue(tmp_path).positions():
        time.sleep(0.05)
    assert GpuHolder.read(tmp_path / "simulated-gpu-0.lock") == GpuHolder("holder", Priority.NORMAL)
    holder.release()
    low.join(30)
    high.join(30)
    assert got == ["ordinary", "background"]
    assert json.loads((tmp_path / "simulated-gpu-0.lock").read_text())["priority"] == "best_effort"
    assert os.listdir(tmp_path / "queue") == []  # both left the queue once served


def test_a_critical_job_asks_only_as_many_best_effort_jobs_as_make_up_its_gpus():
    big, small = GpuHolder("big", Priority.BEST_EFFORT), GpuHolder("small", Priority.BEST_EFFORT)
    ordinary = GpuHolder("ordinary", Priority.NORMAL)
    busy = {"0": big, "1": big, "2": small, "3": ordinary}
    assert to_preempt(busy, free=0, count=2) == [big]
    assert to_preempt(busy, free=1, count=2) == [big]  # the fewest jobs: one holding two
    assert to_preempt(busy, free=0, count=3) == [big, small]
    # Stopping every best-effort job would still leave it short: nobody is stopped for nothing.
    assert to_preempt(busy, free=0, count=4) == []
    assert to_preempt({"0": ordinary, "1": None}, free=0, count=1) == []


def test_a_critical_job_first_in_line_writes_its_request_and_takes_it_back_when_served(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKGPU_GPU_LOCK_DIR", str(tmp_path))
    from sparkgpu.config import settings

    settings.cache_clear()
    background = lease_gpus(["0", "1"], 2, "background", wait=5, simulated=True, priority=Priority.BEST_EFFORT)
    seen: list[tuple[PreemptionRequest, QueueEntry]] = []

    def target_supervisor() -> None:  # polls for a request, then frees its GPUs, as a supervisor does
        deadline = time.monotonic() + 15
        while not seen and time.monotonic() < deadline:
            found = pending_request(tmp_path, "background", Priority.BEST_EFFORT, "simulated-gpu")
            if found is not None:
                seen.append(found)
            time.sleep(0.05)
        background.release()

    threading.Thread(target=target_supervisor).start()
    lease = lease_gpus(["0", "1"], 2, "urgent", wait=20, simulated=True, priority=Priority.CRITICAL)
    try:
        assert lease.devices == ("0", "1")
        assert seen[0] is not None and seen[0][0].requester_job_id == "urgent"
        assert os.listdir(tmp_path / "preempt") == []  # served: its request is gone
    finally:
        lease.release()
