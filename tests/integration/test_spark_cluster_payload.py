"""Payload security and environment reports on the real Spark standalone cluster.

Shares the session-wide cluster of ``tests/integration/conftest.py`` (two workers, fake GPUs
0,1 and 2,3, ranks on CPU with gloo).
"""

from __future__ import annotations

import pytest

from sparkgpu import WorkerFailedError, distributed, runtime
from sparkgpu.config import settings
from sparkgpu.errors import PayloadSignatureError
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.client.supervisor import Supervisor

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


def rank_and_node():
    return runtime.get_global_rank(), runtime.get_node_rank()


def test_a_tampered_entrypoint_runs_on_no_executor(cluster_spark, tmp_path):
    job = distributed(rank_and_node, gpus=4, gpu_type="A10", remote=True, backend=cluster_spark.gpu.backend())
    prepared = job.prepare((), {}).write()
    marker = tmp_path / "pwned"  # the executors run on this host: the tampered code would create it
    air = prepared.run_dir.air
    air.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + air.read_text())

    with pytest.raises(
        WorkerFailedError,
        match=r"ranks 0, 1, 2, 3: sparkgpu.errors.PayloadSignatureError: refusing "
        r"to run .*modified after it was staged",
    ) as err:
        Supervisor(prepared.job, prepared.run_dir, prepared.backend, prepared.key, []).run()
    assert isinstance(err.value.__cause__, PayloadSignatureError)
    assert not marker.exists()
    assert not list(prepared.run_dir.file(RunLayout.attempt(0)).glob("logs/rank-*.log"))  # no rank started on any node
    assert prepared.backend.last_attempt.nodes and {n["state"] for n in prepared.backend.last_attempt.nodes} == {
        "bad-signature"
    }


def test_every_rank_on_the_executors_reports_its_environment(cluster_spark):
    job = distributed(
        rank_and_node, gpus=4, gpu_type="A10", remote=True, backend=cluster_spark.gpu.backend(), log_ranks="all"
    )
    assert job.distributed() == [(0, 0), (1, 0), (2, 1), (3, 1)]
    rd = RunDir(settings().staging_root / job.last_job_id)
    reports = rd.read_env_reports(0)
    assert sorted(reports) == [0, 1, 2, 3] and all(
        set(r["steps"]) == {"check", "extract", "view"} for r in reports.values()
    )
    assert all("sparkgpu: environment rehydrated in" in rd.file(RunLayout.rank_log(0, r)).read_text() for r in range(4))
