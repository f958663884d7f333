"""Sweeps' pure parts: settings checked before anything starts, the ranks' reports, a trial's value,
and Trainer.hyperparameter_search refused inside a job."""

from __future__ import annotations

import json

import pytest

optuna = pytest.importorskip("optuna")

import sparkgpu  # noqa: E402
from sparkgpu.errors import ConfigurationError  # noqa: E402
from sparkgpu.sweeps import reports  # noqa: E402
from sparkgpu.sweeps.driver import _objective  # noqa: E402
from sparkgpu.sweeps.folder import sweeps_root  # noqa: E402
from sparkgpu.sweeps.options import parse_budget  # noqa: E402

SPACE = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}


def train(lr: float = 0.1):
    return lr


def test_import_sparkgpu_does_not_import_optuna():
    import subprocess
    import sys

    code = "import sys, sparkgpu; sparkgpu.sweep; import sparkgpu.sweeps.reports; print('optuna' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.parametrize(
    "settings, names",
    [
        ({"space": None}, "space= is needed"),
        ({"space": {"lr": (1e-4, 1e-1)}}, "'lr' must be Optuna distributions"),
        ({"direction": "down"}, "direction='down'"),
        ({"n_trials": 0}, "n_trials=0 must be an int >= 1"),
        ({"max_concurrent": 0}, "max_concurrent=0"),
        ({"budget": "$40"}, "budget='$40' is not a sweep budget"),
        ({"max_failures": -1}, "max_failures=-1"),
        ({"study": "not used", "direction": "minimize"}, "either study="),
        ({"priority": "urgent"}, "urgent"),
        ({"register_best_as": "a.b.c.d"}, "has 4 levels"),
    ],
)
def test_bad_settings_raise_naming_the_fix_before_any_trial_or_folder(settings, names):
    kwargs = {"space": SPACE, "n_trials": 2, "direction": "minimize", "gpus": 1, "gpu_type": "cpu", **settings}
    if kwargs.get("study") == "not used":
        kwargs["study"] = optuna.create_study()
    with pytest.raises(ConfigurationError, match=names.replace("$", r"\$").replace("(", r"\(")):
        sparkgpu.sweep(train, **kwargs)
    assert not sweeps_root().exists() or not any(sweeps_root().iterdir())


def test_a_multi_objective_study_is_refused():
    study = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(ConfigurationError, match="single-objective"):
        sparkgpu.sweep(train, study=study, space=SPACE, n_trials=1)


def test_budgets_read_gpu_hours():
    assert parse_budget("40 GPU-hours") == 40.0
    assert parse_budget("0.5 gpu hours") == 0.5
    assert parse_budget("2 GPU-h") == 2.0
    assert parse_budget(3) == 3.0
    assert parse_budget(None) is None
    with pytest.raises(ConfigurationError, match="more than 0"):
        parse_budget("0 GPU-hours")


def test_a_trials_value_is_rank_zeros_number_else_its_last_report():
    import torch

    assert _objective(0.5, 9.0) == 0.5
    assert _objective({"value": 2, "model": object()}, None) == 2.0
    assert _objective(torch.tensor(1.5), None) == 1.5
    assert _objective(object(), 3.0) == 3.0
    assert _objective(float("nan"), 4.0) == 4.0
    assert _objective(True, None) is None


def test_rank_zero_writes_its_reports_whole_and_other_ranks_none(tmp_path, monkeypatch):
    path = str(tmp_path / "attempts" / "0" / "trial-reports.json")
    monkeypatch.setenv(reports.ENV_TRIAL, json.dumps({"sweep": "s", "number": 3, "params": {"lr": 0.01}}))
    assert reports.trial_params({"lr": 1.0, "wd": 0.1}) == {"lr": 0.01, "wd": 0.1}
    assert reports.trial_number() == 3
    assert reports.report(0, 1.5, path=path, is_main=True, stop_requested=lambda: False) is False
    assert reports.report(1, 1.25, path=path, is_main=True, stop_requested=lambda: True) is True
    assert reports.read_reports(path) == [(0, 1.5), (1, 1.25)]
    other = str(tmp_path / "other.json")
    reports.report(0, 1.0, path=other, is_main=False, stop_requested=lambda: False)
    assert reports.read_reports(other) == []
    for step, value in ((-1, 1.0), (1.5, 1.0), (True, 1.0), (2, "x"), (2, float("inf"))):
        with pytest.raises(ValueError, match="runtime.report"):
            reports.report(step, value, path=path, is_main=True, stop_requested=lambda: False)


def test_outside_a_sweep_trial_nothing_is_recorded_and_defaults_are_the_params(tmp_path, monkeypatch):
    monkeypatch.delenv(reports.ENV_TRIAL, raising=False)
    path = str(tmp_path / "r.json")
    assert sparkgpu.runtime.trial({"lr": 0.1}) == {"lr": 0.1}
    assert reports.trial_number() is None
    assert reports.report(0, 1.0, path=path, is_main=True, stop_requested=lambda: False) is False
    assert reports.read_reports(path) == []


def test_hyperparameter_search_inside_a_job_is_refused_pointing_to_sparkgpu_sweep():
    transformers = pytest.importorskip("transformers")
    from sparkgpu.hf.resume import patch_trainer

    class JobTrainer(transformers.Trainer):  # patched as a job's rank patches transformers' Trainer
        pass

    patch_trainer(JobTrainer)
    with pytest.raises(ConfigurationError, match=r"sparkgpu\.sweep\(train") as raised:
        JobTrainer.hyperparameter_search(object.__new__(JobTrainer), backend="optuna", n_trials=2)
    assert "every rank" in str(raised.value)
    assert transformers.Trainer.hyperparameter_search is not JobTrainer.hyperparameter_search  # only the patched class
