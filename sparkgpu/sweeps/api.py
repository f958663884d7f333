"""``sparkgpu.sweep``: an Optuna study whose trials are sparkgpu jobs.

Where the study lives by default: Optuna's ``JournalStorage`` with its file backend, in the
sweep's folder under the staging root (``study.journal``). It needs no server (an RDB needs one;
MLflow's ``MlflowStorage`` keeps the study as runs of a tracking server), it is an append-only log that Optuna replays, so a driver killed mid-write loses at most its
last record, and it sits beside the trials' run dirs, so a resume finds both in one place. A
caller who wants the study elsewhere passes a study of their own (an RDB URL:
``optuna.create_study(storage="postgresql://...")``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from sparkgpu.errors import ConfigurationError, JobStateError, MissingDependencyError
from sparkgpu.sweeps.folder import SweepFolder, find_sweep, new_sweep_id, sweeps_root
from sparkgpu.sweeps.options import SweepOptions, parse_budget

__all__ = ["sweep", "resume_sweep", "DetachedSweep"]

logger = logging.getLogger(__name__)


def _optuna():
    try:
        import optuna
    except ImportError:
        raise MissingDependencyError(
            "sparkgpu.sweep needs Optuna: pip install 'sparkgpu[sweep]' (or optuna>=5)"
        ) from None
    return optuna


def _journal(folder: SweepFolder):
    _optuna()
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return JournalStorage(JournalFileBackend(str(folder.journal)))


def _decorated(train, gpus, gpu_type):
    from sparkgpu.api.decorator import DistributedFunction, distributed

    if isinstance(train, DistributedFunction):
        return train
    if not callable(train):
        raise ConfigurationError(f"sweep(train, ...): train must be a function or a @distributed one, got {train!r}")
    return distributed(gpus=gpus or 1, gpu_type=gpu_type)(train)


def sweep(
    train,
    *,
    space=None,
    n_trials: int | None = None,
    study=None,
    direction: str | None = None,
    sampler=None,
    pruner=None,
    max_concurrent: int = 1,
    gpus: int | None = None,
    gpu_type: str | None = None,
    max_failures: int | None = 3,
    budget=None,
    priority: str | None = None,
    register_best_as: str | None = None,
    experiment: str | None = None,
    args: tuple = (),
    kwargs: dict | None = None,
    resume: str | None = None,
    name: str | None = None,
    detach: bool = False,
):
    """Searches ``train``'s parameters with Optuna, each trial a sparkgpu job of ``gpus`` ranks.

    Every trial's parameters are sampled once, here, and reach every rank identically:
    ``runtime.trial()`` returns them, and those that ``train`` takes as keyword arguments are
    passed too. Its rank 0 reports values with ``runtime.report(step, value)`` (called on every
    rank); the study's pruner decides on them here, and a pruned trial's ranks all stop at the same
    step. The trial's value is rank 0's return value (a number, or ``{"value": x, ...}``), else
    its last report.

    Args:
        train: The training function, plain or ``@distributed`` (its settings are the trials').
        space: ``{name: optuna distribution}``, or a function of an Optuna trial that suggests
            the parameters (``lambda t: t.suggest_float("lr", 1e-5, 1e-2, log=True)``).
        n_trials: Trials of the sweep in all (a resume goes on to this many).
        study: An Optuna study of your own (its sampler, pruner, storage); else ``direction``.
        direction: ``"minimize"`` or ``"maximize"``, for a study in the sweep's folder.
        sampler: For that study (Optuna's default: TPE).
        pruner: For that study (Optuna's default: the median pruner).
        max_concurrent: Trials at once at most; more wait for GPUs as jobs do.
        gpus: Each trial's ranks (default: ``train``'s).
        gpu_type: Their GPU type (default: ``train``'s).
        max_failures: Failed trials tolerated; one more stops new trials (``None``: no limit).
        budget: GPU-hours of all trials (``"40 GPU-hours"``) after which no new trial starts.
        priority: The trials' job priority (``"best_effort"`` trials give way to critical jobs).
        register_best_as: Registers the best trial's model (rank 0's return value, or its
            ``"model"``) as ``catalog.schema.model``.
        experiment: MLflow experiment of the sweep's parent run and its trials' runs.
        args: Fixed positional arguments of ``train``.
        kwargs: Fixed keyword arguments of ``train``.
        resume: A sweep id: go on with that sweep (its finished trials are not run again; the
            jobs of its running ones are found again).
        name: The trials' job names start with it (``train``'s name by default).
        detach: Drive the sweep in a process of its own (the child of a keeper in a session of
            its own, which starts another should it die), so that it runs on when this process
            exits; returns at once.

    Returns:
        A :class:`~sparkgpu.sweeps.driver.SweepResult` (``study``, ``best_params``, ``best_value``);
        with ``detach=True``, a :class:`DetachedSweep` to wait for it.

    Raises:
        ConfigurationError: bad settings, raised before any trial starts.
        SweepStoppedError: more than ``max_failures`` trials failed.
    """
    optuna = _optuna()
    from sparkgpu.sweeps.driver import check_space

    if resume is not None and space is None:
        space = _saved(find_sweep(resume)).get("space")  # as the sweep was started
    check_space(space)
    budget_hours = parse_budget(budget)
    fn = _decorated(train, gpus, gpu_type)
    if resume is not None:
        return _resume(find_sweep(resume), fn, space, study, args, kwargs or {}, sampler, pruner)
    if n_trials is None:
        raise ConfigurationError("sweep(...) needs n_trials=: how many trials to run")
    if study is not None and (direction is not None or sampler is not None or pruner is not None):
        raise ConfigurationError(
            "give either study= (with its own sampler and pruner) or direction= (with sampler=, pruner=), not both"
        )
    if study is None and direction not in ("minimize", "maximize"):
        raise ConfigurationError(
            f"direction={direction!r}: give 'minimize' or 'maximize' (or study=optuna.create_study(...))"
        )
    if detach and study is not None:
        raise ConfigurationError(
            "detach=True keeps the study in the sweep's folder, where its own process finds it: drop study= "
            "and give direction= (with sampler=, pruner=)"
        )
    if study is not None and len(study.directions) != 1:
        raise ConfigurationError(
            "sparkgpu.sweep runs single-objective studies (pruning needs one value); give one direction"
        )
    sweep_id = new_sweep_id(name or fn.name)
    options = SweepOptions(
        name=name or fn.name,
        n_trials=n_trials,
        max_concurrent=max_concurrent,
        gpus=gpus,
        gpu_type=gpu_type,
        max_failures=max_failures,
        budget_gpu_hours=budget_hours,
        priority=priority,
        register_best_as=register_best_as,
        experiment=experiment,
        storage="user" if study is not None else "journal",
        study_name=study.study_name if study is not None else sweep_id,
    )
    # The trials' settings fail here, not at the first trial (with_overrides checks them as @distributed does).
    fn.with_overrides(
        **{k: v for k, v in (("gpus", gpus), ("gpu_type", gpu_type), ("priority", priority)) if v is not None}
    )
    folder = SweepFolder(sweeps_root() / sweep_id).create()
    if study is None:
        study = optuna.create_study(
            study_name=sweep_id, storage=_journal(folder), direction=direction, sampler=sampler, pruner=pruner
        )
    saved = _save_driver(folder, fn, args, kwargs or {}, space, sampler, pruner)
    record: dict[str, Any] = {"sweep_id": sweep_id, "options": options.to_json(), "created_at": time.time()}
    folder.write(record)
    if detach:
        if not saved:
            raise ConfigurationError(
                "detach=True: the function, its arguments, space, sampler or pruner do not pickle, so "
                "no other process can drive the sweep; make them importable, or drop detach"
            )
        return DetachedSweep.start(folder)
    return _drive(folder, options, study, fn, space, args, kwargs or {})


def _drive(folder: SweepFolder, options: SweepOptions, study, fn, space, args, kwargs):
    """Drives the sweep here, unless another process does (a live driver, or a keeper that restarts one)."""
    keeper = folder.keeper()
    if keeper is not None and keeper.pid != os.getppid():  # only the keeper's own child drives a kept sweep
        raise JobStateError(
            f"sweep {folder.sweep_id} is kept by its keeper (pid {keeper.pid}), which restarts its driver "
            f"should it die (see {folder.driver_log}); wait for it with "
            f"sparkgpu.sweeps.DetachedSweep({folder.sweep_id!r}).result()"
        )
    with folder.driving():
        return _drive_locked(folder, options, study, fn, space, args, kwargs)


def _drive_locked(folder: SweepFolder, options: SweepOptions, study, fn, space, args, kwargs):
    from sparkgpu._util.process import ProcessRef
    from sparkgpu.config import settings
    from sparkgpu.sweeps.driver import SweepDriver

    record = folder.read()
    sweep_run = None
    if settings().tracking:
        from sparkgpu.sweeps.tracking import SweepRun

        if record.get("parent_run_id"):
            sweep_run = SweepRun(record["parent_run_id"], record["experiment"])
        else:
            summary = {k: v for k, v in options.to_json().items() if k not in ("study_name",)}
            sweep_run = SweepRun.start(folder.sweep_id, options.experiment, summary)
            record = folder.update(parent_run_id=sweep_run.run_id, experiment=sweep_run.experiment)
    folder.update(driver=ProcessRef.current().record(), finished_at=None)
    result = SweepDriver(folder, options, study, fn, space, args, kwargs, sweep_run).run()
    if options.register_best_as is not None:
        result.model_version = _register_best(result, options.register_best_as)
    return result


def _register_best(result, name: str):
    """Registers the best trial's model: its job's rank-0 return value, or, where that is
    ``{"value": ..., "model": ...}``, its ``"model"`` (with its ``"tokenizer"`` where it has one)."""
    from sparkgpu.api.call import attach
    from sparkgpu.sweeps.driver import ATTR_JOB
    from sparkgpu.sweeps.tracking import child_run_id
    from sparkgpu.tracking.registration import register_result

    best = result.study.best_trial
    call = attach(best.user_attrs[ATTR_JOB])
    returned = call.result(timeout=0)[0]
    model = returned
    if isinstance(returned, dict) and "value" in returned:
        model = returned.get("model", returned)
        if "tokenizer" in returned:  # a transformers model registers with its tokenizer
            model = {"model": model, "tokenizer": returned["tokenizer"]}
    return register_result(model, name, call.job_id, child_run_id(call.run_dir.path))


def _save_driver(folder: SweepFolder, fn, args, kwargs, space, sampler, pruner) -> bool:
    """Keeps what another process needs to drive the sweep; False (and a warning) when it does not pickle."""
    import cloudpickle

    from sparkgpu._util.files import atomic_write_bytes

    payload = {
        "fn": fn,
        "args": tuple(args),
        "kwargs": dict(kwargs),
        "space": space,
        "sampler": sampler,
        "pruner": pruner,
    }
    try:
        body = cloudpickle.dumps(payload)
    except Exception as exc:  # noqa: BLE001 - only a resume from another process needs it
        logger.warning(
            "sweep %s: the function does not pickle (%s); resume it with sweep(..., resume=ID)", folder.sweep_id, exc
        )
        return False
    atomic_write_bytes(folder.driver_file, body, mode=0o600)
    folder.path.joinpath("sys_path.txt").write_text("\n".join(p for p in sys.path if p))
    return True


class DetachedSweep:
    """A sweep driven by a process of its own (``sweep(..., detach=True)``); any process may wait for it.

    Its keeper (``python -m sparkgpu.sweeps.keeper SWEEP_ID``, in a session of its own: no signal
    of the caller's terminal reaches it) runs the driver in a child and starts another, which
    resumes the sweep as ``sparkgpu sweep resume`` does, should that one die before the sweep
    ended. Both write to ``driver.log`` in the sweep's folder.
    """

    def __init__(self, sweep_id: str):
        self.sweep_id = find_sweep(sweep_id).sweep_id

    def __repr__(self) -> str:
        return f"<DetachedSweep {self.sweep_id} {self.state()}>"

    @classmethod
    def start(cls, folder: SweepFolder) -> "DetachedSweep":
        import subprocess
        import threading

        from sparkgpu._util.process import ProcessRef

        log = os.open(folder.driver_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "sparkgpu.sweeps.keeper", folder.sweep_id],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            os.close(log)
        folder.name_keeper(ProcessRef.of(process.pid), time.time())  # running from now on, for whoever looks
        # Nobody's child to wait for: a caller that lives on must not keep it a zombie.
        threading.Thread(target=process.wait, daemon=True, name=f"sparkgpu-sweep-{process.pid}").start()
        return cls(folder.sweep_id)

    def state(self) -> str:
        """``running``, ``finished``, ``stopped`` or ``lost`` (see ``sparkgpu sweeps``)."""
        from sparkgpu.sweeps.summary import sweep_state

        return sweep_state(find_sweep(self.sweep_id))

    def wait(self, timeout: float | None = None) -> str:
        """Waits until the sweep no longer runs (or ``timeout`` seconds passed); returns its state then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (state := self.state()) == "running" and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.5)
        return state

    def result(self, timeout: float | None = None):
        """The :class:`~sparkgpu.sweeps.driver.SweepResult` once the sweep ended.

        Raises:
            CallNotFinishedError: it still runs after ``timeout`` seconds.
            JobStateError: its driver died first, and its keeper too or gave up restarting it
                (``sparkgpu sweep resume SWEEP_ID`` goes on).
        """
        from sparkgpu.errors import CallNotFinishedError, JobStateError
        from sparkgpu.sweeps.driver import SweepResult

        state = self.wait(timeout)
        if state == "running":
            raise CallNotFinishedError(f"sweep {self.sweep_id} still runs after {timeout}s")
        folder = find_sweep(self.sweep_id)
        if state == "lost":
            raise JobStateError(
                f"the driver of sweep {self.sweep_id} died and nothing restarts it (see {folder.driver_log}); "
                f"go on with `sparkgpu sweep resume {self.sweep_id}`"
            )
        record = folder.read()
        options = SweepOptions.from_json(record["options"])
        study = _optuna().load_study(study_name=options.study_name, storage=_journal(folder))
        return SweepResult(self.sweep_id, study, record.get("stopped_because"), record.get("parent_run_id"))


def _resume(folder: SweepFolder, fn, space, study, args, kwargs, sampler, pruner):
    optuna = _optuna()
    record = folder.read()
    options = SweepOptions.from_json(record["options"])
    if study is None:
        if options.storage != "journal":
            raise ConfigurationError(
                f"sweep {folder.sweep_id} ran a study of the caller's; pass it again: sweep(..., study=study, resume=...)"
            )
        study = optuna.load_study(
            study_name=options.study_name, storage=_journal(folder), sampler=sampler, pruner=pruner
        )
    if study.trials:
        # A sampler read back (or built again) as it was when the sweep started would draw the
        # same points again: a seeded RandomSampler or TPE's start-up trials repeat the trials
        # already run. Reseeded, the resumed sweep samples new ones.
        study.sampler.reseed_rng()
    logger.info("resuming sweep %s", folder.sweep_id)
    return _drive(folder, options, study, fn, space, args, kwargs)


def _saved(folder: SweepFolder) -> dict[str, Any]:
    """What the sweep kept of its caller (function, arguments, space, sampler, pruner); ``{}`` if nothing."""
    import pickle

    if not folder.driver_file.is_file():
        return {}
    paths = folder.path.joinpath("sys_path.txt")
    if paths.is_file():  # the caller's modules unpickle from where the caller found them
        for entry in reversed(paths.read_text().splitlines()):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
    return pickle.loads(folder.driver_file.read_bytes())


def resume_sweep(sweep_id: str):
    """Goes on with sweep ``sweep_id`` from what its folder kept (its function, space, sampler, pruner).

    Raises:
        ConfigurationError: no such sweep, or it kept no function (resume it with ``sweep(..., resume=ID)``).
    """
    folder = find_sweep(sweep_id)
    payload = _saved(folder)
    if not payload:
        raise ConfigurationError(
            f"sweep {folder.sweep_id} kept no function (it did not pickle); resume it with sweep(train, ..., resume={folder.sweep_id!r})"
        )
    return sweep(
        payload["fn"],
        space=payload["space"],
        sampler=payload["sampler"],
        pruner=payload["pruner"],
        args=payload["args"],
        kwargs=payload["kwargs"],
        resume=folder.sweep_id,
    )
