"""Scoring rows/s on a Spark cluster: ``spark.gpu.predict`` vs ``predict_batch_udf`` vs ``mapInPandas``.

One real standalone cluster on this host (two workers of 2 cores and 2 simulated GPUs each, a
Spark Connect server; ``tests/integration/spark_cluster.py``); every side scores the same
DataFrame with the same model through the same session, 4 tasks at once:

  * ``spark.gpu.predict`` (ours): the model from the registry (``main.bench.mlp@champion``),
    one task per GPU through a task ResourceProfile, Arrow batches into tensors;
  * ``pyspark.ml.functions.predict_batch_udf`` as its docs set it up: ``make_predict_fn`` loads
    the model, ``batch_size`` as ours, features as ``struct(*columns)``;
  * a plain ``mapInPandas`` that loads the model in each task and scores each pandas batch.

Ours ships this checkout to the executors' Python workers on every call (the executors run this
venv, as a cluster whose image has the same packages: ``SPARKGPU_ENV_WORKER_LOCK``), and reuses the
session's capacity probe; both costs are inside its timings.

Two models: a tabular MLP (32 float features -> 128 -> 128 -> 1) over ``--rows`` rows, and a
tiny Llama (2 layers, hidden 64) generating ``--new-tokens`` tokens greedily for ``--prompts``
prompts of 3 to 40 words (every side forced to the same number of new tokens). The timed
action is a ``noop`` write of the scored DataFrame. Each side runs once untimed (its Python
workers start and load the model: the start-up figure), then ``--repeats`` times, the sides
alternating; rows/s is rows over the median.

    python benchmarks/bench_predict.py [--rows 1000000] [--prompts 512] [--repeats 3]

The defaults are the published settings (the guide runs the command as it stands): windows of
a few seconds per side on 2 cores. Writes benchmarks/results/predict.json, with the command that
made it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(ROOT))

from common import load_seen, machine, method, spread  # noqa: E402 (the checkout goes on sys.path first)

FEATURES = [f"f{i}" for i in range(32)]
WORDS = "the cat sat on the mat a dog ran in the park what is two plus two answer four spark scores tables".split()


def tabular_frame(spark, rows: int):
    from pyspark.sql import functions as F

    return spark.range(0, rows, 1, 4).select(
        "id", *[F.rand(seed=i).cast("float").alias(c) for i, c in enumerate(FEATURES)]
    )


def prompt_frame(spark, count: int):
    import random

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(count)]
    return spark.createDataFrame([(i, p) for i, p in enumerate(prompts)], "id long, prompt string").repartition(4, "id")


def mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)
    )


def llama_dir(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(
        [" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"])
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def noop(df) -> None:
    df.write.format("noop").mode("overwrite").save()


# -- tabular sides ----------------------------------------------------------------------------


def tabular_sides(spark, model_file: str, batch: int):
    import numpy as np
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.functions import struct
    from pyspark.sql.types import FloatType

    def make_predict_fn():
        import torch

        model = torch.load(model_file, weights_only=False).eval()

        def predict(inputs):
            with torch.inference_mode():
                return model(torch.from_numpy(inputs)).numpy()[:, 0]

        return predict

    classify = predict_batch_udf(make_predict_fn, return_type=FloatType(), batch_size=batch)

    def score_pandas(batches):
        import torch

        model = torch.load(model_file, weights_only=False).eval()
        for frame in batches:
            with torch.inference_mode():
                frame["prediction"] = model(torch.from_numpy(frame[FEATURES].to_numpy(np.float32))).numpy()[:, 0]
            yield frame

    def ours(df):
        return spark.gpu.predict(
            df,
            "main.bench.mlp@champion",
            gpus=4,
            gpu_type="A10",
            input_cols=FEATURES,
            result_type="float",
            batch_size=batch,
        )

    def udf(df):
        return df.withColumn("prediction", classify(struct(*FEATURES)))

    def pandas(df):
        return df.mapInPandas(score_pandas, df.schema.simpleString()[:-1] + ",prediction:float>")

    return {"sparkgpu.predict": ours, "predict_batch_udf": udf, "mapInPandas": pandas}


# -- language-model sides ---------------------------------------------------------------------


def lm_sides(spark, model_dir: str, batch: int, new_tokens: int):
    import numpy as np
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.types import StringType

    def load():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        tok.padding_side = "left"
        return AutoModelForCausalLM.from_pretrained(model_dir).eval(), tok

    def complete(model, tok, prompts):
        import torch

        encoded = tok(list(prompts), return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(
                **encoded,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        return tok.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)

    def make_predict_fn():
        model, tok = load()

        def predict(prompts):
            return np.array(complete(model, tok, prompts))

        return predict

    generate_udf = predict_batch_udf(make_predict_fn, return_type=StringType(), batch_size=batch)

    def generate_pandas(batches):
        model, tok = load()
        for frame in batches:
            prompts = frame["prompt"].tolist()
            frame["completion"] = sum(
                (complete(model, tok, prompts[s : s + batch]) for s in range(0, len(prompts), batch)), []
            )
            yield frame

    def ours(df):
        return spark.gpu.generate(
            df,
            model_dir,
            gpus=4,
            gpu_type="A10",
            generation={"max_new_tokens": new_tokens, "batch_size": batch, "extra": {"min_new_tokens": new_tokens}},
        )

    return {
        "sparkgpu.generate": ours,
        "predict_batch_udf": lambda df: df.withColumn("completion", generate_udf("prompt")),
        "mapInPandas": lambda df: df.mapInPandas(generate_pandas, "id long, prompt string, completion string"),
    }


def run_sides(sides: dict, frame, rows: int, repeats: int) -> dict:
    startup: dict[str, float] = {}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for name, side in sides.items():
        started = time.perf_counter()
        noop(side(frame))
        startup[name] = time.perf_counter() - started
    for repeat in range(repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            started = time.perf_counter()
            noop(sides[name](frame))
            times[name].append(time.perf_counter() - started)
            print(f"  {name}: {times[name][-1]:.2f}s", flush=True)
    out = {}
    for name in sides:
        rates = [rows / t for t in times[name]]
        out[name] = {
            "rows_per_s": spread(rates, higher_is_better=True),
            "seconds": spread(times[name]),
            "first_run_s": round(startup[name], 2),
        }
    ours = next(iter(sides))
    best_peer = max((n for n in sides if n != ours), key=lambda n: out[n]["rows_per_s"]["median"])
    out["ratio_to_best_peer"] = round(out[ours]["rows_per_s"]["median"] / out[best_peer]["rows_per_s"]["median"], 2)
    out["best_peer"] = best_peer
    for name in sides:
        if name != ours:
            out[f"ratio_to_{name}"] = round(out[ours]["rows_per_s"]["median"] / out[name]["rows_per_s"]["median"], 2)
    return out


def workers_share_this_python(folder: Path) -> None:
    """The executors run this venv: our jobs ship only this checkout, as on a cluster with the same image."""
    import subprocess

    from sparkgpu.config import reset_settings
    from sparkgpu.env import hydrate_module_path

    probe = subprocess.run(
        [sys.executable, str(hydrate_module_path()), "--probe"], capture_output=True, text=True, check=True
    ).stdout
    (folder / "worker-image.json").write_text(probe)
    os.environ["SPARKGPU_ENV_WORKER_LOCK"] = str(folder / "worker-image.json")
    reset_settings()


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The command that gives these results: the script and every option that differs from its default."""
    words = ["python", "benchmarks/bench_predict.py"]
    for action in parser._actions:
        if action.dest in ("help", "out") or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if value != action.default:
            words += [action.option_strings[0], str(value)]
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--lm-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "predict.json"))
    args = parser.parse_args()

    import torch

    import sparkgpu.api.spark_gpu
    from sparkgpu import registry
    from tests.integration.spark_cluster import LocalSparkCluster

    sparkgpu.api.spark_gpu.attach()
    facts = machine()
    with tempfile.TemporaryDirectory(prefix="sparkgpu-bench-predict-") as tmp:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        os.environ["SPARKGPU_HOME"] = str(Path(tmp) / "home")
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        workers_share_this_python(Path(tmp))
        model = mlp()
        model_file = str(Path(tmp) / "mlp.pt")
        torch.save(model, model_file)
        registry.register(model, "main.bench.mlp", alias="champion", serialization_format="pickle")
        model_dir = str(llama_dir(Path(tmp) / "llama"))
        with LocalSparkCluster(Path(tmp) / "cluster", workers=2, gpus_per_worker=2, cores_per_worker=2) as cluster:
            spark = cluster.session()
            spark.gpu.capacity()
            print("tabular", flush=True)
            tabular = run_sides(
                tabular_sides(spark, model_file, args.batch), tabular_frame(spark, args.rows), args.rows, args.repeats
            )
            print("language model", flush=True)
            frame = prompt_frame(spark, args.prompts)
            lm = run_sides(
                lm_sides(spark, model_dir, args.lm_batch, args.new_tokens), frame, args.prompts, args.repeats
            )
            spark.stop()
    result = {
        "question": "rows/s scoring a DataFrame on the same Spark executors: spark.gpu.predict vs predict_batch_udf vs mapInPandas",
        "command": command_line(parser, args),
        "machine": load_seen(facts),
        "cluster": "standalone, 2 workers x (2 cores, 2 simulated GPUs), Spark Connect; 4 tasks at once for every side",
        "tabular": {
            "rows": args.rows,
            "features": 32,
            "model": "MLP 32-128-128-1",
            "batch_size": args.batch,
            **tabular,
        },
        "language_model": {
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "batch_size": args.lm_batch,
            "model": "Llama 2 layers, hidden 64, word-level vocabulary; greedy, min_new_tokens = max_new_tokens",
            **lm,
        },
        "method": method(
            "a noop write of the scored DataFrame (scan, scoring, nothing stored)",
            startup="the first run of each side (Python workers started, model loaded) is reported apart as first_run_s",
            repeats=args.repeats,
            order="sides alternate between repeats",
            tasks_at_once=4,
        ),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({"tabular": tabular["ratio_to_best_peer"], "language_model": lm["ratio_to_best_peer"]}))


if __name__ == "__main__":
    main()
