"""End-to-end demo on embedded defaults. Run with `make demo`.

1. starts a local Spark Connect server and prepares features with Spark on CPU;
2. ``spark.gpu.train`` converts them to MDS shards on a local folder standing in for the volume,
   and trains a small model on 2 CPU ranks on the Spark executors, reading the shards through the
   local cache with ``sparkgpu.data.dataset`` and checkpointing with ``sparkgpu.train.Checkpointer``;
3. the job is one MLflow run in an embedded SQLite store, and the trained model is registered as
   ``main.demo.clicks`` with the alias ``champion``, then loaded back by that alias;
4. it ends by printing the run's URI (``runs:/<run_id>``), how to open it with ``mlflow ui``, and
   how to load the model by its alias.

Everything lives under ``$SPARKGPU_HOME`` (``~/.local/share/sparkgpu`` by default).
"""

from __future__ import annotations

import os
import sys
import time

FEATURES = 16


def train(data_url: str, epochs: int, lr: float):
    """A plain PyTorch loop; DDP averages gradients across the ranks."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparkgpu
    from sparkgpu import data, runtime
    from sparkgpu.train import Checkpointer

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # x: (256, FEATURES) float32 in the order named, gathered straight from the rows; y: the int64 labels
    names = [f"f{i}" for i in range(FEATURES)]
    ds = data.dataset(remote=data_url, batch_size=256, shuffle=True, seed=0, features=names, target="clicked")
    ckpt = Checkpointer(every_steps=20, keep_last=2)
    step = ckpt.restore(model=model, optimizer=opt, loader=ds)
    total = epochs * len(ds)
    while step < total:
        for x, y in ds:
            loss = F.binary_cross_entropy_with_logits(model(x).squeeze(1), y.float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sparkgpu.log({"loss": loss.item()}, step=step)
            step += 1  # steps done: what restore() returns
            ckpt.maybe_save(step, model=model, optimizer=opt, loader=ds)
            if ckpt.should_stop:
                runtime.stop_for_restart()
            if runtime.is_main_process() and step % len(ds) == 0:
                print(f"epoch {step // len(ds)}: loss {loss.item():.4f}", flush=True)
            if step >= total:
                break
    ckpt.close()
    return net if runtime.is_main_process() else None


def main() -> None:
    started = time.time()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from sparkgpu.testing.local_spark import local_session, workers_run_this_environment

    # The local executors are processes of this venv: only editable installs and this script travel.
    workers_run_this_environment()
    from pyspark.sql import functions as F

    import sparkgpu  # noqa: F401 - attaches spark.gpu
    from sparkgpu import registry

    print("starting a local Spark Connect server ...", flush=True)
    # In this process, on loopback only, no UI; with a cluster: SparkSession.builder.remote("sc://host:15002").
    spark = local_session(cores=2)
    features = spark.range(50_000).select(
        *[(F.randn(seed=i) * (i + 1) / FEATURES).cast("float").alias(f"f{i}") for i in range(FEATURES)]
    )
    score = sum(F.col(f"f{i}") * (1 if i % 2 else -1) for i in range(FEATURES))
    features = features.withColumn("clicked", (score > 0).cast("long"))

    results = spark.gpu.train(
        train,
        data=features,
        gpus=2,
        gpu_type="cpu",
        kwargs={"epochs": 3, "lr": 3e-3},
        experiment="/sparkgpu/demo",
        register_as="main.demo.clicks",
        max_restarts=1,
    )
    model = results[0]
    registered = registry.versions("main.demo.clicks")[-1]
    version = registered.version
    registry.set_alias("main.demo.clicks", "champion", version)
    champion = registry.load("main.demo.clicks@champion")

    import torch

    x = torch.randn(1000, FEATURES)
    y = (x @ torch.tensor([(1.0 if i % 2 else -1.0) for i in range(FEATURES)]) > 0).float()
    accuracy = ((champion(x).squeeze(1) > 0).float() == y).float().mean().item()
    assert torch.equal(champion(x), model(x)), "the registered model differs from the trained one"

    from mlflow import MlflowClient

    from sparkgpu.tracking import resolve_target

    # The registered version was logged in the job's run: one run per job.
    target = resolve_target()
    run = MlflowClient(target.tracking_uri).get_run(registered.run_id)
    print()
    print(f"sparkgpu demo: done in {time.time() - started:.0f}s (job {spark.gpu.last_job_id})")
    print(f"  run dir with every rank's log:  {spark.gpu.last_run_dir}")
    print(f"  MLflow run:                     runs:/{run.info.run_id}  (experiment /sparkgpu/demo,")
    print(f"                                  store {target.tracking_uri})")
    print(f"  open it in the MLflow UI:       mlflow ui --backend-store-uri {target.tracking_uri}")
    print(
        f"                                  then http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}"
        f"/runs/{run.info.run_id}"
    )
    print(f"  registered model:               main.demo.clicks version {version}, alias champion")
    print('  load it by alias:               sparkgpu.registry.load("main.demo.clicks@champion")')
    print(f"  champion held-out accuracy:     {accuracy:.3f}")
    spark.stop()


if __name__ == "__main__":
    main()
