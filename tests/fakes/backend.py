"""A backend that plays attempts out of a script instead of starting processes.

Each scripted outcome writes what real ranks would have written into the run dir, so the
supervisor's reading of results, errors and preemptions is exercised for real.
"""

from __future__ import annotations

import dataclasses
import json

from sparkgpu.launch.backends.base import AttemptHandle, Backend, LaunchPlan, ResolvedJob
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout


@dataclasses.dataclass
class FakeAttempt(AttemptHandle):
    attempt: int
    code: int
    polls_left: int


class ScriptedBackend(Backend):
    """Attempt k plays ``script[k]``: ``"ok"``, ``"raise"``, ``"segv"``, ``"preempt"`` or ``"hang"``."""

    name = "fake"

    def __init__(self, script):
        self.script = list(script)
        self.submitted_env: list[dict] = []
        self.cancelled: list[int] = []

    def resolve(self, job):
        return ResolvedJob(job)

    def plan(self, job, run_dir, attempt, env, placement=None):
        return LaunchPlan(self.name, attempt, 1, job.world_size, (), (("fake",),), env)

    def submit(self, job, run_dir: RunDir, attempt, env, placement=None):
        self.submitted_env.append(dict(env))
        run_dir.prepare_attempt(attempt)
        action = self.script[attempt]
        code = 0
        for rank in range(job.world_size):
            run_dir.file(RunLayout.rank_log(attempt, rank)).write_text(f"attempt {attempt} rank {rank}\n")
            if action == "ok":
                run_dir.write_result(attempt, rank, {"rank": rank, "attempt": attempt})
            elif action == "raise":
                try:
                    raise ValueError(f"bad batch at attempt {attempt}")
                except ValueError as exc:
                    run_dir.write_error(attempt, rank, exc)
                code = 1
            elif action == "preempt":
                run_dir.file(RunLayout.preempted(attempt, rank)).write_text("x")
                code = 1
        if action == "segv":
            failures = {str(r): {"exitcode": -11, "signal": "SIGSEGV", "pid": 1} for r in range(job.world_size)}
            run_dir.write_control(
                run_dir.file(RunLayout.node_exits(attempt, 0)), json.dumps({"failures": failures}).encode()
            )
            code = 1
        polls = 10**9 if action == "hang" else 1
        return FakeAttempt(attempt=attempt, code=code, polls_left=polls)

    def poll(self, handle):
        handle.polls_left -= 1
        return handle.code if handle.polls_left <= 0 else None

    def cancel(self, handle, grace):
        self.cancelled.append(handle.attempt)
        handle.polls_left = 0
