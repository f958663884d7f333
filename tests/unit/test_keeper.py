"""The keeper's loop shared by detached jobs and sweeps (``sparkgpu._util.keeper``), on real forked children.

Each child records its start in a file and then does what the test asks of that start (die by
SIGKILL, exit with a code); the loop's answer and the file say how many children it started. And what a kept sweep's folder
says of who drives and who keeps it (its ``driver.lock``, its ``keeper.json``).
"""

from __future__ import annotations

import os
import signal

import pytest

from sparkgpu._util.keeper import Kept, keep


@pytest.fixture(autouse=True)
def _sigchld_as_in_a_keeper():
    """The keeper runs in a process of its own, where SIGCHLD has its default action. This test
    process may hold torch's handler, left by a DataLoader test: it raises on any child's exit
    while a worker it once knew was killed, which a keeper never meets."""
    before = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGCHLD, before)


def _kept(tmp_path, plan: list[str], ended=lambda: False) -> Kept:
    """A thing whose n-th child does ``plan[n]``: ``"kill"`` (SIGKILLs itself) or ``"exit N"``."""
    starts = tmp_path / "starts"

    def run() -> int:
        with open(starts, "a") as f:
            f.write("start\n")
        what = plan[len(starts.read_text().splitlines()) - 1]
        if what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return int(what.split()[1])

    return Kept(kind="thing", name="t1", worker="worker", run=run, ended=ended, resume="resume t1")


def _starts(tmp_path) -> int:
    return len((tmp_path / "starts").read_text().splitlines())


def test_a_child_killed_by_a_signal_is_replaced_and_the_last_ones_exit_code_is_the_keepers(tmp_path):
    assert keep(_kept(tmp_path, ["kill", "exit 3"])) == 3
    assert _starts(tmp_path) == 2


def test_a_child_that_exited_is_not_replaced(tmp_path):
    assert keep(_kept(tmp_path, ["exit 1", "exit 0"])) == 1
    assert _starts(tmp_path) == 1


def test_a_child_killed_after_the_thing_ended_is_not_replaced(tmp_path):
    assert keep(_kept(tmp_path, ["kill", "exit 0"], ended=lambda: True)) == -signal.SIGKILL
    assert _starts(tmp_path) == 1


def test_the_keeper_gives_up_after_its_limit(tmp_path, caplog):
    assert keep(_kept(tmp_path, ["kill"] * 2), limit=2) == 1
    assert _starts(tmp_path) == 2
    assert "thing t1: 2 workers died one after another; giving up. `resume t1` continues it" in caplog.text


def test_one_process_drives_a_sweep_at_a_time_and_a_dead_keeper_names_no_keeper(tmp_path):
    import subprocess
    import sys

    import pytest

    from sparkgpu._util.process import ProcessRef
    from sparkgpu.errors import JobStateError
    from sparkgpu.sweeps.folder import SweepFolder

    folder = SweepFolder(tmp_path / "sweep-x").create()
    folder.write({"sweep_id": folder.sweep_id, "driver": {"pid": 4242}})
    with folder.driving():
        with pytest.raises(JobStateError, match="driven by another process \\(pid 4242\\)"):
            with folder.driving():
                pass
    with folder.driving():  # released with the block
        pass
    assert folder.keeper() is None  # none was named
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder.name_keeper(ProcessRef.of(int(gone.stdout)), 0.0)
    assert folder.keeper() is None  # named, but it has exited
    folder.name_keeper(ProcessRef.current(), 0.0)
    assert folder.keeper() == ProcessRef.current()
