import datetime

import pytest

from sparkgpu.spec.catalog import GPU_CATALOG, lookup_gpu_type
from sparkgpu.errors import ConfigurationError
from sparkgpu.spec import JobSpec, Resources, RunPolicy, new_job_id
from sparkgpu.spec.units import parse_duration


@pytest.mark.parametrize(
    "value,seconds",
    [
        ("7d", 7 * 86400),
        ("90s", 90),
        ("30m", 1800),
        ("1.5h", 5400),
        (12, 12),
        (0.5, 0.5),
        (datetime.timedelta(minutes=2), 120),
        ("250ms", 0.25),
        (None, None),
    ],
)
def test_durations_in_every_form_users_write(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["7 days", "-1s", 0, "soon", True])
def test_bad_durations_name_the_accepted_forms(value):
    with pytest.raises(ConfigurationError, match="must be positive|not a duration"):
        parse_duration(value, name="max_runtime")


def test_unknown_gpu_type_lists_the_known_ones():
    with pytest.raises(ConfigurationError) as err:
        Resources(gpus=1, gpu_type="V100")
    for name in ("A10", "H100", "H200", "L4", "cpu", "A100-80GB"):
        assert repr(name) in str(err.value)


def test_gpu_type_is_case_insensitive_and_canonical():
    assert Resources(gpus=2, gpu_type="h100").gpu_type == "H100"
    assert Resources(gpus=2, gpu_type="A100").gpu_type == "A100-40GB"
    assert lookup_gpu_type("CPU").is_cpu
    assert GPU_CATALOG["H100"].memory_gb == 80 and GPU_CATALOG["H100"].max_per_node == 8


@pytest.mark.parametrize("gpus", [0, -2, 1.5, "2", True])
def test_gpus_must_be_a_positive_integer(gpus):
    with pytest.raises(ConfigurationError, match="gpus must"):
        Resources(gpus=gpus, gpu_type="cpu")


def test_remote_needs_a_gpu_type():
    with pytest.raises(ConfigurationError, match="remote=True needs a gpu_type"):
        Resources(gpus=8, remote=True)


def test_grace_must_be_shorter_than_the_cap():
    with pytest.raises(ConfigurationError, match="checkpoint_grace"):
        RunPolicy(max_runtime="30s", checkpoint_grace="60s")
    with pytest.raises(ConfigurationError, match="max_restarts"):
        RunPolicy(max_restarts=-1)


def test_job_spec_round_trips_through_json_dict():
    job = JobSpec(
        job_id=new_job_id("Train CTR!"),
        name="train",
        resources=Resources(4, "A10"),
        policy=RunPolicy(timeout="1h", max_runtime="7d", max_restarts=2),
        log_ranks=None,
        tags={"team": "ml"},
        devices=("0", "1", "2", "3"),
    )
    assert job.job_id.startswith("train-ctr-")
    again = JobSpec.from_dict(job.to_dict())
    assert again == job
    assert again.policy.max_runtime == 7 * 86400
