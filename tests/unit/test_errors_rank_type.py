"""The client's error for failed ranks is also an instance of the type the ranks raised."""

import pickle
import subprocess
import sys

import pytest

from sparkgpu.errors import RankFailure, SparkGPUError, WorkerFailedError, worker_failed_error


class ShardError(ValueError):
    def __init__(self, shard: int, reason: str):  # an __init__ with arguments of its own
        super().__init__(f"shard {shard}: {reason}")
        self.shard = shard


def _failures(exc_by_rank):
    return [
        RankFailure(r, type(e).__qualname__, str(e), f"Traceback...\n{type(e).__name__}: {e}", timestamp=1.0 + r)
        for r, e in exc_by_rank.items()
    ]


def test_one_type_on_every_failing_rank_is_caught_by_that_type():
    excs = {0: ShardError(3, "corrupt"), 1: ShardError(5, "corrupt")}
    error = worker_failed_error(_failures(excs), excs, "job-1", "/logs")
    assert isinstance(error, WorkerFailedError) and isinstance(error, SparkGPUError)
    assert isinstance(error, ShardError) and isinstance(error, ValueError)
    assert type(error).rank_exception_type is ShardError
    assert type(error).__name__ == "WorkerFailedError(ShardError)"
    assert error.ranks == [0, 1] and error.job_id == "job-1"
    assert "ranks 0, 1" not in str(error)  # distinct messages stay apart
    assert "rank 0: ShardError: shard 3: corrupt" in str(error) and "Logs of every rank: /logs" in str(error)
    with pytest.raises(ValueError, match="shard 3: corrupt"):
        raise error


def test_the_message_stays_ours_where_the_type_formats_its_args_otherwise():
    excs = {0: KeyError("label")}
    error = worker_failed_error(_failures(excs), excs)
    assert isinstance(error, KeyError)
    assert str(error).startswith("1 rank(s) failed.")


def test_derived_error_pickles_and_derives_again():
    excs = {1: ShardError(1, "bad")}
    error = worker_failed_error(_failures(excs), excs, "job-2", "/logs")
    again = pickle.loads(pickle.dumps(error))
    assert type(again).rank_exception_type is ShardError and isinstance(again, ShardError)
    assert str(again) == str(error) and again.job_id == "job-2" and again.ranks == [1]


def test_derived_error_unpickles_as_plain_where_the_type_does_not_exist():
    excs = {0: ShardError(1, "bad")}
    data = pickle.dumps(worker_failed_error(_failures(excs), excs))
    code = (
        "import pickle, sys; e = pickle.loads(sys.stdin.buffer.read()); "
        "print(type(e).__name__, e.ranks, isinstance(e, ValueError))"
    )
    # The test module is not importable in a fresh interpreter run from elsewhere.
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True, cwd="/")
    assert out.stdout.decode().split() == ["WorkerFailedError", "[0]", "False"]


@pytest.mark.parametrize(
    "excs",
    [
        {0: ValueError("a"), 1: TypeError("b")},  # two types
        {0: ValueError("a"), 1: None},  # rank 1 died without an exception (or it did not unpickle)
        {0: SystemExit(3)},  # never end the client's interpreter
        {0: KeyboardInterrupt()},
    ],
)
def test_falls_back_to_plain_worker_failed_error(excs):
    failures = [RankFailure(r, None if e is None else type(e).__name__, str(e)) for r, e in excs.items()]
    error = worker_failed_error(failures, {r: e for r, e in excs.items() if e is not None})
    assert type(error) is WorkerFailedError
    assert pickle.loads(pickle.dumps(error)).ranks == sorted(excs)


def test_a_type_whose_init_needs_its_own_arguments_is_still_derived():
    exc = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    error = worker_failed_error(_failures({0: exc}), {0: exc})
    assert isinstance(error, UnicodeDecodeError) and str(error).startswith("1 rank(s) failed.")


def test_types_that_cannot_be_subclassed_fall_back():
    class Final(Exception):
        def __init_subclass__(cls, **kwargs):
            raise TypeError("final")

    class Refusing(ValueError):
        def __new__(cls, *args):
            if cls is not Refusing:
                raise RuntimeError("no subclass instances")
            return super().__new__(cls, *args)

    for exc in (Final("x"), Refusing("y")):
        error = worker_failed_error(_failures({0: exc}), {0: exc})
        assert type(error) is WorkerFailedError and "rank 0" in str(error)


def test_a_quiet_exit_is_the_first_failure_even_when_its_peers_error_was_recorded_just_before():
    peer = RankFailure(0, "RuntimeError", "Connection closed by peer", timestamp=100.00)
    quiet = RankFailure(
        1, None, "the process exited with code 0 without returning a result", exitcode=0, timestamp=100.05
    )
    error = WorkerFailedError([peer, quiet])
    assert error.first_failure is quiet and "First to fail: rank 1 (no Python exception)" in str(error)
    much_later = RankFailure(1, None, "exited with code 3", exitcode=3, timestamp=130.0)
    assert WorkerFailedError([peer, much_later]).first_failure is peer


def test_a_quiet_exit_seen_late_on_a_busy_node_is_still_the_cause_of_its_peers_collective_error():
    # The launcher noticed the exit seconds after the peer's all_reduce failed because of it.
    quiet = RankFailure(1, None, "the process exited with code 0", exitcode=0, timestamp=104.5)
    for exc_type, message in [
        ("RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error: Connection reset by peer"),
        ("torch.distributed.DistBackendError", "NCCL error: remote process exited or there was a network error"),
    ]:
        peer = RankFailure(0, exc_type, message, timestamp=100.0)
        assert WorkerFailedError([peer, quiet]).first_failure is quiet
    # An error of the rank's own (not a peer leaving) is still first when the exit came seconds later.
    own = RankFailure(0, "ValueError", "label column has NaN", timestamp=100.0)
    assert WorkerFailedError([own, quiet]).first_failure is own
    # A peer the launcher killed seconds after an NCCL abort is a consequence, not the cause.
    nccl = RankFailure(0, "torch.distributed.DistBackendError", "NCCL communicator was aborted", timestamp=100.0)
    killed = RankFailure(1, None, "killed by SIGKILL", exitcode=-9, timestamp=102.5)
    assert WorkerFailedError([nccl, killed]).first_failure is nccl


def test_a_rank_killed_from_outside_is_the_cause_of_its_peers_closed_connection_however_late_its_launcher_saw_it():
    # Rank 1 was SIGKILLed (a lost machine's stand-in); rank 0's all_reduce failed at once, and a
    # busy node's launcher timed rank 1's exit seconds later, or could not time it at all.
    closed = RankFailure(
        0, "torch.distributed.DistBackendError", "Connection closed by peer [127.0.0.1]:4242", timestamp=100.0
    )
    for seen_at in (102.5, 115.0, None):
        killed = RankFailure(1, None, "the process was killed by SIGKILL", exitcode=-9, timestamp=seen_at)
        assert WorkerFailedError([closed, killed]).first_failure is killed
    # An exit of its own still comes before a peer the launcher stopped afterwards.
    quiet = RankFailure(2, None, "the process exited with code 0", exitcode=0, timestamp=104.0)
    stopped = RankFailure(1, None, "the process was killed by SIGTERM", exitcode=-15, timestamp=101.0)
    assert WorkerFailedError([closed, stopped, quiet]).first_failure is quiet
    # A death long after the closed connection is not its cause.
    assert WorkerFailedError([closed, RankFailure(1, None, "x", exitcode=-9, timestamp=140.0)]).first_failure is closed
