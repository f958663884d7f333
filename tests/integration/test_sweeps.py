"""Sweeps: an Optuna study's trials run as 2-rank gloo jobs of a tiny transformer (``sweep_trials.train``).

What each test checks comes from the ranks' own records (``sweep_trials.events``), the trials'
job states and the study, never from a clock: a pruned trial's ranks stop at one step, a failing
trial is FAIL and the sweep goes on, ``max_concurrent`` holds, a budget stops new trials, the
parent MLflow run has one child per trial, the best trial's model is registered, a detached sweep
runs on after its caller exited, a sweep whose driver was killed resumes without
running a finished trial again, and a detached sweep whose driver was killed is finished by its
keeper with no one resuming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap

import pytest

optuna = pytest.importorskip("optuna")

import sparkgpu  # noqa: E402
from sparkgpu.config import settings  # noqa: E402
from sparkgpu.sweeps.folder import list_sweeps  # noqa: E402
from tests.integration.processes import start_client, wait_for  # noqa: E402
from tests.integration.sweep_trials import UNTIL_PRUNED, events, train  # noqa: E402

pytestmark = pytest.mark.integration

SPACE = {
    "offset": optuna.distributions.FloatDistribution(0.0, 10.0),
    "fail": optuna.distributions.CategoricalDistribution([False, True]),
}


@pytest.fixture(autouse=True)
def _no_sweep_driver_left(_isolated_sparkgpu_home):
    """A detached sweep's keeper and driver (a session of their own) outlive a test that failed before it ended."""
    yield
    from sparkgpu._util.process import ProcessRef

    for folder in list_sweeps():
        keeper = folder.keeper()
        if keeper is not None:  # its session's leader: the group holds its driver too
            os.killpg(keeper.pid, signal.SIGKILL)
        driver = folder.read().get("driver")
        if driver and driver["pid"] != os.getpid() and not ProcessRef.from_record(driver).is_gone():
            os.kill(driver["pid"], signal.SIGKILL)


def _intervals(study) -> list[tuple[float, float]]:
    """When each trial's job held its GPUs: its attempts' ranks' start to end, from its state.json."""
    spans = []
    for trial in study.trials:
        job_id = trial.user_attrs["sparkgpu.job_id"]
        state = json.loads((settings().staging_root / job_id / "state.json").read_text())
        for attempt in state["attempts"]:
            spans.append((attempt["submitted_at"], attempt["ended_at"]))
    return spans


def _most_at_once(spans) -> int:
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = now = 0
    for _, change in edges:
        now += change
        most = max(most, now)
    return most


def test_a_pruned_trial_stops_all_its_ranks_at_one_step_a_failed_one_does_not_stop_the_sweep_and_mlflow_nests_them(
    tmp_path, mlflow_store, monkeypatch
):
    uri, client, _ = mlflow_store
    monkeypatch.setenv("SPARKGPU_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from sparkgpu.config import reset_settings

    reset_settings()
    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.ThresholdPruner(upper=5.0))
    study.enqueue_trial({"offset": 0.0, "fail": False})  # completes
    study.enqueue_trial({"offset": 10.0, "fail": False})  # above the threshold from its first report: pruned
    study.enqueue_trial({"offset": 0.0, "fail": True})  # rank 1 raises at step 1
    steps = 20  # the complete trial's; the one above the threshold runs until pruned (UNTIL_PRUNED at most)
    result = sparkgpu.sweep(
        train,
        study=study,
        space=SPACE,
        n_trials=3,
        max_concurrent=2,
        gpus=2,
        gpu_type="cpu",
        experiment="test_sweeps",
        register_best_as="main.ml.sweep_best",
        kwargs={"where": str(tmp_path), "steps": steps, "return_model": True, "prune_above": 5.0},
    )
    complete, pruned, failed = result.study.trials
    assert [t.state.name for t in result.study.trials] == ["COMPLETE", "PRUNED", "FAIL"]
    # Every rank of the pruned trial left the loop at the same step, well before its end.
    stops = [[e["step"] for e in events(tmp_path, 1, rank) if e["event"] == "stopped"] for rank in (0, 1)]
    assert len(stops[0]) == 1 and stops[0] == stops[1], stops
    assert stops[0][0] < UNTIL_PRUNED - 1
    assert all(any(e["event"] == "end" for e in events(tmp_path, 1, rank)) for rank in (0, 1))
    # Recorded with its last reported value, as Optuna does for a pruned trial.
    assert pruned.value == pruned.intermediate_values[max(pruned.intermediate_values)]
    assert complete.value == pytest.approx(complete.intermediate_values[steps - 1])
    assert "trial asked to fail at step 1" in failed.user_attrs["sparkgpu.error"]
    assert _most_at_once(_intervals(result.study)) <= 2
    # One parent run, one child per trial: each trial's own job run, tagged with its state.
    parent = client.get_run(result.parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'"
    )
    assert sorted(c.data.tags["sparkgpu.trial.state"] for c in children) == ["COMPLETE", "FAIL", "PRUNED"]
    assert {c.data.tags["sparkgpu.job_id"] for c in children} == {t.user_attrs["sparkgpu.job_id"] for t in study.trials}
    by_state = {c.data.tags["sparkgpu.trial.state"]: c for c in children}
    assert by_state["PRUNED"].data.params["trial.offset"] == "10.0"
    history = client.get_metric_history(by_state["PRUNED"].info.run_id, "trial_value")
    assert sorted(m.step for m in history) == sorted(pruned.intermediate_values)
    assert parent.data.tags["best.trial"] == "0" and parent.data.tags["best.offset"] == "0.0"
    assert parent.data.metrics["best_value"] == pytest.approx(complete.value)
    # The best trial's model (rank 0's "model"), registered with its job as lineage.
    version = result.model_version
    assert version.name == "main.ml.sweep_best"
    assert version.tags["sparkgpu.job_id"] == complete.user_attrs["sparkgpu.job_id"]


DETACHED = textwrap.dedent("""
    import optuna, sparkgpu
    from tests.integration.sweep_trials import train

    detached = sparkgpu.sweep(
        train,
        direction="minimize",
        space={{"offset": optuna.distributions.FloatDistribution(0.0, 1.0)}},
        n_trials=3,
        gpus=2,
        gpu_type="cpu",
        budget="0.000001 GPU-hours",  # spent by the first trial's first second
        kwargs={{"where": {where!r}, "steps": 3}},
        detach=True,
    )
    print(detached.sweep_id, flush=True)
""")


def test_a_detached_sweep_runs_on_after_its_caller_exits_and_its_budget_stops_new_trials(
    tmp_path, _isolated_sparkgpu_home
):
    caller = start_client(
        tmp_path, _isolated_sparkgpu_home, DETACHED.format(where=str(tmp_path)), stdout=subprocess.PIPE, text=True
    )
    out, _ = caller.communicate(timeout=120)
    assert caller.returncode == 0
    sweep_id = out.split()[-1]
    result = sparkgpu.sweeps.DetachedSweep(sweep_id).result(timeout=240)
    (only,) = result.study.trials  # the budget was spent by the first: no second trial started
    assert only.state.name == "COMPLETE"
    assert "budget of 1e-06 GPU-hours is spent" in result.stopped_because
    assert sparkgpu.sweeps.DetachedSweep(sweep_id).state() == "stopped"


RESUMABLE = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    import optuna, sparkgpu
    from tests.integration.sweep_trials import train

    sparkgpu.sweep(
        train,
        direction="minimize",
        space={{"offset": optuna.distributions.FloatDistribution(0.0, 1.0)}},
        sampler=optuna.samplers.RandomSampler(seed=0),
        n_trials=2,
        gpus=2,
        gpu_type="cpu",
        kwargs={{"where": {where!r}, "steps": {steps}}},
    )
""")


def test_a_sweep_resumed_after_its_driver_was_killed_runs_no_finished_trial_twice(
    tmp_path, _isolated_sparkgpu_home, capsys
):
    where = tmp_path / "records"
    where.mkdir()
    driver = start_client(
        tmp_path,
        _isolated_sparkgpu_home,
        RESUMABLE.format(where=str(where), steps=40),
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    # Killed once trial 0 has ended and trial 1's ranks run: one trial finished, one unfinished
    # (its job, detached, runs on without the driver).
    started_1 = lambda: any(e["event"] == "start" for e in events(where, 1, 0))  # noqa: E731
    assert wait_for(started_1, within=240), "trial 1 never started"
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    (folder,) = list_sweeps()
    assert _cli(capsys, "sweeps", "--json")[0]["state"] == "lost"
    assert _cli(capsys, "sweep", "resume", folder.sweep_id) == []  # runs the sweep here to its end
    trials = _cli(capsys, "sweep", folder.sweep_id, "--json")
    assert [t["state"] for t in trials] == ["COMPLETE", "COMPLETE"]
    for number in range(2):
        starts = [e for e in events(where, number, 0) if e["event"] == "start"]
        assert len(starts) == 1, f"trial {number} started {len(starts)} times: {starts}"
    assert len({t["job_id"] for t in trials}) == 2
    assert _cli(capsys, "sweeps", "--json")[0]["state"] == "finished"


KEPT = textwrap.dedent("""
    import optuna, sparkgpu
    from tests.integration.sweep_trials import train

    detached = sparkgpu.sweep(
        train,
        direction="minimize",
        space={{"offset": optuna.distributions.FloatDistribution(0.0, 1.0)}},
        sampler=optuna.samplers.RandomSampler(seed=0),
        n_trials=3,
        gpus=2,
        gpu_type="cpu",
        kwargs={{"where": {where!r}, "steps": {steps}}},
        detach=True,
    )
    print(detached.sweep_id, flush=True)
""")


def test_a_detached_sweep_whose_driver_is_killed_is_finished_by_its_keeper_running_no_trial_twice(
    tmp_path, _isolated_sparkgpu_home, capsys
):
    where = tmp_path / "records"
    where.mkdir()
    caller = start_client(
        tmp_path, _isolated_sparkgpu_home, KEPT.format(where=str(where), steps=80), stdout=subprocess.PIPE, text=True
    )
    out, _ = caller.communicate(timeout=120)
    assert caller.returncode == 0  # the caller is gone: nothing but the keeper can go on with the sweep
    (folder,) = list_sweeps()
    assert out.split()[-1] == folder.sweep_id
    keeper = folder.keeper()
    assert keeper is not None
    # Killed once trial 0 has ended and trial 1's ranks run: one trial finished, one unfinished (its
    # job, detached, runs on without the driver), one the next driver samples.
    ended_0 = lambda: any(e["event"] == "end" for e in events(where, 0, 0))  # noqa: E731
    started_1 = lambda: any(e["event"] == "start" for e in events(where, 1, 0))  # noqa: E731
    assert wait_for(lambda: ended_0() and started_1(), within=240), "trial 0 never ended while trial 1 ran"
    first = folder.read()["driver"]
    assert first["pid"] != keeper.pid
    os.kill(first["pid"], signal.SIGKILL)
    # A kept sweep is not lost while its keeper lives, and no one else may drive it meanwhile.
    assert _cli(capsys, "sweeps", "--json")[0]["state"] == "running"
    from sparkgpu.cli import main

    assert main(["sweep", "resume", folder.sweep_id]) != 0
    assert f"kept by its keeper (pid {keeper.pid})" in capsys.readouterr().err
    # The keeper's next driver finishes it, with no client and no resume.
    result = sparkgpu.sweeps.DetachedSweep(folder.sweep_id).result(timeout=300)
    assert [t.state.name for t in result.study.trials] == ["COMPLETE"] * 3
    assert folder.read()["driver"]["pid"] not in (first["pid"], keeper.pid)
    for number in range(3):
        starts = [e for e in events(where, number, 0) if e["event"] == "start"]
        assert len(starts) == 1, f"trial {number} started {len(starts)} times: {starts}"
    assert len({t.user_attrs["sparkgpu.job_id"] for t in result.study.trials}) == 3
    # The next driver's sampler, reseeded, draws a new point: not trial 0's again.
    assert len({t.params["offset"] for t in result.study.trials}) == 3, [t.params for t in result.study.trials]
    log = folder.driver_log.read_text()
    assert f"the driver of sweep {folder.sweep_id} (pid {first['pid']}) died (signal 9)" in log
    assert wait_for(lambda: folder.keeper() is None, within=60), "the keeper outlived its sweep"
    assert _cli(capsys, "sweeps", "--json")[0]["state"] == "finished"


def _cli(capsys, *argv: str) -> list[dict]:
    """Runs ``sparkgpu ARGV`` here; the JSON lines it printed (none for a command that prints text)."""
    from sparkgpu.cli import main

    capsys.readouterr()
    assert main(list(argv)) == 0
    lines = capsys.readouterr().out.splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]
