"""Which client reads byte ranges from an S3-protocol server fastest: obstore, s3fs or http.client?

Question: which reader should volumes use for ``s3://`` (and ``gs://``, ``az://``, ``http(s)://``)?
Peers, all on the same real S3-protocol server (moto, in its own process on loopback, serving
a byte range at the cost of the range as S3 does: see sparkgpu/testing/simulated_s3.py), all
fetching the same files as ranges of :func:`sparkgpu.data.storage.volume.part_bytes_for` bytes on the
same number of threads, each range written to its place in a local file (as the loader does):
  * obstore: the Rust object_store client (``obstore.get_range``), an S3 store (signed requests),
    each range written from a view of the client's buffer, as the loader does;
  * obstore-http: the same client as a plain HTTP store (unsigned; what http(s):// volumes use);
  * s3fs: fsspec's S3 filesystem (``cat_file`` with start/end; every request on its one
    event-loop thread);
  * http.client: the standard library's keep-alive HTTP client, one connection per thread (what
    the project read http(s):// volumes with before obstore). It cannot sign requests, so it can
    never read a private bucket: it stands for http(s):// volumes only (the bucket is public).
Peers run interleaved in a fresh random order in every repetition; medians are reported.
On a shared or loaded machine absolute figures are noisy, and moto (a Python server) may be
the bottleneck: compare the peers' ratios within one run, not figures across runs.
Results: benchmarks/results/object_store.json.

    python benchmarks/bench_object_store.py --files 4 --file-mb 8 --repeats 3    # a quick look
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def readers(endpoint: str, bucket: str) -> dict:
    """``{name: read(key, start, end) -> bytes}`` for every peer."""
    import obstore
    import s3fs
    from obstore.store import HTTPStore, S3Store

    s3 = S3Store(
        bucket,
        endpoint=endpoint,
        client_options={"allow_http": True},
        region="us-east-1",
        access_key_id="bench",
        secret_access_key="bench",
    )
    http_store = HTTPStore.from_url(f"{endpoint}/{bucket}", client_options={"allow_http": True})
    fs = s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=endpoint)
    local = threading.local()
    host = urllib.parse.urlsplit(endpoint).netloc

    def plain(key, start, end):
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(host, timeout=60)
        local.conn.request("GET", f"/{bucket}/{key}", headers={"Range": f"bytes={start}-{end - 1}"})
        response = local.conn.getresponse()
        body = response.read()
        if response.status != 206:
            raise RuntimeError(f"GET {key} answered {response.status}")
        return body

    return {
        "obstore": lambda key, start, end: memoryview(obstore.get_range(s3, key, start=start, end=end)),
        "obstore-http": lambda key, start, end: memoryview(obstore.get_range(http_store, key, start=start, end=end)),
        "s3fs": lambda key, start, end: fs.cat_file(f"{bucket}/{key}", start=start, end=end),
        "http.client": plain,
    }


def fetch_all(read, keys: list[str], size: int, threads: int, part: int, target: Path) -> float:
    """Seconds to fetch every key as ranges on ``threads`` threads into files under ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    fds = {key: os.open(target / key.replace("/", "_"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for key in keys}

    def one(item):
        key, start = item
        data = read(key, start, min(start + part, size))
        if len(data) != min(part, size - start):
            raise RuntimeError(f"{key} [{start}:] came back with {len(data)} bytes")
        os.pwrite(fds[key], data, start)

    started = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, [(key, start) for key in keys for start in range(0, size, part)]))
        return time.perf_counter() - started
    finally:
        for fd in fds.values():
            os.close(fd)


def run(args) -> dict:
    import boto3

    from sparkgpu.testing.simulated_s3 import start_s3_server
    from sparkgpu.data.storage.volume import part_bytes_for

    os.environ.update(ENV)
    server, endpoint = start_s3_server()
    work = Path(tempfile.mkdtemp(prefix="sparkgpu-bench-objstore-", dir=args.work_dir))
    try:
        bucket, size = "bench", args.file_mb << 20
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        payload = os.urandom(size)
        keys = [f"ds/shard.{i:05d}.mds" for i in range(args.files)]
        for key in keys:
            client.put_object(Bucket=bucket, Key=key, Body=payload, ACL="public-read")  # unsigned peers read it
        part = part_bytes_for(size, args.threads)
        peers = readers(endpoint, bucket)
        for name, read in peers.items():  # every peer answers the same bytes before it is timed
            if read(keys[0], 5, 1005) != payload[5:1005]:
                raise RuntimeError(f"{name} read the wrong bytes")
        seconds: dict[str, list[float]] = {name: [] for name in peers}
        total = size * len(keys)
        for repeat in range(args.repeats):
            order = random.Random(repeat).sample(list(peers), len(peers))
            for name in order:
                seconds[name].append(fetch_all(peers[name], keys, size, args.threads, part, work / name))
            print(
                f"  repeat {repeat + 1}: "
                + ", ".join(f"{name} {total / seconds[name][-1] / 1e6:.0f} MB/s" for name in order),
                flush=True,
            )
        results = {
            name: {"seconds": s, "median_mb_per_s": total / statistics.median(s) / 1e6} for name, s in seconds.items()
        }
        for name, figures in sorted(results.items(), key=lambda item: -item[1]["median_mb_per_s"]):
            print(f"{name:>13}: median {figures['median_mb_per_s']:.0f} MB/s over {args.repeats} repeats")
        return {"peers": results, "bytes_per_repeat": total, "part_bytes": part}
    finally:
        server.terminate()
        server.wait(timeout=10)
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--file-mb", type=int, default=16)
    parser.add_argument("--threads", type=int, default=8, help="parallel range requests, every peer alike")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--out", default=str(RESULTS / "object_store.json"))
    args = parser.parse_args(argv)
    results = run(args)
    results["config"] = {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")} | {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
