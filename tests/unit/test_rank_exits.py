"""RankExitWatcher on real child processes: exit codes without reaping, quiet exits stop the others."""

import os
import signal
import subprocess
import sys
import time

import pytest

from sparkgpu.launch.node.rank_exits import RankExitWatcher

pytestmark = pytest.mark.skipif(not hasattr(os, "waitid"), reason="waitid: Linux")


def _rank(rank: int, code: str, run_id="job-0") -> subprocess.Popen:
    env = {**os.environ, "TORCHELASTIC_RUN_ID": run_id, "RANK": str(rank)}
    # The rank's environment is readable only after exec: give the watcher time to find it.
    return subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1.0); {code}"], env=env)


def test_a_quiet_exit_is_recorded_and_stops_the_other_ranks():
    with RankExitWatcher("job-0", reported=lambda rank: False) as watcher:
        quiet, waiting = _rank(1, "os._exit(0)"), _rank(0, "time.sleep(60)")
        other_job = _rank(0, "time.sleep(3)", run_id="job-1")  # not this watcher's rank
        started = time.monotonic()
        while len(watcher.exits) < 2 and time.monotonic() - started < 30:
            time.sleep(0.05)  # reap only after the watcher saw them (torch's agent polls, it does not block)
        assert waiting.wait(timeout=5) == -signal.SIGTERM
        assert quiet.wait(timeout=5) == 0  # still the parent's to reap: WNOWAIT left it
    assert time.monotonic() - started < 45  # stopped for its peer's exit, not at the end of its 60 s sleep
    assert watcher.quiet == [1]
    assert watcher.exits[1].exitcode == 0 and watcher.exits[1].signal is None
    assert watcher.exits[0].signal == "SIGTERM"
    assert other_job.wait(timeout=30) == 0  # left alone


def test_a_rank_that_reported_may_exit_with_code_zero():
    with RankExitWatcher("job-0", reported=lambda rank: True) as watcher:
        done, still = _rank(0, "os._exit(0)"), _rank(1, "time.sleep(3); os._exit(4)")
        deadline = time.monotonic() + 30
        while len(watcher.exits) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # reap only after the watcher saw them (torch's agent polls, it does not block)
        assert done.wait(timeout=5) == 0 and still.wait(timeout=5) == 4
    assert watcher.quiet == []
    assert watcher.exits[0].exitcode == 0 and watcher.exits[1].exitcode == 4
    assert watcher.exits[0].time < watcher.exits[1].time


def test_after_a_crash_only_ranks_that_checkpoint_on_sigterm_are_killed():
    """Those would sit out the shutdown grace waiting for the dead peer; a rank that cleans up on
    SIGTERM (a Ray node) is left to torch's SIGTERM and grace."""
    with RankExitWatcher(
        "job-0", reported=lambda rank: False, crash_kill_delay=0.5, checkpoints_on_sigterm=lambda rank: rank == 1
    ) as watcher:
        crashed = _rank(0, "os._exit(3)")
        checkpointing = _rank(1, "time.sleep(60)")
        cleaning_up = _rank(2, "time.sleep(4); os._exit(0)")
        deadline = time.monotonic() + 10
        while not {0, 1} <= watcher.exits.keys() and time.monotonic() < deadline:
            time.sleep(0.05)  # reap only after the watcher saw them (torch's agent polls, it does not block)
        assert checkpointing.wait(timeout=5) == -signal.SIGKILL
        assert crashed.wait(timeout=5) == 3
        assert cleaning_up.wait(timeout=10) == 0  # never killed: it ended on its own
    assert watcher.exits[0].exitcode == 3 and watcher.exits[1].signal == "SIGKILL"


def test_ranks_named_to_it_are_watched_without_looking_for_any():
    """Forked ranks carry the agent's environment in /proc: the agent names them (adopt)."""
    with RankExitWatcher("job-0", reported=lambda rank: False, ranks=0) as watcher:
        assert not watcher._thread.is_alive()  # no scan of the host's processes
        quiet = subprocess.Popen([sys.executable, "-c", "import os; os._exit(0)"])  # no rank variables at all
        waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        watcher.adopt(waiting.pid, 0)
        watcher.adopt(quiet.pid, 1)
        assert waiting.wait(timeout=15) == -signal.SIGTERM  # the quiet exit stopped it
        assert quiet.wait(timeout=5) == 0  # a zombie until here: the watcher read it without reaping
    assert watcher.quiet == [1]


def test_the_watcher_stops_looking_once_it_found_every_rank():
    with RankExitWatcher("job-0", reported=lambda rank: True, ranks=2) as watcher:
        ranks = [_rank(0, "os._exit(0)"), _rank(1, "os._exit(5)")]
        watcher._thread.join(timeout=30)
        assert not watcher._thread.is_alive()  # both found: no more scans
        deadline = time.monotonic() + 30
        while len(watcher.exits) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # reap only after the watcher saw them, as torch's agent does
        assert [r.wait(timeout=10) for r in ranks] == [0, 5]
    assert watcher.exits[1].exitcode == 5
