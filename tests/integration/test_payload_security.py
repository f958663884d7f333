"""What someone who can write the staging root can make workers and the client do: nothing.

Real agents and ranks on this host (the local backend and a Spark node task run in-process
with a stand-in for Spark's barrier context); the "attacker" edits files of a real run dir.
"""

from __future__ import annotations

import os
import pickle
import types

import pyspark
import pytest

from sparkgpu import WorkerFailedError, distributed, runtime
from sparkgpu.config import settings
from sparkgpu.errors import PayloadSignatureError
from sparkgpu.launch.backends.spark.executor.node import NodeLaunch, run_node
from sparkgpu.rundir.keyring import load_key
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.client.supervisor import Supervisor

pytestmark = pytest.mark.integration

# Spark's credentials as an executor's Python worker sees them (spark.authenticate, spark.ssl.rpc).
SPARK_SECRETS = {
    "_SPARK_AUTH_SECRET": "sentinel-auth-secret-7f3a9c",
    "PYTHON_WORKER_FACTORY_SECRET": "sentinel-factory-secret-91c2",
    "_SPARK_SSL_RPC_KEY_STORE_PASSWORD": "sentinel-keystore-password-55de",
}


@distributed(gpus=2, gpu_type="cpu")
def add_rank(x):
    return x + runtime.get_global_rank()


class Planted:
    """Unpickling this creates ``path``: stands for any code a planted pickle could run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def tamper_entrypoint(run_dir: RunDir, marker) -> None:
    """What a writer of the staging root does: their code first in ``_air.py``, the rest intact."""
    run_dir.air.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + run_dir.air.read_text())


def assert_nothing_started(run_dir: RunDir, marker) -> None:
    assert not marker.exists()
    assert not list(run_dir.file(RunLayout.attempt(0)).glob("logs/rank-*.log"))  # no rank ever ran


def assert_never_written(run_dir, secrets: list[bytes]) -> None:
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name.startswith("rank-") for p in files)  # the job wrote logs and results
    for path in files:
        data = path.read_bytes()
        for secret in secrets:
            assert secret not in data, f"{path.relative_to(run_dir)} holds a secret"


# -- the local backend ---------------------------------------------------------------------


def test_a_tampered_entrypoint_starts_no_rank(tmp_path):
    prepared = add_rank.prepare((1,), {}).write()
    marker = tmp_path / "pwned"
    tamper_entrypoint(prepared.run_dir, marker)
    with pytest.raises(
        WorkerFailedError,
        match=r"ranks 0, 1: sparkgpu.errors.PayloadSignatureError: refusing to "
        r"run .*modified after it was staged",
    ) as err:
        Supervisor(prepared.job, prepared.run_dir, prepared.backend, prepared.key, []).run()
    assert isinstance(err.value.__cause__, PayloadSignatureError)
    assert_nothing_started(prepared.run_dir, marker)


def test_a_pickle_planted_as_a_rank_result_never_runs_on_the_client(tmp_path):
    marker = tmp_path / "pwned"

    @distributed(gpus=2, gpu_type="cpu")
    def plant(path):
        if runtime.get_global_rank() == 1:
            # User code never sees the job key: here it stands for any writer of the run dir
            # without it, planting a pickle where rank 1's result goes.
            run_dir = RunDir(os.environ[runtime.ENV_RUN_DIR])
            run_dir.file(RunLayout.result(runtime.attempt(), 1)).write_bytes(pickle.dumps(Planted(path)))
            os._exit(0)  # and rank 1 never writes its own
        return "rank 0"

    with pytest.raises(
        PayloadSignatureError,
        match=r"refusing to unpickle .*rank-1.pkl: the result of rank 1 is "
        r"not signed",
    ):
        plant.distributed(str(marker))
    assert not marker.exists()


def test_spark_secrets_and_the_job_key_never_reach_the_ranks_or_the_run_dir(monkeypatch):
    for name, value in SPARK_SECRETS.items():
        monkeypatch.setenv(name, value)

    @distributed(gpus=2, gpu_type="cpu", log_ranks="all")
    def leaky():
        print(f"environment: {dict(os.environ)}", flush=True)  # user code that logs everything
        return dict(os.environ)

    results = leaky.distributed()
    assert all(set(SPARK_SECRETS).isdisjoint(env) and not any("JOB_KEY" in name for name in env) for env in results)
    key = load_key(leaky.last_job_id)
    secrets = [v.encode() for v in SPARK_SECRETS.values()] + [key, key.hex().encode()]
    assert_never_written(settings().staging_root / leaky.last_job_id, secrets)


# -- a Spark node task (the barrier context stands in for Spark's) -------------------------


class OneNodeBarrier:
    """The calls a node task makes on ``BarrierTaskContext``, for a one-node stage on this host."""

    def partitionId(self):
        return 0

    def attemptNumber(self):
        return 0

    def resources(self):
        return {}

    def allGather(self, message):
        return [message]

    def getTaskInfos(self):
        return [types.SimpleNamespace(address="127.0.0.1:7077")]


def run_spark_node(monkeypatch, prepared) -> dict:
    """Runs the job's only node as a Spark barrier task would; returns the task's status row."""
    monkeypatch.setattr(pyspark.BarrierTaskContext, "get", classmethod(lambda cls: OneNodeBarrier()))
    rd = prepared.run_dir
    rd.prepare_attempt(0)
    rd.file(RunLayout.spark(0)).mkdir(parents=True)
    env = {
        runtime.ENV_JOB_ID: prepared.job.job_id,
        runtime.ENV_ATTEMPT: "0",
        runtime.ENV_RUN_DIR: str(rd.path),
        runtime.ENV_CHECKPOINT_DIR: str(rd.checkpoints),
    }
    launch = NodeLaunch(
        run_dir=str(rd.path),
        attempt=0,
        nnodes=1,
        nproc=prepared.job.world_size,
        env=env,
        key=prepared.key,
        shutdown_grace=2,
        client_timeout=None,
        threads_per_rank=1,
    )
    (batch,) = run_node(launch, iter(()))
    return batch.to_pylist()[0]


def test_a_spark_node_refuses_a_tampered_entrypoint_before_starting_an_agent(monkeypatch, tmp_path):
    prepared = add_rank.prepare((1,), {}).write()
    marker = tmp_path / "pwned"
    tamper_entrypoint(prepared.run_dir, marker)
    row = run_spark_node(monkeypatch, prepared)
    assert (row["state"], row["exit_code"], row["pid"]) == ("bad-signature", 1, 0)
    assert_nothing_started(prepared.run_dir, marker)
    client = RunDir(prepared.run_dir.path, key=prepared.key)
    for rank in (0, 1):
        failure, exc = client.read_error(0, rank)
        assert isinstance(exc, PayloadSignatureError) and "modified after it was staged" in failure.message
    assert "node 0 starts none of its ranks" in client.file(RunLayout.agent_log(0, 0)).read_text()


def test_a_spark_node_strips_spark_secrets_from_the_ranks(monkeypatch):
    for name, value in SPARK_SECRETS.items():
        monkeypatch.setenv(name, value)  # the environment of the executor's Python worker

    @distributed(gpus=2, gpu_type="cpu")
    def leaky():
        print(f"environment: {dict(os.environ)}", flush=True)
        return dict(os.environ)

    prepared = leaky.prepare((), {}).write()
    row = run_spark_node(monkeypatch, prepared)
    assert row["state"] == "succeeded", prepared.run_dir.file(RunLayout.agent_log(0, 0)).read_text()
    client = RunDir(prepared.run_dir.path, key=prepared.key)
    envs = [client.read_result(0, rank) for rank in (0, 1)]
    assert all(set(SPARK_SECRETS).isdisjoint(env) and not any("JOB_KEY" in name for name in env) for env in envs)
    secrets = [v.encode() for v in SPARK_SECRETS.values()] + [prepared.key, prepared.key.hex().encode()]
    assert_never_written(prepared.run_dir.path, secrets)
