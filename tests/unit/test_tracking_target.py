"""Which stores a call resolves to, and the default experiment name."""

from __future__ import annotations

import sys
import types

from sparkgpu.tracking import target as tracking_target


def test_tracking_uri_from_the_environment_wins_over_the_embedded_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    target = tracking_target.resolve_target()
    assert (target.tracking_uri, target.registry_uri, target.embedded) == (
        "http://tracking.example:5000",
        "http://tracking.example:5000",
        False,
    )
    assert target.artifact_root is None  # a server decides where artifacts go


def test_workers_resolve_the_real_store_behind_their_spool(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sparkgpu-spool:///runs/job/tracking")
    monkeypatch.setenv("SPARKGPU_MLFLOW_TRACKING_URI", "sqlite:////data/mlflow.db")
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    target = tracking_target.resolve_target()
    assert target.tracking_uri == "sqlite:////data/mlflow.db"
    assert target.artifact_root == "file:///data/artifacts"  # beside the database, not ./mlruns


def test_databricks_tracking_means_a_unity_catalog_registry(monkeypatch):
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    target = tracking_target.resolve_target(tracking_uri="databricks")
    assert target.registry_uri == "databricks-uc" and target.is_unity_catalog
    assert tracking_target.resolve_target(
        tracking_uri="http://h", registry_uri="uc:http://localhost:8080"
    ).is_unity_catalog
    assert not tracking_target.resolve_target(tracking_uri="http://h").is_unity_catalog


def test_default_experiment_name_follows_the_script_or_notebook(monkeypatch):
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__file__="/home/me/train_ctr.py"))
    assert tracking_target.default_experiment_name() == "train_ctr"
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/notebooks/CTR model.ipynb")
    assert tracking_target.default_experiment_name() == "CTR model"
    monkeypatch.delenv("JPY_SESSION_NAME")
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace())
    assert tracking_target.default_experiment_name() == "sparkgpu"
