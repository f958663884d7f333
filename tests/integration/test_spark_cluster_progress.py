"""The ranks' progress and a sweep trial's reports reach the client while a Spark attempt runs.

On the real standalone cluster, through a ``file://`` staging store, so the nodes' run dirs are
copies of their own and nothing of the ranks' progress or reports reaches the client but what
node 0 writes into the attempt's state (its ranks' rows, which the nodes' beats bring it, and
rank 0's trial reports):

* a 2-rank gloo job whose rank 1 sleeps before a collective is found hung within
  ``progress_timeout`` and a few seconds, its stacks come back from the executors, the diagnosis
  names rank 1 and where both ranks are, and the job restarts from its checkpoint and finishes;
* the restarted attempt's rank 1 computes its steps 6x slower than rank 0: it is named a
  straggler, with its node, from the arrivals at collectives the beats bring node 0;
* a sweep's pruner prunes a trial on Spark from the reports read while it runs: every rank
  leaves its loop at the same step, long before its last.

Named ``test_spark_cluster_*`` so the session orders it with the other cluster tests (before
the in-process Connect server exists).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from sparkgpu import runtime
from sparkgpu.config import settings
from tests.integration.test_spark_cluster import no_tracking  # noqa: F401 (fixture)
from tests.integration.test_spark_cluster_staging_store import staging_store  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]

PROGRESS_TIMEOUT = 5.0
#: Seconds past the progress timeout within which the hang must be found: node 0 reads its ranks'
#: records every half second and writes its state at most once a second, and the mirrors move it
#: once a second each way.
FOUND_WITHIN = 8.0
#: The restarted attempt's straggler: steps of rank 1 take SLOW, rank 0's QUICK, over a short window.
SLOW_STEPS, QUICK, SLOW, STRAGGLER_WINDOW = 25, 0.05, 0.3, "3"


def _train(steps: int = 3) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401  (the first save imports it: seconds, before any progress)

    from sparkgpu.train import Checkpointer

    model = torch.nn.Linear(1, 1)
    ckpt = Checkpointer(every_steps=1, async_save=False)
    start = ckpt.restore(model=model)
    for step in range(start, steps):
        if step == start + 1 and runtime.attempt() == 0 and runtime.get_global_rank() == 1:
            time.sleep(600)
        total = torch.ones(1)
        dist.all_reduce(total)
        ckpt.maybe_save(step, model=model)  # the progress node 0 hears of: no call of the user's
    if runtime.attempt() == 1:  # the restart's rank 1 computes its steps 6x slower: a straggler
        for step in range(steps, steps + SLOW_STEPS):
            time.sleep(SLOW if runtime.get_global_rank() == 1 else QUICK)
            dist.all_reduce(torch.ones(1))
            runtime.heartbeat(step)
    return start


@pytest.mark.usefixtures("no_tracking")
def test_a_rank_that_hangs_on_spark_is_found_named_with_its_stacks_and_the_job_resumes(
    cluster_spark, staging_store, capsys, monkeypatch
):
    from sparkgpu.config import reset_settings

    monkeypatch.setenv("SPARKGPU_STRAGGLER_WINDOW", STRAGGLER_WINDOW)
    reset_settings()
    assert cluster_spark.gpu.train(
        _train, gpus=2, gpu_type="A10", max_restarts=1, progress_timeout=PROGRESS_TIMEOUT, timeout=300
    ) == [1, 1]  # the restart resumed from the step before the hang (unfound, the hang lasts 600 s)
    said = capsys.readouterr()
    said = said.out + said.err
    run_dir = settings().staging_root / cluster_spark.gpu.last_job_id
    state = json.loads((run_dir / "state.json").read_text())
    assert [a.get("failure_class") for a in state["attempts"]] == ["hang", None]
    assert state["restarts"] == 1 and state["attempts"][1]["status"] == "succeeded"
    folder = run_dir / "attempts" / "0"
    hang = json.loads((folder / "hang.json").read_text())
    summary = hang["summary"]
    assert hang["behind"] == [1], summary
    assert summary.startswith("rank 1 on node 0 is in `_train` at test_spark_cluster_progress.py:"), summary
    assert "(`time.sleep(600)`)" in summary, summary
    assert "rank 0 waits in `all_reduce`, called from `_train` at test_spark_cluster_progress.py:" in summary
    # Found within the timeout and a few seconds of rank 1's last progress (one host: one clock).
    found_after = hang["detected_at"] - hang["ranks"]["1"]["progress"]["last"]
    assert PROGRESS_TIMEOUT <= found_after <= PROGRESS_TIMEOUT + FOUND_WITHIN, found_after
    stacks = (folder / "hang.txt").read_text()
    assert stacks.startswith(summary) and "=== rank 0 on node 0: waits in `all_reduce`" in stacks
    assert "(most recent call first)" in stacks and "in _train" in stacks
    # The flight recorders came back from the executor beside the stacks.
    waiting, behind = hang["ranks"]["0"]["last_collective"], hang["ranks"]["1"]["last_collective"]
    assert waiting["seq"] > behind["seq"] and not waiting["completed"], hang
    assert "flight recorder: rank 0 at collective #" in summary
    assert all((folder / "spark" / f"flight-recorder-rank-{r}.json").exists() for r in (0, 1))
    assert f"attempt 0 hung: {summary}" in said
    assert "attempt 0 failed (hang: rank 1 on node 0 is in `_train` at test_spark_cluster_progress.py:" in said
    assert "(restart 1 of 1)" in said
    # The restart's slow rank 1 is named from the arrivals the nodes' beats carried to node 0.
    stragglers = json.loads((run_dir / "attempts" / "1" / "stragglers.json").read_text())["stragglers"]
    assert [(s["rank"], s["node"]) for s in stragglers] == [(1, 0)], stragglers
    assert (SLOW - QUICK) * 0.6 <= stragglers[0]["lateness"] <= SLOW and stragglers[0]["factor"] >= 1.5, stragglers
    assert "attempt 1: rank 1 on node 0 is a straggler: it reaches the job's collectives" in said


def _reported(where: str, steps: int = 1200) -> float:
    """Two gloo ranks report a value above the pruner's threshold at every step until told to stop."""
    import torch
    import torch.distributed as dist

    rank = runtime.get_global_rank()
    value = 10.0
    for step in range(steps):
        total = torch.ones(1)
        dist.all_reduce(total)
        with open(os.path.join(where, f"rank-{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"event": "step", "step": step}) + "\n")
        if runtime.report(step, value):
            with open(os.path.join(where, f"rank-{rank}.jsonl"), "a") as f:
                f.write(json.dumps({"event": "stopped", "step": step}) + "\n")
            break
        time.sleep(0.05)  # the workload's pace: the whole loop lasts a minute unless pruned
    return value


def _events(where, rank: int) -> list[dict]:
    with open(os.path.join(str(where), f"rank-{rank}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.usefixtures("no_tracking")
def test_a_sweep_prunes_a_trial_on_spark_from_the_reports_it_reads_while_the_trial_runs(
    cluster_spark, staging_store, tmp_path
):
    optuna = pytest.importorskip("optuna")
    import sparkgpu

    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.ThresholdPruner(upper=5.0))
    result = sparkgpu.sweep(
        cluster_spark.gpu.distributed(_reported, gpus=2, gpu_type="A10"),
        study=study,
        space={"x": optuna.distributions.FloatDistribution(0.0, 1.0)},
        n_trials=1,
        kwargs={"where": str(tmp_path)},
    )
    (trial,) = result.study.trials
    assert trial.state.name == "PRUNED"
    stops = [[e["step"] for e in _events(tmp_path, rank) if e["event"] == "stopped"] for rank in (0, 1)]
    assert len(stops[0]) == 1 and stops[0] == stops[1], stops  # every rank left at the same step
    assert stops[0][0] < 1200 - 1  # pruned while it ran, not read after its end
    assert trial.intermediate_values and min(trial.intermediate_values) == 0
