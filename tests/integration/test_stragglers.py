"""A straggler produced for real in a local job: named with its node and factor, in the caller's
lines, the run dir and the job's MLflow run, while its quick peers are not.

Three gloo ranks on CPU step with one ``all_reduce`` a step; rank 2 takes 0.3 s to compute its
step where ranks 0 and 1 take 0.05 s, so they wait for it in every collective. Over a 3 s
window the supervisor must name rank 2 (the steps take 0.3 s or more and would take 0.25 s less
without it), with its lateness and the factor it costs, and neither of the others.
"""

from __future__ import annotations

import json

import pytest

from sparkgpu import distributed, runtime
from sparkgpu.config import reset_settings, settings

pytestmark = pytest.mark.integration

STEPS = 40
QUICK, SLOW = 0.05, 0.3


def _train() -> int:
    import time

    import torch
    import torch.distributed as dist

    total = torch.ones(8)
    for step in range(STEPS):
        time.sleep(SLOW if runtime.get_global_rank() == 2 else QUICK)  # the step's compute
        dist.all_reduce(total)
        runtime.heartbeat(step)
    return STEPS


def test_a_slow_rank_is_named_a_straggler_with_its_node_and_factor_and_its_peers_are_not(tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    from sparkgpu.tracking.mlflow_run import MLflowCallback

    monkeypatch.setenv("SPARKGPU_STRAGGLER_WINDOW", "3")
    reset_settings()
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    callback = MLflowCallback("/team/stragglers", tracking_uri=tracking_uri, fn=_train, flush_interval=0.3)
    job = distributed(gpus=3, gpu_type="cpu", callbacks=[callback], log_ranks=None)(_train)
    assert job.distributed() == [STEPS] * 3

    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if "is a straggler" in line]
    assert len(lines) == 1 and "attempt 0: rank 2 on node 0 is a straggler" in lines[0], lines
    record = json.loads((settings().staging_root / job.last_job_id / "attempts/0/stragglers.json").read_text())
    assert record["factor"] == 1.5 and record["window"] == 3
    (named,) = record["stragglers"]
    assert named["rank"] == 2 and named["node"] == 0
    # It reaches each collective SLOW - QUICK after the others; the steps take at least SLOW (more on a
    # busy machine), and without it they would take that less its lateness.
    assert (SLOW - QUICK) * 0.6 <= named["lateness"] <= SLOW, named
    assert SLOW * 0.9 <= named["step"] <= SLOW * 4, named
    assert named["factor"] == pytest.approx(named["step"] / (named["step"] - named["lateness"]))
    assert named["factor"] >= 1.5
    assert named["collectives"] >= 8

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("/team/stragglers").experiment_id])
    assert run.data.tags["sparkgpu.straggler.rank-2"].startswith("node 0, attempt 0: ")
    assert not any(
        tag.startswith("sparkgpu.straggler.rank-") and tag != "sparkgpu.straggler.rank-2" for tag in run.data.tags
    )
    assert run.data.metrics["sparkgpu/straggler_factor/rank-2"] == pytest.approx(named["factor"])
