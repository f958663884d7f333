"""What ``sparkgpu sweeps`` and ``sparkgpu sweep SWEEP_ID`` show: a sweep's state and its trials, read from its folder."""

from __future__ import annotations

from typing import Any

from sparkgpu.sweeps.folder import SweepFolder

__all__ = ["sweep_state", "trial_rows", "sweep_row"]


def sweep_state(folder: SweepFolder, record: dict[str, Any] | None = None) -> str:
    """``finished``, ``stopped`` (it started no more trials: budget, failures, a policy), ``running``
    (its driver process is alive, or its keeper, which restarts a driver that died) or ``lost``
    (its driver died and nothing restarts it: ``sparkgpu sweep resume ID``)."""
    from sparkgpu._util.process import ProcessRef

    record = folder.read() if record is None else record
    if record.get("finished_at"):
        return "stopped" if record.get("stopped_because") else "finished"
    driver = record.get("driver")
    if isinstance(driver, dict) and not ProcessRef.from_record(driver).is_gone():
        return "running"
    return "running" if folder.keeper() is not None else "lost"


def _study(folder: SweepFolder, record: dict[str, Any]):
    """The sweep's study when it lives in its folder (the default), else ``None``."""
    options = record.get("options") or {}
    if options.get("storage") != "journal" or not folder.journal.is_file():
        return None
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(str(folder.journal)))
    return optuna.load_study(study_name=options["study_name"], storage=storage)


def trial_rows(folder: SweepFolder) -> list[dict[str, Any]]:
    """One row per trial of the sweep: ``number``, ``state``, ``value``, ``last_step``, ``params``, ``job_id``, ``error``."""
    from sparkgpu.sweeps.driver import ATTR_ERROR, ATTR_JOB, ATTR_SWEEP

    study = _study(folder, folder.read())
    if study is None:
        return []
    rows = []
    for trial in study.get_trials(deepcopy=False):
        if trial.user_attrs.get(ATTR_SWEEP) != folder.sweep_id:
            continue
        steps = trial.intermediate_values
        rows.append(
            {
                "number": trial.number,
                "state": trial.state.name,
                "value": trial.value,
                "last_step": max(steps) if steps else None,
                "params": dict(trial.params),
                "job_id": trial.user_attrs.get(ATTR_JOB),
                "error": (trial.user_attrs.get(ATTR_ERROR) or "").strip().splitlines()[-1:] or None,
            }
        )
    return rows


def sweep_row(folder: SweepFolder) -> dict[str, Any]:
    """The sweep at a glance: ``sweep_id``, ``state``, ``trials`` (by state), ``n_trials``, ``best_value``, ``created_at``."""
    record = folder.read()
    rows = trial_rows(folder)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    values = [r["value"] for r in rows if r["state"] == "COMPLETE" and r["value"] is not None]
    direction_max = False
    study = None
    if values:
        study = _study(folder, record)
        direction_max = study is not None and study.direction.name == "MAXIMIZE"
    best = (max(values) if direction_max else min(values)) if values else None
    return {
        "sweep_id": folder.sweep_id,
        "state": sweep_state(folder, record),
        "trials": counts,
        "n_trials": (record.get("options") or {}).get("n_trials"),
        "best_value": best,
        "created_at": record.get("created_at"),
        "stopped_because": record.get("stopped_because"),
        "parent_run_id": record.get("parent_run_id"),
    }
