"""What the two launch benchmarks share: the timed function, the floors, the summary and the plot.

The functions here run on the ranks (locally and on Spark executors, which cannot import
``benchmarks/``), so importing this module registers it with both cloudpickles (ours and
pyspark's vendored copy) to travel by value.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import importlib

# The package ships functions with cloudpickle, TorchDistributor with pyspark's own copy of it.
for _pickler in ("cloudpickle", "pyspark.cloudpickle"):
    try:
        importlib.import_module(_pickler).register_pickle_by_value(sys.modules[__name__])
    except ImportError:  # without pyspark only our own launches run
        continue


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


def time_calls(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def bench_floor(code: str, ranks: int, repeats: int) -> list[float]:
    """``python -c code``, one process per rank in parallel: what any launcher pays at least."""

    def run():
        procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(ranks)]
        for p in procs:
            assert p.wait() == 0

    run()
    return time_calls(run, repeats)


def summarize(peers: dict[str, list[float] | str], ours: str) -> dict:
    """Median, runs and ratio to ``ours`` per peer; a peer that could not run keeps its status."""
    reference = statistics.median(peers[ours])
    summary = {}
    for name, times in peers.items():
        if isinstance(times, str):
            summary[name] = {"status": times}
            continue
        median = statistics.median(times)
        summary[name] = {
            "median_s": round(median, 3),
            "runs_s": [round(t, 3) for t in times],
            "peer_over_sparkgpu": round(median / reference, 2),
        }
    return summary


def print_summary(summary: dict) -> None:
    width = max(map(len, summary))
    for name, row in summary.items():
        value = (
            f"{row['median_s']:7.2f} s  (x{row['peer_over_sparkgpu']} of sparkgpu)"
            if "median_s" in row
            else row["status"]
        )
        print(f"{name:<{width}}  {value}")


def plot_summary(summary: dict, path: Path, title: str, width: float = 7) -> None:
    """Horizontal bars of the medians (floors grey); nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [(n, r["median_s"]) for n, r in summary.items() if "median_s" in r]
    fig, ax = plt.subplots(figsize=(width, 0.6 * len(rows) + 1))
    ax.barh([n for n, _ in rows], [v for _, v in rows], color=["#bbb" if "floor" in n else "#3a7" for n, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds, call -> all ranks returned (median)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
