"""`sparkgpu run` as a user types it: a real console process, real ranks, a real ledger."""

import json
import os
import subprocess
import sys

import pytest

from sparkgpu.usage.ledger import UsageLedger

pytestmark = pytest.mark.integration

SCRIPT = """\
import json, os, sys
import torch
import torch.distributed as dist
from sparkgpu import runtime

t = torch.ones(1)
dist.all_reduce(t)  # the process group is already up when the script starts
rank = runtime.get_global_rank()
with open(os.path.join(os.environ["OUT_DIR"], f"rank-{rank}.json"), "w") as f:
    json.dump({"name": __name__, "argv": sys.argv[1:], "sum": t.item(), "env": os.environ.get("GREETING")}, f)
print(f"rank {rank} done", flush=True)
"""


def sparkgpu(*args, cwd, env):
    return subprocess.run(
        [sys.executable, "-m", "sparkgpu.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "OUT_DIR": str(tmp_path / "out"), "SPARKGPU_USER": "ana"}
    return tmp_path, env


def test_run_a_script_on_two_ranks_then_list_it_and_read_its_logs(workdir):
    cwd, env = workdir
    result = sparkgpu(
        "run", "train.py", "--gpus", "2", "--gpu-type", "cpu", "--tag", "team=ml", "--", "--lr", "0.1", cwd=cwd, env=env
    )
    assert result.returncode == 0, result.stderr
    outputs = [json.loads((cwd / "out" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert all(o == {"name": "__main__", "argv": ["--lr", "0.1"], "sum": 2.0, "env": None} for o in outputs)
    assert "rank 0 done" in result.stdout  # rank 0 streams to the terminal by default
    assert "GPU-hours" in result.stderr and "succeeded" in result.stderr

    jobs = [json.loads(line) for line in sparkgpu("jobs", "--json", cwd=cwd, env=env).stdout.splitlines()]
    assert len(jobs) == 1
    job = jobs[0]
    assert (job["name"], job["status"], job["attempts"], job["gpus"], job["tags"]) == (
        "train",
        "succeeded",
        1,
        2,
        {"team": "ml"},
    )

    logs = sparkgpu("logs", job["job_id"], "--all", cwd=cwd, env=env)
    assert "[rank0] rank 0 done" in logs.stdout and "[rank1] rank 1 done" in logs.stdout
    assert sparkgpu("logs", job["job_id"], "--rank", "1", "--follow", cwd=cwd, env=env).stdout == "rank 1 done\n"

    home = env.get("SPARKGPU_HOME")
    rows = UsageLedger(os.path.join(home, "usage", "ledger")).read().to_pylist()
    assert [(r["job_id"], r["user"], dict(r["tags"]), r["gpus"]) for r in rows] == [
        (job["job_id"], "ana", {"team": "ml"}, 2)
    ]

    usage = sparkgpu("usage", "--by", "team,user", cwd=cwd, env=env)
    assert usage.returncode == 0 and "ml" in usage.stdout and "ana" in usage.stdout


def test_run_a_job_file_and_a_failing_script(workdir):
    cwd, env = workdir
    (cwd / "jobs").mkdir()
    (cwd / "jobs" / "nightly.yaml").write_text(
        "script: ../train.py\nargs: [--epochs, 1]\nname: nightly\ngpus: 2\ngpu_type: cpu\n"
        "tags: {team: ml}\nenv: {GREETING: hello}\nlog_ranks: all\n"
    )
    result = sparkgpu("run", "jobs/nightly.yaml", cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    outputs = [json.loads((cwd / "out" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert all(o["argv"] == ["--epochs", "1"] and o["env"] == "hello" for o in outputs)
    assert "[rank1] rank 1 done" in result.stdout  # log_ranks: all

    (cwd / "crash.py").write_text("raise ValueError('bad learning rate')\n")
    result = sparkgpu("run", "crash.py", "--gpu-type", "cpu", "--name", "crash", cwd=cwd, env=env)
    assert result.returncode == 1
    assert "ValueError: bad learning rate" in result.stderr and "failed" in result.stderr
    statuses = sorted(
        r["status"] for r in UsageLedger(os.path.join(env["SPARKGPU_HOME"], "usage", "ledger")).read().to_pylist()
    )
    assert statuses == ["failed", "succeeded"]  # failed attempts are billed too
