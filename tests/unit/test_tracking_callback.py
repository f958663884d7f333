"""MLflowCallback's configuration, its pickling for the workers, and the environment lock."""

from __future__ import annotations

import importlib.metadata
import pickle
import re
import threading

import cloudpickle
import pytest

from sparkgpu.errors import ConfigurationError
from sparkgpu.tracking.mlflow_run import MLflowCallback, _dataset_input, _function_source, _job_params, environment_lock


def a_training_function(lr):
    return lr * 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"system_metrics_interval": 0}, "system_metrics_interval"),
        ({"flush_interval": -1}, "flush_interval"),
        ({"lr_every_n_steps": 0}, "lr_every_n_steps"),
        ({"experiment": "  "}, "experiment"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        MLflowCallback(**kwargs)


def test_callback_pickles_for_the_workers_without_clients_or_threads():
    callback = MLflowCallback(experiment="/team/ctr", fn=a_training_function, tags={"team": "ads"})
    callback._client = threading.Lock()  # stands for the client-side MLflow client: not picklable
    callback._flusher = threading.Thread(target=lambda: None)
    copy = pickle.loads(cloudpickle.dumps(callback))
    assert copy.experiment == "/team/ctr" and copy.tags == {"team": "ads"}
    assert copy._client is None and copy._flusher is None and copy.run_id is None
    assert "return lr * 2" in copy.fn_source


def test_function_source_and_name():
    name, source = _function_source(a_training_function)
    assert name.endswith("test_tracking_callback.a_training_function")
    assert source.startswith("def a_training_function(lr):")
    assert _function_source(len) == ("builtins.len", None)  # no Python source: name only


def test_job_spec_becomes_flat_params():
    spec = {
        "job_id": "j",
        "name": "train",
        "backend": "local",
        "simulated": False,
        "resources": {"gpus": 8, "gpu_type": "H100", "remote": True},
        "policy": {"max_runtime": 604800.0, "max_restarts": 3, "timeout": None},
    }
    assert _job_params(spec) == {
        "gpus": "8",
        "gpu_type": "H100",
        "remote": "True",
        "policy.max_runtime": "604800.0",
        "policy.max_restarts": "3",
        "backend": "local",
        "simulated": "False",
    }


def test_environment_lock_lists_installed_distributions_pip_freeze_style():
    lock = environment_lock()
    lines = lock.splitlines()
    assert lines[0].startswith("# python 3.")
    assert f"torch=={importlib.metadata.version('torch')}" in lines
    assert f"mlflow=={importlib.metadata.version('mlflow')}" in lines
    names = [
        re.sub(r"[-_.]+", "-", line.split("==")[0].split(" @ ")[0]).lower()
        for line in lines[1:]
        if not line.startswith("-e ")
    ]
    assert names == sorted(names) and len(names) == len(set(names))


def test_environment_lock_is_kept_until_a_distribution_is_installed(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    before = environment_lock()
    assert environment_lock() is before  # nothing installed meanwhile: not read again
    info = tmp_path / "freshly_installed-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: freshly-installed\nVersion: 1.2.3\n")
    after = environment_lock()
    assert "freshly-installed==1.2.3" in after.splitlines() and "freshly-installed" not in before


def test_the_system_metrics_interval_is_a_setting_of_the_default_run(monkeypatch):
    from sparkgpu.config import reset_settings
    from sparkgpu.api.decorator import default_callbacks
    from sparkgpu.tracking.mlflow_run import MLflowCallback

    monkeypatch.setenv("SPARKGPU_TRACKING", "1")
    monkeypatch.setenv("SPARKGPU_SYSTEM_METRICS_INTERVAL", "2.5")
    reset_settings()
    (tracking,) = [c for c in default_callbacks() if isinstance(c, MLflowCallback)]
    assert tracking.system_metrics_interval == 2.5
    monkeypatch.setenv("SPARKGPU_SYSTEM_METRICS_INTERVAL", "often")
    reset_settings()
    with pytest.raises(ConfigurationError, match="SPARKGPU_SYSTEM_METRICS_INTERVAL='often' is not a number"):
        default_callbacks()


@pytest.mark.parametrize(
    "source, version, kind",
    [
        ("main.ml.clicks", None, "spark"),  # a catalog table's name
        ("s3://bucket/clicks", None, "spark"),
        ("s3://bucket/clicks", 3, "delta_table"),
    ],
)
def test_the_data_source_becomes_an_mlflow_dataset_input(source, version, kind):
    dataset = _dataset_input(source, version).dataset
    assert dataset.source_type == kind and dataset.name == source.rsplit("/", 1)[-1]
