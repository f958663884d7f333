"""The Spark cluster's restart path is exact: a transformer whose rank is SIGKILLed on an executor
resumes from its checkpoint in a new barrier stage and ends bitwise equal to an uninterrupted run.

The model, data and checks are those of ``test_transformer_restart_exactness.py``; the
uninterrupted run is the local one, since the simulated-GPU ranks of the test cluster run on
this host's CPUs with the same thread counts (the host's cores shared out between a node's
ranks), so the cluster must reproduce it bit for bit.
"""

from __future__ import annotations

import json
import random

import pytest

from sparkgpu.config import settings
from tests.integration.test_transformer_restart_exactness import (  # noqa: F401 - fixtures
    TOTAL_STEPS,
    WORLD,
    all_blocks,
    assert_same_run,
    read_records,
    token_dir,
    train_transformer,
    uninterrupted,
)

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


def test_a_sigkilled_rank_on_an_executor_resumes_bitwise_equal(
    cluster_spark, uninterrupted, token_dir, all_blocks, tmp_path
):
    plain, plain_steps = uninterrupted("ddp")
    seed = random.randrange(1 << 30)
    kill_step = random.Random(seed).randrange(4, TOTAL_STEPS - 1)
    note = f"(Spark, rank 1 killed after step {kill_step}, seed {seed})"
    record = tmp_path / "spark.jsonl"
    states = cluster_spark.gpu.train(
        train_transformer,
        gpus=WORLD,
        gpu_type="A10",
        args=(token_dir, str(record), "ddp"),
        kwargs={"kill_step": kill_step},
        max_restarts=1,
        name="spark_exactness",
    )
    (run_dir,) = settings().staging_root.glob("spark-exactness-*")
    state = json.loads((run_dir / "state.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"], note
    assert_same_run(states, read_records(record), plain, plain_steps, all_blocks, note)
