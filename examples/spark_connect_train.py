"""Train from a Spark Connect session: Spark prepares features, ``spark.gpu.train`` runs DDP.

Three ways to run it:

    # a Spark Connect server you already have (a GPU cluster):
    python examples/spark_connect_train.py --remote sc://host:15002 --gpus 8 --gpu-type A10

    # a local standalone cluster with 2 workers x 2 simulated A10 (ranks on CPU, scheduling real):
    python examples/spark_connect_train.py --simulated-cluster

    # an in-process Connect server, CPU ranks (the default):
    python examples/spark_connect_train.py

The features go to MDS shards once (``data=``; reused on the next run while the data is
unchanged) and each rank streams its share of them. With a remote cluster, set
``SPARKGPU_STAGING_ROOT`` and ``SPARKGPU_DATA_VOLUME`` to folders mounted under the same path
on this machine and on every executor.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

FEATURES = 8


def features(spark, rows: int):
    """A regression problem built on the executors: y = x . w + noise."""
    from pyspark.sql import functions as F

    frame = spark.range(0, rows, numPartitions=4)
    columns = [F.randn(seed=k).cast("float").alias(f"x{k}") for k in range(FEATURES)]
    frame = frame.select(*columns)
    target = sum(F.col(f"x{k}") * (k - FEATURES / 2) for k in range(FEATURES)) + F.randn(seed=99) * 0.1
    return frame.withColumn("y", target.cast("float"))


def train(data_url: str, epochs: int, lr: float):
    """Plain PyTorch + DDP; each rank reads its own share of the MDS shards."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import data, runtime

    device = runtime.device()
    model = torch.nn.Linear(FEATURES, 1).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = data.dataset(remote=data_url, batch_size=256, shuffle=True)
    for epoch in range(epochs):
        total, count = 0.0, 0
        for batch in loader:
            x = torch.stack([torch.as_tensor(batch[f"x{k}"]) for k in range(FEATURES)], dim=1).to(device)
            y = torch.as_tensor(batch["y"]).to(device)
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, count = total + loss.item() * len(y), count + len(y)
        if runtime.is_main_process():
            print(f"epoch {epoch}: mse {total / count:.4f}", flush=True)
    weights = model.module.weight.detach().cpu().squeeze(0).tolist()
    return {"rank": runtime.get_global_rank(), "mse": total / count, "weights": [round(w, 2) for w in weights]}


def workers_share_this_python(folder: str) -> None:
    """Executors on this machine run this very venv: ship only what it lacks (this checkout)."""
    import subprocess

    from sparkgpu.config import reset_settings
    from sparkgpu.env import hydrate_module_path

    probe = subprocess.run(
        [sys.executable, str(hydrate_module_path()), "--probe"], capture_output=True, text=True, check=True
    ).stdout
    lock = os.path.join(folder, "worker-image.json")
    with open(lock, "w") as f:
        f.write(probe)
    os.environ.setdefault("SPARKGPU_ENV_WORKER_LOCK", lock)
    reset_settings()


@contextlib.contextmanager
def session(args):
    """Yields (spark, gpus, gpu_type) for the chosen way to run."""
    from pyspark.sql import SparkSession

    if args.remote:
        yield SparkSession.builder.remote(args.remote).getOrCreate(), args.gpus, args.gpu_type
    elif args.simulated_cluster:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from tests.integration.spark_cluster import LocalSparkCluster

        with tempfile.TemporaryDirectory(prefix="sparkgpu-example-") as tmp, LocalSparkCluster(tmp) as cluster:
            print(f"started a standalone cluster: {cluster.master_url}, Spark Connect at {cluster.connect_url}")
            workers_share_this_python(tmp)
            yield cluster.session(), args.gpus or 4, "A10"
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        with tempfile.TemporaryDirectory(prefix="sparkgpu-example-") as tmp:
            workers_share_this_python(tmp)
            from sparkgpu.testing.local_spark import local_session

            yield local_session(cores=2), args.gpus or 2, "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--remote", help="Spark Connect URL, e.g. sc://host:15002")
    parser.add_argument("--simulated-cluster", action="store_true", help="start a local cluster with simulated GPUs")
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument("--gpu-type", default=None, help="GPU type of the remote cluster, e.g. A10")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    if args.remote and not (args.gpus and args.gpu_type):
        parser.error("--remote needs --gpus and --gpu-type")

    import sparkgpu  # noqa: F401  (attaches spark.gpu)
    from sparkgpu.api.spark_gpu import attach

    attach()
    with session(args) as (spark, gpus, gpu_type):
        print(spark.gpu.capacity())
        started = time.time()
        results = spark.gpu.train(
            train,
            gpus=gpus,
            gpu_type=gpu_type,
            data=features(spark, args.rows),
            kwargs={"epochs": args.epochs, "lr": 0.05},
        )
        print(
            f"{len(results)} ranks in {time.time() - started:.1f}s; rank 0: mse {results[0]['mse']:.4f}, "
            f"weights {results[0]['weights']} (true: {[k - FEATURES / 2 for k in range(FEATURES)]})"
        )
        spark.stop()


if __name__ == "__main__":
    main()
