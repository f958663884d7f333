"""Autolog of plain PyTorch loops and sparkgpu.tracking.log, read back from the real spool files."""

from __future__ import annotations

import json

import pytest
import torch

from sparkgpu.errors import ConfigurationError
from sparkgpu.tracking import autolog
from sparkgpu.tracking.autolog import OptimizerAutolog
from sparkgpu.tracking.spool import SpoolDir, SpoolWriter


@pytest.fixture
def spool(tmp_path):
    return SpoolDir(tmp_path / "tracking")


@pytest.fixture
def session(spool):
    """This process acts as rank 0 of a 2-rank job; the session is torn down afterwards."""
    writer = SpoolWriter(spool, attempt=0, rank=0)
    active = autolog._activate(writer, rank=0, world_size=2)
    yield active
    autolog._deactivate()


def read_records(spool: SpoolDir) -> dict:
    out = {"m": [], "p": [], "g": [], "c": []}
    for path in sorted(spool.records_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            for kind, values in json.loads(line).items():
                out[kind].extend(values)
    return out


def metric_points(spool, key):
    return [(step, value) for k, value, step, _ in read_records(spool)["m"] if k == key]


def train(optimizer, scheduler, model, steps):
    for _ in range(steps):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def test_optimizer_hyperparameters_are_logged_once(spool, session):
    hook = OptimizerAutolog(session.writer)
    hook.install()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    train(optimizer, None, model, 5)
    hook.remove()
    params = dict(read_records(spool)["p"])
    assert params["optimizer"] == "AdamW"
    assert params["optimizer.lr"] == "0.0003"
    assert params["optimizer.betas"] == "(0.9, 0.95)"
    assert params["optimizer.weight_decay"] == "0.1"
    assert "optimizer.foreach" not in params  # implementation switches are not hyper-parameters
    assert len(read_records(spool)["p"]) == len(params)  # once, not per step


def test_step_decay_is_logged_at_the_exact_steps_it_happens(spool, session):
    hook = OptimizerAutolog(session.writer, every_n_steps=10)
    hook.install()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    train(optimizer, scheduler, model, 13)
    hook.remove()
    assert metric_points(spool, "lr") == [(0, 1.0), (4, 0.5), (8, 0.25), (12, 0.125)]


def test_schedule_changing_every_step_is_sampled_every_n_steps(spool, session):
    hook = OptimizerAutolog(session.writer, every_n_steps=10)
    hook.install()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=40)
    train(optimizer, scheduler, model, 35)
    hook.remove()
    points = metric_points(spool, "lr")
    assert [step for step, _ in points] == [0, 10, 20, 30]
    assert points[0][1] == 1.0 and points[-1][1] < points[1][1] < 1.0


def test_param_groups_and_second_optimizer_get_their_own_names(spool, session):
    hook = OptimizerAutolog(session.writer)
    hook.install()
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    grouped = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.01}], momentum=0.9
    )
    other = torch.optim.Adam(torch.nn.Linear(3, 1).parameters(), lr=1e-3)
    grouped.step()
    other.step()
    hook.remove()
    params = dict(read_records(spool)["p"])
    assert params["optimizer.group_0.lr"] == "0.1" and params["optimizer.group_1.lr"] == "0.01"
    assert params["optimizer.momentum"] == "0.9"  # equal in every group: one name
    assert params["optimizer_1"] == "Adam" and params["optimizer_1.lr"] == "0.001"
    assert metric_points(spool, "lr/group_1") == [(0, 0.01)]


def test_steps_continue_from_a_restored_adam_state(spool, session):
    model = torch.nn.Linear(3, 1)
    first = torch.optim.Adam(model.parameters(), lr=0.1)
    train(first, None, model, 7)
    restored = torch.optim.Adam(model.parameters(), lr=0.1)
    restored.load_state_dict(first.state_dict())
    hook = OptimizerAutolog(session.writer)
    hook.install()
    train(restored, None, model, 2)
    hook.remove()
    assert hook.current_step == 9
    assert metric_points(spool, "lr") == [(7, 0.1)]


def test_restoring_a_checkpoint_records_no_optimizer_step(spool, session, tmp_path):
    """torch's set_state_dict makes a fresh optimizer's state with one lr=0 step: not the training's."""
    from sparkgpu.train import Checkpointer

    model = torch.nn.Linear(3, 1)
    first = torch.optim.AdamW(model.parameters(), lr=0.003)
    train(first, None, model, 4)
    ckpt = Checkpointer(tmp_path / "ckpt", handle_sigterm=False)
    ckpt.save(3, model=model, optimizer=first, wait=True)
    ckpt.close()

    hook = OptimizerAutolog(session.writer)
    hook.install()
    restored_model = torch.nn.Linear(3, 1)
    restored = torch.optim.AdamW(restored_model.parameters(), lr=0.003)  # no state yet
    assert Checkpointer(tmp_path / "ckpt", handle_sigterm=False).restore(model=restored_model, optimizer=restored) == 4
    assert hook.current_step is None and read_records(spool)["p"] == []  # nothing recorded by the restore
    train(restored, None, restored_model, 1)
    hook.remove()
    params = dict(read_records(spool)["p"])
    assert params["optimizer.lr"] == "0.003"
    assert hook.current_step == 5 and metric_points(spool, "lr") == [(4, 0.003)]  # the 5th step, index 4


def test_log_from_rank_zero_uses_optimizer_steps(spool, session):
    session.autolog = OptimizerAutolog(session.writer)
    session.autolog.install()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.ones(2, 3)).pow(2).mean()
        autolog.log({"loss": loss})  # before the step: Lightning's global_step convention
        loss.backward()
        optimizer.step()
    assert [step for step, _ in metric_points(spool, "loss")] == [0, 1, 2]


def test_log_without_autolog_counts_per_key_and_honours_explicit_steps(spool, session):
    autolog.log({"a": 1.0, "b": torch.tensor(2.0)})
    autolog.log({"a": 3})
    autolog.log({"b": 4.0}, step=100)
    assert metric_points(spool, "a") == [(0, 1.0), (1, 3.0)]
    assert metric_points(spool, "b") == [(0, 2.0), (100, 4.0)]


def test_other_ranks_do_not_log_without_reduce(spool):
    writer = SpoolWriter(spool, attempt=0, rank=1)
    autolog._activate(writer, rank=1, world_size=2)
    try:
        autolog.log({"loss": 1.0})
    finally:
        autolog._deactivate()
    assert read_records(spool)["m"] == []


def test_log_checkpoint_records_lineage(spool, session):
    autolog.log_checkpoint(100, "/ckpt/step-100")
    assert read_records(spool)["c"][0][:2] == [100, "/ckpt/step-100"]


def test_bad_values_and_reductions_are_refused(session):
    with pytest.raises(ConfigurationError, match="'loss' must be a number"):
        autolog.log({"loss": "low"})
    with pytest.raises(ConfigurationError, match="reduce='median'"):
        autolog.log({"loss": 1.0}, reduce="median")
    with pytest.raises(ConfigurationError, match="dict"):
        autolog.log([1.0])


def test_outside_a_job_without_an_mlflow_run_nothing_happens(monkeypatch):
    monkeypatch.delenv("SPARKGPU_TRACKING_SPOOL", raising=False)
    autolog._deactivate()
    autolog.log({"loss": 1.0})  # no job, no active run: recorded nowhere, and no error
    assert autolog.current_step() is None


def test_session_is_created_from_the_environment_in_subprocesses(spool, monkeypatch):
    autolog._deactivate()
    monkeypatch.setenv("SPARKGPU_TRACKING_SPOOL", str(spool.path))
    monkeypatch.setenv("RANK", "0")
    try:
        autolog.log({"loss": 2.0}, step=5)
    finally:
        autolog._deactivate()
    assert metric_points(spool, "loss") == [(5, 2.0)]


def test_every_n_steps_must_be_positive(spool):
    with pytest.raises(ConfigurationError, match="every_n_steps"):
        OptimizerAutolog(SpoolWriter(spool, 0, 0), every_n_steps=0)
