"""Submit and walk away: a local job supervised by processes of its own outlives whoever submitted it.

Every test here kills, or lets exit, the process that submitted the job before the job has
done anything worth keeping, and then checks what a user relies on: the job ran to its end,
nothing restarted that should not have, a rank killed meanwhile restarted from its checkpoint,
its supervisor killed meanwhile was replaced, and ``attach``, ``cancel``, ``result`` and the CLI
work from another process. The bitwise-exact restart of a transformer with its submitter and
its supervisor killed is in ``test_transformer_restart_exactness.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap

import pytest

from sparkgpu import attach, distributed, runtime
from sparkgpu.callbacks import JobCallback
from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError, JobCancelledError, WorkerFailedError
from sparkgpu.launch.client.detached import keeper_alive, supervision_record
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.states import JobStatus
from tests.integration.processes import assert_no_orphans, processes_of, start_client, wait_for

pytestmark = pytest.mark.integration

#: A job of 2 CPU ranks that counts STEPS steps, checkpointing every step (a file per rank), and
#: waits at each step for the test's go-ahead file: the test decides when it moves on.
JOB = textwrap.dedent("""
    import json, os, time
    from sparkgpu import distributed, runtime

    STEPS = 6

    def count(where):
        rank, attempt = runtime.get_global_rank(), runtime.attempt()
        progress = os.path.join(runtime.checkpoint_dir(), f"rank-{rank}")
        step = int(open(progress).read()) if os.path.exists(progress) else 0
        with open(os.path.join(where, f"attempts-{rank}"), "a") as f:
            f.write(f"{attempt}:{step}\\n")
        while step < STEPS:
            gate = os.path.join(where, f"go-{step}")
            while not os.path.exists(gate):
                time.sleep(0.05)
            step += 1
            with open(progress + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(progress + ".tmp", progress)
            with open(os.path.join(where, f"step-{rank}-{step}"), "w") as f:
                f.write(str(attempt))
            if os.path.exists(os.path.join(where, f"kill-rank-{rank}-at-{step}")) and attempt == 0:
                os.kill(os.getpid(), 9)
        return {"rank": rank, "steps": step, "attempt": attempt, "pid": os.getpid()}

    job = distributed(gpus=2, gpu_type="cpu", max_restarts=1)(count)
""")


def _job_module(tmp_path) -> None:
    (tmp_path / "walkaway_job.py").write_text(JOB)


def _client(tmp_path, home, body: str, **popen) -> subprocess.Popen:
    """A client process (its own process group) that imports the job module and runs ``body``."""
    _job_module(tmp_path)
    source = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nfrom walkaway_job import job\n" + textwrap.dedent(
        body
    )
    return start_client(tmp_path, home, source, stdout=subprocess.PIPE, text=True, start_new_session=True, **popen)


def _go(where, *steps: int) -> None:
    for step in steps:
        (where / f"go-{step}").touch()


def _stepped(where, step: int) -> bool:
    return all((where / f"step-{rank}-{step}").exists() for rank in range(2))


def _state(job_id: str) -> dict:
    return json.loads((settings().staging_root / job_id / "state.json").read_text())


def _kill_group(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)  # the client and everything in its process group
    process.wait()


SUBMIT_AND_WAIT = """
    call = job.submit({where!r})
    print(call.job_id, flush=True)
    call.wait()
"""


def test_a_job_runs_on_to_its_end_when_its_submitter_is_killed_with_its_process_group(
    tmp_path, _isolated_sparkgpu_home
):
    where = tmp_path / "steps"
    where.mkdir()
    client = _client(tmp_path, _isolated_sparkgpu_home, SUBMIT_AND_WAIT.format(where=str(where)))
    job_id = client.stdout.readline().strip()
    _go(where, 0, 1, 2)
    assert wait_for(lambda: _stepped(where, 3), within=120), "the job never reached step 3"
    _kill_group(client)  # at step 3 of 6, as a closed laptop or a culled notebook pod would
    assert client.returncode == -signal.SIGKILL
    _go(where, 3, 4, 5)
    results = attach(job_id).result(timeout=120)
    assert [(r["rank"], r["steps"], r["attempt"]) for r in results] == [(0, 6, 0), (1, 6, 0)]
    state = _state(job_id)
    assert state["status"] == "succeeded" and [a["status"] for a in state["attempts"]] == ["succeeded"]
    assert state["restarts"] == 0  # the ranks never stopped: nothing was lost to restart
    assert state["client"]["pid"] not in (client.pid, os.getpid())  # supervised by neither caller
    assert_no_orphans(settings().staging_root / job_id, within=30)


def test_a_script_that_exits_normally_leaves_its_job_running(tmp_path, _isolated_sparkgpu_home):
    where = tmp_path / "steps"
    where.mkdir()
    client = _client(
        tmp_path,
        _isolated_sparkgpu_home,
        f"""
        call = job.submit({str(where)!r})
        print(call.job_id, flush=True)
        """,
    )
    job_id = client.stdout.readline().strip()
    assert client.wait(timeout=60) == 0  # the script ends as soon as it submitted
    _go(where, *range(6))
    call = attach(job_id)
    assert call._thread is None  # observed: its own keeper supervises it, not this process
    assert [r["steps"] for r in call.result(timeout=120)] == [6, 6]
    assert _state(job_id)["status"] == "succeeded"


def test_a_rank_killed_with_no_client_alive_restarts_from_its_checkpoint(tmp_path, _isolated_sparkgpu_home):
    where = tmp_path / "steps"
    where.mkdir()
    (where / "kill-rank-1-at-2").touch()
    client = _client(tmp_path, _isolated_sparkgpu_home, SUBMIT_AND_WAIT.format(where=str(where)))
    job_id = client.stdout.readline().strip()
    _kill_group(client)  # dead from the first minute
    _go(where, *range(6))
    results = attach(job_id).result(timeout=180)
    assert [(r["steps"], r["attempt"]) for r in results] == [(6, 1), (6, 1)]
    state = _state(job_id)
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"] and state["restarts"] == 1
    # Attempt 1 started from the checkpoint of the step rank 1 died at, not from the beginning.
    assert (where / "attempts-1").read_text().splitlines() == ["0:0", "1:2"]


def test_the_supervisor_killed_is_replaced_and_the_job_resumes_from_its_checkpoint(tmp_path, _isolated_sparkgpu_home):
    where = tmp_path / "steps"
    where.mkdir()
    client = _client(tmp_path, _isolated_sparkgpu_home, SUBMIT_AND_WAIT.format(where=str(where)))
    job_id = client.stdout.readline().strip()
    _kill_group(client)
    _go(where, 0, 1)
    assert wait_for(lambda: _stepped(where, 2), within=120), "the job never reached step 2"
    run_dir = RunDir(settings().staging_root / job_id)
    first = _state(job_id)["client"]["pid"]
    os.kill(first, signal.SIGKILL)  # the supervisor itself; its agent and ranks die with it
    assert wait_for(lambda: len(_state(job_id)["attempts"]) == 2, within=120), "no supervisor took over"
    _go(where, *range(2, 6))
    results = attach(job_id).result(timeout=120)
    assert [(r["steps"], r["attempt"]) for r in results] == [(6, 1), (6, 1)]
    state = _state(job_id)
    assert [a["status"] for a in state["attempts"]] == ["lost", "succeeded"]
    assert state["restarts"] == 0  # a supervisor's death is not the job's failure
    assert state["client"]["pid"] != first
    assert (where / "attempts-0").read_text().splitlines() == ["0:0", "1:2"]  # resumed at its checkpoint
    assert "died (signal 9)" in (run_dir.path / "supervisor.log").read_text()
    assert not keeper_alive(run_dir) or wait_for(lambda: not keeper_alive(run_dir), within=30)


@distributed(gpus=1, gpu_type="cpu")
def _forever(where: str):
    import pathlib
    import time

    pathlib.Path(where, f"started-{runtime.attempt()}").touch()
    time.sleep(600)


def test_cancel_from_another_process_stops_a_detached_job_and_nothing_is_left(tmp_path, capsys):
    from sparkgpu.cli import main

    call = _forever.submit(str(tmp_path))
    assert wait_for(lambda: (tmp_path / "started-0").exists(), within=90), "the rank never started"
    assert main(["cancel", call.job_id, "--timeout", "60"]) == 0
    assert f"job {call.job_id} is cancelled" in capsys.readouterr().out
    with pytest.raises(JobCancelledError):
        call.result(timeout=60)
    run_dir = settings().staging_root / call.job_id
    assert_no_orphans(run_dir, within=30)  # keeper, supervisor, agent and rank all ended
    assert [a["status"] for a in _state(call.job_id)["attempts"]] == ["cancelled"]


@distributed(gpus=1, gpu_type="cpu")
def _fails():
    raise KeyError("no column 'label' in batch 7")


def test_a_failed_detached_job_raises_the_remote_error_wherever_its_result_is_read():
    call = _fails.submit()
    with pytest.raises(WorkerFailedError, match="no column 'label'") as caught:
        call.result(timeout=120)
    assert isinstance(caught.value, KeyError)  # `except KeyError` catches it, as after .distributed()
    with pytest.raises(KeyError):
        attach(call.job_id).result()


@distributed(gpus=1, gpu_type="cpu")
def _once(where: str):
    import pathlib

    with open(pathlib.Path(where, "ran"), "a") as f:
        f.write("x")
    return runtime.job_id()


def test_a_submission_with_a_used_idempotency_key_returns_the_same_job(tmp_path):
    keyed = _once.with_overrides(idempotency_key="nightly-2026-12-02")
    first = keyed.submit(str(tmp_path))
    second = keyed.submit(str(tmp_path))
    assert second.job_id == first.job_id
    assert first.result(timeout=120) == [first.job_id]
    assert keyed.submit(str(tmp_path)).job_id == first.job_id  # ended: still the same job
    assert (tmp_path / "ran").read_text() == "x"  # it ran once
    runs = [p.name for p in settings().staging_root.iterdir() if (p / "spec.json").exists()]
    assert runs == [first.job_id]  # the second submission wrote nothing that stayed
    other = _once.with_overrides(idempotency_key="nightly-2026-12-03").submit(str(tmp_path))
    assert other.job_id != first.job_id
    other.result(timeout=120)
    with pytest.raises(ConfigurationError, match="idempotency_key"):
        _once.with_overrides(idempotency_key="  ").submit(str(tmp_path))


def test_the_keeper_is_named_sealed_and_needs_no_secret_on_its_command_line(tmp_path):
    call = _forever.submit(str(tmp_path))
    try:
        run_dir = RunDir(settings().staging_root / call.job_id)
        assert wait_for(lambda: (tmp_path / "started-0").exists(), within=90), "the rank never started"
        record = supervision_record(run_dir)
        assert record is not None and keeper_alive(run_dir)
        key = (settings().home / "keys" / call.job_id).read_bytes()
        for proc in processes_of(run_dir.path):
            environ = open(f"/proc/{proc.pid}/environ", "rb").read()
            cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read()
            assert key not in environ and key.hex().encode() not in environ
            assert key not in cmdline and key.hex().encode() not in cmdline
        assert os.stat(run_dir.path / "supervision.json").st_mode & 0o077 == 0
        assert os.stat(run_dir.path / "supervisor.log").st_mode & 0o077 == 0
        # A forged record (not sealed with the job's key) names no keeper.
        (run_dir.path / "supervision.json").write_text(json.dumps(record))
        assert supervision_record(run_dir) is None
    finally:
        call.cancel(timeout=60)
    assert call.status() is JobStatus.CANCELLED


def test_a_blocking_detached_call_streams_the_logs_here_and_returns_every_rank_result(tmp_path, capsys):
    @distributed(gpus=2, gpu_type="cpu", detach=True, log_ranks="all")
    def shout(word: str):
        print(f"{word} from rank {runtime.get_global_rank()}", flush=True)
        return word.upper(), runtime.get_global_rank()

    assert shout.distributed("hello") == [("HELLO", 0), ("HELLO", 1)]
    out = capsys.readouterr().out
    assert "[rank0] hello from rank 0" in out and "[rank1] hello from rank 1" in out
    state = _state(shout.last_job_id)
    assert state["status"] == "succeeded" and state["client"]["pid"] != os.getpid()  # not supervised here


TRACKED_CLIENT = """
import os, signal, sys
import torch
from sparkgpu import distributed, log, runtime

@distributed(gpus=2, gpu_type="cpu", experiment="/team/walk-away", register_as="main.ml.walkaway")
def train(where):
    import time
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, 16)
    for step in range(4):
        while not os.path.exists(os.path.join(where, "go")):  # the submitter is dead before step 0
            time.sleep(0.05)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        log({{"loss": loss.item()}}, step=step)
    model.eval()
    return model if runtime.is_main_process() else None

call = train.submit({where!r})
print(call.job_id, flush=True)
os.killpg(0, signal.SIGKILL)
"""


def test_with_no_client_the_mlflow_run_finishes_the_model_is_registered_and_usage_is_metered(
    tmp_path, monkeypatch, _isolated_sparkgpu_home
):
    import mlflow
    import pyarrow.compute as pc
    import torch

    from sparkgpu import registry
    from sparkgpu.config import reset_settings
    from sparkgpu.tracking import resolve_target
    from sparkgpu.usage.meter import UsageMeter

    monkeypatch.setenv("SPARKGPU_TRACKING", "1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reset_settings()
    client = start_client(
        tmp_path,
        _isolated_sparkgpu_home,
        TRACKED_CLIENT.format(where=str(tmp_path)),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    job_id = client.stdout.readline().strip()
    assert client.wait(timeout=60) == -signal.SIGKILL
    (tmp_path / "go").touch()
    results = attach(job_id).result(timeout=180)
    tracking = mlflow.MlflowClient(resolve_target().tracking_uri)
    experiment = tracking.get_experiment_by_name("/team/walk-away")
    (run,) = tracking.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert len(tracking.get_metric_history(run.info.run_id, "loss")) == 4
    version = registry.get_version("main.ml.walkaway")
    assert version.version == 1 and version.run_id == run.info.run_id
    assert version.tags["sparkgpu.job_id"] == job_id
    loaded = registry.load("main.ml.walkaway/1")
    x = torch.randn(2, 8, 16)
    assert torch.allclose(loaded(x), results[0](x))
    rows = UsageMeter().ledger.read()
    rows = rows.filter(pc.equal(rows["job_id"], job_id))
    assert rows.num_rows == 1 and pc.sum(rows["gpu_seconds"]).as_py() > 0


def _unpickled_in(where: str, name: str):
    """What a returned value unpickles to: the value, after noting which process unpickled it."""
    with open(os.path.join(where, f"unpickled-{name}"), "a") as f:
        f.write(f"{os.getpid()}\n")
    return name


class _NotedWhenUnpickled:
    """A returned value (a model, say) whose unpickling is seen: what importing its libraries costs."""

    def __init__(self, where: str, name: str):
        self.where, self.name = where, name

    def __reduce__(self):
        return _unpickled_in, (self.where, self.name)


class _ReadsResults(JobCallback):
    def __init__(self, where: str):
        self.where = where

    def after_job(self, job, results, error) -> None:
        with open(os.path.join(self.where, "after-job"), "w") as f:
            f.write(repr(results))


@distributed(gpus=2, gpu_type="cpu")
def _returns_a_model(where: str):
    return _NotedWhenUnpickled(where, f"rank{runtime.get_global_rank()}")


def test_a_detached_supervisor_leaves_results_pickled_unless_a_callback_reads_them(tmp_path):
    # Nobody in the supervisor reads them: it ends the job without unpickling (importing) them.
    call = _returns_a_model.submit(str(tmp_path))
    assert call.result(timeout=120) == ["rank0", "rank1"]
    assert [(tmp_path / f"unpickled-rank{r}").read_text().split() for r in (0, 1)] == [[str(os.getpid())]] * 2
    assert _state(call.job_id)["status"] == "succeeded"

    # A callback whose after_job reads them gets them, unpickled in the supervisor.
    for r in (0, 1):
        (tmp_path / f"unpickled-rank{r}").unlink()
    read = _returns_a_model.with_overrides(callbacks=[_ReadsResults(str(tmp_path))]).submit(str(tmp_path))
    assert read.result(timeout=120) == ["rank0", "rank1"]
    assert (tmp_path / "after-job").read_text() == "['rank0', 'rank1']"
    pids = {r: (tmp_path / f"unpickled-rank{r}").read_text().split() for r in (0, 1)}
    assert all(len(p) == 2 and p[1] == str(os.getpid()) and p[0] != str(os.getpid()) for p in pids.values()), pids
