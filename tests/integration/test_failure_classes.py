"""Each failure class produced for real in a rank of a local job: its record, the decision, the message.

Two gloo ranks on CPU; rank 1 fails (rank 0 returns), on the first attempt only for the classes
the default policy restarts, so a restarted job then succeeds.
"""

from __future__ import annotations

import json

import pytest

from sparkgpu import distributed, runtime
from sparkgpu.cli import list_jobs
from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError, WorkerFailedError

pytestmark = pytest.mark.integration

WATCHDOG = (
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1200, OpType=ALLREDUCE, "
    "NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600021 milliseconds before timing out."
)
OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
    "1.05 GiB is free. Of the allocated memory 79.1 GiB is allocated by PyTorch"
)


def _fail(how: str) -> int:
    import ctypes
    import os
    import signal

    import torch

    rank = runtime.get_global_rank()
    if how == "none" or rank != 1 or runtime.attempt() > 0 and how in ("nccl", "abort", "segv", "sigkill"):
        return rank
    if how == "cuda_oom":
        raise torch.cuda.OutOfMemoryError(OOM)
    if how == "nccl":
        raise torch.distributed.DistBackendError(WATCHDOG)
    if how == "abort":
        os.abort()
    if how == "segv":
        ctypes.string_at(0)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "data":
        from sparkgpu.errors import DataError

        raise DataError("column 'text' is null in row 3 of part-0.parquet")
    if how == "import":
        import sparkgpu_no_such_module_of_the_user  # noqa: F401
    if how == "key":
        return {"input_ids": 1}["labels"]
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how, failure_class, restarts",
    [
        ("nccl", "nccl", 1),
        ("abort", "native_crash", 1),
        ("segv", "native_crash", 1),
        ("sigkill", "killed", 1),
        ("cuda_oom", "cuda_oom", 0),
        ("data", "data_error", 0),
        ("import", "environment_error", 0),
        ("key", "user_exception", 1),  # restarted once; the same place again is raised
    ],
)
def test_a_failure_is_named_by_its_class_and_restarted_by_its_policy(how, failure_class, restarts, capsys):
    job = distributed(gpus=2, gpu_type="cpu", max_restarts=3, log_ranks=None)(_fail)
    if how in ("nccl", "abort", "segv", "sigkill"):
        assert job.distributed(how) == [0, 1]  # restarted, and the next attempt succeeded
    else:
        with pytest.raises(WorkerFailedError) as err:
            job.distributed(how)
    out = capsys.readouterr()
    said = out.out + out.err
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    failed = [a for a in state["attempts"] if a["status"] == "failed"]
    assert failed and {a["failure_class"] for a in failed} == {failure_class}
    assert state["restarts"] == restarts
    if restarts:
        assert f"attempt 0 failed ({failure_class}: " in said and "(restart 1 of 3)" in said
    else:
        assert "restarting" not in said and f"attempt 0 failed ({failure_class}: " in said
    listed = next(j for j in list_jobs() if j["job_id"] == job.last_job_id)
    assert listed["failure_class"] == failure_class
    if how == "cuda_oom":
        assert "tried to allocate 2.00 GiB; 79.1 GiB in use" in said
        assert "gradient checkpointing" in said and "restart_on=" in said
    if how == "key":
        assert len(failed) == 2 and "KeyError at " in said and "again, as the attempt before it" in said
        assert isinstance(err.value, KeyError)


def test_restart_on_retries_a_cuda_oom_and_is_checked_at_decoration(capsys):
    job = distributed(gpus=2, gpu_type="cpu", max_restarts=1, log_ranks=None, restart_on=["cuda_oom"])(_fail)
    with pytest.raises(WorkerFailedError):
        job.distributed("cuda_oom")
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    assert state["restarts"] == 1 and [a["failure_class"] for a in state["attempts"]] == ["cuda_oom", "cuda_oom"]
    with pytest.raises(ConfigurationError, match="restart_on= got 'oom', which is no failure class"):
        distributed(gpus=2, gpu_type="cpu", restart_on=["oom"])(_fail)
    with pytest.raises(ConfigurationError, match="restart_on= got 'oom'"):
        job.with_overrides(restart_on="oom")


def test_the_failure_class_is_a_tag_of_the_jobs_mlflow_run(tmp_path):
    from mlflow import MlflowClient

    from sparkgpu.tracking.mlflow_run import MLflowCallback

    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    callback = MLflowCallback("/team/failures", tracking_uri=tracking_uri, fn=_fail, flush_interval=0.3)
    job = distributed(gpus=2, gpu_type="cpu", max_restarts=2, callbacks=[callback], log_ranks=None)(_fail)
    with pytest.raises(WorkerFailedError):
        job.distributed("data")
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("/team/failures").experiment_id])
    assert run.data.tags["sparkgpu.failure_class"] == "data_error"
    assert run.info.status == "FAILED"


def test_a_host_that_fails_its_preflight_check_starts_no_rank_and_is_not_restarted(tmp_path, monkeypatch, capsys):
    from sparkgpu.config import reset_settings
    from sparkgpu.errors import PreflightError

    (tmp_path / "cache").write_text("the cache disk is not mounted here\n")
    monkeypatch.setenv("SPARKGPU_CACHE_DIR", str(tmp_path / "cache"))
    reset_settings()
    job = distributed(gpus=2, gpu_type="cpu", max_restarts=3)(_fail)
    with pytest.raises(PreflightError) as err:  # a WorkerFailedError too, as every rank failure
        job.distributed("key")
    assert isinstance(err.value, WorkerFailedError) and "ranks 0, 1: sparkgpu.errors.PreflightError" in str(err.value)
    said = capsys.readouterr()
    said = said.out + said.err
    assert (
        "attempt 0 failed (bad_node: node 0 on host " in said and f"cache_disk: {tmp_path / 'cache'} is a file" in said
    )
    assert "the job has no other node to run on" in said and "restarting" not in said
    run_dir = settings().staging_root / job.last_job_id
    state = json.loads((run_dir / "state.json").read_text())
    assert [a["failure_class"] for a in state["attempts"]] == ["bad_node"] and state["restarts"] == 0
    assert not any(p.stat().st_size for p in (run_dir / "attempts" / "0" / "logs").glob("rank-*"))  # no rank ran
    # Off for a job that asks: its ranks start (and would meet the disk themselves).
    assert distributed(gpus=2, gpu_type="cpu", preflight=False)(_fail).distributed("none") == [0, 1]
