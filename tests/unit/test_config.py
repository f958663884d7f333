"""Settings read from the environment: the staging root as a path or as a store URL."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sparkgpu.config import Settings
from sparkgpu.errors import ConfigurationError, MissingDependencyError


def test_a_staging_root_path_stays_the_run_dir_folder_and_no_store_is_used(tmp_path):
    settings = Settings.from_env({"SPARKGPU_HOME": str(tmp_path), "SPARKGPU_STAGING_ROOT": "/mnt/shared/runs"})
    assert settings.staging_root == Path("/mnt/shared/runs") and settings.staging_url is None

    default = Settings.from_env({"SPARKGPU_HOME": str(tmp_path)})
    assert default.staging_root == tmp_path / "runs" and default.staging_url is None


def test_a_staging_root_url_is_the_store_and_run_dirs_stay_local(tmp_path):
    settings = Settings.from_env({"SPARKGPU_HOME": str(tmp_path), "SPARKGPU_STAGING_ROOT": f"file://{tmp_path}/store/"})

    assert settings.staging_url == f"file://{tmp_path}/store"
    assert settings.staging_root == tmp_path / "runs"
    # Executors share no folder with the client: shipped environments and conversions go to
    # the store too, unless set otherwise.
    assert settings.env_store == f"file://{tmp_path}/store/_envstore"
    assert settings.data_volume == f"file://{tmp_path}/store/_mds"
    chosen = Settings.from_env(
        {
            "SPARKGPU_HOME": str(tmp_path),
            "SPARKGPU_STAGING_ROOT": f"file://{tmp_path}/store",
            "SPARKGPU_ENV_STORE": "s3://envs",
            "SPARKGPU_DATA_VOLUME": "/mnt/mds",
        }
    )
    assert (chosen.env_store, chosen.data_volume) == ("s3://envs", "/mnt/mds")


def test_an_s3_staging_root_is_never_a_relative_folder_and_names_its_pip_install(tmp_path):
    pytest.importorskip("fsspec")
    try:
        import s3fs  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match=r"SPARKGPU_STAGING_ROOT=s3://bucket/runs.*`pip install s3fs`"):
            Settings.from_env({"SPARKGPU_HOME": str(tmp_path), "SPARKGPU_STAGING_ROOT": "s3://bucket/runs"})
    else:  # an environment with s3fs: the URL is the store, never the folder "s3:/bucket/runs"
        settings = Settings.from_env({"SPARKGPU_HOME": str(tmp_path), "SPARKGPU_STAGING_ROOT": "s3://bucket/runs"})
        assert settings.staging_url == "s3://bucket/runs" and settings.staging_root == tmp_path / "runs"


@pytest.mark.parametrize("url, package", [("gs://b/runs", "gcsfs"), ("abfs://c/runs", "adlfs")])
def test_a_store_whose_filesystem_is_not_installed_names_the_exact_pip_command(tmp_path, url, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(MissingDependencyError) as err:
        Settings.from_env({"SPARKGPU_HOME": str(tmp_path), "SPARKGPU_STAGING_ROOT": url})
    assert err.value.install == f"pip install {package}"


def test_an_unknown_scheme_is_refused_naming_urls_that_work(tmp_path):
    with pytest.raises(ConfigurationError, match=r"no filesystem for nosuch://.*s3://bucket/path"):
        Settings.from_env({"SPARKGPU_HOME": str(tmp_path), "SPARKGPU_STAGING_ROOT": "nosuch://b/runs"})


def test_the_spark_heartbeat_timeouts_are_settings_a_backend_takes_unless_given(tmp_path, monkeypatch):
    from sparkgpu.config import reset_settings
    from sparkgpu.launch.backends.spark.backend import SparkBackend

    default = Settings.from_env({"SPARKGPU_HOME": str(tmp_path)})
    assert (default.spark_client_timeout, default.spark_node_timeout) == (120.0, 10.0)
    assert default.spark_control_interval == 20.0  # one store request per look of node 0: 180 an hour
    never = Settings.from_env({"SPARKGPU_HOME": str(tmp_path), "SPARKGPU_SPARK_CLIENT_TIMEOUT": "none"})
    assert never.spark_client_timeout is None
    for name, raw, message in (
        ("SPARKGPU_SPARK_CLIENT_TIMEOUT", "2", "must be at least 6 seconds, or none"),
        ("SPARKGPU_SPARK_NODE_TIMEOUT", "-3", "must be at least 3 seconds, e.g."),
        ("SPARKGPU_SPARK_NODE_TIMEOUT", "none", "is not a number"),
        ("SPARKGPU_SPARK_CONTROL_INTERVAL", "0", "must be at least 0.5 seconds, e.g."),
    ):
        with pytest.raises(ConfigurationError, match=f"{name}='{raw}' {message}"):
            Settings.from_env({"SPARKGPU_HOME": str(tmp_path), name: raw})

    monkeypatch.setenv("SPARKGPU_SPARK_CLIENT_TIMEOUT", "30")
    monkeypatch.setenv("SPARKGPU_SPARK_NODE_TIMEOUT", "25")
    monkeypatch.setenv("SPARKGPU_SPARK_CONTROL_INTERVAL", "5")
    reset_settings()
    backend = SparkBackend(spark=object(), staging_url="")
    assert (backend.client_timeout, backend.node_timeout, backend.control_interval) == (30.0, 25.0, 5.0)
    given = SparkBackend(spark=object(), staging_url="", client_timeout=None, node_timeout=4.0)
    assert (given.client_timeout, given.node_timeout) == (None, 4.0)  # None: the nodes never stop on it


@pytest.mark.parametrize("raw, seconds", [("600", 600.0), ("2h", 7200.0), ("90s", 90.0), ("1.5m", 90.0)])
def test_duration_variables_take_what_duration_arguments_take(tmp_path, raw, seconds):
    settings = Settings.from_env(
        {
            "SPARKGPU_HOME": str(tmp_path),
            "SPARKGPU_TIMEOUT": raw,
            "SPARKGPU_SPARK_WAIT_TIMEOUT": raw,
            "SPARKGPU_POOL_IDLE_TIMEOUT": raw,
        }
    )
    assert settings.default_timeout == settings.spark_wait_timeout == settings.warm_idle_timeout == seconds


def test_a_duration_variable_that_is_none_names_both_forms(tmp_path):
    with pytest.raises(
        ConfigurationError, match=r"SPARKGPU_TIMEOUT='soon' is not a number of seconds or a duration.*=10m"
    ):
        Settings.from_env({"SPARKGPU_HOME": str(tmp_path), "SPARKGPU_TIMEOUT": "soon"})


def test_keep_runs_ages_are_parsed_as_durations(tmp_path):
    settings = Settings.from_env({"SPARKGPU_HOME": str(tmp_path), "SPARKGPU_KEEP_RUNS": "50,1.5d"})
    assert (settings.keep_runs, settings.keep_runs_days) == (50, 1.5)
