"""``spark.gpu.train(data=...)`` refuses a job before it pays for the data conversion."""

from __future__ import annotations

import threading

import pytest

from sparkgpu.errors import PolicyViolationError, SerializationError
from sparkgpu.config import reset_settings, settings

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


@pytest.fixture
def gpu_spark(spark):
    from sparkgpu.api.spark_gpu import attach

    attach()
    return spark


def count_samples(data_url):
    return data_url


def assert_nothing_converted_or_staged(volume):
    assert not volume.exists(), f"MDS output was written for a refused job: {list(volume.rglob('*'))}"
    runs = settings().staging_root
    assert not runs.exists() or not any(runs.iterdir())


def test_a_job_the_usage_policy_refuses_raises_before_any_mds_output(gpu_spark, tmp_path, monkeypatch):
    policy = tmp_path / "policy.toml"
    policy.write_text('name = "ml-platform"\nmax_gpus_per_job = 1\nrequired_tags = ["team"]\n')
    monkeypatch.setenv("SPARKGPU_USAGE_POLICY", str(policy))
    reset_settings()
    frame = gpu_spark.range(0, 1000, numPartitions=2).selectExpr("id", "cast(id as double) as y")
    volume = tmp_path / "volume"

    with pytest.raises(PolicyViolationError) as err:
        gpu_spark.gpu.train(count_samples, gpus=2, gpu_type="cpu", data=frame, data_volume=str(volume))
    assert "'ml-platform'" in str(err.value) and "at most 1 per job" in str(err.value)
    assert "required tag(s) team missing" in str(err.value)  # the job's own tags are what is checked
    assert_nothing_converted_or_staged(volume)

    # The same policy lets a compliant job through, data and all.
    result = gpu_spark.gpu.train(
        count_samples, gpus=1, gpu_type="cpu", data=frame, data_volume=str(volume), tags={"team": "ml"}
    )
    assert len(result) == 1 and result[0].startswith(str(volume))


def test_an_argument_that_cannot_travel_raises_before_any_mds_output(gpu_spark, tmp_path):
    frame = gpu_spark.range(10)
    volume = tmp_path / "volume"

    def train(lock, data_url):
        return data_url

    with pytest.raises(SerializationError):
        gpu_spark.gpu.train(
            train, gpus=1, gpu_type="cpu", args=(threading.Lock(),), data=frame, data_volume=str(volume)
        )
    assert_nothing_converted_or_staged(volume)
