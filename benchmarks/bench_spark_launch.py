"""Launch overhead on a Spark cluster: call -> all ranks returned, for a trivial gloo all_reduce.

One real standalone cluster on this host (master, two workers with 2 simulated GPUs each,
a Spark Connect server; ``tests/integration/spark_cluster.py``); every peer runs on it
through the same Spark Connect session, in the same run:

  * ``spark.gpu.train`` (ours): one barrier task per node with a task-level GPU
    ResourceProfile, torch's elastic agent per node, ``--ranks`` ranks;
  * ``pyspark.ml.torch.distributor.TorchDistributor(local_mode=False)``: one barrier task per
    process, torchrun inside each (TorchDistributor runs over Spark Connect in Spark 4);
  * a trivial barrier ``mapInArrow`` job with one task per node: Spark's own scheduling floor.

Floors measured in the same run: ``python -c pass`` and ``python -c "import torch"``, one
process per rank, in parallel. Our jobs ship the client's environment as remote jobs do; the
executors run this venv (``SPARKGPU_ENV_WORKER_LOCK``), so only this checkout travels.

    python benchmarks/bench_spark_launch.py [--ranks 4] [--repeats 3]

Writes benchmarks/results/spark_launch.json (and spark_launch.png with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(ROOT))

from launch_common import bench_floor, plot_summary, print_summary, summarize, time_calls  # noqa: E402 (the checkout goes on sys.path first)
from launch_common import trivial_all_reduce, trivial_all_reduce_own_group  # noqa: E402 (the checkout goes on sys.path first)


def _noop_node(batches):
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    BarrierTaskContext.get().barrier()
    yield pa.RecordBatch.from_pydict({"ok": [1]}, schema=pa.schema([("ok", pa.int32())]))


def bench_sparkgpu(spark, ranks: int, repeats: int) -> list[float]:
    expected = [sum(range(1, ranks + 1))] * ranks

    def run():
        # No tracking callbacks: TorchDistributor tracks nothing either; this measures the launch path.
        assert spark.gpu.train(trivial_all_reduce, gpus=ranks, gpu_type="A10", log_ranks=None, callbacks=[]) == expected

    run()  # warm the page cache and the executors' Python workers, like every peer below
    return time_calls(run, repeats)


def bench_torch_distributor(spark, ranks: int, repeats: int) -> list[float] | str:
    from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(num_processes=ranks, local_mode=False, use_gpu=False)

    def run():
        assert distributor.run(trivial_all_reduce_own_group) == sum(range(1, ranks + 1))

    try:
        run()
    except Exception as exc:  # report, do not hide, a peer that cannot run here
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return time_calls(run, repeats)


def bench_barrier_floor(spark, nodes: int, repeats: int) -> list[float]:
    def run():
        spark.range(0, nodes, 1, nodes).mapInArrow(_noop_node, "ok int", barrier=True).collect()

    run()
    return time_calls(run, repeats)


def _workers_share_this_python(folder: Path) -> None:
    """The executors run this venv: our jobs ship only this checkout, as on a cluster with the same image."""
    from sparkgpu.config import reset_settings
    from sparkgpu.env import hydrate_module_path

    probe = subprocess.run(
        [sys.executable, str(hydrate_module_path()), "--probe"], capture_output=True, text=True, check=True
    ).stdout
    (folder / "worker-image.json").write_text(probe)
    os.environ["SPARKGPU_ENV_WORKER_LOCK"] = str(folder / "worker-image.json")
    reset_settings()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from tests.integration.spark_cluster import LocalSparkCluster

    import sparkgpu.api.spark_gpu

    sparkgpu.api.spark_gpu.attach()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sparkgpu-bench-") as tmp:
        os.environ["SPARKGPU_HOME"] = str(Path(tmp) / "home")
        _workers_share_this_python(Path(tmp))
        started = time.perf_counter()
        with LocalSparkCluster(Path(tmp) / "cluster", workers=2, gpus_per_worker=2, cores_per_worker=2) as cluster:
            cluster_seconds = time.perf_counter() - started
            spark = cluster.session()
            # The test helper leaves the process without a default session; TorchDistributor
            # takes the active one, so this one must be it.
            type(spark)._set_default_and_active_session(spark)
            from sparkgpu.launch.backends.spark.capacity import plan_placement

            nodes = plan_placement(args.ranks, "A10", spark.gpu.capacity()).nodes  # how our ranks map onto tasks
            peers: dict[str, list[float] | str] = {
                "python -c pass (floor)": bench_floor("pass", args.ranks, args.repeats),
                "python -c 'import torch' (floor)": bench_floor("import torch", args.ranks, args.repeats),
                f"Spark barrier job, {nodes} no-op task(s) (floor)": bench_barrier_floor(spark, nodes, args.repeats),
                "sparkgpu spark.gpu.train": bench_sparkgpu(spark, args.ranks, args.repeats),
                "TorchDistributor(local_mode=False)": bench_torch_distributor(spark, args.ranks, args.repeats),
            }
            spark.stop()

    summary = summarize(peers, "sparkgpu spark.gpu.train")
    result = {
        "question": "launch overhead on a Spark cluster: call -> all ranks returned (trivial gloo all_reduce)",
        "setup": (
            f"standalone master + 2 workers (2 cores, 2 simulated GPUs each) + Spark Connect server on this "
            f"host; every peer through the same Connect session; ours: {nodes} node(s) x "
            f"{args.ranks // nodes} ranks; TorchDistributor: {args.ranks} tasks x 1 process"
        ),
        "ranks": args.ranks,
        "repeats": args.repeats,
        "cluster_start_s": round(cluster_seconds, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "results": summary,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "spark_launch.json").write_text(json.dumps(result, indent=2))
    plot_summary(
        summary,
        RESULTS / "spark_launch.png",
        f"Launch overhead on a Spark cluster, {args.ranks} ranks (gloo all_reduce)",
        width=8,
    )
    print_summary(summary)


if __name__ == "__main__":
    main()
