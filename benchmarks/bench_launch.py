"""Launch overhead: call -> all ranks returned, for a trivial 2-rank gloo all_reduce.

Peers in the same run, on the same function:
  * sparkgpu ``@distributed(...).distributed()`` (cold: each call starts its agent and ranks)
  * the same with the warm pool (ranks forked from a process with torch imported)
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
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

TORCHRUN_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    dist.destroy_process_group()
""")


def trivial_all_reduce():
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    return t.item()


def trivial_all_reduce_own_group():
    """TorchDistributor leaves the process group to the function, as torchrun does."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return trivial_all_reduce()
    finally:
        dist.destroy_process_group()


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def bench_sparkgpu(ranks: int, repeats: int) -> list[float]:
    from sparkgpu import distributed

    job = distributed(gpus=ranks, gpu_type="cpu", log_ranks=None)(trivial_all_reduce)
    expected = [sum(range(1, ranks + 1))] * ranks
    assert job.distributed() == expected  # warm the page cache once, like every peer below
    return _time(lambda: job.distributed(), repeats)


def bench_sparkgpu_warm(ranks: int, repeats: int) -> list[float]:
    from sparkgpu import distributed
    from sparkgpu.launch.pool import PoolBackend, stop_pool

    job = distributed(gpus=ranks, gpu_type="cpu", log_ranks=None, backend=PoolBackend(idle_timeout=300))(
        trivial_all_reduce)
    try:
        job.distributed()  # starts the pool: the cold cost, paid once per interpreter
        return _time(lambda: job.distributed(), repeats)
    finally:
        stop_pool()


def bench_torchrun(ranks: int, repeats: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(TORCHRUN_SCRIPT)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)]
        subprocess.run(cmd, check=True, capture_output=True)
        return _time(lambda: subprocess.run(cmd, check=True, capture_output=True), repeats)


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
        return _time(lambda: distributor.run(trivial_all_reduce_own_group), repeats)
    finally:
        spark.stop()


def bench_floor(code: str, ranks: int, repeats: int) -> list[float]:
    def run():
        procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(ranks)]
        for p in procs:
            assert p.wait() == 0

    run()
    return _time(run, repeats)


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
        "sparkgpu .distributed()": bench_sparkgpu(args.ranks, args.repeats),
        "sparkgpu .distributed(), warm pool": bench_sparkgpu_warm(args.ranks, args.repeats),
        "torchrun CLI": bench_torchrun(args.ranks, args.repeats),
    }
    if not args.skip_spark:
        peers["TorchDistributor(local_mode=True)"] = bench_torch_distributor(args.ranks, args.repeats)

    ours = statistics.median(peers["sparkgpu .distributed()"])
    summary = {}
    for name, times in peers.items():
        if isinstance(times, str):
            summary[name] = {"status": times}
            continue
        median = statistics.median(times)
        summary[name] = {"median_s": round(median, 3), "runs_s": [round(t, 3) for t in times],
                         "peer_over_sparkgpu": round(median / ours, 2)}
    result = {
        "question": "launch overhead: call -> all ranks returned (trivial gloo all_reduce)",
        "ranks": args.ranks, "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "results": summary,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "launch.json").write_text(json.dumps(result, indent=2))
    _plot(summary, RESULTS / "launch.png")
    width = max(map(len, summary))
    for name, row in summary.items():
        value = f"{row['median_s']:7.2f} s  (x{row['peer_over_sparkgpu']} of sparkgpu)" if "median_s" in row else row["status"]
        print(f"{name:<{width}}  {value}")


def _plot(summary: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [(n, r["median_s"]) for n, r in summary.items() if "median_s" in r]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1))
    ax.barh([n for n, _ in rows], [v for _, v in rows], color=["#bbb" if "floor" in n else "#3a7" for n, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds, call -> all ranks returned (median)")
    ax.set_title("Launch overhead, 2-rank gloo all_reduce")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
