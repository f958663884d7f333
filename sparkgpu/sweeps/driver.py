"""The sweep's loop: ask Optuna for a trial, run it as a job, feed its reports back, tell the outcome.

One process drives a sweep (:class:`SweepDriver`); every trial is a sparkgpu job of its own,
submitted detached (it outlives the driver) with an idempotency key of the sweep and the trial's
number. So a driver that died and is resumed finds each unfinished trial's job again, running
or ended, instead of running it twice; a job whose own supervisor died too is taken over and
goes on from its checkpoint (``attach``).

At every poll the driver, for each running trial:

1. reads the values its rank 0 reported (``attempts/<k>/trial-reports.json``) and gives the new
   ones to Optuna (``trial.report``); once the pruner says so (``trial.should_prune``) it asks
   the job to stop (:func:`~sparkgpu.sweeps.trial_job.ask_to_stop`), once;
2. once the job ended, tells Optuna: ``COMPLETE`` with rank 0's returned value (or the last
   reported one), ``PRUNED`` when it asked the job to stop, ``FAIL`` with the error otherwise.

Then it starts trials while fewer than ``max_concurrent`` run, the sweep has fewer than
``n_trials``, and neither ``max_failures`` nor the budget (GPU-hours of its trials, from their
jobs' attempts) nor a usage policy refusing a trial stopped sampling. Trials beyond the GPUs
that are free wait in the host's (or the cluster's) queue, as any job does.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import numbers
import time
import traceback
from typing import Any

from sparkgpu.errors import ConfigurationError, PolicyViolationError, SparkGPUError
from sparkgpu.rundir.states import JobStatus
from sparkgpu.sweeps.folder import SweepFolder
from sparkgpu.sweeps.options import SweepOptions
from sparkgpu.sweeps.trial_job import TrialCallback, ask_to_stop, trial_reports

__all__ = ["SweepDriver", "SweepResult", "SweepStoppedError", "ATTR_SWEEP", "ATTR_JOB", "ATTR_ERROR"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at the running trials.
POLL_SECONDS = 0.2
#: The trials' user attributes in the study.
ATTR_SWEEP, ATTR_JOB, ATTR_ERROR = "sparkgpu.sweep", "sparkgpu.job_id", "sparkgpu.error"
_ERROR_CHARS = 4000


class SweepStoppedError(SparkGPUError):
    """The sweep stopped starting trials because ``max_failures`` trials failed."""


@dataclasses.dataclass
class SweepResult:
    """How a sweep ended.

    Attributes:
        sweep_id: Its id (``sparkgpu sweep SWEEP_ID``, ``sweep(..., resume=SWEEP_ID)``).
        study: The Optuna study (its trials, ``best_trial``, ...).
        stopped_because: Why it started no more trials before ``n_trials``, else ``None``.
        parent_run_id: Its MLflow parent run, when tracked.
        model_version: The best trial's registered model (``register_best_as``), else ``None``.
    """

    sweep_id: str
    study: Any
    stopped_because: str | None = None
    parent_run_id: str | None = None
    model_version: Any = None

    @property
    def best_params(self) -> dict[str, Any]:
        return self.study.best_trial.params

    @property
    def best_value(self) -> float:
        return self.study.best_trial.value


@dataclasses.dataclass
class _Running:
    """A trial whose job runs (or waits for GPUs)."""

    trial: Any  # optuna.trial.Trial
    call: Any  # DistributedFunctionCall
    params: dict[str, Any]
    reported: set[int] = dataclasses.field(default_factory=set)
    last_value: float | None = None
    prune_asked: bool = False


def _number(value) -> float | None:
    """A finite float from a returned or reported value, else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        number = float(value)
    elif hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:  # a one-element tensor
        number = float(value.item())
    else:
        return None
    return number if math.isfinite(number) else None


def _objective(result, last_reported: float | None) -> float | None:
    """A trial's value: rank 0's returned number (or ``{"value": x, ...}``), else its last report."""
    if isinstance(result, dict) and "value" in result:
        result = result["value"]
    value = _number(result)
    return value if value is not None else last_reported


class SweepDriver:
    """Drives one sweep to its end (see the module docstring).

    Args:
        folder: The sweep's folder (``sweep.json`` written).
        options: Its settings.
        study: Its Optuna study.
        train: The trial function, decorated (a :class:`~sparkgpu.api.decorator.DistributedFunction`).
        space: ``{name: optuna distribution}`` (``study.ask(fixed_distributions=...)``) or a
            function of an Optuna trial that suggests the parameters (on the sweep's side).
        args: The function's fixed positional arguments.
        kwargs: Its fixed keyword arguments; the trial's parameters are added to them where the
            function takes them.
        sweep_run: The MLflow parent run, or ``None`` untracked.
    """

    def __init__(self, folder: SweepFolder, options: SweepOptions, study, train, space, args, kwargs, sweep_run):
        import optuna

        self._optuna = optuna
        self.folder = folder
        self.options = options
        self.study = study
        self.train = train
        self.space = space
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self.sweep_run = sweep_run
        self.running: dict[int, _Running] = {}
        self.stopped_because: str | None = None
        self._accepted = _accepted_names(train.fn)

    # -- the study's view of this sweep ------------------------------------------------------
    @property
    def sweep_id(self) -> str:
        return self.folder.sweep_id

    def _own_trials(self, states=None) -> list:
        return [
            t
            for t in self.study.get_trials(deepcopy=False, states=states)
            if t.user_attrs.get(ATTR_SWEEP) == self.sweep_id
        ]

    def _failures(self) -> int:
        return len(self._own_trials((self._optuna.trial.TrialState.FAIL,)))

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> SweepResult:
        """Runs the sweep until ``n_trials`` trials ended or sampling stopped and the running ones ended.

        Raises:
            SweepStoppedError: more than ``max_failures`` trials failed (after the running ones ended).
        """
        self._resume_running()
        try:
            while True:
                for number in list(self.running):
                    self._poll(self.running[number])
                if self._may_start():
                    self._start_trial()
                    continue
                if not self.running:
                    break
                time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            logger.warning(
                "sweep %s interrupted; its running trials' jobs run on (`sparkgpu jobs`): go on with "
                "`sparkgpu sweep resume %s`, or stop them with `sparkgpu cancel JOB_ID`",
                self.sweep_id,
                self.sweep_id,
            )
            raise
        self._record_best()
        if self.sweep_run is not None:
            self.sweep_run.end("FINISHED" if self.stopped_because is None else "FAILED")
        result = SweepResult(self.sweep_id, self.study, self.stopped_because, getattr(self.sweep_run, "run_id", None))
        self.folder.update(finished_at=time.time(), stopped_because=self.stopped_because)
        if self.stopped_because is not None and self.stopped_because.startswith("max_failures"):
            raise SweepStoppedError(f"sweep {self.sweep_id}: {self.stopped_because}")
        return result

    def _may_start(self) -> bool:
        if self.stopped_because is not None or len(self.running) >= self.options.max_concurrent:
            return False
        if len(self._own_trials()) >= self.options.n_trials:
            return False
        failures, limit = self._failures(), self.options.max_failures
        if limit is not None and failures > limit:
            self._stop(
                f"max_failures={limit} exceeded: {failures} trials failed (see `sparkgpu sweep {self.sweep_id}`)"
            )
            return False
        budget = self.options.budget_gpu_hours
        if budget is not None:
            spent = self._gpu_hours()
            if spent >= budget:
                self._stop(f"its budget of {budget:g} GPU-hours is spent ({spent:.4g} GPU-hours)")
                return False
        return True

    def _stop(self, why: str) -> None:
        self.stopped_because = why
        logger.warning("sweep %s starts no more trials: %s; the running ones finish", self.sweep_id, why)

    def _gpu_hours(self) -> float:
        """GPU-hours the sweep's trials used: their jobs' attempts, from when their ranks started."""
        from sparkgpu.config import settings
        from sparkgpu.launch.client.job_state import JobBook
        from sparkgpu.rundir.layout import RunLayout

        now, seconds = time.time(), 0.0
        for frozen in self._own_trials():
            job_id = frozen.user_attrs.get(ATTR_JOB)
            if not job_id:
                continue
            try:
                book = JobBook.read(settings().staging_root / job_id / RunLayout.STATE)
            except ValueError:
                continue
            if book is None:
                continue
            for attempt in book.state.get("attempts") or []:
                started = attempt.get("started_at")
                if started is not None:
                    end = attempt.get("ended_at") or now
                    seconds += max(0.0, end - started) * attempt.get("gpus", self._gpus())
        return seconds / 3600.0

    def _gpus(self) -> int:
        return self.options.gpus or self.train.resources.gpus

    # -- one trial -----------------------------------------------------------------------------
    def _start_trial(self) -> None:
        trial = self.study.ask(fixed_distributions=self.space) if isinstance(self.space, dict) else self.study.ask()
        if callable(self.space):
            self.space(trial)
        trial.set_user_attr(ATTR_SWEEP, self.sweep_id)
        self._submit(trial, dict(trial.params))

    def _submit(self, trial, params: dict[str, Any]) -> None:
        number = trial.number
        try:
            call = self._trial_function(number, params).submit(*self.args, **self._arguments(params))
        except PolicyViolationError as exc:  # a usage policy refuses the trial: it would refuse the next too
            self._tell_failed(trial, None, f"{type(exc).__name__}: {exc}")
            self._stop(f"a usage policy refused trial {number}: {exc}")
            return
        except Exception as exc:  # the trial cannot be submitted (its arguments do not pickle, ...): nor could the next
            self._tell_failed(trial, None, f"{type(exc).__name__}: {exc}")
            raise
        trial.set_user_attr(ATTR_JOB, call.job_id)
        logger.info("sweep %s: trial %d runs as job %s with %s", self.sweep_id, number, call.job_id, params)
        self.running[number] = _Running(trial, call, params)

    def _trial_function(self, number: int, params: dict[str, Any]):
        from sparkgpu.api.decorator import default_callbacks

        base = self.train
        callbacks = (
            list(base.callbacks) if base.callbacks is not None else default_callbacks(base.fn, self._experiment())
        )
        tags = {**base.tags, "sparkgpu.sweep": self.sweep_id, "sparkgpu.sweep.trial": str(number)}
        if self.sweep_run is not None:
            tags["mlflow.parentRunId"] = self.sweep_run.run_id
        overrides: dict[str, Any] = {}
        if self.options.gpus is not None:
            overrides["gpus"] = self.options.gpus
        if self.options.gpu_type is not None:
            overrides["gpu_type"] = self.options.gpu_type
        if self.options.priority is not None:
            overrides["priority"] = self.options.priority
        if base.backend is None and not base.resources.remote and not base.ship_environment:
            # A local trial's ranks fork from the warm pool, torch imported: the sweep's trials
            # start in well under a second each, where a fresh agent imports torch for every one.
            overrides["backend"] = "warm_pool"
        return base.with_overrides(
            name=f"{self.options.name}-t{number}",
            tags=tags,
            callbacks=[*callbacks, TrialCallback(self.sweep_id, number, params)],
            experiment=self._experiment(),
            detach=True,
            run_async=False,
            register_as=None,
            idempotency_key=f"sparkgpu-sweep:{self.sweep_id}:trial:{number}",
            **overrides,
        )

    def _experiment(self) -> str | None:
        return self.sweep_run.experiment if self.sweep_run is not None else self.options.experiment

    def _arguments(self, params: dict[str, Any]) -> dict[str, Any]:
        accepted = {k: v for k, v in params.items() if self._accepted is None or k in self._accepted}
        return {**self.kwargs, **accepted}

    def _poll(self, running: _Running) -> None:
        trial, call = running.trial, running.call
        for step, value in trial_reports(call.run_dir.path):
            if step in running.reported:
                continue
            running.reported.add(step)
            running.last_value = value
            trial.report(value, step)
            if not running.prune_asked and trial.should_prune():
                running.prune_asked = True
                ask_to_stop(call.run_dir, f"pruned by sweep {self.sweep_id} at step {step} (value {value:g})")
                logger.info("sweep %s: trial %d pruned at step %d (value %g)", self.sweep_id, trial.number, step, value)
        if call.done():
            self._finish(running)

    def _finish(self, running: _Running) -> None:
        trial, call = running.trial, running.call
        del self.running[trial.number]
        status = call.status()
        results, error = None, None
        try:
            results = call.result(timeout=0)
        except Exception as exc:  # noqa: BLE001 - a trial's failure is recorded, the sweep goes on
            error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        TrialState = self._optuna.trial.TrialState
        if running.prune_asked:
            self.study.tell(trial, state=TrialState.PRUNED)
            state, value = "PRUNED", running.last_value
        elif status is JobStatus.SUCCEEDED and results is not None:
            value = _objective(results[0], running.last_value)
            if value is None:
                self._tell_failed(
                    trial,
                    running,
                    f"trial {trial.number} returned {type(results[0]).__name__} from rank 0 and reported no value; "
                    "return the value to optimize (a number, or {'value': x, ...}) or call runtime.report(step, value)",
                )
                return
            self.study.tell(trial, value)
            state = "COMPLETE"
        else:
            self._tell_failed(trial, running, error or f"its job {call.job_id} ended {status.value}")
            return
        logger.info("sweep %s: trial %d %s (value %s)", self.sweep_id, trial.number, state, value)
        self._track(running, state, value)
        self._record_best()

    def _tell_failed(self, trial, running: _Running | None, error: str) -> None:
        trial.set_user_attr(ATTR_ERROR, error[-_ERROR_CHARS:])
        self.study.tell(trial, state=self._optuna.trial.TrialState.FAIL)
        logger.warning("sweep %s: trial %d failed: %s", self.sweep_id, trial.number, error.strip().splitlines()[-1:])
        if running is not None:
            self._track(running, "FAIL", None)

    def _track(self, running: _Running, state: str, value: float | None) -> None:
        if self.sweep_run is None:
            return
        try:
            reports = trial_reports(running.call.run_dir.path)
            self.sweep_run.record_trial(
                running.call.run_dir.path, running.trial.number, running.params, reports, state, value
            )
        except Exception:  # noqa: BLE001 - tracking must not cost the sweep; the study has it all
            logger.exception("sweep %s: recording trial %d in MLflow failed", self.sweep_id, running.trial.number)

    def _record_best(self) -> None:
        if self.sweep_run is None:
            return
        complete = self._own_trials((self._optuna.trial.TrialState.COMPLETE,))
        if not complete:
            return
        best = self.study.best_trial
        counts: dict[str, int] = {}
        for frozen in self._own_trials():
            counts[frozen.state.name] = counts.get(frozen.state.name, 0) + 1
        try:
            self.sweep_run.record_best(best.params, best.value, best.number, counts)
        except Exception:  # noqa: BLE001 - as in _track
            logger.exception("sweep %s: recording the best trial in MLflow failed", self.sweep_id)

    # -- resume ----------------------------------------------------------------------------------
    def _resume_running(self) -> None:
        """Finds again the jobs of the trials a dead driver left running (the same idempotency key
        returns the job, running or ended); none of them runs twice."""
        for frozen in self._own_trials((self._optuna.trial.TrialState.RUNNING,)):
            trial = self._optuna.trial.Trial(self.study, frozen._trial_id)
            self._submit(trial, dict(frozen.params))
            running = self.running.get(frozen.number)
            if running is not None:
                # Steps Optuna has already: reported again they would only warn.
                running.reported.update(frozen.intermediate_values)
                if frozen.intermediate_values:
                    running.last_value = frozen.intermediate_values[max(frozen.intermediate_values)]
                from sparkgpu.sweeps.trial_job import stop_asked

                running.prune_asked = stop_asked(running.call.run_dir) is not None
            logger.info("sweep %s: trial %d resumed (job found again)", self.sweep_id, frozen.number)


def _accepted_names(fn) -> set[str] | None:
    """The keyword arguments ``fn`` takes; ``None`` when it takes any (``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def check_space(space) -> None:
    """Raises ConfigurationError unless ``space`` is ``{name: distribution}`` or a function of a trial."""
    import optuna

    if callable(space):
        return
    if isinstance(space, dict) and space:
        bad = [k for k, v in space.items() if not isinstance(v, optuna.distributions.BaseDistribution)]
        if not bad:
            return
        raise ConfigurationError(
            f"space={{...}}: {', '.join(map(repr, bad))} must be Optuna distributions, e.g. "
            "optuna.distributions.FloatDistribution(1e-5, 1e-2, log=True)"
        )
    raise ConfigurationError(
        "space= is needed: {name: optuna distribution} (e.g. {'lr': optuna.distributions.FloatDistribution(1e-5, 1e-2, "
        "log=True)}) or a function of an Optuna trial that suggests them (lambda t: t.suggest_float('lr', 1e-5, 1e-2))"
    )
