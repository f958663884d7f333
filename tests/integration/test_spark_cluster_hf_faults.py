"""A Hugging Face Trainer on the Spark cluster survives a lost executor with no resume code.

Four gloo ranks on two executors (two simulated GPUs each) train the tiny Llama of
``test_hf_trainer.py`` with a plain ``Trainer``. In attempt 0, rank 2 kills its own executor's
JVM mid-step, as a lost machine would: its node's ranks die with it, the other node stops, and
the job restarts on a new executor. The restarted attempt resumes from the newest sealed
checkpoint by itself and ends bitwise equal to an uninterrupted run on the same cluster
(weights, optimizer state, the loss of every step), every sample trained on once per epoch.

Runs on the session's disposable cluster (it kills an executor). Named
``test_spark_cluster_*`` so the session orders it with the other cluster tests.
"""

from __future__ import annotations

import json
import re

import pytest

from sparkgpu.config import settings
from tests.integration.test_hf_trainer import BATCH, EPOCHS, SAMPLES, train_plainly
from tests.integration.test_spark_cluster_faults import fault_cluster, fault_spark  # noqa: F401 - fixtures
from tests.integration.test_transformer_restart_exactness import assert_bitwise_equal

pytestmark = [
    pytest.mark.integration,
    pytest.mark.spark,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("workers_share_this_image"),
]

WORLD, SAVE_STEPS = 4, 2  # two nodes of two ranks; test_hf_trainer's batch of 4 and 2 epochs
STEPS_PER_EPOCH = SAMPLES // (BATCH * WORLD)  # 3
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 6
KILL_AT = 5  # rank 2 kills its executor in the forward pass of step 5, after checkpoint-4 was saved


def train(spark, tmp_path, tag, **options):
    record = tmp_path / f"{tag}.jsonl"
    fault = {"kill_step": KILL_AT - 1, "kill_executor_of": 2} if options.pop("kill", False) else {}
    states = spark.gpu.train(
        train_plainly,
        gpus=WORLD,
        gpu_type="A10",
        args=(str(record),),
        kwargs={"save_steps": SAVE_STEPS, **fault},
        name=tag,
        **options,
    )
    (run_dir,) = settings().staging_root.glob(f"{tag}-*")
    state = json.loads((run_dir / "state.json").read_text())
    steps = {}  # (rank, step) -> what it trained on, from the last attempt that ran it
    for rank in range(WORLD):
        for line in open(f"{record}.{rank}"):
            entry = json.loads(line)
            steps[(rank, entry["step"])] = entry
    return states, state, steps


def test_a_trainer_resumes_bitwise_equal_after_its_executor_is_lost(fault_cluster, fault_spark, tmp_path, capfd):  # noqa: F811
    plain_states, plain_state, plain_steps = train(fault_spark, tmp_path, "hf-plain")
    assert len(plain_state["attempts"]) == 1 and [s["world_size"] for s in plain_states] == [WORLD] * WORLD
    assert sorted(plain_steps) == [(r, s) for r in range(WORLD) for s in range(1, TOTAL_STEPS + 1)]

    states, state, steps = train(fault_spark, tmp_path, "hf-lost", kill=True, max_restarts=1)
    first, second = state["attempts"]
    assert (first["status"], second["status"]) == ("failed", "succeeded"), state["attempts"]
    out = capfd.readouterr().out
    resumed = re.search(r"restarting from step (\d+) \(restart 1 of 1\)", out)
    assert resumed, out[-3000:]
    # The client names the checkpoint the Trainer resumed from: a sealed one, no later than the kill.
    first_resumed_step = min(e["step"] for e in steps.values() if e["attempt"] == 1)
    assert first_resumed_step == int(resumed.group(1)) + 1 and 2 <= int(resumed.group(1)) < KILL_AT

    assert {k: (v["loss"], v["samples"]) for k, v in steps.items()} == {
        k: (v["loss"], v["samples"]) for k, v in plain_steps.items()
    }, "the loss curve or the data differ after the lost executor"
    for epoch in range(EPOCHS):
        seen = [s for (_, step), e in steps.items() if (step - 1) // STEPS_PER_EPOCH == epoch for s in e["samples"]]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch} skipped or repeated samples"
    for rank_state in states:
        assert_bitwise_equal(rank_state, plain_states[0])
    fault_cluster.wait_for_executors()  # the worker starts a new executor for the next test
