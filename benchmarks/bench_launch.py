"""Launch overhead: call -> all ranks returned, for a trivial 2-rank gloo all_reduce.

Peers in the same run, on the same function:
  * sparkgpu ``@distributed(...).distributed()`` (cold: each call starts its agent and ranks),
    untracked (``callbacks=[]``) as every peer is, and with its default MLflow run and usage row
  * the same with the warm pool (ranks forked from a process with torch imported), untracked
  * ``torchrun`` on the command line running the same function in a script
  * ``pyspark.ml.torch.distributor.TorchDistributor(local_mode=True)`` on a local Spark session
Floors measured in the same run: ``python -c pass`` and ``python -c "import torch"``, N times
(one per rank) in parallel.

    python benchmarks/bench_launch.py [--ranks 2] [--repeats 3] [--skip-spark]

Writes benchmarks/results/launch.json and launch.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from launch_common import bench_floor, plot_summary, print_summary, summarize, time_calls
from launch_common import trivial_all_reduce, trivial_all_reduce_own_group

RESULTS = Path(__file__).parent / "results"

TORCHRUN_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    dist.destroy_process_group()
""")


def bench_sparkgpu(ranks: int, repeats: int, callbacks=None) -> list[float]:
    """``callbacks=None``: the default MLflow run and usage-ledger row per job; ``[]``: neither."""
    from sparkgpu import distributed

    job = distributed(gpus=ranks, gpu_type="cpu", log_ranks=None, callbacks=callbacks)(trivial_all_reduce)
    expected = [sum(range(1, ranks + 1))] * ranks
    assert job.distributed() == expected  # warm the page cache once, like every peer below
    return time_calls(lambda: job.distributed(), repeats)


def bench_sparkgpu_warm(ranks: int, repeats: int) -> list[float]:
    from sparkgpu import distributed
    from sparkgpu.launch.backends.local.warm import WarmBackend
    from sparkgpu.launch.backends.local.zygote_client import stop_warm_zygote

    job = distributed(gpus=ranks, gpu_type="cpu", log_ranks=None, backend=WarmBackend(idle_timeout=300), callbacks=[])(
        trivial_all_reduce
    )
    try:
        job.distributed()  # starts the warm pool: the cold cost, paid once per interpreter
        return time_calls(lambda: job.distributed(), repeats)
    finally:
        stop_warm_zygote()


def bench_torchrun(ranks: int, repeats: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(TORCHRUN_SCRIPT)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)]
        subprocess.run(cmd, check=True, capture_output=True)
        return time_calls(lambda: subprocess.run(cmd, check=True, capture_output=True), repeats)


def bench_torch_distributor(ranks: int, repeats: int) -> list[float] | str:
    try:
        from pyspark.ml.torch.distributor import TorchDistributor
        from pyspark.sql import SparkSession
    except ImportError as exc:
        return f"skipped: {exc}"
    spark = SparkSession.builder.master("local[2]").appName("bench-launch").getOrCreate()
    try:
        distributor = TorchDistributor(num_processes=ranks, local_mode=True, use_gpu=False)
        distributor.run(trivial_all_reduce_own_group)
        return time_calls(lambda: distributor.run(trivial_all_reduce_own_group), repeats)
    finally:
        spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-spark", action="store_true")
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    peers: dict[str, list[float] | str] = {
        "python -c pass (floor)": bench_floor("pass", args.ranks, args.repeats),
        "python -c 'import torch' (floor)": bench_floor("import torch", args.ranks, args.repeats),
        "sparkgpu .distributed()": bench_sparkgpu(args.ranks, args.repeats, callbacks=[]),
        "sparkgpu .distributed(), with MLflow run + usage row (default)": bench_sparkgpu(args.ranks, args.repeats),
        "sparkgpu .distributed(), warm pool": bench_sparkgpu_warm(args.ranks, args.repeats),
        "torchrun CLI": bench_torchrun(args.ranks, args.repeats),
    }
    if not args.skip_spark:
        peers["TorchDistributor(local_mode=True)"] = bench_torch_distributor(args.ranks, args.repeats)

    summary = summarize(peers, "sparkgpu .distributed()")
    result = {
        "question": "launch overhead: call -> all ranks returned (trivial gloo all_reduce)",
        "ranks": args.ranks,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "results": summary,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "launch.json").write_text(json.dumps(result, indent=2))
    plot_summary(summary, RESULTS / "launch.png", f"Launch overhead, {args.ranks}-rank gloo all_reduce")
    print_summary(summary)


if __name__ == "__main__":
    main()
