"""When and how each rank of a node exits, exit code 0 included.

torch's elastic agent reports only ranks that exit with a non-zero code, and only when it
notices (it polls). A rank that leaves with code 0 and no result (``os._exit(0)`` in user
code, a library calling ``exit(0)``) is not a failure there: its peers then fail in the next
collective ("Connection closed by peer") or hang in it, and they would be reported as the
cause. :class:`RankExitWatcher` runs in the node's agent, beside torch's: it finds the rank
processes among the agent's children (or is told of those the agent forked) and waits for each with ``waitid(WNOWAIT)``, which
reads the exit status without reaping the process, so torch's own bookkeeping is untouched.
A rank that exits with code 0 without leaving a result, an error or a preemption marker is a
failure: the watcher stops the node's other ranks (SIGTERM, as torch does after a failure)
so that none waits in a collective for it.

A rank that crashes (a non-zero exit or a signal other than SIGTERM, not the "resume me"
status) leaves its peers blocked in their next collective. torch then stops them with SIGTERM
and waits the shutdown grace; but a rank whose ``Checkpointer`` turned SIGTERM into a
checkpoint request sits out the whole grace, and no checkpoint can be taken once a peer is
gone. So the watcher kills those of the node's other ranks ``crash_kill_delay`` after a crash;
ranks that handle SIGTERM otherwise (a Ray node stopping itself) get torch's whole grace.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from sparkgpu.failure_class import oom_kills, own_cgroup
from sparkgpu.rundir.exit_codes import EXIT_PREEMPTED
from sparkgpu.rundir.states import RankExit

__all__ = ["RankExitWatcher", "CRASH_KILL_DELAY"]

#: Seconds after a rank crashed before its node's peers that checkpoint on SIGTERM are killed.
CRASH_KILL_DELAY = 2.0


class RankExitWatcher:
    """Records each rank's exit code, signal and exit time on this node.

    Args:
        run_id: ``TORCHELASTIC_RUN_ID`` of this node's ranks: tells them from other children.
        reported: ``reported(rank)`` is True when the rank left a result, an error or a
            preemption marker, i.e. it did not exit quietly.
        poll_interval: Seconds between looks for newly started ranks.
        crash_kill_delay: Seconds after a rank crashed before the node's other ranks, if still
            running and checkpointing on SIGTERM, are killed.
        checkpoints_on_sigterm: ``checkpoints_on_sigterm(rank)`` is True when the rank turned
            SIGTERM into a checkpoint request (:func:`sparkgpu.runtime.handle_sigterm_as_checkpoint_request`).
        ranks: How many ranks the node starts: the watcher stops looking for new ones once it
            has them all (``None``: it looks until it is closed). ``0``: it never looks, and
            knows only the ranks it is told of (:meth:`adopt`).
        cgroup: The cgroup (v2) directory whose ``memory.events`` tells an OOM kill from
            another SIGKILL; ``None``: this process's own (:func:`~sparkgpu.failure_class.own_cgroup`).

    Attributes:
        exits: Global rank -> :class:`RankExit` (exit code, signal, time; no pid) of every rank seen exiting.
        quiet: Ranks that exited with code 0 without reporting anything, in exit order.
    """

    def __init__(
        self,
        run_id: str,
        reported: Callable[[int], bool],
        poll_interval: float = 0.05,
        crash_kill_delay: float = CRASH_KILL_DELAY,
        checkpoints_on_sigterm: Callable[[int], bool] = lambda rank: True,
        ranks: int | None = None,
        cgroup: str | Path | None = None,
    ):
        self.expected = ranks
        self.cgroup = cgroup if cgroup is not None else own_cgroup()
        # The OOM kills its cgroup counted before any rank ran: a rise at a SIGKILL is the host's OOM killer.
        self._oom_kills = oom_kills(self.cgroup) if self.cgroup is not None else None
        self.run_id = run_id
        self.reported = reported
        self.checkpoints_on_sigterm = checkpoints_on_sigterm
        self.poll_interval = poll_interval
        self.crash_kill_delay = crash_kill_delay
        self.exits: dict[int, RankExit] = {}
        self.quiet: list[int] = []
        self._ranks: dict[int, tuple[psutil.Process, int]] = {}  # pid -> its process and rank, while it runs
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._discover, name="sparkgpu-rank-exits", daemon=True)

    def __enter__(self) -> "RankExitWatcher":
        if hasattr(os, "waitid") and self.expected != 0:  # Linux; elsewhere torch's own report is all there is
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()

    def _discover(self) -> None:
        me = psutil.Process()
        # Each look reads every process of the host (psutil's children()): once all ranks are
        # found, there is nothing left to look for.
        while not self._stop.is_set() and (self.expected is None or len(self._seen) < self.expected):
            for child in me.children():
                with self._lock:
                    if child.pid in self._seen:
                        continue
                rank = self._rank_of(child)
                if rank is not None:
                    with self._lock:
                        if child.pid in self._seen:  # adopted meanwhile
                            continue
                        self._seen.add(child.pid)
                        self._ranks[child.pid] = (child, rank)
                    threading.Thread(target=self._wait, args=(child, rank), daemon=True).start()
            self._stop.wait(self.poll_interval)

    def adopt(self, pid: int, rank: int) -> None:
        """Watches a rank this agent forked (:mod:`~sparkgpu.launch.node.forked_ranks`): its
        environment in ``/proc`` is the agent's, so the rank is named here, not found there."""
        if not hasattr(os, "waitid"):
            return
        try:
            child = psutil.Process(pid)
        except psutil.NoSuchProcess:  # gone already: torch's report covers it
            return
        with self._lock:
            self._seen.add(pid)
            self._ranks[pid] = (child, rank)
        threading.Thread(target=self._wait, args=(child, rank), daemon=True).start()

    def _rank_of(self, child: psutil.Process) -> int | None:
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None  # gone already, or not ours to read: torch's report covers it
        if env.get("TORCHELASTIC_RUN_ID") != self.run_id or "RANK" not in env:
            return None  # not exec'd yet (the agent's own environment), or not a rank
        return int(env["RANK"])

    def _wait(self, child: psutil.Process, rank: int) -> None:
        try:
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # torch reaped it first: its own report stands
            return
        finally:
            with self._lock:
                self._ranks.pop(child.pid, None)
        if info is None:
            return
        exited = info.si_code == os.CLD_EXITED
        record_signal = None if exited else signal.Signals(info.si_status).name
        record = RankExit(
            info.si_status if exited else -info.si_status,
            signal=record_signal,
            time=time.time(),
            oom_killed=record_signal == "SIGKILL" and self._oom_killed(),
        )
        self.exits[rank] = record
        if exited and info.si_status == 0 and not self.reported(rank):
            self.quiet.append(rank)
            self._stop_other_ranks()
        elif record.exitcode not in (0, EXIT_PREEMPTED, -signal.SIGTERM):
            threading.Timer(self.crash_kill_delay, self._kill_other_ranks).start()

    def _oom_killed(self) -> bool:
        """Whether the cgroup counted an OOM kill since the watcher started (``False`` where unreadable)."""
        if self.cgroup is None or self._oom_kills is None:
            return False
        now = oom_kills(self.cgroup)
        return now is not None and now > self._oom_kills

    def _kill_other_ranks(self) -> None:
        with self._lock:
            others = [process for process, rank in self._ranks.values() if self.checkpoints_on_sigterm(rank)]
        for process in others:
            try:
                process.kill()  # psutil checks that the pid is still this process
            except psutil.NoSuchProcess:
                continue

    def _stop_other_ranks(self) -> None:
        with self._lock:
            others = [process for process, _ in self._ranks.values()]
        for process in others:
            try:
                process.send_signal(signal.SIGTERM)  # psutil checks that the pid is still this process
            except psutil.NoSuchProcess:
                continue
