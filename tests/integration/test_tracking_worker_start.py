"""What a rank pays for tracking before the training function runs."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import time

import pytest

from sparkgpu.spec import JobSpec, Resources
from sparkgpu.tracking.mlflow_run import MLflowCallback

pytestmark = pytest.mark.integration

# A rank as the entrypoint drives it: the callback unpickled from the payload (after the
# function's module, which may import Lightning), then on_worker_start, then the function.
_RANK = textwrap.dedent("""
    import pickle, sys
    if sys.argv[2] == "lightning":
        import lightning
    from sparkgpu.callbacks import WorkerContext
    worker = pickle.loads(open(sys.argv[1], "rb").read())
    ctx = WorkerContext("job", ".", attempt=0, rank=0, local_rank=0, world_size=1, node_rank=0, device="cpu")
    worker.on_worker_start(ctx)
    print("patched" if "mlflow.pytorch" in sys.modules else "not patched", flush=True)
    worker.on_worker_end(ctx, None)
""")


@pytest.fixture(scope="module")
def rank_env(tmp_path_factory):
    """The workers' environment and pickled callback for one job tracked in a SQLite store."""
    pytest.importorskip("lightning")
    root = tmp_path_factory.mktemp("worker-start")
    job = JobSpec(job_id=f"ws-{time.time_ns()}", name="ws", resources=Resources(gpus=1, gpu_type="cpu"))
    callback = MLflowCallback("/team/worker-start", tracking_uri=f"sqlite:///{root}/mlflow.db", system_metrics=False)
    callback.before_job(job, str(root / job.job_id))
    env = {
        **callback.before_attempt(job, 0),
        "SPARKGPU_RUN_DIR": str(root / job.job_id),
    }  # as the node's launcher sets it
    pickled = root / "callback.pkl"
    pickled.write_bytes(pickle.dumps(callback))
    yield env, pickled
    callback.after_job(job, [0], None)


def _rank(rank_env, imports: str) -> str:
    import os

    env, pickled = rank_env
    result = subprocess.run(
        [sys.executable, "-c", _RANK, str(pickled), imports],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_rank_that_does_not_use_lightning_does_not_import_mlflow_before_its_function(rank_env):
    # Installed is not used: importing MLflow's Lightning autologging costs seconds per rank.
    assert _rank(rank_env, "plain") == "not patched"


def test_a_rank_whose_module_imported_lightning_is_autologged_before_its_function(rank_env):
    assert _rank(rank_env, "lightning") == "patched"


def test_a_rank_s_lightning_autologging_ends_with_its_job(rank_env, monkeypatch):
    """MLflow patches Lightning's Trainer for the whole process: in a process that outlives the
    job (a notebook's, a test's), a later fit must not be logged as the ended job's run."""
    import lightning  # noqa: F401  (the function's module imported it)
    from mlflow.utils.autologging_utils import autologging_is_disabled

    from sparkgpu.callbacks import WorkerContext

    env, pickled = rank_env
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    worker = pickle.loads(pickled.read_bytes())
    ctx = WorkerContext("job", ".", attempt=0, rank=0, local_rank=0, world_size=1, node_rank=0, device="cpu")
    worker.on_worker_start(ctx)
    assert not autologging_is_disabled("pytorch")
    worker.on_worker_end(ctx, None)
    assert autologging_is_disabled("pytorch")
