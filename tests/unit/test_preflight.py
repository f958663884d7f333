"""A node's pre-flight check: each check on this host for real, the class and the policy of a
node that fails, and which tasks of a Spark attempt become its nodes around an executor left out."""

from __future__ import annotations

import json
import shutil

import pytest

from sparkgpu.config import reset_settings
from sparkgpu.errors import PreflightError, RankFailure
from sparkgpu.failure_class import FailureClass, classify
from sparkgpu.launch.backends.spark import exclusions
from sparkgpu.launch.backends.spark.capacity import ExecutorInfo, SparkCapacity
from sparkgpu.launch.backends.spark.executor.node_launch import NodeLaunch
from sparkgpu.launch.backends.spark.executor.seating import take_seat
from sparkgpu.launch.client.failure_policy import Decision, FailurePolicy
from sparkgpu.launch.node import preflight
from sparkgpu.rundir.states import NodeState


def test_a_writable_cache_disk_with_room_passes_and_says_how_much_is_free(tmp_path):
    found = preflight.check_cache_disk(tmp_path / "cache", free_bytes=1)
    assert found.ok and "writable" in found.detail and " free" in found.detail
    assert (tmp_path / "cache").is_dir() and not list((tmp_path / "cache").iterdir())  # the probe is gone


def test_a_cache_path_that_is_a_file_or_cannot_be_created_fails_naming_the_fix(tmp_path):
    (tmp_path / "cache").write_text("a file where the disk should be mounted")
    found = preflight.check_cache_disk(tmp_path / "cache", free_bytes=1)
    assert not found.ok and "is a file, not a folder" in found.detail and "SPARKGPU_CACHE_DIR" in found.detail
    found = preflight.check_cache_disk(tmp_path / "cache" / "below", free_bytes=1)
    assert not found.ok and found.detail.startswith(f"cannot write {tmp_path / 'cache' / 'below'}")


def test_a_cache_disk_with_less_room_than_the_setting_fails_with_both_figures(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    found = preflight.check_cache_disk(tmp_path, free_bytes=free + 2**40)  # a terabyte more than there is
    assert not found.ok and "less than the" in found.detail and "SPARKGPU_PREFLIGHT_FREE" in found.detail


def test_the_free_space_the_check_wants_comes_from_the_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARKGPU_PREFLIGHT_FREE", "1PB")
    monkeypatch.setenv("SPARKGPU_CACHE_DIR", str(tmp_path))
    reset_settings()
    try:
        checked = preflight.run_preflight({}, ("0", "1"), simulated=True)  # simulated GPUs: nothing to check
        assert [c.name for c in checked.checks] == ["cache_disk"] and not checked.ok
        error = checked.error("node 1 (executor 3 on host h)", replaceable=True)
        assert str(error).startswith("node 1 (executor 3 on host h) failed its pre-flight check: cache_disk: ")
        monkeypatch.setenv("SPARKGPU_PREFLIGHT_FREE", "0")
        reset_settings()
        assert preflight.run_preflight({"SPARKGPU_CACHE_DIR": str(tmp_path / "ranks")}).ok
        assert (tmp_path / "ranks").is_dir()  # the ranks' own cache folder is the one checked
    finally:
        reset_settings()


def test_a_bf16_matmul_matches_its_float64_reference_and_a_wrong_product_does_not():
    import torch

    found = preflight.check_compute("cpu", size=256)
    assert found.ok and "TFLOP/s" in found.detail
    reference = torch.randn(64, 64, dtype=torch.float64)
    assert preflight.relative_error(reference.bfloat16(), reference) < preflight.COMPUTE_TOLERANCE
    wrong = reference.clone()
    wrong[:, :8] = 0  # a device that drops a slice of the answer
    assert preflight.relative_error(wrong, reference) > preflight.COMPUTE_TOLERANCE
    wrong[0, 0] = float("nan")
    assert preflight.relative_error(wrong, reference) == float("inf")


def test_gpus_this_host_cannot_see_fail_the_check_in_its_child_interpreter():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: benchmarks/gpu_suite.py runs the GPU checks")
    (found,) = preflight.check_gpus(["0", "1"])
    assert not found.ok and found.name == "gpus" and "CUDA sees 0 of the 2 GPUs" in found.detail


def test_a_node_that_fails_its_check_is_a_bad_node_restarted_only_where_another_can_stand_in():
    failure = RankFailure(0, "sparkgpu.errors.PreflightError", "node 0 on host h failed its pre-flight check: ...")
    for replaceable, decision in ((True, Decision.RESTART), (False, Decision.RAISE)):
        exc = PreflightError(failure.message, replaceable=replaceable)
        assert classify([failure], {0: exc}).cls is FailureClass.BAD_NODE
        policy = FailurePolicy(max_restarts=3)
        assert policy.decide(0, {0: exc}, [failure]) is decision
    why = FailurePolicy(3).unrestartable({0: PreflightError("x", replaceable=False)}, [failure])
    assert why is not None and "no other node to run on" in why and "sparkgpu resume" in why
    import pickle

    assert pickle.loads(pickle.dumps(PreflightError("x", replaceable=True))).replaceable  # the rank's error file


def _cluster(*executors, dynamic=False):
    return SparkCapacity("spark://h:7077", executors, 2, "A10", "conf", False, dynamic_allocation=dynamic)


def test_an_excluded_executor_gets_one_spare_per_node_slot_it_holds_or_the_job_is_refused():
    exclusions.forget()
    try:
        a, b, c = (ExecutorInfo(str(i), f"host-{i}", 4, (f"{2 * i}", f"{2 * i + 1}")) for i in range(3))
        assert exclusions.stand_ins("c", _cluster(a, b, c), 2, 2, "job") == ((), 0)
        exclusions.exclude("c", "1", "host-1", "cache_disk: ...")
        assert exclusions.stand_ins("c", _cluster(a, b, c), 2, 2, "job") == (("1",), 1)
        assert exclusions.stand_ins("c", _cluster(a, b, c), 1, 2, "job") == (("1",), 2)  # 2 one-GPU slots
        assert exclusions.stand_ins("c", _cluster(a, c), 2, 2, "job") == ((), 0)  # replaced: a new id
        with pytest.raises(PreflightError, match="the cluster has 2 node slot\\(s\\) for the job's 3") as err:
            exclusions.stand_ins("c", _cluster(a, b, c), 2, 3, "job-7")
        assert not err.value.replaceable and "executor 1 on host host-1 failed it: cache_disk" in str(err.value)
        assert exclusions.stand_ins("c", _cluster(a, b, c, dynamic=True), 2, 3, "job") == (("1",), 1)
        assert exclusions.stand_ins("other cluster", _cluster(a, b, c), 2, 3, "job") == ((), 0)
    finally:
        exclusions.forget()


class _Barrier:
    """The two calls of Spark's ``BarrierTaskContext`` a seat takes, for task ``task`` of a stage
    whose other tasks sent ``others`` (by task) at the first exchange."""

    def __init__(self, task: int, others: dict[int, dict]):
        self.task, self.others = task, others

    def partitionId(self) -> int:
        return self.task

    def allGather(self, message: str) -> list[str]:
        sent = {**self.others, self.task: json.loads(message)}
        return [json.dumps(sent[t]) for t in sorted(sent)]


def _launch(nnodes: int = 2, **fields) -> NodeLaunch:
    return NodeLaunch("/runs/job", 0, nnodes, 1, {}, b"key", 10.0, None, preflight=False, **fields)


def test_the_tasks_that_passed_on_executors_not_left_out_become_the_nodes_in_task_order():
    executors = {0: "7", 1: "8", 2: "9"}
    sent = {t: {"executor": e, "ok": True} for t, e in executors.items()}
    launch = _launch(spares=1, avoid=("7",))
    seats = {
        t: take_seat(_Barrier(t, {o: m for o, m in sent.items() if o != t}), launch, executors[t], ()) for t in sent
    }
    assert (seats[1].node, seats[2].node) == (0, 1) and seats[1].state is None
    assert seats[0].node is None and seats[0].state is NodeState.SPARE and seats[0].exchanges
    # A task whose check failed (as it told the others) is passed over as well.
    sent[2]["ok"] = False
    seat = take_seat(_Barrier(1, {0: sent[0], 2: sent[2]}), _launch(spares=1, avoid=("7",), nnodes=1), "8", ())
    assert seat.node == 0
    # Without spares a task is its node, whatever the others found.
    assert take_seat(_Barrier(1, {}), _launch(), "8", ()).node == 1


def test_too_few_fit_tasks_start_nothing_and_skip_the_nodes_exchange_all_alike():
    others = {0: {"executor": "7", "ok": True}, 1: {"executor": "8", "ok": True}}
    seat = take_seat(_Barrier(1, {0: others[0]}), _launch(spares=1, avoid=("7",)), "8", ())
    assert seat.node is None and seat.state is NodeState.PEER_NOT_READY and not seat.exchanges


def test_an_executor_is_kept_out_only_for_the_exclusion_setting(monkeypatch):
    import time

    monkeypatch.setenv("SPARKGPU_PREFLIGHT_EXCLUDE", "0.2")
    reset_settings()
    exclusions.forget()
    try:
        kept = exclusions.exclude("c", "1", "host-1", "cache_disk: ...")
        assert exclusions.excluded("c") == [kept] and kept.where == "executor 1 on host host-1"
        time.sleep(kept.until - time.monotonic() + 0.05)
        assert exclusions.excluded("c") == []
    finally:
        exclusions.forget()
        reset_settings()
