"""Failures named by class, from real exceptions and real tracebacks, and the policy per class.

Each failure is the record a rank writes (:class:`RankFailure`, as ``serialize_error`` builds it)
of an exception really raised, of torch's own classes where torch has one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from sparkgpu.data.transforms import TransformError
from sparkgpu.errors import ConfigurationError, EnvironmentMismatchError, RankFailure, ResultError
from sparkgpu.failure_class import OOM_KILLED, FailureClass, classify, oom_kills, own_cgroup
from sparkgpu.launch.client.attempt_verdict import read_attempt
from sparkgpu.launch.client.failure_policy import Decision, FailurePolicy
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.launch.node.rank_exits import RankExitWatcher
from sparkgpu.rundir.states import NodeExit, RankExit
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from tests.rank_failures import raised

KEY = b"k" * 32
#: The message torch's NCCL watchdog raises when a collective times out.
WATCHDOG = (
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, "
    "NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600021 milliseconds before timing out."
)
OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
    "1.05 GiB is free. Of the allocated memory 79.1 GiB is allocated by PyTorch, and 12.0 MiB is reserved "
    "by PyTorch but unallocated."
)


def train_step(step: int):
    raise torch.cuda.OutOfMemoryError(OOM)


def train_loop():
    for step in range(812, 813):
        try:
            train_step(step)
        except torch.cuda.OutOfMemoryError as exc:
            raise RuntimeError(f"training failed at step {step}") from exc


def all_reduce():
    raise dist.DistBackendError(WATCHDOG)


def died(signum: int, rank: int = 0, message: str = "") -> RankFailure:
    text = message or f"the process died from signal {signal.Signals(signum).name} (exit code {-signum})"
    return RankFailure(rank, None, text, exitcode=-signum, timestamp=1.0)


def test_a_cuda_oom_is_named_with_its_memory_figures():
    failure, exc = raised(lambda: train_step(812))
    found = classify([failure], {0: exc})
    assert found.cls is FailureClass.CUDA_OOM
    assert found.detail == "CUDA out of memory: tried to allocate 2.00 GiB; 79.1 GiB in use"
    # Known by its type's name and message too, where the exception did not unpickle here.
    assert classify([failure], {}).cls is FailureClass.CUDA_OOM


def test_a_cuda_oom_wrapped_by_the_users_loop_names_its_step():
    failure, exc = raised(train_loop)
    # The raised RuntimeError says the step; the OOM is in its chained traceback.
    failure.message = f"{failure.message}: {OOM}"
    found = classify([failure], {0: exc})
    assert found.cls is FailureClass.CUDA_OOM
    assert found.detail.startswith("CUDA out of memory at step 812: tried to allocate 2.00 GiB")


def test_an_nccl_watchdog_timeout_is_nccl_and_a_peers_error_after_it_is_not_the_cause():
    watchdog, exc = raised(all_reduce, rank=1, at=1.0)
    follower, key_error = raised(lambda: {}["x"], rank=0, at=5.0)
    found = classify([follower, watchdog], {0: key_error, 1: exc})
    assert found.cls is FailureClass.NCCL
    assert found.detail.startswith("DistBackendError: [Rank 1] Watchdog caught collective operation timeout")


def test_a_plain_dist_error_is_no_nccl_failure_without_nccl_in_it():
    failure, exc = raised(lambda: (_ for _ in ()).throw(dist.DistNetworkError("connect() timed out")))
    assert classify([failure], {0: exc}).cls is FailureClass.USER_EXCEPTION


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE])
def test_a_crash_signal_is_a_native_crash(signum):
    found = classify([died(signum)])
    assert found.cls is FailureClass.NATIVE_CRASH and signal.Signals(signum).name in found.detail


def test_sigkill_is_host_oom_only_with_the_cgroups_evidence():
    assert classify([died(signal.SIGKILL)]).cls is FailureClass.KILLED
    evidence = died(signal.SIGKILL, message=f"the process died from signal SIGKILL: {OOM_KILLED}")
    assert classify([evidence]).cls is FailureClass.HOST_OOM
    assert classify([died(signal.SIGSEGV, message=OOM_KILLED)]).cls is FailureClass.NATIVE_CRASH


def test_a_lost_node_is_named_before_its_peers_errors():
    peer, exc = raised(lambda: {}["x"])
    found = classify([peer], {0: exc}, lost="executor 7 on host 10.0.0.7 was lost")
    assert found.cls is FailureClass.LOST_NODE and "10.0.0.7" in found.detail


def test_data_environment_and_result_errors_by_type_or_name():
    data, data_exc = raised(lambda: (_ for _ in ()).throw(TransformError("column 'text' is null in row 3")))
    assert classify([data], {0: data_exc}).cls is FailureClass.DATA_ERROR
    missing, missing_exc = raised(lambda: __import__("no_such_module_of_the_users"))
    assert classify([missing], {0: missing_exc}).cls is FailureClass.ENVIRONMENT_ERROR
    assert classify([missing], {}).cls is FailureClass.ENVIRONMENT_ERROR
    mismatch = EnvironmentMismatchError("torch 2.1 on the workers, 2.4 here")
    assert classify([RankFailure(0, "sparkgpu.errors.EnvironmentMismatchError", str(mismatch))]).cls is (
        FailureClass.ENVIRONMENT_ERROR
    )
    result = RankFailure(0, "sparkgpu.errors.ResultError", "its result could not be written back")
    assert classify([result], {0: ResultError(result.message)}).cls is FailureClass.RESULT_ERROR
    user, user_exc = raised(lambda: {}["labels"])
    found = classify([user], {0: user_exc})
    assert found.cls is FailureClass.USER_EXCEPTION and found.detail == "KeyError: 'labels'"


def test_the_default_policy_per_class():
    policy = FailurePolicy(max_restarts=3)
    oom, oom_exc = raised(lambda: train_step(812))
    assert policy.decide(0, {0: oom_exc}, [oom]) is Decision.RAISE
    why = policy.unrestartable({0: oom_exc}, [oom])
    assert why is not None and "tried to allocate 2.00 GiB" in why
    assert "batch size" in why and "gradient checkpointing" in why and "restart_on=" in why
    nccl, nccl_exc = raised(all_reduce)
    assert policy.decide(0, {0: nccl_exc}, [nccl]) is Decision.RESTART
    assert policy.decide(0, {}, [died(signal.SIGSEGV)]) is Decision.RESTART
    assert policy.decide(0, {}, [died(signal.SIGKILL)]) is Decision.RESTART
    assert policy.decide(3, {0: nccl_exc}, [nccl]) is Decision.RAISE  # none left
    data, data_exc = raised(lambda: (_ for _ in ()).throw(TransformError("bad row")))
    assert policy.decide(0, {0: data_exc}, [data]) is Decision.RAISE


def test_restart_on_names_the_restarted_classes():
    oom, oom_exc = raised(lambda: train_step(812))
    nccl, nccl_exc = raised(all_reduce)
    policy = FailurePolicy(max_restarts=3, restart_on=RunPolicy(restart_on=["cuda_oom"]).restart_on)
    assert policy.decide(0, {0: oom_exc}, [oom]) is Decision.RESTART
    assert policy.decide(0, {0: nccl_exc}, [nccl]) is Decision.RAISE
    why = policy.unrestartable({0: nccl_exc}, [nccl])
    assert why is not None and why.startswith("(nccl: DistBackendError") and "restart_on= does not name" in why


def test_restart_on_is_checked_when_the_policy_is_made():
    with pytest.raises(
        ConfigurationError, match="restart_on= got 'ncc', which is no failure class; use some of "
    ) as err:
        RunPolicy(restart_on=["ncc"])
    assert "cuda_oom" in str(err.value) and "user_exception" in str(err.value)
    with pytest.raises(ConfigurationError, match="restart_on= takes failure class names"):
        RunPolicy(restart_on=3)
    assert RunPolicy(restart_on="nccl").restart_on == ("nccl",)
    assert RunPolicy(restart_on=[FailureClass.NCCL, "killed"]).restart_on == ("nccl", "killed")


def test_oom_kills_reads_the_cgroups_memory_events(tmp_path):
    assert oom_kills(tmp_path) is None  # no memory.events: no evidence either way
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    assert oom_kills(tmp_path) == 2
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job.scope\n")
    assert own_cgroup(proc, root=tmp_path / "fs") == tmp_path / "fs" / "user.slice" / "job.scope"


def test_the_watcher_records_an_oom_kill_only_when_the_cgroups_counter_rose(tmp_path):
    events = tmp_path / "memory.events"
    events.write_text("oom 0\noom_kill 4\n")
    with RankExitWatcher("run", reported=lambda rank: False, ranks=0, cgroup=tmp_path) as watcher:
        plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        watcher.adopt(plain.pid, 0)
        plain.kill()
        _exited(watcher, 0)
        plain.wait()
        events.write_text("oom 1\noom_kill 5\n")  # the kernel killed a process of the cgroup meanwhile
        victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        watcher.adopt(victim.pid, 1)
        victim.kill()
        _exited(watcher, 1)
        victim.wait()
    assert watcher.exits[0].signal == "SIGKILL" and not watcher.exits[0].oom_killed
    assert watcher.exits[1].signal == "SIGKILL" and watcher.exits[1].oom_killed
    # It travels in the node's exit record, and reads back as the host's OOM killer.
    record = RankExit.from_json(watcher.exits[1].to_json())
    assert record.oom_killed and "oom_killed" not in watcher.exits[0].to_json()


def _exited(watcher: RankExitWatcher, rank: int) -> None:
    # The watcher's thread records the exit as soon as waitid returns; the process stays unreaped till then.
    deadline = time.monotonic() + 60
    while rank not in watcher.exits:
        assert time.monotonic() < deadline, f"rank {rank}'s exit was never recorded"
        time.sleep(0.01)


def test_a_node_exit_record_with_the_oom_evidence_reads_back_as_host_oom(tmp_path):
    job = JobSpec(job_id="job-1", name="job", resources=Resources(2, "cpu"))
    rd = RunDir(tmp_path / "job-1")
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), KEY, [])
    for attempt, oom_killed in ((0, True), (1, False)):
        rd.prepare_attempt(attempt)
        killed = RankExit(-signal.SIGKILL, signal="SIGKILL", time=1.0, oom_killed=oom_killed)
        node = NodeExit(0, 1, {1: killed})
        rd.write_control(rd.file(RunLayout.node_exits(attempt, 0)), json.dumps(node.to_json()).encode())
        rd.write_result(attempt, 0, 0)  # rank 0 returned; rank 1 was killed
    oom = read_attempt(rd, 0, 2, job.policy)
    assert classify(oom.failures, oom.exceptions).cls is FailureClass.HOST_OOM
    plain = read_attempt(rd, 1, 2, job.policy)
    assert classify(plain.failures, plain.exceptions).cls is FailureClass.KILLED


def test_a_long_detail_is_cut_at_a_word_and_marked_so():
    from sparkgpu.failure_class import DETAIL_CHARS, _first_line

    words = "rank 0 at collective #5 (gloo:barrier, not completed); rank 1 at collective #4 (gloo:barrier, completed)"
    line = ("no progress for 10.0s; " * 20) + words
    cut = _first_line(line + "\nsecond line")
    assert len(cut) <= DETAIL_CHARS and cut.endswith("…")
    assert line.startswith(cut[:-1]) and line[len(cut) - 1] in " ,;("  # the cut falls between words
    assert _first_line("short\nmore") == "short" and _first_line("") == ""
