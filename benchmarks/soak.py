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

Every phase also records a curve: the client's RSS, threads (by name: ``tokio-rt-worker`` are
deltalake's, which the usage ledger loads) and descriptors every ``--every`` jobs, and the
slope of RSS, threads and live Python objects over the phase's second half, per 100 jobs
(least squares; the curve's own points add one object each). A flat client has slopes near
zero however long the phase; a leak shows as a steady slope. A week of notebook jobs is a
thousand or more, so ``--local-warm 1000`` (0.3-0.5 s a job: 5-8 minutes on two cores) is the
long run; ``--output`` keeps it apart from the committed soak.json, with its figure beside it
(``--plot``, the output's name with ``.png``).

    python benchmarks/soak.py --local-cold 0 --spark 0 --local-warm 1000 \
        --output benchmarks/results/soak_client.json
    python benchmarks/soak.py --local-cold 0 --spark 0 --local-warm 1000 --ledger-checkpoint-every 0 \
        --output benchmarks/results/soak_client_before.json     # the ledger as it was before
"""

from __future__ import annotations

import argparse
import collections
import gc
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


def thread_names() -> dict[str, int]:
    """The client's OS threads by name (``/proc/self/task/*/comm``); empty where there is no /proc."""
    names: collections.Counter[str] = collections.Counter()
    tasks = Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            names[(task / "comm").read_text().strip()] += 1
        except OSError:  # the thread ended meanwhile
            continue
    return dict(names.most_common())


def curve_point(jobs_done: int, started: float) -> dict:
    """A cheap sample of the client for the curve (no disk walks): RSS, threads, descriptors."""
    import psutil

    gc.collect()  # what stays after a collection is held, not merely not yet collected
    me = psutil.Process()
    return {
        "jobs": jobs_done,
        "seconds": round(time.perf_counter() - started, 2),
        "client_rss_mb": round(me.memory_info().rss / 1e6, 2),
        "client_threads": me.num_threads(),
        "client_fds": me.num_fds(),
        "python_objects": len(gc.get_objects()),
        "thread_names": thread_names(),
    }


def slope_per_100(points: list[dict], key: str) -> float | None:
    """Least-squares slope of ``key`` per 100 jobs over the second half of the curve's jobs."""
    last = points[-1]["jobs"] if points else 0
    half = [p for p in points if p["jobs"] >= last / 2]
    if len(half) < 2:
        return None
    xs, ys = [p["jobs"] for p in half], [p[key] for p in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return round(100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 3) if var else None


def run_phase(name: str, count: int, call, samples: list, warmup: int, every: int = 50) -> tuple[int, float, dict]:
    failures = 0
    started = time.perf_counter()
    points = [curve_point(0, started)]
    for i in range(count):
        try:
            assert call(i) == [float(i * 2 + 1)] * 2
        except Exception as exc:  # a soak counts failures; it does not stop at the first
            failures += 1
            print(f"{name} job {i} failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr, flush=True)
        if i + 1 == min(warmup, count):
            samples.append(sample(f"{name}: after warm-up", i + 1, failures))
        if every and ((i + 1) % every == 0 or i + 1 == count):
            points.append(curve_point(i + 1, started))
            p = points[-1]
            print(f"{name}: {i + 1} jobs, RSS {p['client_rss_mb']:.1f} MB, {p['client_threads']} threads", flush=True)
    samples.append(sample(f"{name}: end", count, failures))
    seconds = time.perf_counter() - started
    print(f"{name}: {count} jobs, {failures} failed, {seconds:.0f} s", flush=True)
    curve = {
        "every": every,
        "slope_second_half_per_100_jobs": {
            "client_rss_mb": slope_per_100(points, "client_rss_mb"),
            "client_threads": slope_per_100(points, "client_threads"),
            "python_objects": slope_per_100(points, "python_objects"),
        },
        "points": points,
    }
    return failures, seconds, curve


def plot_curves(curves: dict, path: Path) -> None:
    """RSS and threads against jobs, one line per phase (matplotlib via the package's helper)."""
    from sparkgpu._util.plotting import pyplot

    plt = pyplot("plotting the soak")
    fig, (rss, threads) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, curve in curves.items():
        jobs = [p["jobs"] for p in curve["points"]]
        slope = curve["slope_second_half_per_100_jobs"]
        rss.plot(
            jobs,
            [p["client_rss_mb"] for p in curve["points"]],
            marker=".",
            label=f"{name} ({slope['client_rss_mb']} MB/100 jobs)",
        )
        threads.plot(
            jobs,
            [p["client_threads"] for p in curve["points"]],
            marker=".",
            label=f"{name} ({slope['client_threads']}/100 jobs)",
        )
    rss.set_ylabel("client RSS (MB)")
    threads.set_ylabel("client OS threads")
    for ax in (rss, threads):
        ax.set_xlabel("jobs run by this client")
        ax.set_ylim(bottom=0)
        ax.legend(title="slope over the second half")
    fig.suptitle("one client, many 2-rank jobs: what the client holds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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


def _ledger_checkpoints_every(commits: int) -> None:
    """Every usage ledger this process opens checkpoints after ``commits`` commits (0: only when compacting)."""
    import functools

    from sparkgpu.usage import ledger

    ledger.UsageLedger.__init__ = functools.partialmethod(ledger.UsageLedger.__init__, checkpoint_every=commits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local-cold", type=int, default=100)
    parser.add_argument("--local-warm", type=int, default=100)
    parser.add_argument("--spark", type=int, default=50)
    parser.add_argument("--keep-runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--every", type=int, default=50, help="jobs between the points of each phase's curve")
    parser.add_argument("--output", default=str(RESULTS / "soak.json"))
    parser.add_argument(
        "--plot", default=None, help="figure of the curves (default: the output with .png; 'none' to skip)"
    )
    parser.add_argument(
        "--ledger-checkpoint-every",
        type=int,
        default=None,
        help="the usage ledger's checkpoint interval (default: the ledger's own); 0 runs the design before "
        "it checkpointed between compactions, for a before-and-after pair",
    )
    args = parser.parse_args()
    if args.ledger_checkpoint_every is not None:
        _ledger_checkpoints_every(args.ledger_checkpoint_every)

    with tempfile.TemporaryDirectory(prefix="sparkgpu-soak-") as tmp:
        os.environ.update(
            SPARKGPU_HOME=str(Path(tmp) / "home"), SPARKGPU_KEEP_RUNS=str(args.keep_runs), SPARKGPU_TRACKING="0"
        )
        from sparkgpu import distributed
        from sparkgpu.config import reset_settings
        from sparkgpu.launch.backends.local.warm import WarmBackend
        from sparkgpu.launch.backends.local.zygote_client import stop_warm_zygote

        reset_settings()
        samples = [sample("start", 0, 0)]
        phases = {}
        if args.local_cold:
            cold = distributed(gpus=2, gpu_type="cpu")(all_reduce_step)
            phases["local cold"] = run_phase(
                "local cold", args.local_cold, lambda i: cold.distributed(i), samples, args.warmup, args.every
            )
        if args.local_warm:
            warm = distributed(gpus=2, gpu_type="cpu", backend=WarmBackend(idle_timeout=600))(all_reduce_step)
            try:
                phases["local warm"] = run_phase(
                    "local warm", args.local_warm, lambda i: warm.distributed(i), samples, args.warmup, args.every
                )
            finally:
                stop_warm_zygote()
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
                    args.every,
                )
                spark.stop()
            CLUSTER_DIR = None
        samples.append(
            sample("end", args.local_cold + args.local_warm + args.spark, sum(f for f, _, _ in phases.values()))
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
            for name, count, (failed, seconds, _) in [
                (n, {"local cold": args.local_cold, "local warm": args.local_warm, "spark": args.spark}[n], v)
                for n, v in phases.items()
            ]
        },
        "curves": {name: curve for name, (_, _, curve) in phases.items()},
        "samples": samples,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    if args.plot != "none" and report["curves"] and args.every:
        plot_curves(report["curves"], Path(args.plot or Path(args.output).with_suffix(".png")))
    for name, phase in report["phases"].items():
        print(name, json.dumps(phase), json.dumps(report["curves"][name]["slope_second_half_per_100_jobs"]))


if __name__ == "__main__":
    main()
