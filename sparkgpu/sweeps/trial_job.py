"""The job of one sweep trial: its parameters reach every rank, and the sweep can stop it.

:class:`TrialCallback` rides on the trial's job like the tracking and metering callbacks (it
pickles into the run dir, so a detached supervisor has it too). It puts the trial into every
attempt's environment, and it is how a prune reaches the ranks: the sweep writes the sealed
``sweep-stop`` request into the trial's run dir (:func:`ask_to_stop`), the callback's
:meth:`~TrialCallback.stop_reason` returns it to the supervisor, which asks the ranks to stop
exactly as a spent budget does (the attempt's sealed stop file: ``runtime.should_checkpoint()``
turns True on every rank, and ``runtime.report`` agrees on it across the ranks). Ranks that
return then end the job ``SUCCEEDED``; ranks that stop for a restart end it ``STOPPED``; ranks
that ignore it are stopped after ``checkpoint_grace``. No new channel and no new stop reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparkgpu.callbacks import JobCallback
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.sweeps.reports import ENV_TRIAL, Report, read_attempt_reports

__all__ = ["TrialCallback", "ask_to_stop", "stop_asked", "trial_reports"]


class TrialCallback(JobCallback):
    """Hands a sweep trial's parameters to every rank and relays the sweep's stop request.

    Args:
        sweep_id: The sweep.
        number: The trial's number in its study.
        params: Its parameters (JSON values).
    """

    def __init__(self, sweep_id: str, number: int, params: dict[str, Any]):
        self.sweep_id = sweep_id
        self.number = number
        self.params = dict(params)
        self._run_dir: RunDir | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_run_dir"] = None  # holds the job key once read: never pickled
        return state

    def before_job(self, job, run_dir: str) -> None:
        self._run_dir = RunDir(run_dir)

    def before_attempt(self, job, attempt: int) -> dict[str, str]:
        return {ENV_TRIAL: json.dumps({"sweep": self.sweep_id, "number": self.number, "params": self.params})}

    def stop_reason(self, job, attempt: int, attempt_seconds: float) -> str | None:
        return stop_asked(self._run_dir) if self._run_dir is not None else None


def ask_to_stop(run_dir: RunDir, reason: str) -> None:
    """Asks the trial job in ``run_dir`` to stop its ranks, for ``reason`` (sealed under the job key)."""
    run_dir.write_control(run_dir.file(RunLayout.SWEEP_STOP), reason.encode())


def stop_asked(run_dir: RunDir) -> str | None:
    """The reason a sweep asked the trial job in ``run_dir`` to stop, or ``None``."""
    body = run_dir.read_control(run_dir.file(RunLayout.SWEEP_STOP))
    return body.decode(errors="replace") if body is not None else None


def trial_reports(run_dir: Path) -> list[Report]:
    """Every report of the trial job in ``run_dir``, over all its attempts; a later attempt's value of a step wins."""
    by_step: dict[int, float] = {}
    attempts = run_dir / RunLayout.ATTEMPTS
    numbers = sorted(int(p.name) for p in attempts.iterdir() if p.name.isdigit()) if attempts.is_dir() else []
    for attempt in numbers:
        for step, value in read_attempt_reports(run_dir, attempt):
            by_step[step] = value
    return sorted(by_step.items())
