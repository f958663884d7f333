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
mlflow_run_name: lr-0.001
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
        [sys.executable, "-m", "sparkgpu.cli", "run", "workloads/train.yaml", "--watch"],
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
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_name for run in runs] == ["lr-0.001"]  # mlflow_run_name

    bad = tmp_path / "workloads" / "piped.yaml"
    bad.write_text(WORKLOAD.replace("--data ${CODE_SOURCE_PATH}/data", "| tee log.txt"))
    refused = subprocess.run(
        [sys.executable, "-m", "sparkgpu.cli", "run", str(bad)], env=dict(os.environ), capture_output=True, text=True
    )
    assert refused.returncode == 2 and "uses the shell operator '|'" in refused.stderr


FULL_SCRIPT = """\
import hashlib, json, os
import yaml
import torch
import torch.distributed as dist
from sparkgpu import runtime

t = torch.ones(1)
dist.all_reduce(t)
rank, attempt = runtime.get_global_rank(), runtime.attempt()
if attempt == 0 and rank == 1:
    raise SystemExit(3)  # the first attempt fails: max_retries restarts it
token = runtime.secret("HF_TOKEN")
with open("/proc/self/environ", "rb") as f:
    environ = f.read()
with open("/proc/self/cmdline", "rb") as f:
    cmdline = f.read()
path = os.environ["HYPERPARAMETERS_PATH"]
with open(path) as f:
    parameters = yaml.safe_load(f)
report = {
    "attempt": attempt,
    "parameters": parameters,
    "parameters_path": path,
    "parameters_mode": os.stat(path).st_mode & 0o777,
    "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
    "token_in_proc_environ": token.encode() in environ,
    "token_in_os_environ": any(token in value for value in os.environ.values()),
    "token_in_cmdline": token.encode() in cmdline,
    "cwd": os.getcwd(),
}
with open(os.path.join(os.environ["OUT_DIR"], f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
print(f"rank {rank} read its parameters and its secret", flush=True)
"""

FULL_WORKLOAD = """\
experiment_name: air-full
compute: {num_accelerators: 2, accelerator_type: GPU_2xA10}
code_source: {type: snapshot, snapshot: {root_path: repo}}
env_variables: {OUT_DIR: "@OUT@"}
secrets:
  HF_TOKEN: hub/token
parameters:
  lr: 0.001
  layers: [64, 64]
max_retries: 1
timeout_minutes: 30
command: |
  set -euo pipefail
  cd $CODE_SOURCE_PATH/src
  python train.py
"""


def test_an_air_workload_with_parameters_secrets_retries_and_a_timeout(tmp_path, monkeypatch):
    import hashlib

    from sparkgpu.config import reset_settings, settings

    value = "hf_" + os.urandom(12).hex()  # a value that appears nowhere by chance
    secrets = tmp_path / "secrets" / "hub"
    secrets.mkdir(parents=True, mode=0o700)
    (secrets / "token").write_text(value + "\n")
    (secrets / "token").chmod(0o600)
    (tmp_path / "repo" / "src").mkdir(parents=True)
    (tmp_path / "repo" / "src" / "train.py").write_text(FULL_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "train.yaml").write_text(FULL_WORKLOAD.replace("@OUT@", str(out)))
    monkeypatch.setenv("SPARKGPU_SECRETS_DIR", str(tmp_path / "secrets"))
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "A10:2")
    reset_settings()

    result = subprocess.run(
        [sys.executable, "-m", "sparkgpu.cli", "run", "train.yaml", "--watch"],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.splitlines()[0]  # printed once it is submitted
    assert "rank 0 read its parameters and its secret" in result.stdout  # --watch followed the logs
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    run_dir = settings().staging_root / job_id
    for report in reports:
        assert report["attempt"] == 1  # attempt 0 failed; max_retries: 1 ran it again
        assert report["parameters"] == {"lr": 0.001, "layers": [64, 64]}
        assert report["parameters_path"] == str(run_dir / "parameters.yaml") and report["parameters_mode"] & 0o077 == 0
        assert report["token_sha256"] == hashlib.sha256(value.encode()).hexdigest()
        assert not report["token_in_proc_environ"] and not report["token_in_os_environ"]
        assert not report["token_in_cmdline"]
        assert report["cwd"] == str(tmp_path / "repo" / "src")
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["policy"]["timeout"] == 1800 and spec["policy"]["max_restarts"] == 1
    # Nowhere on disk under the run dir (payload, logs, results, state), nor in what the command printed.
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert value.encode() not in path.read_bytes(), path
    assert value not in result.stdout and value not in result.stderr


def _cli(*argv, cwd):
    return subprocess.run(
        [sys.executable, "-m", "sparkgpu.cli", *argv], cwd=cwd, env=dict(os.environ), capture_output=True, text=True
    )


def test_a_detached_job_file_prints_its_id_and_its_result_is_read_later(tmp_path):
    (tmp_path / "train.py").write_text("from sparkgpu import runtime\nprint('rank', runtime.get_global_rank())\n")
    (tmp_path / "job.yaml").write_text("script: train.py\ngpus: 2\ngpu_type: cpu\n")
    submitted = _cli("run", "job.yaml", "--detach", cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.splitlines()[0]
    followed = _cli("logs", job_id, "--follow", "--all", cwd=tmp_path)  # returns once the job ended
    assert followed.returncode == 0 and "rank 1" in followed.stdout
    result = _cli("result", job_id, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[rank0] None", "[rank1] None"]


def test_the_same_idempotency_key_submits_one_job(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(
        "import os, time\n"
        "with open(os.environ['RUNS'], 'a') as f:\n"
        "    f.write('run\\n')\n"
        "while not os.path.exists(os.environ['RELEASE']):  # still running when it is submitted again\n"
        "    time.sleep(0.05)\n"
    )
    (tmp_path / "train.yaml").write_text(
        "experiment_name: idem\ncompute: {num_accelerators: 1, accelerator_type: GPU_1xA10}\n"
        f"env_variables: {{RUNS: {tmp_path / 'runs.txt'}, RELEASE: {tmp_path / 'release'}}}\n"
        "command: python train.py\n"
    )
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "A10:1")
    try:
        first = _cli("run", "train.yaml", "--idempotency-key", "nightly-1", cwd=tmp_path)
        second = _cli("run", "train.yaml", "--idempotency-key", "nightly-1", cwd=tmp_path)
    finally:
        (tmp_path / "release").write_text("")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    job_id = first.stdout.splitlines()[0]
    assert second.stdout.splitlines()[0] == job_id  # the same job, not a second one
    assert _cli("logs", job_id, "--follow", cwd=tmp_path).returncode == 0
    assert _cli("result", job_id, cwd=tmp_path).returncode == 0
    assert (tmp_path / "runs.txt").read_text() == "run\n"
