"""A `databricks air run` workload file, unchanged, run by `sparkgpu run` on two local ranks."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """\
import json, os, sys
import torch
import torch.distributed as dist
from sparkgpu import runtime

t = torch.ones(1)
dist.all_reduce(t)  # the process group is already up when the script starts
rank = runtime.get_global_rank()
out = os.path.join(os.environ["CODE_SOURCE_PATH"], "out", f"rank-{rank}.json")
with open(out, "w") as f:
    json.dump({"name": __name__, "argv": sys.argv[1:], "sum": t.item(), "batch": os.environ.get("BATCH_SIZE")}, f)
"""

WORKLOAD = """\
experiment_name: /team/air-workload
environment:
  version: '4'
  dependencies:
    - torch
compute:
  num_accelerators: 2
  accelerator_type: GPU_2xA10
code_source:
  type: snapshot
  snapshot:
    root_path: ../repo
env_variables:
  BATCH_SIZE: '32'
  LR: '0.001'
command: torchrun --nproc_per_node=2 $CODE_SOURCE_PATH/train.py --lr $LR --data ${CODE_SOURCE_PATH}/data
"""


def test_an_air_workload_runs_its_script_on_every_rank(tmp_path, monkeypatch):
    import mlflow

    from sparkgpu.config import reset_settings
    from sparkgpu.tracking import resolve_target

    repo = tmp_path / "repo"
    (repo / "out").mkdir(parents=True)
    (repo / "train.py").write_text(SCRIPT)
    (tmp_path / "workloads").mkdir()
    (tmp_path / "workloads" / "train.yaml").write_text(WORKLOAD)
    monkeypatch.setenv("SPARKGPU_TRACKING", "1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # Two A10s as far as sparkgpu can tell: the file's GPU_2xA10 runs as it is, ranks on CPU with gloo.
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "A10:2")
    reset_settings()

    result = subprocess.run(
        [sys.executable, "-m", "sparkgpu.cli", "run", "workloads/train.yaml"],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    outputs = [json.loads((repo / "out" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    expected = {"name": "__main__", "argv": ["--lr", "0.001", "--data", f"{repo}/data"], "sum": 2.0, "batch": "32"}
    assert outputs == [expected, expected]

    client = mlflow.MlflowClient(resolve_target().tracking_uri)
    experiment = client.get_experiment_by_name("/team/air-workload")  # experiment_name
    assert experiment is not None and len(client.search_runs([experiment.experiment_id])) == 1

    bad = tmp_path / "workloads" / "piped.yaml"
    bad.write_text(WORKLOAD.replace("--data ${CODE_SOURCE_PATH}/data", "| tee log.txt"))
    refused = subprocess.run(
        [sys.executable, "-m", "sparkgpu.cli", "run", str(bad)], env=dict(os.environ), capture_output=True, text=True
    )
    assert refused.returncode == 2 and "uses the shell operator '|'" in refused.stderr
