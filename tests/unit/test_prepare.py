"""A call is prepared once (one resolve, one job id, each argument pickled once) and launched from
what was prepared: the backend gets its own placement back explicitly at every plan and submit."""

from __future__ import annotations

import pickle
import threading

import pytest

from sparkgpu import distributed
from sparkgpu.config import settings
from sparkgpu.data.tables.plan import TableRef
from sparkgpu.errors import SerializationError, SparkGPUError
from sparkgpu.launch.backends.base import ResolvedJob
from sparkgpu.rundir.keyring import load_key
from sparkgpu.rundir.directory import RunDir
from sparkgpu.api.spark_gpu import GPUNamespace
from tests.fakes.backend import ScriptedBackend


class PlacingBackend(ScriptedBackend):
    """Places the ranks at resolve, as the Spark backend does, and records what it was handed."""

    def __init__(self, script):
        super().__init__(script)
        self.resolved: list[str] = []  # the job id of every resolve
        self.placements: list = []  # the placement every plan and submit got

    def resolve(self, job):
        self.resolved.append(job.job_id)
        return ResolvedJob(job, placement=("placement of", job.job_id))

    def plan(self, job, run_dir, attempt, env, placement=None):
        self.placements.append(placement)
        return super().plan(job, run_dir, attempt, env)

    def submit(self, job, run_dir, attempt, env, placement=None):
        self.placements.append(placement)
        return super().submit(job, run_dir, attempt, env)


class CountsItsPickling:
    """An argument that counts how often the client pickles it."""

    pickled = 0

    def __reduce__(self):
        type(self).pickled += 1
        return CountsItsPickling, ()


@pytest.fixture(autouse=True)
def _reset_count():
    CountsItsPickling.pickled = 0


def job_on(backend, **options):
    def add(counter, x=0, data_url=None):
        return x

    return distributed(gpus=2, gpu_type="cpu", backend=backend, callbacks=[], **options)(add)


def payload_kwargs(run_dir: str, job_id: str) -> dict:
    _, parts = RunDir(run_dir).load_verified(load_key(job_id))
    return RunDir.unpack(parts)[2]


def test_dryrun_prepares_once_and_writes_nothing():
    backend = PlacingBackend(["ok"])
    plan = job_on(backend).dryrun(CountsItsPickling(), x=1)

    (job_id,) = backend.resolved
    assert backend.placements == [("placement of", job_id)]
    assert CountsItsPickling.pickled == 1  # picklability is checked, once
    assert plan.backend == "fake" and plan.env == {"SPARKGPU_JOB_ID": job_id}
    assert not settings().staging_root.exists()


def test_a_call_is_resolved_once_and_every_attempt_gets_its_layout():
    backend = PlacingBackend(["raise", "ok"])
    job = job_on(backend, max_restarts=1)

    results = job.distributed(CountsItsPickling(), x=3)

    assert [r["attempt"] for r in results] == [1, 1]
    assert backend.resolved == [job.last_job_id]
    assert backend.placements == [("placement of", job.last_job_id)] * 2  # the restart reuses it, unasked
    assert CountsItsPickling.pickled == 1


def test_submit_launches_the_job_it_prepared():
    backend = PlacingBackend(["ok"])
    job = job_on(backend)

    call = job.submit(CountsItsPickling())

    assert call.result(timeout=60) == [{"rank": 0, "attempt": 0}, {"rank": 1, "attempt": 0}]
    assert backend.resolved == [call.job_id] and backend.placements == [("placement of", call.job_id)]
    assert CountsItsPickling.pickled == 1


def uses_table(counter, data_url):
    return str(data_url)


def test_train_with_data_prepares_once_and_launches_that_job_with_data_url(tmp_path, monkeypatch):
    backend = PlacingBackend(["ok"])
    monkeypatch.setattr(GPUNamespace, "backend", lambda self, **options: backend)
    table = tmp_path / "table"
    table.mkdir()
    gpu = GPUNamespace(spark=None)

    gpu.train(
        uses_table,
        gpus=1,
        gpu_type="cpu",
        args=(CountsItsPickling(),),
        data=str(table),
        data_format="table",
        callbacks=[],
        ship_environment=False,
    )

    # One job: checked before the data step and launched after it, under the same id.
    assert backend.resolved == [gpu.last_job_id]
    assert backend.placements == [("placement of", gpu.last_job_id)]
    assert CountsItsPickling.pickled == 1
    assert [p.name for p in settings().staging_root.iterdir()] == [gpu.last_job_id]
    assert payload_kwargs(gpu.last_run_dir, gpu.last_job_id)["data_url"] == TableRef(str(table))


def test_added_keyword_arguments_are_the_only_ones_pickled_again():
    prepared = job_on(PlacingBackend(["ok"])).prepare((CountsItsPickling(),), {"x": 2})

    with_url = prepared.with_kwargs(data_url="s3://bucket/shards")

    assert CountsItsPickling.pickled == 1
    assert pickle.loads(prepared.payload)["kwargs"].keys() == {"x"}  # the prepared job is left as it was
    parts = pickle.loads(with_url.payload)
    assert parts["args"] == pickle.loads(prepared.payload)["args"]
    assert RunDir.unpack(parts)[2] == {"x": 2, "data_url": "s3://bucket/shards"}
    with pytest.raises(SerializationError, match="keyword argument 'data_url'"):
        prepared.with_kwargs(data_url=threading.Lock())


def test_a_prepared_job_launches_only_once_written_and_is_written_once():
    prepared = job_on(PlacingBackend(["ok"])).prepare((CountsItsPickling(),), {})
    with pytest.raises(SparkGPUError, match=r"call write\(\) first"):
        prepared.supervisor()

    written = prepared.write()

    assert written.written and written.run_dir.spec_file.exists() and load_key(written.job.job_id) == written.key
    with pytest.raises(SparkGPUError, match="add arguments before write"):
        written.with_kwargs(data_url="x")
    with pytest.raises(SparkGPUError, match="written already"):
        written.write()
    assert written.supervisor().placement == ("placement of", written.job.job_id)


class PoolBackend(PlacingBackend):
    """Places every job on the pool "a10" as the Spark backend does, and probes only at resolve."""

    def place(self, job):
        import dataclasses

        from sparkgpu.spec.pools import POOL_TAG

        return dataclasses.replace(job, tags={**job.tags, POOL_TAG: "a10"})


def test_the_pools_usage_policy_refuses_before_the_backend_probes_anything(tmp_path, monkeypatch):
    from sparkgpu.config import reset_settings
    from sparkgpu.errors import PolicyViolationError

    (tmp_path / "policy.yaml").write_text("name: a10-pool\nmax_gpus_per_job: 1\n")
    (tmp_path / "pools.yaml").write_text(
        "pools:\n  a10:\n    url: sc://127.0.0.1:1\n    gpu_type: A10\n    gpus_per_node: 4\n"
        f"    usage_policy: {tmp_path / 'policy.yaml'}\n"
    )
    monkeypatch.setenv("SPARKGPU_POOLS", str(tmp_path / "pools.yaml"))
    reset_settings()
    backend = PoolBackend([0])
    job = distributed(gpus=2, gpu_type="A10", backend=backend, callbacks=[])(lambda: 1)
    with pytest.raises(PolicyViolationError, match="2 GPUs asked for, at most 1 per job"):
        job.distributed()
    assert backend.resolved == []  # refused before any capacity probe
    assert not list(settings().staging_root.glob("*"))  # and before anything was written
