"""spark.gpu.predict's executor side and Delta commit, without Spark: chunks, skips, generation, evaluation."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sparkgpu.errors import ConfigurationError
from sparkgpu.predict import GenerationConfig, resolve_model
from sparkgpu.predict.delta_output import commit_chunks
from sparkgpu.predict.evaluation import compute_metrics
from sparkgpu.predict.executor import scoring
from sparkgpu.predict.executor.generation import generate_completions
from sparkgpu.predict.executor.scoring import ScoringPlan, score_partition
from tests.fakes import tiny_models

CALLS: list[int] = []


def make_doubler():
    def predict(x, y):
        CALLS.append(len(x))
        return x * 2 + y

    return predict


def batches(rows: int, size: int):
    ids = np.arange(rows)
    for start in range(0, rows, size):
        part = ids[start : start + size]
        yield pa.RecordBatch.from_pydict({"x": part.astype(np.float64), "y": np.ones(len(part)), "id": part})


def plan(tmp_path=None, **changes) -> ScoringPlan:
    options = dict(
        source=resolve_model(make_doubler),
        task="predict",
        input_cols=("x", "y"),
        output_col="prediction",
        result_type=pa.float64(),
        batch_size=10,
        chunk_rows=30,
        output_uri=str(tmp_path) if tmp_path else None,
        run_id="r1",
    )
    options.update(changes)
    return ScoringPlan(**options)


def test_a_partition_is_scored_outside_spark_where_pyspark_is_not_installed():
    """The GPU suite scores a torch module with this code path on a machine that has torch and CUDA
    but no pyspark (here on the CPU)."""
    script = (
        "import sys; sys.modules['pyspark'] = None  # as if pyspark were not installed\n"
        "import numpy as np, pyarrow as pa, torch\n"
        "from sparkgpu.predict import resolve_model\n"
        "from sparkgpu.predict.executor.scoring import ScoringPlan, score_partition\n"
        "model = torch.nn.Linear(2, 1)\n"
        "with torch.no_grad(): model.weight.copy_(torch.tensor([[2.0, 1.0]])); model.bias.zero_()\n"
        "plan = ScoringPlan(source=resolve_model(model), task='predict', input_cols=('x', 'y'),\n"
        "    output_col='prediction', result_type=pa.float32(), batch_size=8, chunk_rows=16)\n"
        "ids = np.arange(40, dtype=np.float32)\n"
        "batch = pa.RecordBatch.from_pydict({'x': ids, 'y': np.ones(40, np.float32)})\n"
        "out = pa.Table.from_batches(list(score_partition(plan, iter([batch]))))\n"
        "assert 'pyspark' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "print(out.column('prediction').to_pylist())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str([2.0 * i + 1 for i in range(40)])


def test_rows_come_back_with_their_prediction_in_batches_of_the_batch_size():
    CALLS.clear()
    out = pa.Table.from_batches(list(score_partition(plan(), batches(95, 7))))
    assert out.column_names == ["x", "y", "id", "prediction"]
    assert out.column("id").to_pylist() == list(range(95))
    assert out.column("prediction").to_pylist() == [2.0 * i + 1 for i in range(95)]
    assert max(CALLS) == 10 and sum(CALLS) == 95


def test_a_model_is_loaded_once_per_process_and_kept_across_tasks():
    def make_tripler():
        return lambda x, y: x * 3

    before = scoring.loads_in_process()
    source = resolve_model(make_tripler)
    assert resolve_model(make_tripler).key == source.key
    for _ in range(3):
        list(score_partition(plan(source=source), batches(20, 10)))
    assert scoring.loads_in_process() - before == 1


def test_a_rerun_task_scores_only_the_chunks_its_earlier_attempt_did_not_finish(tmp_path):
    source = resolve_model(make_doubler)
    first = pa.Table.from_batches(list(score_partition(plan(tmp_path, source=source), batches(95, 7))))
    assert first.column("rows").to_pylist() == [30, 30, 30, 5] and not any(first.column("reused").to_pylist())
    (tmp_path / scoring.chunk_name("r1", 0, 2)).unlink()  # as if the task died while writing chunk 2
    CALLS.clear()
    second = pa.Table.from_batches(list(score_partition(plan(tmp_path, source=source), batches(95, 7))))
    assert second.column("reused").to_pylist() == [True, True, False, True]
    assert sum(CALLS) == 30
    chunks = second.to_pylist()
    version, committed = commit_chunks(
        str(tmp_path), chunks, pa.parquet.read_schema(tmp_path / chunks[0]["path"]), "r1"
    )
    assert (version, committed) == (0, True)
    assert commit_chunks(str(tmp_path), chunks, None, "r1") == (0, False)  # the same run commits once
    table = DeltaTable(str(tmp_path)).to_pyarrow_table()
    assert sorted(table.column("id").to_pylist()) == list(range(95))


def test_generation_pads_per_batch_and_seeds_each_row_from_its_key(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tiny_models.llama_dir(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    tok = AutoTokenizer.from_pretrained(base)
    prompts = ["the cat sat", "what is two plus two", "a dog", "the answer is"]
    greedy = GenerationConfig(max_new_tokens=5, batch_size=4)
    together = generate_completions(model, tok, prompts, prompts, greedy)
    alone = [generate_completions(model, tok, [p], [p], greedy)[0] for p in prompts]
    assert together == alone and all(together)
    sampled = GenerationConfig(max_new_tokens=6, do_sample=True, seed=7, batch_size=2, top_k=20)
    keys = [10, 11, 12, 13]
    first = generate_completions(model, tok, prompts, keys, sampled)
    reordered = generate_completions(model, tok, prompts[::-1], keys[::-1], dataclasses_replace(sampled, batch_size=3))
    assert first == reordered[::-1]
    other_seed = generate_completions(model, tok, prompts, keys, dataclasses_replace(sampled, seed=8))
    assert other_seed != first
    torch.manual_seed(0)  # the global generator plays no part
    assert generate_completions(model, tok, prompts, keys, sampled) == first


def dataclasses_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def test_a_peft_adapter_directory_loads_on_its_base_and_changes_the_completions(tmp_path):
    base = tiny_models.llama_dir(tmp_path / "base")
    adapter = tiny_models.adapter_dir(base, tmp_path / "adapter")
    prompts = ["the cat sat", "what is two plus two"]
    out = {}
    for name, path in (("base", base), ("adapter", adapter)):
        generate_plan = plan(
            source=resolve_model(str(path)),
            task="generate",
            input_cols=(),
            output_col="completion",
            result_type=pa.string(),
            prompt_col="prompt",
            generation=GenerationConfig(max_new_tokens=6),
            batch_size=2,
            chunk_rows=2,
        )
        rows = pa.RecordBatch.from_pydict({"prompt": prompts})
        out[name] = pa.Table.from_batches(list(score_partition(generate_plan, [rows]))).column("completion").to_pylist()
    assert resolve_model(str(adapter)).kind == "peft"
    assert out["base"] != out["adapter"]


def test_metrics_accuracy_of_probabilities_and_a_user_function():
    table = pa.table({"prediction": [0.9, 0.2, 0.7, 0.4], "label": [1, 0, 0, 0]})
    assert compute_metrics(table, "accuracy", "prediction", "label") == {"accuracy": 0.75}
    assert compute_metrics(table, lambda t: {"mean": float(np.mean(t["prediction"]))}, "prediction", None) == {
        "mean": pytest.approx(0.55)
    }
    with pytest.raises(ConfigurationError, match="label_col"):
        compute_metrics(table, "accuracy", "prediction", None)


def test_a_model_that_is_none_of_the_accepted_forms_is_refused_naming_them(tmp_path):
    with pytest.raises(ConfigurationError, match="registry name"):
        resolve_model(42)
    with pytest.raises(ConfigurationError, match="adapter_config.json"):
        resolve_model(str(tmp_path))


class FakeVLLM:
    """The slice of vLLM's API generation uses: ``LLM(model=, enable_lora=)``, ``generate``,
    ``SamplingParams``, ``LoRARequest`` (as vLLM's docs show them)."""

    def __init__(self):
        import types

        self.llms: list = []
        outer = self

        class SamplingParams:
            def __init__(self, **kwargs):
                self.kwargs = kwargs

        class LLM:
            def __init__(self, model, enable_lora=False):
                self.model, self.enable_lora, self.calls = model, enable_lora, []
                outer.llms.append(self)

            def generate(self, prompts, params, lora_request=None, use_tqdm=True):
                self.calls.append((prompts, params, lora_request))
                return [
                    types.SimpleNamespace(outputs=[types.SimpleNamespace(text=f"{p}|{s.kwargs.get('seed')}")])
                    for p, s in zip(prompts, params)
                ]

        class LoRARequest:
            def __init__(self, name, number, path):
                self.name, self.number, self.path = name, number, path

        self.module = types.ModuleType("vllm")
        self.module.LLM, self.module.SamplingParams = LLM, SamplingParams
        self.lora = types.ModuleType("vllm.lora")
        self.lora_request = types.ModuleType("vllm.lora.request")
        self.lora_request.LoRARequest = LoRARequest


def test_with_vllm_and_a_gpu_an_adapter_is_served_as_a_lora_with_one_seed_per_row(tmp_path, monkeypatch):
    import sys

    from sparkgpu.predict.executor import generation
    from sparkgpu.predict.executor.generation import row_seed

    fake = FakeVLLM()
    monkeypatch.setitem(sys.modules, "vllm", fake.module)
    monkeypatch.setitem(sys.modules, "vllm.lora", fake.lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", fake.lora_request)
    monkeypatch.setattr(generation, "vllm_usable", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "/models/base"}')

    loaded = resolve_model(str(adapter)).load("cuda:3")
    assert loaded.module is None and fake.llms[0].model == "/models/base" and fake.llms[0].enable_lora
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    generate_plan = plan(
        source=resolve_model(str(adapter)),
        task="generate",
        input_cols=(),
        output_col="completion",
        result_type=pa.string(),
        prompt_col="prompt",
        key_col="id",
        generation=GenerationConfig(max_new_tokens=5, do_sample=True, seed=4, top_k=0),
        use_cuda=True,
    )
    rows = pa.RecordBatch.from_pydict({"id": [7, 8], "prompt": ["a", "b"]})
    out = pa.Table.from_batches(list(score_partition(generate_plan, [rows])))
    assert out.column("completion").to_pylist() == [f"a|{row_seed(4, 7)}", f"b|{row_seed(4, 8)}"]
    (_, params, lora) = fake.llms[-1].calls[0]
    assert params[0].kwargs["top_k"] == -1 and params[0].kwargs["max_tokens"] == 5
    assert lora.path == str(adapter)


def test_the_task_function_carries_its_bootstrap_by_value_and_scores_after_it():
    import functools
    import pickle

    from pyspark import cloudpickle

    from sparkgpu.predict.executor.bootstrap import score_shipped
    from sparkgpu.predict.job import _shipped

    shipped = _shipped(plan(), ship_environment=False)
    task = cloudpickle.dumps(functools.partial(score_shipped, shipped))
    assert b"sparkgpu.predict.executor.bootstrap" not in task.split(b"payload")[0]  # by value, not an import
    out = pa.Table.from_batches(list(pickle.loads(task)(batches(40, 10))))
    assert out.column("prediction").to_pylist() == [2.0 * i + 1 for i in range(40)]


def test_a_language_model_without_a_tokenizer_generates_with_tokenizer_and_is_refused_without(tmp_path):
    from transformers import AutoModelForCausalLM

    base = tiny_models.llama_dir(tmp_path / "base")
    module = AutoModelForCausalLM.from_pretrained(base)
    rows = pa.RecordBatch.from_pydict({"prompt": ["the cat sat", "a dog"]})
    options = dict(
        task="generate",
        input_cols=(),
        output_col="completion",
        result_type=pa.string(),
        prompt_col="prompt",
        generation=GenerationConfig(max_new_tokens=4),
    )
    with_tokenizer = plan(source=resolve_model(module, tokenizer=str(base)), **options)
    out = pa.Table.from_batches(list(score_partition(with_tokenizer, [rows])))
    assert all(out.column("completion").to_pylist())
    with pytest.raises(ConfigurationError, match="tokenizer="):
        list(score_partition(plan(source=resolve_model(module), **options), [rows]))


def test_an_overwrite_commit_replaces_the_tables_rows_with_the_runs(tmp_path):
    import pyarrow.parquet as pq

    table = pa.table({"x": [1, 2, 3]})

    def staged(run: str) -> list[dict]:
        (tmp_path / f"sparkgpu-{run}").mkdir()
        path = f"sparkgpu-{run}/p00000-c000000.parquet"
        pq.write_table(table, tmp_path / path)
        return [{"path": path, "bytes": (tmp_path / path).stat().st_size, "rows": 3}]

    commit_chunks(str(tmp_path), staged("a"), table.schema, "a")
    assert commit_chunks(str(tmp_path), staged("b"), table.schema, "b", mode="overwrite") == (1, True)
    assert DeltaTable(str(tmp_path)).file_uris() == [str(tmp_path / "sparkgpu-b/p00000-c000000.parquet")]
