"""Remote volume against the local NVMe cache: epoch 1 from the volume, epoch 2 from the cache.

Question: does the loader keep up with the volume on the first epoch (downloads planned from
the known order, in parallel, ahead of the reader), and what does the cache buy afterwards?

The volume is a real HTTP server on loopback (Python's ThreadingHTTPServer in its own
process, answering byte-range requests as object stores and nginx do) serving MDS shards of
tabular samples (32 float32 + 1 int64). Measured in one run:
  * ceiling: the volume's raw rate, the same shard files fetched by an independent plain
    client (http.client, one keep-alive connection per thread), not by this project's
    downloader, doing what the loader does: the same number of connections (--threads) and
    the same byte ranges (each file cut by ``part_bytes_for`` with the link's bytes in
    flight, as the loader cuts it once its first answer has measured the link), each range
    written to its place in a local file; and one connection fetching whole files, apart;
  * sparkgpu.data.dataset: epoch 1 (cold cache, everything comes over HTTP) and epoch 2
    (from the cache), through sparkgpu.data.report.volume_report; each of the --repeats
    runs measures the raw rate right before its epoch 1, and the score is each run's own
    epoch 1 / raw ratio (best and median reported, the target judged on the median);
  * peers: not in this mode (Mosaic Streaming has no http:// downloader); they are in ``--peers``.
Two profiles: ``loopback`` (the server as it is) and ``s3-like`` (a TCP proxy in front of it,
in its own process: 30 ms before each request reaches the server, 100 MB/s per connection
for the answers; what a training node sees of an object store). Every client, the raw
download included, goes through the same proxy with the same number of connections; the
target is epoch 1 at 70% of the raw download on loopback, 80% in the S3-like profile.
Results: benchmarks/results/volume.json and volume.png (volume-s3-like.* for that profile).

With ``--table`` the same rows are a Delta table (64k-row groups) read by
sparkgpu.data.table_dataset from ``s3://``: an S3-protocol server (moto) on loopback, behind
the same proxy in the s3-like profile, reached by deltalake, pyarrow and the object-store
client as they reach S3. The raw download is the same plain http.client GET of the table's
data files (path-style S3 URLs), as ranges cut as above; results in volume-table[-s3-like].json. No peer: the
table peers are in bench_table.py.

    python benchmarks/bench_volume.py                     # about 1-2 minutes on 2 cores
    python benchmarks/bench_volume.py --profile s3-like
    python benchmarks/bench_volume.py --table --profile s3-like
    python benchmarks/bench_volume.py --samples 500000    # a quick look

With ``--peers`` (volume_peers.py) the peers read the same samples from one S3 bucket:
sparkgpu.data.dataset, Mosaic Streaming's StreamingDataset (boto3, ``S3_ENDPOINT_URL``) and
litdata's StreamingDataset (``storage_options``), each from shards its own writer made
(to_mds, MDSWriter, litdata.optimize; 64 MB shards, samples of a 100 kB payload and a label),
each in a process of its own with the same DataLoader workers (``--workers``), behind one
S3-like proxy that counts bytes and connections; the raw parallel download with the connection
budget (``--connections``) beside them. Epoch 1 (cold) and epoch 2 (warm), in order and
shuffled, start-up and steady rate apart, medians of ``--repeats``; results in
volume-peers.json. ``--real-size`` holds every reader's cache to ``--cache-limit`` (default
1.5 GB) on 6 GB of shards, so eviction and re-download are on the measured path
(volume-peers-real-size.json), and the page cache is dropped (as root) before every epoch and raw
download, so nothing is read from memory a run before left behind:

    python benchmarks/bench_volume.py --peers                    # 400 MB, about 5 minutes
    python benchmarks/bench_volume.py --peers --real-size        # 3 x 6 GB on disk, about an hour
    python benchmarks/bench_volume.py --peers --real-size --samples 20000 --cache-limit 600000000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from common import load_seen, machine, method
from sparkgpu.testing.simulated_link import PROFILES, serve_folder, start_proxy

ROW_BYTES = 32 * 4 + 8
STREAMING_DROPPED = (
    "Mosaic Streaming has no http:// downloader; its documented remote path (s3:// through boto3) "
    "is measured by --peers (volume-peers*.json), beside litdata, on the same S3 bucket"
)
RESULTS = Path(__file__).resolve().parent / "results"


def plain_parallel_download(
    remote: str, files: list[str], threads: int, target: Path, in_flight: int = 0, ranges: bool = True
) -> dict:
    """The volume's raw rate: ``files`` fetched with http.client in ``threads`` threads, to disk.

    Each thread keeps one keep-alive connection. With ``ranges``, every file is cut into byte
    ranges as the loader cuts it (:func:`part_bytes_for` of its size, ``threads`` and the
    link's ``in_flight`` bytes), all ranges queued in file order, each written to its place in
    the file; without, files are fetched whole. Sizes are asked with HEAD before the clock starts.
    """
    from sparkgpu.data.storage.volume import part_bytes_for

    parsed = urllib.parse.urlsplit(remote)
    local = threading.local()

    def connection():
        if not hasattr(local, "connection"):
            local.connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
        return local.connection

    def size_of(name):
        connection().request("HEAD", f"{parsed.path}/{name}")
        response = connection().getresponse()
        response.read()
        return int(response.headers["Content-Length"])

    def fetch(item):
        number, name, start, end = item
        headers = {"Range": f"bytes={start}-{end - 1}"} if end is not None else {}
        connection().request("GET", f"{parsed.path}/{name}", headers=headers)
        response = connection().getresponse()
        if response.status not in (200, 206):
            raise RuntimeError(f"GET {remote}/{name} answered {response.status} {response.reason}")
        buffer = memoryview(bytearray(8 << 20))
        size, offset = 0, start
        fd = os.open(target / f"{number}.bin", os.O_WRONLY | os.O_CREAT)
        try:
            while count := response.readinto(buffer):
                os.pwrite(fd, buffer[:count], offset)
                offset += count
                size += count
        finally:
            os.close(fd)
        return size

    target.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        sizes = list(pool.map(size_of, files))
    parts: list[tuple[int, str, int, int | None]] = []
    part_sizes = []
    for number, (name, size) in enumerate(zip(files, sizes)):
        if not ranges:
            parts.append((number, name, 0, None))
            continue
        step = part_bytes_for(size, threads, in_flight)
        part_sizes.append(step)
        parts += [(number, name, begin, min(begin + step, size)) for begin in range(0, size, step)]
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(fetch, parts))
    seconds = time.perf_counter() - started
    shutil.rmtree(target, ignore_errors=True)
    return {
        "client": "http.client",
        "threads": threads,
        "connections": threads,
        "requests": len(parts),
        "range_bytes": sorted(set(part_sizes)) if ranges else "whole files",
        "bytes": total,
        "seconds": seconds,
        "mb_per_s": total / seconds / 1e6,
    }


def in_flight_bytes(profile: dict | None) -> int:
    """What one connection moves while it waits for a first byte on the profile's link."""
    return int(profile["latency_s"] * profile["mb_per_s_per_connection"] * 1e6) if profile else 0


def write_dataset(path: Path, samples: int, shard_bytes: int, compression) -> None:
    import pyarrow as pa

    from sparkgpu import data

    rng = np.random.default_rng(0)
    columns = {f"f{i:02d}": pa.array(rng.random(samples, dtype=np.float32)) for i in range(32)}
    columns["label"] = pa.array(np.arange(samples, dtype=np.int64))
    data.to_mds(
        pa.table(columns), str(path), size_limit=shard_bytes, hashes=["xxh64"], compression=compression, progress=False
    )


def write_table(path: Path, samples: int) -> None:
    import pyarrow as pa
    from deltalake import WriterProperties, write_deltalake

    rng = np.random.default_rng(0)
    columns = {f"f{i:02d}": pa.array(rng.random(samples, dtype=np.float32)) for i in range(32)}
    columns["label"] = pa.array(np.arange(samples, dtype=np.int64))
    step = 512 * 1024  # files of 8 row groups of 64k rows, as Spark writes them
    for start in range(0, samples, step):
        write_deltalake(
            str(path),
            pa.table(columns).slice(start, step),
            mode="append",
            writer_properties=WriterProperties(max_row_group_size=64 * 1024),
        )


def run_table(args) -> dict:
    from sparkgpu.testing.simulated_s3 import simulated_s3
    from sparkgpu.data.report import plot_volume_report, table_report

    work = Path(tempfile.mkdtemp(prefix="sparkgpu-bench-volume-", dir=args.work_dir))
    try:
        print(
            f"writing {args.samples:,} rows ({args.samples * ROW_BYTES / 1e6:.0f} MB) as a Delta table ...", flush=True
        )
        write_table(work / "volume" / "table", args.samples)
        with simulated_s3(work / "volume" / "table", args.profile) as url:
            http_url = f"{os.environ['AWS_ENDPOINT_URL']}/{url.removeprefix('s3://')}"  # path-style S3 GETs

            def raw(names, target):
                return plain_parallel_download(
                    http_url, names, args.threads, target, in_flight_bytes(PROFILES[args.profile])
                )

            runs = [
                table_report(
                    url,
                    local=work,
                    batch_size=args.batch_size,
                    download_threads=args.threads,
                    shuffle=args.shuffle,
                    raw_download=raw,
                )
                for _ in range(args.repeats)
            ]
        report, ratios, median, target = summarize_runs(
            runs, "table_dataset", args.threads, PROFILES[args.profile] is not None
        )
        plot_volume_report(report, args.out_png)
        return {
            "profile": {"name": args.profile, **(PROFILES[args.profile] or {})},
            "sparkgpu_table_dataset": report,
            "ratios": {
                "epoch1_vs_raw_parallel_download_per_run": ratios,
                "epoch1_vs_raw_parallel_download_median": median,
                "target_epoch1_of_raw": target,
                "target_met_on_median": median >= target,
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize_runs(runs: list[dict], label: str, threads: int, latency: bool) -> tuple[dict, list, float, float]:
    """Prints each run's epoch 1 against its raw download; returns the median run's report (the
    figures shown and plotted), every ratio, their median and the target of the profile."""
    ratios = [run["epoch1_vs_raw"] for run in runs]
    median = statistics.median(ratios)
    report = dict(sorted(runs, key=lambda run: run["epoch1_vs_raw"])[(len(runs) - 1) // 2])
    report["runs"] = runs
    for number, run in enumerate(runs, 1):
        print(
            f"  run {number}: raw parallel download ({threads} threads, http.client) "
            f"{run['raw_parallel_download']['mb_per_s']:.0f} MB/s; {label} epoch 1 {run['epoch1_from_volume']['mb_per_s']:.0f} MB/s "
            f"(first batch after {run['epoch1_from_volume']['first_batch_s']:.2f} s) = {run['epoch1_vs_raw']:.0%} of raw; "
            f"epoch 2 from the cache {run['epoch2_from_cache']['mb_per_s']:.0f} MB/s",
            flush=True,
        )
    target = 0.80 if latency else 0.70
    print(
        f"  epoch 1 / raw parallel download, same run: median {median:.0%}, best {max(ratios):.0%} (target >= {target:.0%})",
        flush=True,
    )
    return report, ratios, median, target


def run(args) -> dict:
    from sparkgpu.data.report import plot_volume_report, volume_report

    work = Path(tempfile.mkdtemp(prefix="sparkgpu-bench-volume-", dir=args.work_dir))
    server = proxy = None
    profile = PROFILES[args.profile]
    try:
        print(f"writing {args.samples:,} samples ({args.samples * ROW_BYTES / 1e6:.0f} MB) ...", flush=True)
        write_dataset(work / "volume" / "ds", args.samples, args.shard_bytes, args.compression)
        server, base = serve_folder(work / "volume")
        if profile is not None:  # every client, raw and loader alike, goes through the proxy
            proxy, base = start_proxy(base, **profile)
            print(
                f"  profile {args.profile}: {profile['latency_s'] * 1e3:.0f} ms to the first byte, "
                f"{profile['mb_per_s_per_connection']:.0f} MB/s per connection",
                flush=True,
            )
        remote = f"{base}/ds"
        index = json.loads((work / "volume" / "ds" / "index.json").read_text())
        files = [(s.get("zip_data") or s["raw_data"])["basename"] for s in index["shards"]]
        one_thread = plain_parallel_download(remote, files, 1, work / "raw1", ranges=False)
        print(f"  raw download, 1 connection, whole files: {one_thread['mb_per_s']:.0f} MB/s", flush=True)

        def raw(names, target):
            return plain_parallel_download(remote, names, args.threads, target, in_flight_bytes(profile))

        # The machine may be shared: each run compares its epoch 1 with the raw rate measured
        # right before it, so a busy moment lowers both sides of that run's ratio.
        runs = [
            volume_report(
                remote,
                local=work,
                batch_size=args.batch_size,
                download_threads=args.threads,
                shuffle=args.shuffle,
                raw_download=raw,
            )
            for _ in range(args.repeats)
        ]
        report, ratios, median, target = summarize_runs(runs, "sparkgpu", args.threads, profile is not None)
        results = {
            "profile": {"name": args.profile, **(profile or {})},
            "sparkgpu": report,
            "raw_download_one_thread": one_thread,
            "streaming_from_volume": {"dropped": STREAMING_DROPPED},
            "ratios": {
                "epoch1_vs_raw_parallel_download_per_run": ratios,
                "epoch1_vs_raw_parallel_download_median": median,
                "epoch1_vs_raw_parallel_download_best": max(ratios),
                "epoch2_speedup_over_epoch1_median": statistics.median(run["epoch2_speedup"] for run in runs),
                "target_epoch1_of_raw": target,
                "target_met_on_median": median >= target,
            },
        }
        plot_volume_report(
            report,
            args.out_png,
            extra={
                "raw download (1 connection, whole files)": one_thread["mb_per_s"],
            },
        )
        return results
    finally:
        for proc in (proxy, server):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2_000_000)
    parser.add_argument("--shard-bytes", type=int, default=16 << 20)
    parser.add_argument("--compression", default=None, help="e.g. zstd (random floats barely compress)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=8, help="parallel downloads, loader and raw alike")
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of raw download + epochs; each run's ratio is reported"
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="loopback",
        help="s3-like: 30 ms to the first byte and 100 MB/s per connection, through a proxy",
    )
    parser.add_argument("--table", action="store_true", help="a Delta table on S3 read by table_dataset instead of MDS")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="sparkgpu, Mosaic Streaming and litdata reading the same samples from one S3 bucket (s3-like link)",
    )
    parser.add_argument(
        "--real-size",
        action="store_true",
        help="with --peers: 6 GB of shards and a 1.5 GB cache limit (eviction on the measured path)",
    )
    parser.add_argument("--sample-bytes", type=int, default=100_000, help="--peers: payload bytes per sample")
    parser.add_argument("--workers", type=int, default=2, help="--peers: DataLoader workers, every reader alike")
    parser.add_argument(
        "--connections", type=int, default=4, help="--peers: connection budget (raw download threads; sparkgpu's total)"
    )
    parser.add_argument("--cache-limit", type=int, default=None, help="--peers: cache bytes for every reader")
    parser.add_argument("--reader-timeout", type=int, default=1800, help="--peers: seconds for one reader's two epochs")
    parser.add_argument("--orders", choices=["both", "in_order", "shuffled"], default="both")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument(
        "--out", default=None, help="default results/volume.json (volume-s3-like.json with that profile)"
    )
    args = parser.parse_args(argv)
    if args.peers:
        return main_peers(parser, args, argv or [])
    if args.out is None:
        name = "volume-table" if args.table else "volume"
        args.out = str(RESULTS / (f"{name}.json" if args.profile == "loopback" else f"{name}-{args.profile}.json"))
    args.out_png = str(Path(args.out).with_suffix(".png"))
    facts = machine()
    results = run_table(args) if args.table else run(args)
    results["config"] = {k: v for k, v in vars(args).items() if k not in ("out", "out_png", "work_dir")} | {
        "row_bytes": ROW_BYTES
    }
    results["machine"] = load_seen(facts)
    results["connections"] = {"loader": args.threads, "raw_parallel_download": args.threads}
    results["method"] = method(
        "epoch 1: the loader's whole first epoch from the volume through a new cache; raw: every file's bytes as "
        "ranges cut as the loader cuts them, on the same number of connections, written to local files",
        startup="inside epoch 1 (its first batch waits for the first file); first_batch_s beside it",
        repeats=args.repeats,
        statistic="median over runs of each run's epoch 1 / its own raw download (taken just before)",
        range_sizing="part_bytes_for(size, connections, latency x per-connection rate) for loader and raw alike",
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out} and {args.out_png}")


def main_peers(parser, args, argv: list[str]) -> None:
    from volume_peers import run_peers

    given = {a.split("=")[0] for a in (argv if argv else sys.argv[1:])}
    if "--shard-bytes" not in given:
        args.shard_bytes = 64 << 20  # Mosaic's and litdata's usual shard size, for all three
    if "--samples" not in given:
        args.samples = 60_000 if args.real_size else 4_000  # 6 GB / 400 MB of 100 kB samples
    if "--batch-size" not in given:
        args.batch_size = 64  # 6.4 MB of 100 kB samples
    if args.real_size and args.cache_limit is None:
        args.cache_limit = 1_500_000_000
    # At real size nothing may come from memory a run before left behind: the page cache is
    # dropped before every epoch and raw download (the readers' cache files, the server's shards).
    args.drop_page_cache = args.real_size
    name = "volume-peers-real-size" if args.real_size else "volume-peers"
    args.out = args.out or str(RESULTS / f"{name}.json")
    facts = machine()
    results = run_peers(args)
    results["command"] = " ".join(["python benchmarks/bench_volume.py", *(argv or sys.argv[1:])])
    results["machine"] = load_seen(facts)
    results["heavy_other_load"] = results["machine"]["other_load_seen"]
    results["config"] = {
        k: v for k, v in vars(args).items() if k not in ("out", "out_png", "work_dir", "shuffle_now", "table")
    }
    results["connections"] = {
        "raw_parallel_download": args.connections,
        "sparkgpu": f"{args.workers} workers x {max(1, args.connections // max(1, args.workers))} download threads",
        "mosaic_streaming": f"{args.workers} workers, one shard download at a time each (its prepare thread)",
        "litdata": f"{args.workers} workers, its own downloader (max_pre_download=2); its obstore chunk GETs "
        "given allow_http, which the http:// endpoint needs (the one change to its setup)",
        "measured": "peak_open_connections per epoch and side, counted at the proxy",
    }
    results["workers"] = {reader: args.workers for reader in ("sparkgpu", "mosaic_streaming", "litdata")}
    results["method"] = method(
        "each reader's whole epoch over its own copy of the same samples (its own writer, same shard size) in one "
        "bucket, through one S3-like proxy; epoch 1 with a new, empty cache, epoch 2 on the same loader object; "
        "MB/s are payload bytes delivered per second; raw: the sparkgpu shards fetched by http.client with the "
        "connection budget as threads and the loader's range sizes, through the same proxy",
        startup="mb_per_s includes it; first_batch_s (loader built to first batch) and steady_mb_per_s (after it) "
        "reported apart, for every reader alike",
        repeats=args.repeats,
        statistic="median over repeats of each side's figure; ratios divide medians; the best peer is the faster "
        "of Mosaic Streaming and litdata on that figure",
        order_of_sides="rotates between repeats; raw download first in every repeat and order",
        bytes_downloaded="answer bytes counted at the proxy during each epoch (HTTP headers included)",
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out}")
    for order, section in results["orders"].items():
        print(f"{order}: ratios {json.dumps(section['ratios'], indent=None)}")
        print(f"{order}: goals {section.get('goals', 'not judged: no peer finished its epochs')}")


if __name__ == "__main__":
    main()
