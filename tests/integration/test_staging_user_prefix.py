"""Each user's jobs live under their own prefix of a shared S3 staging root, so a bucket policy can
keep the prefixes apart; a job keeps its prefix for good (resume), and jobs staged before
prefixes existed are still found. Against the S3 server on loopback."""

import fsspec
import pytest

from sparkgpu.config import reset_settings
from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.backends.spark.backend import SparkBackend
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.launch.staging.mirror import user_prefix
from sparkgpu.spec import JobSpec, Resources
from tests.fakes.spark_session import TaggedSession

pytestmark = pytest.mark.integration


def staged_job(tmp_path, job_id: str) -> RunDir:
    job = JobSpec(job_id=job_id, name="train", resources=Resources(2, "cpu"), backend="spark")
    rd = RunDir(tmp_path / "runs" / job_id)
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), b"k" * 32, [])
    return rd


def stage_as(user: str, rd: RunDir, url: str, monkeypatch) -> SparkBackend:
    monkeypatch.setenv("SPARKGPU_USER", user)
    reset_settings()
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None, staging_url=url)
    backend._mirror(rd)  # what the first attempt does: the payload goes up
    return backend


def test_two_users_jobs_land_under_their_own_prefixes(s3_bucket, tmp_path, monkeypatch):
    url = f"{s3_bucket}/runs"
    fs = fsspec.filesystem("s3")
    ana_job, bob_job = staged_job(tmp_path / "ana", "job-a"), staged_job(tmp_path / "bob", "job-b")
    ana = stage_as("ana", ana_job, url, monkeypatch)
    bob = stage_as("bob", bob_job, url, monkeypatch)

    bucket = s3_bucket.removeprefix("s3://")
    assert fs.ls(f"{bucket}/runs") == [f"{bucket}/runs/ana", f"{bucket}/runs/bob"]  # nothing at the root
    assert fs.ls(f"{bucket}/runs/ana") == [f"{bucket}/runs/ana/job-a"]
    assert fs.ls(f"{bucket}/runs/bob") == [f"{bucket}/runs/bob/job-b"]
    assert fs.exists(f"{bucket}/runs/ana/job-a/payload.sig")
    assert ana.checkpoint_dir(ana_job) == f"{url}/ana/job-a/checkpoints"
    assert bob.checkpoint_dir(bob_job) == f"{url}/bob/job-b/checkpoints"

    # Resumed under another SPARKGPU_USER, a job still reads and writes where it started.
    monkeypatch.setenv("SPARKGPU_USER", "ana.lastname")
    reset_settings()
    again = SparkBackend(spark=TaggedSession(), client_timeout=None, staging_url=url)
    assert again.checkpoint_dir(ana_job) == f"{url}/ana/job-a/checkpoints"


def test_a_job_staged_before_user_prefixes_is_still_found(s3_bucket, tmp_path, monkeypatch):
    url = f"{s3_bucket}/runs"
    fs = fsspec.filesystem("s3")
    old = staged_job(tmp_path, "job-old")
    bucket = s3_bucket.removeprefix("s3://")
    fs.pipe(f"{bucket}/runs/job-old/checkpoints/step-10/.done", b"{}")  # where it used to be staged
    backend = stage_as("ana", old, url, monkeypatch)
    assert backend.checkpoint_dir(old) == f"{url}/job-old/checkpoints"
    assert fs.exists(f"{bucket}/runs/job-old/payload.sig") and not fs.exists(f"{bucket}/runs/ana")


@pytest.mark.parametrize("name", ["ana/../bob", "a b", "..", ""])
def test_a_user_name_that_is_not_one_segment_is_refused(name):
    with pytest.raises(ConfigurationError, match="set SPARKGPU_USER"):
        user_prefix("s3://b/runs", name)
