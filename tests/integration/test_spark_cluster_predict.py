"""spark.gpu.predict and spark.gpu.generate on a real standalone cluster (2 workers x 2 simulated GPUs):
a registered tabular model, a tiny Llama with a LoRA adapter, and an executor killed mid-run.

The last test kills an executor, so the module runs on the session's disposable cluster.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from deltalake import DeltaTable

from sparkgpu.config import reset_settings, settings
from sparkgpu.errors import CapacityError
from sparkgpu.usage import UsageLedger
from tests.fakes import tiny_models
from tests.integration.spark_cluster import cluster_session

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]

FEATURES = [f"f{i}" for i in range(4)]


@pytest.fixture(scope="module")
def predict_cluster(disposable_spark_cluster):
    return disposable_spark_cluster.repaired()


@pytest.fixture(scope="module")
def spark(predict_cluster):
    with cluster_session(predict_cluster) as session:
        yield session


@pytest.fixture
def tracked(monkeypatch, mlflow_store):
    uri, client, _ = mlflow_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    reset_settings()
    return uri, client


def features_frame(spark, rows: int = 2000, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    label = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    data = [(i, *map(float, x[i]), int(label[i])) for i in range(rows)]
    frame = spark.createDataFrame(data, "id long, f0 float, f1 float, f2 float, f3 float, label long")
    return frame.repartition(4, "id"), x, label


def test_a_registered_tabular_model_scores_a_dataframe_and_a_delta_table_once_loaded_per_worker(
    spark, tracked, tmp_path
):
    import torch

    from sparkgpu import registry

    uri, client = tracked
    model = tiny_models.tabular_model()
    version = registry.register(model, "main.ml.ctr", alias="champion", serialization_format="pickle", tracking_uri=uri)
    frame, x, label = features_frame(spark)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()[:, 0]

    scored = spark.gpu.predict(frame, "main.ml.ctr@champion", gpus=4, gpu_type="A10", input_cols=FEATURES)
    rows = scored.toArrow().sort_by("id")
    assert rows.column_names == ["id", *FEATURES, "label", "prediction"]
    np.testing.assert_allclose(rows.column("prediction").to_numpy(), expected, rtol=1e-5, atol=1e-6)

    table = str(tmp_path / "scores")
    result = spark.gpu.predict(
        frame,
        "main.ml.ctr@champion",
        gpus=4,
        gpu_type="A10",
        input_cols=FEATURES,
        output=table,
        batch_size=100,
        metric="accuracy",
        label_col="label",
        tags={"team": "ml"},
    )
    written = DeltaTable(table).to_pyarrow_table().sort_by("id")
    assert written.column("id").to_pylist() == list(range(2000)) and result.rows == 2000
    np.testing.assert_allclose(written.column("prediction").to_numpy(), expected, rtol=1e-5, atol=1e-6)
    assert result.model_loads == 0, "the Python workers of the first stage kept the model"
    accuracy = float(((expected >= 0.5) == label).mean())
    assert result.metrics == {"accuracy": pytest.approx(accuracy)}
    run = client.get_run(result.mlflow_run_id)
    assert run.data.metrics["accuracy"] == pytest.approx(accuracy)
    assert run.data.tags["sparkgpu.model.name"] == "main.ml.ctr" and run.data.tags["sparkgpu.model.version"] == "1"
    assert registry.get_version("main.ml.ctr/1", tracking_uri=uri).tags["sparkgpu.evaluation.run_id"] == run.info.run_id
    assert version.version == 1

    (usage,) = [r for r in UsageLedger(settings().usage_ledger_uri).read().to_pylist() if r["job_id"] == result.job_id]
    assert (usage["gpus"], usage["gpu_type"], usage["backend"], usage["status"]) == (4, "A10", "spark", "succeeded")
    assert dict(usage["tags"])["team"] == "ml"

    again = spark.gpu.predict(
        frame, "main.ml.ctr@champion", gpus=4, gpu_type="A10", input_cols=FEATURES, output=table, run_id=result.run_id
    )
    assert not again.committed and again.chunks_reused == again.chunks and again.version == result.version
    assert DeltaTable(table).to_pyarrow_table().num_rows == 2000


def test_another_gpu_type_is_refused_before_anything_runs(spark):
    with pytest.raises(CapacityError, match="A10"):
        spark.gpu.predict(spark.range(3), lambda: lambda x: x, gpus=1, gpu_type="H100")


def test_a_lora_adapter_generates_on_the_executors_what_it_generates_here(spark, tracked, tmp_path):
    from sparkgpu.predict import GenerationConfig
    from sparkgpu.predict.executor.generation import generate_completions
    from sparkgpu.predict.models import resolve_model

    base = tiny_models.llama_dir(tmp_path / "base")
    adapter = tiny_models.adapter_dir(base, tmp_path / "adapter")
    prompts = [f"{a} {b}" for a in tiny_models.CORPUS for b in ("the", "what is", "a dog ran")]
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_p=0.9, seed=3, batch_size=4)
    local = resolve_model(str(adapter)).load("cpu")
    keys = list(range(len(prompts)))
    expected = generate_completions(local.module, local.tokenizer, prompts, keys, config)
    frame = spark.createDataFrame(
        [(k, p, e) for k, p, e in zip(keys, prompts, expected)], "key long, prompt string, expected string"
    ).repartition(2, "key")

    result = spark.gpu.generate(
        frame,
        str(adapter),
        gpus=2,
        gpu_type="A10",
        key_col="key",
        generation=config,
        output=str(tmp_path / "answers"),
        metric="accuracy",
        label_col="expected",
    )
    answers = DeltaTable(str(tmp_path / "answers")).to_pyarrow_table().sort_by("key")
    assert answers.column("completion").to_pylist() == expected
    assert result.metrics == {"accuracy": 1.0}


def make_slow_doubler():
    def predict(x):
        time.sleep(0.2)
        return x * 2

    return predict


def test_an_executor_lost_mid_run_reruns_only_unfinished_chunks_and_the_table_holds_every_row_once(
    spark, predict_cluster, tmp_path
):
    table = tmp_path / "doubled"
    frame = spark.range(0, 4000, 1, 4).selectExpr("id", "cast(id as double) as x")
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = spark.gpu.predict(
                frame,
                make_slow_doubler,
                gpus=4,
                gpu_type="A10",
                input_cols=["x"],
                output=str(table),
                batch_size=50,
                chunk_rows=100,
                run_id="loss",
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    staged = table / "sparkgpu-loss"
    deadline = time.time() + 180
    while time.time() < deadline:
        done = [p for p in staged.glob("*.parquet")] if staged.exists() else []
        if len({p.name[:6] for p in done}) == 4 and len(done) >= 8:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the four scoring tasks did not write their first chunks")
    executor, (pid, _) = sorted(predict_cluster.executor_pids().items())[0]
    os.kill(pid, signal.SIGKILL)
    thread.join(300)
    assert not thread.is_alive(), "the scoring run did not finish after the executor was lost"
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    ids = DeltaTable(str(table)).to_pyarrow_table().column("id").to_pylist()
    assert sorted(ids) == list(range(4000)), "every input row once"
    assert result.rows == 4000 and result.chunks == 40
    assert result.chunks_reused >= 2, "the re-run tasks skipped the chunks their lost attempts had finished"
    values = DeltaTable(str(table)).to_pyarrow_table()
    assert values.column("prediction").to_pylist() == [2.0 * v for v in values.column("x").to_pylist()]
