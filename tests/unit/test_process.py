"""One answer to "is this process still alive", for every record that names a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sparkgpu._util.process import ProcessRef, machine_id, pid_gone, start_ticks

pytestmark = pytest.mark.skipif(machine_id() is None, reason="needs /proc to tell this machine's processes")


def test_a_running_process_is_alive_and_an_exited_one_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ref = ProcessRef.of(child.pid)
        assert ref.started is not None and not ref.is_gone()
    finally:
        child.kill()
        child.wait()
    assert ref.is_gone()


def test_a_zombie_counts_as_exited():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ref = ProcessRef.of(child.pid)
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert ref.is_gone()
    finally:
        child.wait()


def test_a_recycled_pid_does_not_pass_for_the_process_recorded():
    me = ProcessRef.current()
    assert not me.is_gone()
    assert ProcessRef(me.machine, me.pid, str(int(me.started) + 1)).is_gone()


def test_another_machines_process_is_never_judged_by_its_pid():
    other = ProcessRef("elsewhere/boot/pid:[1]", 2**22 + 7, None)  # no such pid here
    assert pid_gone(other.pid) and not other.is_gone() and not other.on_this_machine()
    assert not ProcessRef(None, 2**22 + 7, None).is_gone()  # machine unknown: cannot tell


def test_a_record_round_trips_and_old_records_read_as_unknown():
    me = ProcessRef.current()
    assert ProcessRef.from_record(me.record()) == me
    assert me.record()["host"]  # for people
    assert ProcessRef.from_record({"host": "h", "pid": me.pid, "pid_started": 1.7e9}).started is None
    assert start_ticks(2**22 + 7) is None
