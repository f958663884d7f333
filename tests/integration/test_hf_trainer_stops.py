"""A plain Trainer survives a critical job's preemption, SIGTERM and a spent budget, and resumes bitwise equal.

The job is ``test_hf_trainer``'s: two gloo CPU ranks train a tiny Llama with a plain ``Trainer``
(no ``resume_from_checkpoint``, nothing from sparkgpu) and record, per rank and step, the samples
and the loss. In the first attempt both ranks pause in the forward pass of step ``STOP_STEP``
(mid-epoch, not a save step) until the job asks them to checkpoint, and the test delivers the
stop from outside, as production does: a critical job that needs the GPUs, SIGTERM to every rank
(a cloud's spot notice), or another job's usage that spends the team's budget. The Trainer must
save step ``STOP_STEP`` and stop; the next attempt (by itself, or ``sparkgpu resume`` once the
budget's window has passed) resumes from that step and ends bitwise equal to an uninterrupted
run: weights, optimizer state, the loss and samples of every step, each sample once per epoch.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from sparkgpu import distributed
from sparkgpu.config import settings
from sparkgpu.errors import PolicyViolationError
from sparkgpu.usage import UsageLedger, UsageMeter, UsagePolicy
from sparkgpu.usage.ledger import UsageRecord
from sparkgpu.usage.rates import RateCard
from tests.integration.preemption import two_gpus, urgent  # noqa: F401  (two_gpus: a fixture)
from tests.integration.test_hf_trainer import (  # noqa: F401  (_in_a_folder_of_its_own: a fixture)
    SAVE_STEPS,
    STEPS_PER_EPOCH,
    TOTAL_STEPS,
    WORLD,
    _in_a_folder_of_its_own,
    assert_same_run,
    read_records,
    train_plainly,
)

# One worker runs this module and test_hf_trainer.py: the uninterrupted run both compare against
# (tests/integration/conftest.py) is trained once.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("hf-trainer")]

STOP_STEP = 8  # in the second epoch, between two saves
assert STOP_STEP % SAVE_STEPS and STEPS_PER_EPOCH < STOP_STEP < TOTAL_STEPS


def train_until_stopped(record_file, pause_file):
    """``train_plainly``, paused in the first attempt at step ``STOP_STEP`` until the job asks for a checkpoint.

    Each rank writes its pid to ``<pause_file>.<rank>`` once it pauses. A global forward hook
    counts the training forward passes of the model (one per step), so the Trainer's code and
    the recorded steps are ``train_plainly``'s own.
    """
    import os
    import time

    import torch

    from sparkgpu import runtime

    if runtime.attempt() == 0:
        forwards = [0]

        def pause(module, inputs, output):
            if type(module).__name__ != "LlamaForCausalLM" or not module.training:
                return
            forwards[0] += 1
            if forwards[0] != STOP_STEP:
                return
            with open(f"{pause_file}.{runtime.get_global_rank()}", "w") as f:
                f.write(str(os.getpid()))
            deadline = time.monotonic() + 300
            while not runtime.should_checkpoint():
                assert time.monotonic() < deadline, f"the job never asked for a checkpoint at step {STOP_STEP}"
                time.sleep(0.05)

        torch.nn.modules.module.register_module_forward_hook(pause)
    return train_plainly(record_file)


def run_stopped(tmp_path, tag, stop, **options):
    """Runs the job to its end, ``stop(pids)`` called from a thread once every rank paused at ``STOP_STEP``.

    Returns:
        ``(per-rank results or the job's error, the job's id, the records)``.
    """
    record, pause = tmp_path / f"{tag}.jsonl", tmp_path / f"{tag}.paused"
    job = distributed(gpus=WORLD, **{"gpu_type": "cpu", **options})(train_until_stopped)
    ended, failures = threading.Event(), []

    def stop_when_paused():
        try:
            stop(wait_until_paused(pause, ended))
        except BaseException as exc:  # raised to the test below
            failures.append(exc)

    stopper = threading.Thread(target=stop_when_paused, daemon=True)
    stopper.start()
    try:
        outcome = job.distributed(str(record), str(pause))
    except Exception as exc:
        outcome = exc
    finally:
        ended.set()
        stopper.join(timeout=300)
    if failures:  # with the job's own error, if it failed, as the cause
        raise failures[0] from (outcome if isinstance(outcome, Exception) else None)
    return outcome, job.last_job_id, record


def wait_until_paused(pause, ended: threading.Event) -> list[int]:
    """The pids of the ranks, once every rank paused at ``STOP_STEP``."""
    deadline = time.monotonic() + 300  # a loaded machine starts ranks and imports transformers slowly
    paths = [f"{pause}.{rank}" for rank in range(WORLD)]
    while not all(os.path.exists(p) and open(p).read() for p in paths):
        assert time.monotonic() < deadline and not ended.is_set(), "the job never reached the step of the stop"
        time.sleep(0.1)
    return [int(open(p).read()) for p in paths]


def job_state(job_id: str) -> dict:
    return json.loads((settings().staging_root / job_id / "state.json").read_text())


def assert_resumed_from_the_stop(states, steps, trainer_uninterrupted, note):
    """Attempt 0 trained up to the stop, attempt 1 from the step after it: no step lost or replayed."""
    by_attempt: dict[int, list[int]] = {}
    for entry in steps.values():
        by_attempt.setdefault(entry["attempt"], []).append(entry["step"])
    assert max(by_attempt[0]) == STOP_STEP, f"the first attempt did not stop at step {STOP_STEP} {note}"
    assert min(by_attempt[1]) == STOP_STEP + 1, f"the resumed attempt did not start after step {STOP_STEP} {note}"
    assert_same_run(states, steps, trainer_uninterrupted, note)


def test_a_trainer_preempted_by_a_critical_job_resumes_by_itself_bitwise_equal(
    trainer_uninterrupted, tmp_path, two_gpus, capfd
):
    critical = distributed(gpus=WORLD, gpu_type="H100", priority="critical", callbacks=[])(urgent)
    spans = []

    def preempt(pids):
        spans.extend(critical.submit(1.0).result(timeout=240))

    states, job_id, record = run_stopped(tmp_path, "preempted", preempt, gpu_type="H100", priority="BEST_EFFORT")

    assert isinstance(states, list), states
    state = job_state(job_id)
    assert [a["status"] for a in state["attempts"]] == ["preempted", "succeeded"]
    assert (state["restarts"], state["preemptions"]) == (0, 1), "giving way uses no restart"
    assert state["attempts"][1]["started_at"] >= max(end for _, end in spans), "it resumed only once the GPUs were free"
    assert_resumed_from_the_stop(states, read_records(record), trainer_uninterrupted, "(preempted by a critical job)")
    out = capfd.readouterr().out
    assert "checkpointed and gave way" in out, out[-3000:]
    assert f"the Trainer resumes from step {STOP_STEP} " in out, out[-3000:]


def test_sigterm_to_the_ranks_saves_stops_and_resumes_bitwise_equal(trainer_uninterrupted, tmp_path, capfd):
    def spot_notice(pids):
        for pid in pids:  # what a spot instance's notice does to every process of the node
            os.kill(pid, signal.SIGTERM)

    states, job_id, record = run_stopped(tmp_path, "sigterm", spot_notice)

    assert isinstance(states, list), states
    state = job_state(job_id)
    assert [a["status"] for a in state["attempts"]] == ["preempted", "succeeded"]
    assert state["restarts"] == 0, "a checkpointed stop uses no restart"
    assert_resumed_from_the_stop(states, read_records(record), trainer_uninterrupted, "(SIGTERM to every rank)")
    out = capfd.readouterr().out
    assert f"the Trainer resumes from step {STOP_STEP} " in out, out[-3000:]


def test_a_spent_budget_stops_the_trainer_and_sparkgpu_resume_finishes_it_bitwise_equal(
    trainer_uninterrupted, tmp_path, capfd
):
    from sparkgpu.launch.client.resume import resume_job

    ledger = UsageLedger(str(tmp_path / "ledger"))
    # 900 GPU-seconds per 20 s: more than the job spends in an attempt; a 1,024-GPU job of the
    # same team spends it in one second, and its usage leaves the window 20 s later.
    policy = UsagePolicy.from_dict({"name": "ml-team", "budgets": {"team=ml": "0.25 GPU-hours per 20s"}})
    meter = UsageMeter(ledger, policy=policy, refresh_seconds=1.0)

    def another_job_spends_the_budget(pids):
        now = time.time()
        other = UsageRecord.priced(
            job_id="another-job", job_name="other", attempt=0, user="bo", tags={"team": "ml"}, backend="local",
            gpu_type="cpu", gpus=1024, simulated=False, status="succeeded", started_at=now - 1, ended_at=now,
            rates=RateCard(),
        )  # fmt: skip
        ledger.append([other])

    error, job_id, record = run_stopped(
        tmp_path, "budget", another_job_spends_the_budget, tags={"team": "ml"}, callbacks=[meter]
    )
    assert isinstance(error, PolicyViolationError), error
    assert "budget 'team=ml: 0.25 GPU-hours per 20s' is spent" in str(error), error
    state = job_state(job_id)
    assert (state["status"], [a["status"] for a in state["attempts"]]) == ("stopped", ["preempted"])

    budget = policy.budgets[0]
    deadline = time.monotonic() + 120
    while budget.spent(ledger.read(since=time.time() - budget.window)) >= budget.limit:  # once the policy allows
        assert time.monotonic() < deadline, "the budget's window never passed"
        time.sleep(1.0)
    states = resume_job(job_id)

    state = job_state(job_id)
    assert [a["status"] for a in state["attempts"]] == ["preempted", "succeeded"]
    assert_resumed_from_the_stop(states, read_records(record), trainer_uninterrupted, "(a spent budget)")
    out = capfd.readouterr().out
    assert f"the Trainer resumes from step {STOP_STEP} " in out, out[-3000:]
