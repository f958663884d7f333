"""Which capabilities each backend has, and the callers that go through them instead of its name."""

import io
import json

import pytest

from sparkgpu.launch.backends.base import BACKENDS, backend_class, create_backend
from sparkgpu.launch.backends.capabilities import (
    DeferredStart,
    ElasticCapacity,
    LocalRanks,
    Preemptible,
    QueuedCapacity,
    Reattachable,
    WatchedProgress,
)
from sparkgpu.launch.backends.local.backend import LocalBackend
from sparkgpu.launch.backends.spark.backend import SparkBackend
from sparkgpu.launch.backends.spark.sessions import SESSION_FILE
from sparkgpu.launch.client.resume import take_over
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from tests.fakes.backend import ScriptedBackend
from tests.fakes.spark_session import TaggedSession
from tests.unit.test_resume import KEY, interrupted_job

CAPABILITIES = (QueuedCapacity, Preemptible, ElasticCapacity, DeferredStart, Reattachable, LocalRanks, WatchedProgress)
REMOTE = "sc://head:15002"


def capabilities(backend) -> set[str]:
    check = issubclass if isinstance(backend, type) else isinstance
    return {c.__name__ for c in CAPABILITIES if check(backend, c)}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("local", {"QueuedCapacity", "Preemptible", "LocalRanks", "WatchedProgress"}),
        ("warm_pool", {"QueuedCapacity", "Preemptible", "LocalRanks", "WatchedProgress"}),
        (
            "spark",
            {"QueuedCapacity", "Preemptible", "ElasticCapacity", "DeferredStart", "Reattachable", "WatchedProgress"},
        ),
    ],
)
def test_each_backend_has_its_capabilities(name, expected):
    assert capabilities(backend_class(name)) == expected


def test_every_registered_backend_is_listed_above():
    assert set(BACKENDS) == {"local", "warm_pool", "spark"}


def test_instances_have_their_class_capabilities_and_the_core_none():
    assert capabilities(LocalBackend(standby=False)) == {
        "QueuedCapacity",
        "Preemptible",
        "LocalRanks",
        "WatchedProgress",
    }
    assert capabilities(SparkBackend(spark=TaggedSession())) == {c.__name__ for c in CAPABILITIES} - {"LocalRanks"}
    assert capabilities(ScriptedBackend([])) == set()  # the core alone: the supervisor runs it all the same


def interrupted(backend: str) -> RunDir:
    """A run dir whose client died while attempt 0 ran, with the Connect URL a Spark job keeps."""
    rd = interrupted_job(None, backend=backend)
    (rd.path / SESSION_FILE).write_text(json.dumps({"remote": REMOTE}))
    rd.file(RunLayout.spark(0)).mkdir(parents=True)
    return rd


def test_resume_rebuilds_a_spark_jobs_backend_and_stops_its_lost_nodes_through_the_capability(monkeypatch):
    rd = interrupted("spark")
    reattached, stopped = [], []
    reattach, stop = SparkBackend.reattach.__func__, SparkBackend.stop_lost_attempts.__func__

    def spy_reattach(cls, run_dir):
        reattached.append(run_dir.job_id)
        return reattach(cls, run_dir)

    def spy_stop(cls, job, run_dir, attempts):
        stopped.append(list(attempts))
        stop(cls, job, run_dir, attempts)

    monkeypatch.setattr(SparkBackend, "reattach", classmethod(spy_reattach))
    monkeypatch.setattr(SparkBackend, "stop_lost_attempts", classmethod(spy_stop))
    supervisor = take_over("job-1", out=io.StringIO())
    try:
        assert isinstance(supervisor.backend, SparkBackend) and supervisor.backend.remote == REMOTE
        assert reattached == ["job-1"] and stopped == [[0]]
        rd.key = KEY
        assert rd.read_control(rd.file(RunLayout.spark_cancel(0))) == b"its client is gone; the job was taken over\n"
    finally:
        supervisor.lock.release()


def test_resume_creates_a_local_jobs_backend_anew_and_stops_nothing():
    rd = interrupted("local")
    supervisor = take_over("job-1", out=io.StringIO())
    try:
        assert type(supervisor.backend) is LocalBackend
        assert not rd.file(RunLayout.spark_cancel(0)).exists()  # its ranks died with their client
    finally:
        supervisor.lock.release()


def test_a_given_backend_is_used_as_it_is_and_the_jobs_own_stops_the_lost_nodes():
    rd = interrupted("spark")
    given = create_backend("spark", spark=TaggedSession())
    supervisor = take_over("job-1", backend=given, out=io.StringIO())
    try:
        assert supervisor.backend is given
        assert rd.file(RunLayout.spark_cancel(0)).exists()
    finally:
        supervisor.lock.release()
