"""Soak: many short jobs in one client process; nothing may grow without bound.

One client process runs, in turn, ``--local-cold`` local jobs (a fresh agent and ranks each),
``--local-warm`` jobs forked from the warm pool, and ``--spark`` jobs on a real standalone
Spark cluster on this host (``tests/integration/spark_cluster.py``: two workers with simulated
GPUs and a Spark Connect server). Each job is a 2-rank gloo all_reduce. Around every phase it records, for the client: open file descriptors, threads,
live child processes and RSS; for the cluster: the RSS of the executors' Python workers; and
the disk used by run dirs, the data cache and the keyring. ``SPARKGPU_KEEP_RUNS`` is set low
(``--keep-runs``, default 20) so its pruning is exercised: run dirs must level off at that
count however many jobs ran.

    python benchmarks/soak.py [--local-cold 100] [--local-warm 100] [--spark 50] [--keep-runs 20]

Writes benchmarks/results/soak.json. The figures compare the end of a phase with the point
after its first ``--warmup`` jobs (imports, pools and Python workers are one-off costs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(ROOT))


def all_reduce_step(step):
    import torch
    import torch.distributed as dist

    from sparkgpu import runtime

    t = torch.tensor([float(runtime.get_global_rank() + step)])
    dist.all_reduce(t)
    return t.item()


def _tree_size(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _count(path: Path, pattern: str) -> int:
    return len(list(path.glob(pattern))) if path.exists() else 0


CLUSTER_DIR: str | None = None  # set while the Spark phase's cluster runs


def _cluster_python_workers() -> list:
    """The Python workers of this soak's Spark executors (their ancestors name the cluster's folder)."""
    import psutil

    if CLUSTER_DIR is None:
        return []
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if "pyspark.daemon" not in line and "pyspark/worker.py" not in line:
            continue
        try:
            if any(CLUSTER_DIR in " ".join(a.cmdline()) for a in p.parents()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def sample(label: str, jobs_done: int, failures: int) -> dict:
    import psutil

    from sparkgpu.config import settings

    me = psutil.Process()
    s = settings()
    workers = _cluster_python_workers()
    worker_rss = 0
    for p in workers:
        try:
            worker_rss += p.memory_info().rss
        except psutil.Error:
            continue
    return {
        "label": label,
        "jobs": jobs_done,
        "failures": failures,
        "time": time.time(),
        "client_fds": me.num_fds(),
        "client_threads": me.num_threads(),
        "client_children": len(me.children(recursive=True)),
        "client_rss_mb": me.memory_info().rss / 1e6,
        "executor_python_workers": len(workers),
        "executor_python_rss_mb": worker_rss / 1e6,
        "run_dirs": _count(s.staging_root, "*/spec.json"),
        "run_dirs_mb": _tree_size(s.staging_root) / 1e6,
        "keys": _count(s.home / "keys", "*"),
        "cache_mb": _tree_size(s.cache_dir) / 1e6,
    }


def run_phase(name: str, count: int, call, samples: list, warmup: int) -> tuple[int, int]:
    failures = 0
    started = time.perf_counter()
    for i in range(count):
        try:
            assert call(i) == [float(i * 2 + 1)] * 2
        except Exception as exc:  # a soak counts failures; it does not stop at the first
            failures += 1
            print(f"{name} job {i} failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr, flush=True)
        if i + 1 == min(warmup, count):
            samples.append(sample(f"{name}: after warm-up", i + 1, failures))
    samples.append(sample(f"{name}: end", count, failures))
    seconds = time.perf_counter() - started
    print(f"{name}: {count} jobs, {failures} failed, {seconds:.0f} s", flush=True)
    return failures, seconds


def growth(samples: list, name: str) -> dict:
    first = next(s for s in samples if s["label"] == f"{name}: after warm-up")
    last = next(s for s in samples if s["label"] == f"{name}: end")
    keys = (
        "client_fds",
        "client_threads",
        "client_children",
        "client_rss_mb",
        "executor_python_workers",
        "executor_python_rss_mb",
        "run_dirs",
        "run_dirs_mb",
        "keys",
    )
    return {k: round(last[k] - first[k], 2) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local-cold", type=int, default=100)
    parser.add_argument("--local-warm", type=int, default=100)
    parser.add_argument("--spark", type=int, default=50)
    parser.add_argument("--keep-runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--output", default=str(RESULTS / "soak.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="sparkgpu-soak-") as tmp:
        os.environ.update(
            SPARKGPU_HOME=str(Path(tmp) / "home"), SPARKGPU_KEEP_RUNS=str(args.keep_runs), SPARKGPU_TRACKING="0"
        )
        from sparkgpu import distributed
        from sparkgpu.config import reset_settings
        from sparkgpu.launch.backends.warm_pool import WarmPoolBackend
        from sparkgpu.launch.warm_pool import stop_pool

        reset_settings()
        samples = [sample("start", 0, 0)]
        phases = {}
        if args.local_cold:
            cold = distributed(gpus=2, gpu_type="cpu")(all_reduce_step)
            phases["local cold"] = run_phase(
                "local cold", args.local_cold, lambda i: cold.distributed(i), samples, args.warmup
            )
        if args.local_warm:
            warm = distributed(gpus=2, gpu_type="cpu", backend=WarmPoolBackend(idle_timeout=600))(all_reduce_step)
            try:
                phases["local warm"] = run_phase(
                    "local warm", args.local_warm, lambda i: warm.distributed(i), samples, args.warmup
                )
            finally:
                stop_pool()
        if args.spark:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from bench_spark_launch import _workers_share_this_python

            from tests.integration.spark_cluster import LocalSparkCluster

            _workers_share_this_python(Path(tmp))
            global CLUSTER_DIR
            CLUSTER_DIR = str(Path(tmp) / "cluster")
            with LocalSparkCluster(Path(CLUSTER_DIR), workers=2, gpus_per_worker=2, cores_per_worker=2) as cluster:
                spark = cluster.session()
                phases["spark"] = run_phase(
                    "spark",
                    args.spark,
                    lambda i: spark.gpu.train(
                        all_reduce_step, gpus=2, gpu_type="A10", kwargs={"step": i}, log_ranks=None, callbacks=[]
                    ),
                    samples,
                    args.warmup,
                )
                spark.stop()
            CLUSTER_DIR = None
        samples.append(
            sample("end", args.local_cold + args.local_warm + args.spark, sum(f for f, _ in phases.values()))
        )

    report = {
        "question": "soak: do descriptors, threads, processes, memory or disk grow with the number of jobs?",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "keep_runs": args.keep_runs,
        "phases": {
            name: {
                "jobs": count,
                "failures": failed,
                "seconds": round(seconds, 1),
                "growth_after_warmup": growth(samples, name),
            }
            for name, count, (failed, seconds) in [
                (n, {"local cold": args.local_cold, "local warm": args.local_warm, "spark": args.spark}[n], v)
                for n, v in phases.items()
            ]
        },
        "samples": samples,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    for name, phase in report["phases"].items():
        print(name, json.dumps(phase))


if __name__ == "__main__":
    main()
