"""Checkpointer in one process (no process group): real DCP writes into real directories."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch
from torch import nn

from sparkgpu import runtime
from sparkgpu.errors import CheckpointError, ConfigurationError
from sparkgpu.train import Checkpointer, latest_checkpoint, list_checkpoints
from sparkgpu.train.checkpoint_directory import CheckpointDirectory, checkpoint_at
from sparkgpu.train.checkpoint import finish_pending_checkpoints

# pytest resets warning filters per test; the module's own filter for this DCP notice is lost.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _restore_signal_and_requests():
    """Checkpointers install a SIGTERM handler and may see a checkpoint request: undo both."""
    handler = signal.getsignal(signal.SIGTERM)
    runtime._checkpoint_requested.clear()
    yield
    signal.signal(signal.SIGTERM, handler)
    runtime._checkpoint_requested.clear()


class Loader:
    """Stands for a data loader: batches depend on its position, its state is plain JSON."""

    def __init__(self):
        self.position = 0

    def next_batch(self):
        gen = torch.Generator().manual_seed(self.position)
        self.position += 1
        return torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def make_training(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return dict(model=model, optimizer=opt, scheduler=sched, loader=Loader())


def train_step(state):
    x, y = state["loader"].next_batch()
    # Dropout draws from torch's RNG, the scale from Python's and NumPy's: a resumed run
    # matches only if all three generators were restored.
    scale = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
    loss = ((state["model"](x) - y) ** 2).mean() * scale
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["scheduler"].step()
    return loss.item()


def _reseed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _assert_same_training_state(a, b):
    for (name, pa), (_, pb) in zip(a["model"].state_dict().items(), b["model"].state_dict().items()):
        assert torch.equal(pa, pb), name
    sa, sb = a["optimizer"].state_dict()["state"], b["optimizer"].state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for field in sa[key]:
            assert torch.equal(sa[key][field], sb[key][field]), (key, field)
    assert a["scheduler"].state_dict() == b["scheduler"].state_dict()
    assert a["loader"].position == b["loader"].position


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_resumed_training_matches_uninterrupted_bitwise(tmp_path, async_save):
    _reseed(1)
    state = make_training(0)
    ckpt = Checkpointer(tmp_path, async_save=async_save)
    for _ in range(5):
        train_step(state)
    ckpt.save(4, extras={"best_loss": 0.5}, **state)
    # Training goes on while the async write is in flight: the checkpoint must hold the
    # state of step 4, not whatever the parameters are when the writer reads them.
    expected = [train_step(state) for _ in range(5)]
    ckpt.close()

    _reseed(99)
    resumed = make_training(123)
    ckpt2 = Checkpointer(tmp_path)
    start = ckpt2.restore(**resumed)
    assert start == 5
    assert ckpt2.restored.step == 4 and ckpt2.restored.extras == {"best_loss": 0.5}
    assert [train_step(resumed) for _ in range(5)] == expected
    _assert_same_training_state(state, resumed)
    ckpt2.close()


def test_restore_without_checkpoint_starts_at_zero_and_changes_nothing(tmp_path):
    state = make_training(0)
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    ckpt = Checkpointer(tmp_path / "fresh")
    assert ckpt.restore(**state) == 0
    assert ckpt.restored is None
    assert all(torch.equal(before[k], v) for k, v in state["model"].state_dict().items())


def test_maybe_save_every_steps_keeps_last_k(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path, every_steps=4, keep_last=2)
    saved = []
    for step in range(14):
        train_step(state)
        if ckpt.maybe_save(step, **state):
            saved.append(step)
    ckpt.close()
    assert saved == [3, 7, 11]
    assert [info.step for info in list_checkpoints(tmp_path)] == [7, 11]
    assert sorted(os.listdir(tmp_path)) == ["step-0000000007", "step-0000000011"]


def test_maybe_save_every_minutes(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(Checkpointer, "clock", staticmethod(lambda: now[0]))
    state = make_training(0)
    ckpt = Checkpointer(tmp_path, every_minutes=2)
    decisions = []
    for step, minutes in enumerate([1.0, 1.5, 0.4, 1.0, 1.0]):
        now[0] += minutes * 60
        decisions.append(ckpt.maybe_save(step, **state))
    ckpt.close()
    # Due at 2.5 min (step 1) and 2.4 min after it (step 4).
    assert decisions == [False, True, False, False, True]
    assert [info.step for info in list_checkpoints(tmp_path)] == [1, 4]


def test_checkpoint_request_saves_waits_and_stops(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path, every_steps=1000)
    assert not ckpt.maybe_save(0, **state)
    runtime.request_checkpoint()
    assert ckpt.maybe_save(1, **state)
    assert ckpt.should_stop
    # Committed before maybe_save returned: the process may exit right away.
    assert latest_checkpoint(tmp_path).step == 1


def test_sigterm_becomes_a_checkpoint_request(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path)
    os.kill(os.getpid(), signal.SIGTERM)  # would end the test process without the handler
    assert ckpt.maybe_save(0, **state) and ckpt.should_stop
    assert latest_checkpoint(tmp_path).step == 0


def test_sigterm_handler_can_be_left_alone(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    Checkpointer(tmp_path, handle_sigterm=False)
    assert signal.getsignal(signal.SIGTERM) is before


def test_saving_the_same_step_twice_writes_once(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, wait=True, **state)
    created = latest_checkpoint(tmp_path).created
    ckpt.save(3, wait=True, **state)
    assert latest_checkpoint(tmp_path).created == created


def test_restore_ignores_a_checkpoint_without_marker(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, wait=True, **state)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    train_step(state)
    ckpt.save(3, wait=True, **state)
    # What a kill between the data write and the commit leaves behind.
    os.remove(tmp_path / "step-0000000003" / "_COMPLETE.json")

    fresh = make_training(7)
    assert Checkpointer(tmp_path).restore(**fresh) == 3
    assert all(torch.equal(expected[k], v) for k, v in fresh["model"].state_dict().items())


def test_restore_a_given_step(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path, keep_last=None)
    for step in range(3):
        train_step(state)
        ckpt.save(step, **state)
    ckpt.close()
    fresh = make_training(1)
    assert Checkpointer(tmp_path).restore(step=1, **fresh) == 2
    assert fresh["loader"].position == 2
    with pytest.raises(CheckpointError, match=r"no complete checkpoint of step 7.*complete steps: \[0, 1, 2\]"):
        Checkpointer(tmp_path).restore(step=7, **fresh)


def test_restore_of_an_object_never_saved_fails_before_loading(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(0, wait=True, model=state["model"], scheduler=state["scheduler"])
    fresh = make_training(1)
    before = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    with pytest.raises(CheckpointError, match="holds no state for optimizer, loader.*pass restore"):
        Checkpointer(tmp_path).restore(**fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh["model"].state_dict().items())
    # Objects saved but not asked for are simply not loaded.
    assert Checkpointer(tmp_path).restore(model=fresh["model"]) == 1


def test_directory_defaults_to_the_jobs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKGPU_CHECKPOINT_DIR", str(tmp_path / "job-ckpt"))
    ckpt = Checkpointer()
    assert ckpt.directory == str(tmp_path / "job-ckpt")
    assert (tmp_path / "job-ckpt").is_dir()


def test_no_directory_outside_a_job_names_the_fix(monkeypatch):
    monkeypatch.delenv("SPARKGPU_CHECKPOINT_DIR", raising=False)
    with pytest.raises(CheckpointError, match=r"pass Checkpointer\(directory=\.\.\.\)"):
        Checkpointer()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(every_steps=0), "every_steps must be a positive"),
        (dict(every_steps=2.5), "every_steps must be a positive"),
        (dict(every_minutes=-1), "every_minutes must be a positive"),
        (dict(keep_last=0), "keep_last must be a positive"),
        (dict(write_threads=True), "write_threads must be a positive"),
    ],
)
def test_bad_settings_are_refused(tmp_path, kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        Checkpointer(tmp_path, **kwargs)


class _NoState:
    pass


class _UnpicklableState:
    def state_dict(self):
        return {"callback": lambda: None}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c, s: c.save(-1, **s), "step must be a non-negative integer"),
        (lambda c, s: c.save(1.0, **s), "step must be a non-negative integer"),
        (lambda c, s: c.save(1, extras={"t": torch.ones(1)}, **s), "extras must hold JSON values"),
        (lambda c, s: c.save(1, optimizer=s["optimizer"]), "pass model= too"),
        (lambda c, s: c.save(1, model="not a module"), "model must be a torch.nn.Module"),
        (lambda c, s: c.save(1, loader=_NoState()), r"has no state_dict\(\)/load_state_dict\(\)"),
        (lambda c, s: c.save(1, data=_UnpicklableState()), "cannot be pickled"),
        (lambda c, s: c.restore(step=-2, **s), "step must be a non-negative integer"),
    ],
)
def test_bad_arguments_fail_before_anything_is_written(tmp_path, call, match):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(ConfigurationError, match=match):
        call(ckpt, state)
    assert os.listdir(tmp_path) == []


class _FailingDirectory(CheckpointDirectory):
    """A store whose DCP writer fails in the background thread, as a full disk would."""

    def writer(self, path, thread_count):
        writer = super().writer(path, thread_count)

        def write_data(plan, planner):
            raise OSError(28, "No space left on device")

        writer.write_data = write_data
        return writer


def test_failed_background_write_surfaces_and_commits_nothing(tmp_path, monkeypatch):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(0, wait=True, **state)
    monkeypatch.setattr(Checkpointer, "directory_cls", _FailingDirectory)
    failing = Checkpointer(tmp_path)
    failing.save(1, **state)  # returns: the write fails later, in the background
    with pytest.raises(CheckpointError, match="step 1 could not be written.*No space left"):
        failing.wait()
    assert [info.step for info in list_checkpoints(tmp_path)] == [0]


def test_no_room_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(CheckpointDirectory, "free_bytes", lambda self: 10)
    state = make_training(0)
    with pytest.raises(CheckpointError, match="no room for the checkpoint of step 0"):
        Checkpointer(tmp_path).save(0, **state)
    assert os.listdir(tmp_path) == []


def test_finish_pending_checkpoints_commits_what_is_in_flight(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(5, **state)
    finish_pending_checkpoints()
    assert latest_checkpoint(tmp_path).step == 5
    assert ckpt.last_write_seconds is not None and ckpt.last_blocking_seconds <= ckpt.last_write_seconds


def test_closed_checkpointer_refuses_work(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path)
    with ckpt:
        ckpt.save(0, **state)
    assert latest_checkpoint(tmp_path).step == 0
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(1, **state)


def test_fsspec_url_round_trip():
    import fsspec

    state = make_training(0)
    url = "memory://ckpt-round-trip/run"
    ckpt = Checkpointer(url)
    for _ in range(3):
        train_step(state)
    ckpt.save(2, wait=True, **state)
    fresh = make_training(5)
    try:
        assert Checkpointer(url).restore(**fresh) == 3
        _assert_same_training_state(state, fresh)
        assert checkpoint_at(f"{url}/step-0000000002/").step == 2  # what the registry checks
        assert checkpoint_at(f"{url}/step-0000000001") is None
    finally:
        fsspec.filesystem("memory").rm("/ckpt-round-trip", recursive=True)


def test_a_committed_checkpoint_is_recorded_in_the_active_mlflow_run(tmp_path):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    state = make_training(0)
    try:
        with mlflow.start_run() as run:
            with Checkpointer(tmp_path / "ckpt", every_steps=2) as ckpt:
                for step in range(4):
                    train_step(state)
                    ckpt.maybe_save(step, **state)
        recorded = mlflow.get_run(run.info.run_id).data
    finally:
        mlflow.set_tracking_uri(None)
    assert recorded.tags["sparkgpu.checkpoint.latest_step"] == "3"
    assert recorded.tags["sparkgpu.checkpoint.latest_path"] == latest_checkpoint(tmp_path / "ckpt").path
    assert recorded.metrics["checkpoint/step"] == 3


def _mlflow_import_failed(name):
    # What reading MLflow gives while a rank's background `import mlflow` fails.
    raise ImportError(f"No module named {name!r}")


def test_inside_a_job_a_save_never_waits_on_mlflow_and_the_job_run_gets_the_lineage(tmp_path, monkeypatch):
    import json

    from sparkgpu.tracking import autolog
    from sparkgpu.tracking.spool import SPOOL_ENV
    from sparkgpu.train import checkpoint as checkpoint_module

    monkeypatch.setattr(checkpoint_module, "imported", _mlflow_import_failed)
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "tracking"))  # what the launcher gives a rank
    state = make_training(0)
    try:
        with Checkpointer(tmp_path / "ckpt", every_steps=1) as ckpt:
            train_step(state)
            ckpt.save(0, **state, wait=True)
    finally:
        autolog._deactivate()
    records = [
        json.loads(line)
        for path in (tmp_path / "tracking" / "records").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert [c[:2] for r in records for c in r.get("c", ())] == [[0, latest_checkpoint(tmp_path / "ckpt").path]]


def test_outside_a_job_a_failing_mlflow_does_not_fail_the_save(tmp_path, monkeypatch, caplog):
    from sparkgpu.train import checkpoint as checkpoint_module

    monkeypatch.setattr(checkpoint_module, "imported", _mlflow_import_failed)
    state = make_training(0)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        train_step(state)
        ckpt.save(0, **state, wait=True)
    assert latest_checkpoint(tmp_path / "ckpt").step == 0
    assert "not recorded in an MLflow run" in caplog.text


def test_a_checkpoint_directory_is_complete_only_with_its_marker(tmp_path):
    state = make_training(0)
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(4, **state)
    path = latest_checkpoint(tmp_path / "ckpt").path
    assert checkpoint_at(path).step == checkpoint_at(f"file://{path}").step == 4
    os.remove(os.path.join(path, "_COMPLETE.json"))  # as if the job stopped before the commit
    assert os.path.exists(os.path.join(path, ".metadata")) and checkpoint_at(path) is None


# -- how the loop counts steps ---------------------------------------------------------------


def _train_counting_steps_done(ckpt, state, until, crash_after=None):
    """A loop as Lightning and Hugging Face write it: ``step = restore()``, ``step += 1``, save(step)."""
    step = ckpt.restore(**state)
    losses = []
    while step < until:
        losses.append(train_step(state))
        step += 1
        ckpt.maybe_save(step, **state)
        if step == crash_after:
            break
    ckpt.close()
    return losses


def test_a_loop_counting_steps_done_resumes_exactly(tmp_path):
    _reseed(1)
    plain = make_training(0)
    expected = _train_counting_steps_done(Checkpointer(tmp_path / "plain", every_steps=3), plain, 10)

    _reseed(1)
    state = make_training(0)
    first = _train_counting_steps_done(Checkpointer(tmp_path / "run", every_steps=3), state, 10, crash_after=7)
    assert [info.step for info in list_checkpoints(tmp_path / "run")] == [3, 6]  # after 3 and 6 steps done
    assert latest_checkpoint(tmp_path / "run").first_step == 1

    _reseed(99)
    resumed = make_training(123)
    ckpt = Checkpointer(tmp_path / "run", every_steps=3)
    assert ckpt.restore(**resumed) == 6  # steps done, the counter's value: step 7 runs next
    ckpt2 = Checkpointer(tmp_path / "run", every_steps=3)
    rest = _train_counting_steps_done(ckpt2, resumed, 10)
    assert first[:6] + rest == expected
    _assert_same_training_state(plain, resumed)


def test_a_loop_passing_indices_resumes_at_the_next_index(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path, every_steps=3)
    for step in range(7):
        train_step(state)
        ckpt.maybe_save(step, **state)
    ckpt.close()
    assert [info.step for info in list_checkpoints(tmp_path)][-1] == 5
    assert latest_checkpoint(tmp_path).first_step == 0
    assert Checkpointer(tmp_path).restore(**make_training(1)) == 6


@pytest.mark.parametrize(
    "saved_by, resumed_by, match",
    [
        ("index", "count", r"restore\(\) returned 6 .*should be 6, but maybe_save got 7: the loop would skip 1 step"),
        ("count", "index", r"restore\(\) returned 6 .*should be 7, but maybe_save got 6: the loop would repeat 1 step"),
    ],
    ids=["index-saved-count-resumed", "count-saved-index-resumed"],
)
def test_resuming_with_the_other_habit_is_refused_before_a_step_is_lost(tmp_path, saved_by, resumed_by, match):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path, every_steps=3)
    for index in range(6):
        train_step(state)
        ckpt.maybe_save(index if saved_by == "index" else index + 1, **state)
    ckpt.close()

    fresh = make_training(1)
    ckpt = Checkpointer(tmp_path, every_steps=3)
    done = ckpt.restore(**fresh)
    assert done == 6
    train_step(fresh)
    next_step = done + 1 if resumed_by == "count" else done
    with pytest.raises(CheckpointError, match=match):
        ckpt.maybe_save(next_step, **fresh)


def test_first_step_given_up_front_and_checked_against_the_checkpoint(tmp_path):
    state = make_training(0)
    ckpt = Checkpointer(tmp_path, first_step=1)
    ckpt.save(4, wait=True, **state)  # a loop that only calls save(): the counter says 4 steps are done
    ckpt.close()
    assert latest_checkpoint(tmp_path).first_step == 1
    assert Checkpointer(tmp_path, first_step=1).restore(**make_training(1)) == 4
    with pytest.raises(ConfigurationError, match="first step was 1, but this Checkpointer was made with first_step=0"):
        Checkpointer(tmp_path, first_step=0).restore(**make_training(1))
    with pytest.raises(ConfigurationError, match="the first step finished is 1"):
        Checkpointer(tmp_path / "other", first_step=1).maybe_save(0, **state)
    with pytest.raises(ConfigurationError, match="first_step must be 0 .*, 1 .* or None"):
        Checkpointer(tmp_path, first_step=2)
