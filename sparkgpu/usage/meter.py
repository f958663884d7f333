"""The metering callback: a ledger row per attempt, and the usage policy before and during a job.

```python
from sparkgpu import distributed
from sparkgpu.usage import UsageMeter, UsagePolicy

meter = UsageMeter(policy=UsagePolicy(max_gpus_per_job=8, required_tags=("team",)))

@distributed(gpus=2, gpu_type="A10", tags={"team": "ml"}, callbacks=[meter])
def train(): ...
```
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from sparkgpu.callbacks import AttemptOutcome, JobCallback
from sparkgpu.config import settings
from sparkgpu.rundir.states import AttemptStatus
from sparkgpu.spec import JobSpec
from sparkgpu.usage.journal import AttemptJournal
from sparkgpu.usage.ledger import UsageLedger, UsageRecord
from sparkgpu.usage.policy import Budget, UsagePolicy, format_duration
from sparkgpu.usage.rates import RateCard

__all__ = ["UsageMeter", "enforce_policy", "enforce_pool_policy", "journal_for"]

_logger = logging.getLogger(__name__)


def journal_for(ledger_uri: str) -> AttemptJournal:
    """The local journal of attempts in progress that belong to the ledger at ``ledger_uri``."""
    digest = hashlib.sha1(ledger_uri.encode()).hexdigest()[:12]
    return AttemptJournal(settings().home / "usage" / "open" / digest)


def write_journaled(ledger: UsageLedger, records: list[dict]) -> None:
    """Writes records recovered from the journal (each priced at the rate it was journaled with)."""
    rows = []
    for record in records:
        record = dict(record)
        rate = record.pop("rate")
        rows.append(UsageRecord.priced(**record, rates=RateCard({}, default=rate)))
    ledger.append(rows)


@dataclasses.dataclass
class _RunningJob:
    """What the meter tracks for one job while it runs (never pickled)."""

    prior_runtime: float = 0.0  # running seconds of the job's finished attempts
    attempts: int = 0
    journal_path: Path | None = None  # its journal entry, opened once its ranks run
    last_beat: float = 0.0
    budgets: list[Budget] = dataclasses.field(default_factory=list)
    spent: dict[int, float] = dataclasses.field(default_factory=dict)  # budget index -> ledger spend
    spent_read_at: float = 0.0


class UsageMeter(JobCallback):
    """Records every attempt's GPU usage in the ledger and enforces a usage policy.

    Before launch the policy refuses jobs that break it (see :func:`enforce_policy`). While
    an attempt runs, the meter adds the attempt's elapsed GPU-seconds to each matching
    budget's ledger spend (re-read every ``refresh_seconds``, so other jobs' usage counts
    too); once a budget is spent, or the job's summed running time reaches the policy's
    ``max_runtime``, the ranks are asked to checkpoint and stop. When the attempt ends, its
    row is committed to the ledger at once. Billing starts when the ranks start: time spent
    waiting for busy GPUs is not used, so it is neither billed nor journaled.

    Args:
        ledger: A :class:`UsageLedger` or its URI; ``SPARKGPU_USAGE_LEDGER`` by default.
        rates: A :class:`RateCard` or anything :meth:`RateCard.parse` takes;
            ``SPARKGPU_USAGE_RATES`` (else the built-in card) by default.
        policy: A :class:`UsagePolicy`, a policy file path or mapping; ``None`` for
            ``SPARKGPU_USAGE_POLICY``; ``False`` for no policy.
        user: Who the usage is attributed to; ``SPARKGPU_USER`` / the login name by default.
        refresh_seconds: How often a running job re-reads budget spend from the ledger.
        heartbeat_seconds: How often a running attempt's journal entry is refreshed.
    """

    reads_results = False  # after_job ends the run / the ledger row, whatever the job returned

    def __init__(
        self,
        ledger: UsageLedger | str | None = None,
        *,
        rates=None,
        policy=None,
        user: str | None = None,
        refresh_seconds: float = 60.0,
        heartbeat_seconds: float = 5.0,
    ):
        s = settings()
        if isinstance(ledger, UsageLedger):
            self.ledger = ledger
        else:
            self.ledger = UsageLedger(str(ledger) if ledger is not None else s.usage_ledger_uri)
        self.rates = RateCard.parse(rates if rates is not None else s.usage_rates)
        self.policy = None if policy is False else UsagePolicy.load(policy)
        self.user = user or s.user
        self.refresh_seconds = refresh_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self._running: dict[str, _RunningJob] = {}
        self._checked: set[str] = set()

    def __repr__(self) -> str:
        policy = self.policy.name if self.policy else None
        return f"UsageMeter(ledger={self.ledger.uri!r}, user={self.user!r}, policy={policy!r})"

    # Workers receive the meter inside the payload; they need none of its client-side state.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_running"], state["_checked"] = {}, set()
        return state

    @property
    def journal(self) -> AttemptJournal:
        return journal_for(self.ledger.uri)

    # -- before launch -------------------------------------------------------------------
    def check_launch(self, job: JobSpec) -> None:
        """Raises :class:`~sparkgpu.errors.PolicyViolationError` when ``job`` may not start."""
        if self.policy is not None:
            self.policy.check_launch(job, self.user, self.ledger)
        self._checked.add(job.job_id)

    def before_job(self, job: JobSpec, run_dir: str) -> None:
        self.recover()
        if job.job_id not in self._checked:  # launched by a path that did not call enforce_policy (a resume)
            self.check_launch(job)
            enforce_pool_policy(job)
        self._running[job.job_id] = _RunningJob(
            budgets=self.policy.budgets_for(job, self.user) if self.policy else [],
        )

    def recover(self) -> list[dict]:
        """Writes rows of attempts whose client died (or whose write failed) to the ledger.

        Returns:
            The recovered records; empty when there were none or the ledger is unreachable
            (they stay journaled for the next try, and a warning says so).
        """
        try:
            return self.journal.recover(lambda records: write_journaled(self.ledger, records))
        except Exception as exc:  # the job must not fail because old usage cannot be written now
            _warn(f"could not write recovered usage to {self.ledger.uri}: {exc}; it stays journaled")
            return []

    # -- while an attempt runs -------------------------------------------------------------
    def before_attempt(self, job: JobSpec, attempt: int) -> dict[str, str]:
        running = self._running.setdefault(job.job_id, _RunningJob())
        if running.budgets:
            self._refresh_spend(running)
        return {}

    def on_ranks_started(self, job: JobSpec, attempt: int, started_at: float) -> None:
        # Journaled from here, not from submit: time spent waiting for busy GPUs is not billed.
        running = self._running.setdefault(job.job_id, _RunningJob())
        try:
            running.journal_path = self.journal.open(job.job_id, attempt, self._record_args(job, attempt, started_at))
            running.last_beat = time.time()
        except OSError as exc:
            _warn(f"cannot journal attempt {attempt} of {job.job_id} ({exc}); usage is still written when it ends")

    def stop_reason(self, job: JobSpec, attempt: int, attempt_seconds: float) -> str | None:
        running = self._running.get(job.job_id)
        if running is None:
            return None
        now = time.time()
        if running.journal_path is not None and now - running.last_beat >= self.heartbeat_seconds:
            running.last_beat = now
            try:
                self.journal.beat(running.journal_path)
            except OSError as exc:
                _warn(f"cannot update the usage journal ({exc})")
        if self.policy is None:
            return None
        limit = self.policy.max_runtime
        if limit is not None and running.prior_runtime + attempt_seconds >= limit:
            total = running.prior_runtime + attempt_seconds
            return (
                f"job {job.job_id} reached the runtime limit of {format_duration(limit)} of {self.policy.name!r} "
                f"({total:,.0f}s over {running.attempts + 1} attempt(s))"
            )
        if not running.budgets:
            return None
        if now - running.spent_read_at >= self.refresh_seconds:
            self._refresh_spend(running)
        gpu_seconds = job.resources.gpus * attempt_seconds
        cost = self.rates.rate(job.resources.gpu_type) * gpu_seconds / 3600.0
        for index, budget in enumerate(running.budgets):
            total = running.spent.get(index, 0.0) + budget.amount(gpu_seconds, cost)
            if total >= budget.limit:
                return f"{self.policy.budget_message(budget, total)} (policy {self.policy.name!r})"
        return None

    def _refresh_spend(self, running: _RunningJob) -> None:
        now = time.time()
        try:
            rows = self.ledger.read(since=now - max(b.window for b in running.budgets))
        except Exception as exc:  # keep the last known spend rather than stop a job over a read error
            _warn(f"cannot read budget spend from {self.ledger.uri}: {exc}; using the last known spend")
            running.spent_read_at = now
            return
        running.spent = {i: b.spent(rows, now) for i, b in enumerate(running.budgets)}
        running.spent_read_at = now

    # -- after an attempt ----------------------------------------------------------------
    def after_attempt(self, job: JobSpec, outcome: AttemptOutcome) -> None:
        running = self._running.setdefault(job.job_id, _RunningJob())
        args = self._record_args(job, outcome.attempt, outcome.started_at)
        args.update(
            ended_at=outcome.ended_at,
            status=outcome.status.value,
            gpus=outcome.gpus,
            gpu_type=outcome.gpu_type or args["gpu_type"],
        )
        rate = args.pop("rate")
        record = UsageRecord.priced(**args, rates=RateCard({}, default=rate))
        running.prior_runtime += record.duration_s
        running.attempts += 1
        journal_path, running.journal_path = running.journal_path, None
        try:
            self.ledger.append([record])
        except Exception as exc:  # metering must never turn a finished job into a failed one
            try:
                if journal_path is None:
                    journal_path = self.journal.open(job.job_id, outcome.attempt, {**args, "rate": rate})
                self.journal.finish(journal_path, {**args, "rate": rate})
                kept = f"kept in {journal_path}; it is written on the next job or `sparkgpu usage`"
            except OSError as journal_exc:
                kept = f"and it could not be journaled either ({journal_exc}): this attempt's usage is lost"
            _warn(f"could not write usage of attempt {outcome.attempt} to {self.ledger.uri}: {exc}; {kept}")
            return
        if journal_path is not None:
            self.journal.close(journal_path)

    def after_job(self, job: JobSpec, results, error) -> None:
        self._running.pop(job.job_id, None)
        self._checked.discard(job.job_id)

    def _record_args(self, job: JobSpec, attempt: int, started_at: float) -> dict[str, Any]:
        gpu_type = job.resources.gpu_type or ""
        return dict(
            job_id=job.job_id,
            job_name=job.name,
            attempt=attempt,
            user=self.user,
            tags=dict(job.tags),
            backend=job.backend,
            gpu_type=gpu_type,
            gpus=job.resources.gpus,
            simulated=job.simulated,
            status=AttemptStatus.RUNNING.value,
            started_at=started_at,
            rate=self.rates.rate(gpu_type),
        )


def enforce_policy(job: JobSpec, callbacks: Sequence[JobCallback] = ()) -> None:
    """Checks ``job`` against the usage policy before anything is written or started.

    The policy of each :class:`UsageMeter` among ``callbacks`` applies; without one, the
    policy in ``SPARKGPU_USAGE_POLICY`` (if set) is checked against the default ledger, so
    passing ``callbacks=[]`` does not skip it.

    Args:
        job: The job as the backend resolved it (``gpu_type`` filled in).
        callbacks: The job's callbacks.

    Raises:
        PolicyViolationError: the job breaks the policy; the message names the policy, each
            broken rule with its numbers, and the fix.
        ConfigurationError: the policy file is missing or invalid.
    """
    meters = [c for c in callbacks if isinstance(c, UsageMeter)]
    for meter in meters:
        meter.check_launch(job)
    if not meters:
        policy = UsagePolicy.load(None)
        if policy is not None:
            s = settings()
            policy.check_launch(job, s.user, UsageLedger(s.usage_ledger_uri))


def enforce_pool_policy(job: JobSpec) -> None:
    """Checks ``job`` against the usage policy of the GPU pool it was placed on, if any.

    The pool is the one its :data:`~sparkgpu.spec.pools.POOL_TAG` names in the pools file
    (``usage_policy:`` there); jobs outside pools, and pools without a policy, pass.

    Raises:
        PolicyViolationError: the pool's policy refuses the job.
        ConfigurationError: the pools file or the policy file is missing or invalid.
    """
    from sparkgpu.spec.pools import POOL_TAG, configured_pools

    name = job.tags.get(POOL_TAG)
    if not name:
        return
    pool = next((p for p in configured_pools() or () if p.answers_to(name)), None)
    if pool is not None and pool.usage_policy:
        s = settings()
        UsagePolicy.from_file(pool.usage_policy).check_launch(job, s.user, UsageLedger(s.usage_ledger_uri))


def _warn(message: str) -> None:
    # The job goes on whatever the ledger does: what is not written now stays journaled for
    # whoever runs the ledger, not for the user of the job.
    _logger.warning("usage: %s", message)
