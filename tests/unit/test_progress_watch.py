"""Progress noted in shared memory, and the watch that judges it: when an attempt counts as hung, and what follows.

The records are real ones (:mod:`sparkgpu.rundir.progress`) in a real run dir; the watch's clock is
the view's, so each test steps time itself instead of waiting for it.
"""

from __future__ import annotations

import json
import os

import pytest

from sparkgpu import runtime
from sparkgpu.rundir import progress as _progress
from sparkgpu.api.decorator import distributed
from sparkgpu.errors import ConfigurationError, HangError, WorkerFailedError, worker_failed_error
from sparkgpu.failure_class import FailureClass, classify
from sparkgpu.launch.client.attempt_verdict import StoppedBy, read_attempt
from sparkgpu.launch.client.failure_policy import Decision, FailurePolicy
from sparkgpu.launch.client.hang_record import HangRecord
from sparkgpu.launch.client.monitors import CONTINUE, AttemptView, StopNow
from sparkgpu.launch.client.progress_source import LocalProgress
from sparkgpu.launch.client.progress_watch import ProgressWatch, default_progress_timeout
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.spec import RunPolicy, parse_progress_timeout
from sparkgpu.rundir.states import AttemptStatus


@pytest.fixture
def rank_record(tmp_path):
    path = tmp_path / "rank-0"
    _progress.start(path, node=2)
    yield path
    _progress.stop()


def test_heartbeat_notes_progress_in_the_ranks_record(rank_record):
    first = _progress.read(rank_record)
    assert first is not None and (first.pid, first.node, first.count, first.step) == (os.getpid(), 2, 0, None)
    runtime.heartbeat()
    runtime.heartbeat(step=7)
    record = _progress.read(rank_record)
    assert record is not None and (record.count, record.step) == (2, 7)
    assert record.last >= first.last and 0 <= record.slowest <= record.last - first.started
    _progress.finish()
    ended = _progress.read(rank_record)
    assert ended is not None and ended.done and not record.done and ended.count == 2


def test_a_process_forked_from_the_rank_notes_nothing(rank_record):
    runtime.heartbeat(1)
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: its progress is not the rank's
        runtime.heartbeat(99)
        os._exit(0)
    os.waitpid(pid, 0)
    record = _progress.read(rank_record)
    assert record is not None and (record.count, record.step) == (1, 1)


def test_outside_a_rank_a_note_does_nothing_and_no_record_reads_as_none(tmp_path):
    _progress.note(3)  # no record started
    assert _progress.read(tmp_path / "missing") is None
    (tmp_path / "short").write_bytes(b"\0" * 10)
    assert _progress.read(tmp_path / "short") is None


def _records(rd: RunDir, ranks: int) -> list[_progress._Record]:
    return [_progress._Record(rd.file(RunLayout.progress(0, rank)), node=0) for rank in range(ranks)]


def _view(now: float) -> AttemptView:
    return AttemptView(attempt=0, gpus=2, now=now, job_seconds=now, waited=now, ran=now)


def test_a_rank_without_progress_for_the_timeout_hangs_the_attempt_while_its_peer_steps(tmp_path):
    rd = RunDir(tmp_path)
    records = _records(rd, 2)
    watch = ProgressWatch(rd, 2, progress_timeout=3.0, source=LocalProgress(rd, signals=False))
    assert watch.check(_view(1.0)) is CONTINUE
    assert watch.check(_view(100.0)) is CONTINUE  # nothing is judged before the first progress
    for record in records:
        record.note(0)
    assert watch.check(_view(101.0)) is CONTINUE
    now = 101.0
    while now < 104.0:  # rank 0 steps on, rank 1 does not
        now += 0.5
        records[0].note(int(now))
        assert watch.check(_view(now)) is CONTINUE
    now += 0.6
    records[0].note(int(now))
    decision = watch.check(_view(now))
    assert isinstance(decision, StopNow) and decision.kind is StoppedBy.HANG
    hang = HangRecord.read(rd, 0)
    assert hang is not None and hang.behind == [1] and hang.timeout == 3.0
    assert hang.summary.startswith("rank 1 on node 0 gave no stacks; no progress for 3.6s (progress_timeout=3s)")
    assert hang.stacks == str(rd.file(RunLayout.hang_stacks(0))) and hang.summary in decision.note
    assert rd.file(RunLayout.hang_stacks(0)).read_text().startswith(hang.summary)


def test_once_a_ranks_function_ended_nothing_is_judged(tmp_path):
    rd = RunDir(tmp_path)
    records = _records(rd, 2)
    watch = ProgressWatch(rd, 2, progress_timeout=3.0, source=LocalProgress(rd, signals=False))
    for record in records:
        record.note(0)
    assert watch.check(_view(0.0)) is CONTINUE
    records[1].done = 1  # rank 1 returned; rank 0 uploads its model for long after its last step
    records[1].write()
    assert watch.check(_view(100.0)) is CONTINUE
    assert HangRecord.read(rd, 0) is None


def test_the_default_timeout_waits_ten_times_the_slowest_gap_and_at_least_ten_minutes(tmp_path):
    assert default_progress_timeout(1.0) == 600.0 and default_progress_timeout(120.0) == 1200.0
    rd = RunDir(tmp_path)
    records = _records(rd, 2)
    watch = ProgressWatch(rd, 2, progress_timeout=None, source=LocalProgress(rd, signals=False))
    for record in records:
        record.note(0)
        record.slowest = 90.0  # a step once took 90 s: the timeout is 900 s
        record.note(1)
    assert watch.check(_view(0.0)) is CONTINUE
    assert watch.check(_view(899.0)) is CONTINUE
    assert isinstance(watch.check(_view(901.0)), StopNow)
    off = ProgressWatch(rd, 2, progress_timeout=0.0, source=LocalProgress(rd, signals=False))
    assert off.check(_view(0.0)) is CONTINUE and off.check(_view(10**6)) is CONTINUE


def test_a_hung_attempt_fails_its_ranks_behind_as_hang_which_the_default_policy_restarts(tmp_path):
    rd = RunDir(tmp_path)
    rd.prepare_attempt(0)
    summary = "rank 1 on node 0 is in `train_step` at train.py:28; rank 0 waits in `all_reduce`"
    HangRecord(5.0, 3.0, [1], summary, "/runs/j/attempts/0/hang.txt").write(rd, 0, summary)
    verdict = read_attempt(rd, 0, 2, RunPolicy(), stopped_by=StoppedBy.HANG)
    assert verdict.status is AttemptStatus.FAILED and [f.rank for f in verdict.failures] == [1]
    assert isinstance(verdict.exceptions[1], HangError)
    found = classify(verdict.failures, verdict.exceptions)
    assert found.cls is FailureClass.HANG
    assert found.detail == f"{summary}. Every rank's stacks: /runs/j/attempts/0/hang.txt"
    assert FailurePolicy(max_restarts=1).decide(0, verdict.exceptions, verdict.failures, verdict.failures) is (
        Decision.RESTART  # no place to fail at again: a hang at the same step is restarted too
    )
    error = worker_failed_error(verdict.failures, verdict.exceptions, "j", "/logs")
    assert isinstance(error, WorkerFailedError) and isinstance(error, HangError)
    assert classify(error.failures).cls is FailureClass.HANG  # as tracking classifies the job's error


def test_a_hung_attempt_without_its_record_still_fails_as_hang(tmp_path):
    rd = RunDir(tmp_path)
    rd.prepare_attempt(0)
    verdict = read_attempt(rd, 0, 2, RunPolicy(), stopped_by=StoppedBy.HANG)
    assert verdict.status is AttemptStatus.FAILED and [f.rank for f in verdict.failures] == [0, 1]
    assert classify(verdict.failures, verdict.exceptions).cls is FailureClass.HANG


def test_the_mlflow_tag_of_a_job_that_ended_hung_is_hang(tmp_path):
    from sparkgpu.tracking.mlflow_run import _failure_class

    rd = RunDir(tmp_path)
    rd.prepare_attempt(0)
    HangRecord(5.0, 3.0, [1], "rank 1 on node 0 is behind", "hang.txt").write(rd, 0, "")
    verdict = read_attempt(rd, 0, 2, RunPolicy(), stopped_by=StoppedBy.HANG)
    error = verdict.error("j", "/logs")
    error.__cause__ = verdict.root_exception
    assert _failure_class(error) == "hang"


@pytest.mark.parametrize("value, seconds", [(None, None), ("off", 0.0), (False, 0.0), ("5m", 300.0), (2, 2.0)])
def test_progress_timeout_takes_a_duration_none_or_off(value, seconds):
    assert parse_progress_timeout(value) == seconds
    assert RunPolicy(progress_timeout=value).progress_timeout == seconds


def test_a_negative_progress_timeout_is_refused_at_decoration_naming_the_fix():
    with pytest.raises(ConfigurationError, match=r"progress_timeout=-1 must be positive; pass seconds .* or 'off'"):
        distributed(gpus=2, gpu_type="cpu", progress_timeout=-1)(len)
    with pytest.raises(ConfigurationError, match="progress_timeout='soon' is not a duration"):
        RunPolicy(progress_timeout="soon")
    assert json.loads(json.dumps(RunPolicy(progress_timeout="off").progress_timeout)) == 0.0


def test_an_nccl_rank_gets_the_flight_recorder_and_its_dump_on_timeout_into_the_attempt(tmp_path):
    from sparkgpu.launch.rank.progress import NCCL_TRACE_ENTRIES, nccl_trace_env

    rd = RunDir(tmp_path)
    assert nccl_trace_env(rd, 2, environ={}) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "attempts" / "2" / "nccl-trace" / "rank-"),
    }
    kept = nccl_trace_env(rd, 2, environ={"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    assert set(kept) == {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}  # what the user set is theirs


def test_a_patched_trainers_steps_and_evaluation_batches_are_progress(rank_record):
    from types import SimpleNamespace

    pytest.importorskip("transformers")
    from sparkgpu.hf.resume import JobCheckpointCallback

    callback = JobCheckpointCallback(store=None)  # outside a job: it seals nothing, but still notes
    control = SimpleNamespace(should_save=False)
    callback.on_step_end(None, SimpleNamespace(global_step=12), control)
    callback.on_prediction_step(None, SimpleNamespace(global_step=12), control)
    record = _progress.read(rank_record)
    assert record is not None and (record.count, record.step) == (2, 12)


def test_a_lightning_trainers_batches_are_progress(rank_record):
    from types import SimpleNamespace

    pytest.importorskip("lightning")
    from sparkgpu.train.lightning import JobCheckpoints

    callbacks = JobCheckpoints()  # not set up for a strategy: it checkpoints nothing, but still notes
    callbacks.on_train_batch_end(SimpleNamespace(global_step=4), None, None, None, 0)
    record = _progress.read(rank_record)
    assert record is not None and (record.count, record.step) == (1, 4)


def test_each_batch_a_sparkgpu_loader_hands_the_rank_is_progress(rank_record):
    from sparkgpu.data.loaders.positioned import Positioned

    class ThreeBatches(Positioned):
        world_size, epoch, _consumed = 1, 0, 0

        def __init__(self):  # no plan, no storage: only the loader's own bookkeeping runs
            pass

        def _begin_epoch(self):
            return None

        def _advance(self, plan, start, batches):
            self._consumed = batches

        def __iter__(self):
            yield from range(3)

        def __len__(self):
            return 3

    assert list(ThreeBatches().loader(num_workers=0)) == [0, 1, 2]
    record = _progress.read(rank_record)
    assert record is not None and record.count == 3 and record.step is None
