"""`.distributed()` on real processes: torch's elastic agent, gloo process groups, real signals."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from sparkgpu.rundir.keyring import load_key
from sparkgpu import CapacityError, JobTimeoutError, SerializationError, WorkerFailedError, distributed, runtime
from sparkgpu.callbacks import JobCallback
from sparkgpu.errors import ConfigurationError
from sparkgpu.config import settings
from tests.integration.processes import assert_no_orphans, ctrl_c_client, processes_of, start_client, wait_for

pytestmark = pytest.mark.integration


@distributed(gpus=2, gpu_type="cpu")
def all_reduce_step(x):
    import torch
    import torch.distributed as dist

    t = torch.tensor([x * (runtime.get_global_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def test_the_readme_snippet_returns_one_result_per_rank():
    assert all_reduce_step.distributed(10) == [30, 30]
    assert all_reduce_step(10) == 10


def test_four_ranks_see_their_ranks_and_a_gloo_group():
    @distributed(gpus=4, gpu_type="cpu", log_ranks="all")
    def who():
        import torch.distributed as dist

        return (
            runtime.get_global_rank(),
            runtime.get_local_rank(),
            runtime.get_world_size(),
            runtime.is_main_process(),
            str(runtime.device()),
            dist.get_backend(),
            runtime.job_id(),
        )

    results = who.distributed()
    assert [r[0] for r in results] == [0, 1, 2, 3]
    assert [r[1] for r in results] == [0, 1, 2, 3]
    assert {r[2] for r in results} == {4}
    assert [r[3] for r in results] == [True, False, False, False]
    assert {r[4] for r in results} == {"cpu"} and {r[5] for r in results} == {"gloo"}
    assert {r[6] for r in results} == {who.last_job_id}


def test_live_output_is_prefixed_by_rank_and_kept_in_the_run_dir(capsys):
    @distributed(gpus=2, gpu_type="cpu", log_ranks="all")
    def chatty():
        print(f"hello from {runtime.get_global_rank()}", flush=True)
        print("to stderr", file=sys.stderr, flush=True)

    chatty.distributed()
    out = capsys.readouterr().out
    assert "[rank0] hello from 0" in out and "[rank1] hello from 1" in out and "[rank1] to stderr" in out
    log = settings().staging_root / chatty.last_job_id / "attempts" / "0" / "logs" / "rank-1.log"
    assert "hello from 1" in log.read_text()


def test_default_streams_only_rank_zero(capsys):
    @distributed(gpus=2, gpu_type="cpu")
    def chatty():
        print(f"line of rank {runtime.get_global_rank()}", flush=True)

    chatty.distributed()
    out = capsys.readouterr().out
    assert "[rank0] line of rank 0" in out and "line of rank 1" not in out


class ShardError(Exception):
    pass


def test_exception_on_one_rank_names_the_rank_and_the_remote_traceback():
    # Stuck in the collective, the job would end at its timeout (JobTimeoutError), not as below.
    @distributed(gpus=2, gpu_type="cpu", timeout=240)
    def flaky():
        import torch
        import torch.distributed as dist

        if runtime.get_global_rank() == 1:
            raise ShardError("shard 7 is corrupt")
        dist.all_reduce(torch.ones(1))  # rank 0 waits on rank 1, which is gone

    with pytest.raises(WorkerFailedError) as err:
        flaky.distributed()
    text = str(err.value)
    assert "rank 1: " in text and "ShardError: shard 7 is corrupt" in text
    assert "Remote traceback" in text and 'raise ShardError("shard 7 is corrupt")' in text
    assert isinstance(err.value.__cause__, ShardError)  # the original exception, chained
    # Rank 0 fails too where its all_reduce sees rank 1 leave before the launcher stops it; where
    # the launcher is first (a busy machine), rank 0 was torn down, which is no failure of its own.
    # Either way rank 1 is the one named first.
    assert err.value.first_failure.rank == 1
    if err.value.ranks == [0, 1]:
        assert "2 rank(s) failed" in text and "First to fail: rank 1 (" in text
    else:
        assert err.value.ranks == [1] and text.startswith("1 rank(s) failed") and "First to fail" not in text
    assert_no_orphans(settings().staging_root / flaky.last_job_id)


def test_identical_failures_on_every_rank_are_grouped():
    @distributed(gpus=3, gpu_type="cpu")
    def broken():
        raise KeyError("feature 'age' missing")

    with pytest.raises(WorkerFailedError) as err:
        broken.distributed()
    assert err.value.ranks == [0, 1, 2]
    assert "ranks 0, 1, 2: KeyError" in str(err.value)
    assert str(err.value).count("Remote traceback") == 1


def test_segfault_reports_the_signal_and_the_log_tail():
    @distributed(gpus=2, gpu_type="cpu")
    def crash():
        import ctypes
        import time as _t

        if runtime.get_global_rank() == 0:
            print("about to read address 0", flush=True)
            ctypes.string_at(0)
        _t.sleep(60)

    with pytest.raises(WorkerFailedError) as err:
        crash.distributed()
    failure = err.value.failures[0]
    assert failure.rank == 0 and failure.exc_type is None and failure.exitcode == -signal.SIGSEGV
    assert "SIGSEGV" in str(err.value) and "about to read address 0" in str(err.value)
    assert "Fatal Python error" in str(err.value)  # faulthandler's dump landed in the log
    assert_no_orphans(settings().staging_root / crash.last_job_id)


def _how_the_rank_started():
    import traceback

    import psutil

    agent = psutil.Process(os.getppid())
    return {
        "agent": "sparkgpu.launch.node.agent" in agent.cmdline(),
        "own_cmdline": psutil.Process().cmdline(),
        "agent_cmdline": agent.cmdline(),
        "torch_launcher_frames": [f.filename for f in traceback.extract_stack() if "torch/distributed" in f.filename],
    }


@pytest.mark.parametrize("fork", ["1", "0"])
def test_ranks_are_forked_from_their_agent_unless_told_to_start_new_interpreters(monkeypatch, fork):
    """Forked, a rank skips its own interpreter's start and torch's import; its stack holds no
    frame of torch's launcher (a crash dump shows the user's frames, not the agent's)."""
    monkeypatch.setenv("SPARKGPU_FORK_RANKS", fork)
    job = distributed(gpus=2, gpu_type="cpu", log_ranks=None)(_how_the_rank_started)
    ranks = job.distributed()
    assert len(ranks) == 2, ranks  # one answer per rank
    for seen in ranks:
        assert seen["agent"], seen
        assert not seen["torch_launcher_frames"], seen
        if fork == "1":
            assert seen["own_cmdline"] == seen["agent_cmdline"]
        else:
            assert seen["own_cmdline"][1:3] == ["-u", "-c"]


def test_os_exit_reports_the_exit_code():
    @distributed(gpus=2, gpu_type="cpu")
    def quit_hard():
        if runtime.get_global_rank() == 1:
            os._exit(3)
        return "fine"

    with pytest.raises(WorkerFailedError, match="rank 1: the process exited with code 3") as err:
        quit_hard.distributed()
    assert err.value.failures[0].exitcode == 3


def _no_process(*args, **kwargs):
    raise AssertionError(f"a process was started: {args[:1]}")


def test_unpicklable_argument_fails_before_any_process_starts(monkeypatch):
    with monkeypatch.context() as starts:  # no rank, no agent, no helper process of any kind
        starts.setattr(subprocess, "Popen", _no_process)
        starts.setattr(os, "fork", _no_process)
        with pytest.raises(SerializationError, match="positional argument 0 .*lock"):
            all_reduce_step.distributed(threading.Lock())
    assert not settings().staging_root.exists() or not any(settings().staging_root.iterdir())


def test_too_many_gpus_is_an_error_before_any_process_starts(monkeypatch):
    @distributed(gpus=2, gpu_type="H100")
    def train():
        return 1

    with monkeypatch.context() as starts:
        starts.setattr(subprocess, "Popen", _no_process)
        starts.setattr(os, "fork", _no_process)
        with pytest.raises(CapacityError, match="this host has no GPUs"):
            train.distributed()


def test_simulated_gpus_get_one_address_per_rank(monkeypatch):
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "H100:4")
    settings.cache_clear()

    @distributed(gpus=2, gpu_type="H100")
    def where():
        import torch.distributed as dist

        return runtime.gpu_address(), str(runtime.device()), dist.get_backend()

    assert where.distributed() == [("0", "cpu", "gloo"), ("1", "cpu", "gloo")]

    @distributed(gpus=5, gpu_type="H100")
    def too_many():
        return 1

    with pytest.raises(CapacityError, match="4 x simulated H100"):
        too_many.distributed()


def test_timeout_stops_every_rank():
    @distributed(gpus=2, gpu_type="cpu", timeout=8)
    def sleepy():
        import time as _t

        _t.sleep(600)

    started = time.monotonic()
    with pytest.raises(JobTimeoutError, match="timeout of 8s"):
        sleepy.distributed()
    assert time.monotonic() - started < 120  # the timeout ended it, long before the ranks' sleep would
    assert_no_orphans(settings().staging_root / sleepy.last_job_id)


def test_large_results_come_back_whole():
    @distributed(gpus=2, gpu_type="cpu")
    def big():
        import numpy as np

        return np.full(30_000_000, runtime.get_global_rank(), dtype=np.float32)  # 120 MB per rank

    results = big.distributed()
    assert [r.nbytes for r in results] == [120_000_000, 120_000_000]
    assert results[0][-1] == 0 and results[1][12345] == 1


def test_tampered_payload_is_refused_by_the_workers():
    from sparkgpu.launch.client.supervisor import Supervisor

    prepared = all_reduce_step.prepare((10,), {}).write()
    parts = pickle.loads(prepared.run_dir.payload_file.read_bytes())
    parts["args"] = [pickle.dumps(99)]
    prepared.run_dir.payload_file.write_bytes(pickle.dumps(parts))
    with pytest.raises(WorkerFailedError, match="PayloadSignatureError.*modified"):
        Supervisor(prepared.job, prepared.run_dir, prepared.backend, prepared.key, []).run()


def test_job_key_never_reaches_the_run_dir_or_user_code():
    @distributed(gpus=1, gpu_type="cpu")
    def env_keys():
        return sorted(k for k in os.environ if "KEY" in k)

    assert env_keys.distributed() == [[]]
    run_dir = settings().staging_root / env_keys.last_job_id
    key = load_key(env_keys.last_job_id)
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert any(path.name == "state.json" for path in files), files  # the run dir was looked through
    for path in files:
        assert key.hex().encode() not in path.read_bytes() and key not in path.read_bytes()


CTRL_C_CLIENT = ctrl_c_client('@distributed(gpus=2, gpu_type="cpu")')


def _both_ranks_run(runs) -> bool:
    logs = list(runs.glob("*/attempts/0/logs/rank-*.log"))
    return len(logs) == 2 and all("started" in p.read_text() for p in logs)


def _wait_or_fail(client, predicate, failure: str) -> None:
    """Fails the test (killing its client) unless ``predicate`` comes true: the checks that
    follow prove nothing about ranks that never ran."""
    if not wait_for(predicate):
        client.kill()
        client.wait()
        pytest.fail(failure)


@pytest.mark.parametrize("detach", [False, True], ids=["supervised-by-the-caller", "detached"])
def test_ctrl_c_in_the_caller_stops_every_rank(detach, tmp_path, _isolated_sparkgpu_home):
    """Ctrl-C in a blocking ``.distributed()`` cancels the job, also one whose supervisor is detached."""
    import json

    source = ctrl_c_client('@distributed(gpus=2, gpu_type="cpu", detach=True)') if detach else CTRL_C_CLIENT
    client = start_client(tmp_path, _isolated_sparkgpu_home, source, stdout=subprocess.PIPE, text=True)
    runs = _isolated_sparkgpu_home / "runs"
    _wait_or_fail(client, lambda: _both_ranks_run(runs), "ranks never started")
    client.send_signal(signal.SIGINT)
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 130, out
    run_dir = next(runs.iterdir())
    assert_no_orphans(run_dir)
    assert json.loads((run_dir / "state.json").read_text())["status"] == "cancelled"


def test_killed_client_leaves_no_orphans(tmp_path, _isolated_sparkgpu_home):
    client = start_client(tmp_path, _isolated_sparkgpu_home, CTRL_C_CLIENT, stdout=subprocess.DEVNULL)
    runs = _isolated_sparkgpu_home / "runs"
    _wait_or_fail(client, lambda: _both_ranks_run(runs), "ranks never started")
    client.kill()  # SIGKILL: no cleanup code runs in the client
    client.wait()
    assert_no_orphans(next(runs.iterdir()), within=15)


RESUMABLE_CLIENT = textwrap.dedent("""
    import os, time
    from sparkgpu import distributed, runtime

    @distributed(gpus=2, gpu_type="cpu")
    def train():
        # Not named like a checkpoint (step-N): the supervisor reads the checkpoint dir.
        marker = os.path.join(runtime.checkpoint_dir(), f"progress-of-rank-{runtime.get_global_rank()}")
        if os.path.exists(marker):
            return ("resumed", runtime.attempt(), open(marker).read())
        with open(marker, "w") as f:
            f.write("500")
        print("checkpointed", flush=True)
        time.sleep(600)

    train.distributed()
""")


def test_resume_continues_a_job_whose_client_died(tmp_path, _isolated_sparkgpu_home):
    import json

    from sparkgpu.launch.client.resume import resume_job

    client = start_client(tmp_path, _isolated_sparkgpu_home, RESUMABLE_CLIENT, stdout=subprocess.DEVNULL)
    runs = _isolated_sparkgpu_home / "runs"

    def both_saved() -> bool:
        return len(list(runs.glob("*/checkpoints/progress-of-rank-*"))) == 2

    _wait_or_fail(client, both_saved, "ranks never checkpointed")
    client.kill()
    client.wait()
    run_dir = next(runs.iterdir())
    assert_no_orphans(run_dir, within=15)
    assert json.loads((run_dir / "state.json").read_text())["status"] == "running"

    assert resume_job(run_dir.name) == [("resumed", 1, "500")] * 2
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "succeeded"
    assert [a["status"] for a in state["attempts"]] == ["lost", "succeeded"]
    assert not any(run_dir.rglob("*key*"))  # the signing key never lands in the run dir


def test_resume_refuses_unknown_and_finished_jobs():
    from sparkgpu import ConfigurationError
    from sparkgpu.launch.client.resume import resume_job

    with pytest.raises(ConfigurationError, match="sparkgpu jobs"):
        resume_job("no-such-job")
    all_reduce_step.distributed(1)
    with pytest.raises(ConfigurationError, match="already succeeded"):
        resume_job(all_reduce_step.last_job_id)


def assert_a_crashed_ranks_checkpointing_peer_is_killed_soon(tmp_path, backend="local") -> None:
    """The peer's SIGTERM is a checkpoint request (as a Checkpointer sets it up), and it is stuck
    waiting for the crashed rank: it is killed soon after the crash, not the grace (10 s) later."""
    crashed_at = tmp_path / "crashed_at"

    @distributed(gpus=2, gpu_type="cpu", backend=backend)
    def crash_beside_a_checkpointer(path):
        import time as _t

        runtime.handle_sigterm_as_checkpoint_request()
        if runtime.get_global_rank() == 0:
            _t.sleep(1)
            with open(path, "w") as f:
                f.write(repr(_t.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        _t.sleep(120)  # as a rank blocked in a collective with the dead one

    with pytest.raises(WorkerFailedError) as err:
        crash_beside_a_checkpointer.distributed(str(crashed_at))
    assert time.time() - float(crashed_at.read_text()) < 8
    assert err.value.failures[0].rank == 0 and err.value.failures[0].exitcode == -signal.SIGKILL
    assert_no_orphans(settings().staging_root / crash_beside_a_checkpointer.last_job_id)


def test_a_crashed_rank_does_not_leave_a_checkpointing_peer_to_sit_out_the_shutdown_grace(tmp_path):
    assert_a_crashed_ranks_checkpointing_peer_is_killed_soon(tmp_path)


def test_a_restart_forks_its_ranks_from_the_jobs_standby_which_ends_with_the_job():
    """A job that may restart gets a standby with torch imported once its attempt is under way;
    the restart's ranks are forked from it (no new interpreter), and it ends with the job."""
    from sparkgpu.launch.backends.local.backend import LocalBackend

    @distributed(gpus=2, gpu_type="cpu", max_restarts=1, log_ranks=None)
    def crash_once(wait):
        import time as _t

        import psutil

        if runtime.attempt() == 0:
            _t.sleep(wait)  # long enough for the supervisor to start the standby
            if runtime.get_global_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            _t.sleep(120)
        parent = psutil.Process(os.getppid())
        return runtime.attempt(), parent.pid, parent.cmdline()

    results = crash_once.distributed(LocalBackend.standby_delay + 1.5)
    assert [r[0] for r in results] == [1, 1]
    (standby_pid,) = {r[1] for r in results}
    assert all("sparkgpu.launch.backends.local.zygote" in r[2] and "standby" in r[2] for r in results)
    assert not psutil.pid_exists(standby_pid) or psutil.Process(standby_pid).status() == psutil.STATUS_ZOMBIE
    assert list((settings().home / "standby").iterdir()) == []


def test_a_killed_client_takes_its_jobs_standby_with_it(tmp_path, _isolated_sparkgpu_home):
    client = start_client(
        tmp_path,
        _isolated_sparkgpu_home,
        ctrl_c_client('@distributed(gpus=2, gpu_type="cpu", max_restarts=1)'),
        stdout=subprocess.DEVNULL,
    )
    standbys = _isolated_sparkgpu_home / "standby"
    _wait_or_fail(client, lambda: any(standbys.glob("*/pool.json")), "the job's standby never started")
    assert processes_of(standbys)
    client.kill()  # SIGKILL: no cleanup code runs in the client
    client.wait()
    assert_no_orphans(standbys, within=15)
    assert_no_orphans(next((_isolated_sparkgpu_home / "runs").iterdir()), within=15)


class _SlowCallback(JobCallback):
    """Takes a second to set the job up (as creating an MLflow run can) and hands the ranks a variable."""

    def before_job(self, job, run_dir):
        time.sleep(1.0)
        agents = [p for p in processes_of(run_dir) if "sparkgpu.launch.node.agent" in " ".join(p.cmdline())]
        ranks = list((Path(run_dir) / "attempts").glob("*/logs/rank-*.log"))
        self.seen = (len(agents), len(ranks))

    def before_attempt(self, job, attempt):
        return {"SPARKGPU_TEST_FROM_CALLBACK": f"attempt {attempt}"}


class _RefusingCallback(JobCallback):
    def before_job(self, job, run_dir):
        raise ConfigurationError("the tracking server is down")


def test_the_first_agent_starts_beside_the_callbacks_and_no_rank_before_them():
    callback = _SlowCallback()

    @distributed(gpus=2, gpu_type="cpu", log_ranks=None, callbacks=[callback])
    def read_the_callbacks_variable():
        return os.environ.get("SPARKGPU_TEST_FROM_CALLBACK")

    assert read_the_callbacks_variable.distributed() == ["attempt 0", "attempt 0"]
    assert callback.seen == (1, 0)  # the agent ran while the callback did; no rank had started


def test_a_callback_that_fails_before_the_job_leaves_no_agent_and_no_attempt():
    @distributed(gpus=2, gpu_type="cpu", log_ranks=None, callbacks=[_RefusingCallback()])
    def never_runs():
        return 1

    with pytest.raises(ConfigurationError, match="tracking server is down"):
        never_runs.distributed()
    run_dir = settings().staging_root / never_runs.last_job_id
    assert_no_orphans(run_dir)
    assert not (run_dir / "attempts").exists() or list((run_dir / "attempts").iterdir()) == []


def _what_the_rank_had_imported():
    import sys

    already = "transformers.trainer" in sys.modules  # before this function's own import below
    if not already:
        return False  # the import below, which the agent reads, would cost this rank seconds for nothing
    from transformers import Trainer  # noqa: F401

    return already


@pytest.mark.parametrize("fork", ["1", "0"])
def test_libraries_the_function_imports_are_imported_once_by_the_agent_before_the_fork(monkeypatch, fork):
    """transformers' Trainer costs each rank about 3.5 s of CPU to import: a forked rank finds it
    imported by its agent (docs/guides/launch.md, "How ranks start")."""
    monkeypatch.setenv("SPARKGPU_FORK_RANKS", fork)
    job = distributed(gpus=2, gpu_type="cpu", log_ranks=None)(_what_the_rank_had_imported)
    assert job.distributed() == [fork == "1"] * 2


def _imported_at_the_restart():
    import sys
    import time

    import psutil

    already = "transformers.trainer" in sys.modules
    from transformers import Trainer  # noqa: F401

    if runtime.attempt() == 0:
        time.sleep(4)  # the job's standby starts 2 s into the attempt
        if runtime.get_global_rank() == 1:
            os._exit(3)
        time.sleep(60)  # stopped by its agent once rank 1 is gone
    return already, "sparkgpu.launch.backends.local.zygote" in " ".join(psutil.Process(os.getppid()).cmdline())


def test_a_restart_from_the_standby_finds_the_libraries_imported_too():
    job = distributed(gpus=2, gpu_type="cpu", log_ranks=None, max_restarts=1)(_imported_at_the_restart)
    assert job.distributed() == [(True, True)] * 2  # forked by the standby, transformers imported there
