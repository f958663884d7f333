"""``bench_volume.py --peers``: sparkgpu, Mosaic Streaming and litdata reading one S3 bucket.

The same samples (a ``bytes`` payload of ``--sample-bytes`` and an ``int64`` label, the shape of
an image data set with the decoding left out: the question is the volume, not the decoder) are
written three ways, each by its own writer with the same shard size: ``sparkgpu.data.to_mds``,
``streaming.MDSWriter`` and ``litdata.optimize``. The three folders are uploaded to one bucket
of a moto S3 server on 127.0.0.1 (:func:`sparkgpu.testing.simulated_s3.start_s3_server`). Every
reader reaches it through one proxy that adds the S3-like link (30 ms before each request,
100 MB/s per connection, as in ``--profile s3-like``) and counts what passes: bytes answered,
connections opened, the most open at once. Readers, each set up as its docs show:

  * ``sparkgpu.data.dataset(remote="s3://...", local=..., num_workers=W, download_threads=...)``,
    the endpoint from ``AWS_ENDPOINT_URL``;
  * ``streaming.StreamingDataset(remote="s3://...", local=..., batch_size=B)`` under a torch
    ``DataLoader(num_workers=W)``; boto3 takes the endpoint from ``S3_ENDPOINT_URL`` (its
    ``download.py``: ``endpoint_url=os.environ.get('S3_ENDPOINT_URL')``);
  * ``litdata.StreamingDataset("s3://...", cache_dir=..., storage_options={"endpoint_url": ...})``
    under ``litdata.StreamingDataLoader(num_workers=W)`` (its S3 client passes
    ``storage_options`` to boto3; chunk GETs go through obstore built from that client). One
    change to its setup: obstore refuses a plain ``http://`` endpoint unless told
    ``allow_http``, which litdata 0.2.76 does not pass (the GET fails with "builder error"), so
    the benchmark adds it to litdata's obstore client options; a real S3 endpoint is https.

The connection budget (``--connections``) is the raw download's thread count and sparkgpu's
download threads over all its workers. Neither peer has a setting for it: Mosaic downloads one
shard at a time per worker, litdata ``max_pre_download`` chunks per worker over a pool; the
proxy's count of connections open at once, per epoch and side, is in the results.

Each repeat, in order and shuffled: the raw parallel download of the sparkgpu shards (the
plain http.client baseline of ``bench_volume.py``, the same proxy, the connection budget as its
thread count, ranges cut as the loader cuts them), then each reader (the order rotating between
repeats) with a new cache folder: epoch 1 (cold) and epoch 2 (warm, the same loader object).
Each epoch reports time to the first batch, the steady rate after it, the whole-epoch rate,
and bytes the proxy answered during it. With ``--cache-limit`` every reader's cache is held to
that many bytes (sparkgpu ``cache_limit``, Mosaic ``cache_limit``, litdata ``max_cache_size``).
With ``drop_page_cache`` (``--real-size``) the page cache is dropped before each raw download and
each reader's every epoch, so no clock starts with shards in memory from before it.
A peer that has not finished its two epochs after ``--reader-timeout`` seconds is stopped, with
its workers, and recorded (``<peer>_stopped``: when, and the bytes the link answered it by then)
instead of measured; sparkgpu stopped that way fails the run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from common import spread

READERS = ("sparkgpu", "mosaic_streaming", "litdata")
# Not a side of any ratio: sparkgpu as its docs set it up for columns that cost nothing to decode
# (num_workers=0, the default: batches decoded in the training process, one downloader with the
# whole budget), to tell the loader's download rate from what its worker processes do to it.
DIAGNOSTICS = ("sparkgpu_in_process",)


class CountingProxy:
    """The S3-like link in front of ``upstream`` (a URL on 127.0.0.1), counting what passes."""

    def __init__(self, upstream: str, latency_s: float, mb_per_s_per_connection: float):
        from sparkgpu.testing.simulated_link import start_counted_proxy

        self.proc, self.url, self.control = start_counted_proxy(upstream, latency_s, mb_per_s_per_connection)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


# --- the same samples, three writers -------------------------------------------------------

_BLOB: np.ndarray | None = None
_BLOB_BYTES = 32 << 20


def payload(index: int, size: int) -> bytes:
    """Sample ``index``'s payload: ``size`` incompressible bytes, the same for every writer."""
    global _BLOB
    if _BLOB is None:
        _BLOB = np.random.default_rng(0).integers(0, 256, _BLOB_BYTES, dtype=np.uint8)
    start = (index * 104_729) % (_BLOB_BYTES - size)
    return _BLOB[start : start + size].tobytes()


def litdata_sample(item: tuple[int, int]) -> dict:
    """litdata.optimize's ``fn``: one sample (module level, so its workers can import it)."""
    index, size = item
    return {"x": payload(index, size), "label": index}


def write_sparkgpu(path: Path, samples: int, sample_bytes: int, shard_bytes: int) -> None:
    import pyarrow as pa

    from sparkgpu import data

    # A stream of 256 MB batches, as the other writers take samples one at a time: a whole
    # table of the real size (6 GB) would stay in this process's memory for the whole run.
    schema = pa.schema([("x", pa.binary()), ("label", pa.int64())])
    step = max(1, (256 << 20) // sample_bytes)

    def batches():
        for start in range(0, samples, step):
            stop = min(start + step, samples)
            yield pa.record_batch(
                [
                    pa.array([payload(i, sample_bytes) for i in range(start, stop)], pa.binary()),
                    pa.array(np.arange(start, stop, dtype=np.int64)),
                ],
                schema=schema,
            )

    stream = pa.RecordBatchReader.from_batches(schema, batches())
    data.to_mds(stream, str(path), size_limit=shard_bytes, progress=False)


def write_mosaic(path: Path, samples: int, sample_bytes: int, shard_bytes: int) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(path), columns={"x": "bytes", "label": "int64"}, size_limit=shard_bytes) as writer:
        for i in range(samples):
            writer.write({"x": payload(i, sample_bytes), "label": np.int64(i)})


def write_litdata(path: Path, samples: int, sample_bytes: int, shard_bytes: int) -> None:
    from litdata import optimize

    optimize(
        fn=litdata_sample,
        inputs=[(i, sample_bytes) for i in range(samples)],
        output_dir=str(path),
        chunk_bytes=shard_bytes,
        num_workers=1,
        verbose=False,
        start_method="fork",
    )


WRITERS = {"sparkgpu": write_sparkgpu, "mosaic_streaming": write_mosaic, "litdata": write_litdata}


def upload(endpoint: str, key: str, secret: str, bucket: str, folder: Path, prefix: str) -> dict:
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1"
    )
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
    for path in files:
        client.upload_file(
            str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", ExtraArgs={"ACL": "public-read"}
        )
    shards = [p for p in files if p.name != "index.json"]
    return {
        "files": len(files),
        "shards": len(shards),
        "bytes": sum(p.stat().st_size for p in files),
        "shard_bytes_max": max(p.stat().st_size for p in shards),
    }


# --- readers ---------------------------------------------------------------------------------


def drop_page_cache(enabled: bool) -> str:
    """Writes dirty pages back and drops the clean ones (root on Linux), so the next clock starts cold.

    Everything a reader finds in memory then comes from its own cache files on disk or over the
    link, the S3 server's copies of the shards included; on a machine that refuses, the state is
    reported instead of hidden.
    """
    if not enabled:
        return "kept"
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError as error:
        return f"not dropped: /proc/sys/vm/drop_caches refused ({error.strerror}); a run as root drops it"
    return "dropped"


def shuffle_block_size(args) -> int | None:
    """sparkgpu's shuffle window under a cache limit: as its error message asks, a window whose
    shards fit the cache (half of it, in samples); None (its default, 262,144) without a limit."""
    if not args.cache_limit:
        return None
    return max(args.batch_size, args.cache_limit // (2 * args.sample_bytes))


class Reader:
    """One reader over its own copy of the data, with a new cache: ``epoch()`` iterates once."""

    def __init__(self, name: str, url: str, cache: Path, args, endpoint: str, credentials: tuple[str, str]):
        self.name = name
        self.connections = None
        limit = args.cache_limit
        if name == "sparkgpu_in_process":
            from sparkgpu import data

            self.connections = {"download_threads": args.connections, "budget": args.connections, "num_workers": 0}
            self.loader = data.dataset(
                remote=url.replace("/sparkgpu_in_process", "/sparkgpu"),
                local=cache,
                batch_size=args.batch_size,
                shuffle=args.shuffle_now,
                shuffle_block_size=shuffle_block_size(args),
                download_threads=args.connections,
                cache_limit=limit,
            )
            self._iterable = lambda: self.loader
        elif name == "sparkgpu":
            from sparkgpu import data

            # Each worker keeps its own downloader over the one shared cache: the budget is
            # split between them (the peak at the proxy says what was used).
            threads = max(1, args.connections // max(1, args.workers))
            self.connections = {"download_threads_per_worker": threads, "budget": threads * max(1, args.workers)}
            self.loader = data.dataset(
                remote=url,
                local=cache,
                batch_size=args.batch_size,
                shuffle=args.shuffle_now,
                shuffle_block_size=shuffle_block_size(args),
                num_workers=args.workers,
                download_threads=threads,
                cache_limit=limit,
            )
            self._iterable = lambda: self.loader
        elif name == "mosaic_streaming":
            import torch
            from streaming import StreamingDataset
            from streaming.base.util import clean_stale_shared_memory

            clean_stale_shared_memory()
            self.connections = {"downloads_per_worker": 1, "budget": max(1, args.workers)}
            self.dataset = StreamingDataset(
                remote=url,
                local=str(cache),
                batch_size=args.batch_size,
                shuffle=args.shuffle_now,
                cache_limit=limit,
            )
            self.loader = torch.utils.data.DataLoader(
                self.dataset, batch_size=args.batch_size, num_workers=args.workers
            )
            self._iterable = lambda: self.loader
        elif name == "litdata":
            import litdata.streaming.downloader as litdata_downloader
            from litdata import StreamingDataLoader, StreamingDataset

            # litdata fetches chunks with obstore, built from its boto3 client's endpoint but without
            # allow_http, which an http:// endpoint needs (otherwise: "HTTP error: builder error").
            litdata_downloader._OBSTORE_CLIENT_OPTIONS = {
                **litdata_downloader._OBSTORE_CLIENT_OPTIONS,
                "allow_http": True,
            }
            self.connections = {"downloads_per_worker": "its own (max_pre_download=2 chunks ahead)", "budget": None}
            self.dataset = StreamingDataset(
                url,
                cache_dir=str(cache),
                shuffle=args.shuffle_now,
                max_cache_size=limit,
                storage_options={
                    "endpoint_url": endpoint,
                    "aws_access_key_id": credentials[0],
                    "aws_secret_access_key": credentials[1],
                    "region_name": "us-east-1",
                },
            )
            self.loader = StreamingDataLoader(self.dataset, batch_size=args.batch_size, num_workers=args.workers)
            self._iterable = lambda: self.loader
        else:
            raise ValueError(name)

    def epoch(self, control: int, payload_bytes: int) -> dict:
        from sparkgpu.testing.simulated_link import link_counts

        before = link_counts(control, reset_peak=True)
        started = time.perf_counter()
        first = None
        samples = label_sum = 0
        for batch in self._iterable():
            if first is None:
                first = time.perf_counter() - started
                first_samples = len(batch["label"])
            samples += len(batch["label"])
            label_sum += int(np.asarray(batch["label"]).sum())
        seconds = time.perf_counter() - started
        after = link_counts(control)
        steady_s = max(seconds - first, 1e-9)
        return {
            "samples": samples,
            "label_sum": label_sum,
            "seconds": seconds,
            "first_batch_s": first,
            "samples_per_s": samples / seconds,
            "mb_per_s": samples * payload_bytes / seconds / 1e6,
            "steady_mb_per_s": (samples - first_samples) * payload_bytes / steady_s / 1e6,
            "steady_samples_per_s": (samples - first_samples) / steady_s,
            "bytes_downloaded": after["bytes_down"] - before["bytes_down"],
            "connections_opened": after["connections"] - before["connections"],
            "peak_open_connections": after["peak_open"],
        }

    def close(self) -> None:
        close = getattr(self.loader, "close", None)
        if callable(close):
            close()
        self.loader = self.dataset = None  # noqa
        gc.collect()


# --- the run ---------------------------------------------------------------------------------


def run_peers(args) -> dict:
    from bench_volume import in_flight_bytes, plain_parallel_download
    from sparkgpu.testing import simulated_s3
    from sparkgpu.testing.simulated_link import PROFILES, link_counts

    profile = PROFILES["s3-like"]
    sample_bytes = args.sample_bytes
    work = Path(tempfile.mkdtemp(prefix="sparkgpu-bench-volume-peers-", dir=args.work_dir))
    server = proxy = None
    saved = {k: os.environ.get(k) for k in (*simulated_s3._environment(""), "S3_ENDPOINT_URL")}
    try:
        total = args.samples * sample_bytes
        print(
            f"writing {args.samples:,} samples of {sample_bytes:,} bytes ({total / 1e9:.2f} GB) three ways, "
            f"shards of {args.shard_bytes >> 20} MB ...",
            flush=True,
        )
        server, endpoint = simulated_s3.start_s3_server()
        key, secret = simulated_s3._KEY, simulated_s3._SECRET
        bucket = "bench-peers"
        written = {}
        for name, write in WRITERS.items():
            started = time.perf_counter()
            folder = work / "written" / name
            write(folder, args.samples, sample_bytes, args.shard_bytes)
            written[name] = upload(endpoint, key, secret, bucket, folder, name)
            written[name]["write_and_upload_s"] = time.perf_counter() - started
            shutil.rmtree(folder, ignore_errors=True)
            print(
                f"  {name}: {written[name]['shards']} shards, {written[name]['bytes'] / 1e9:.2f} GB, "
                f"{written[name]['write_and_upload_s']:.0f} s to write and upload",
                flush=True,
            )
        proxy = CountingProxy(endpoint, **profile)
        os.environ.update(simulated_s3._environment(proxy.url))
        os.environ["S3_ENDPOINT_URL"] = proxy.url
        simulated_s3._forget_clients()
        sparkgpu_shards = sorted(
            s["raw_data"]["basename"]
            for s in json.loads(
                urllib.request.urlopen(f"{endpoint}/{bucket}/sparkgpu/index.json").read()  # noqa: S310 (loopback)
            )["shards"]
        )
        orders = ["in_order", "shuffled"] if args.orders == "both" else [args.orders]
        runs: dict = {order: {"raw": [], **{r: [] for r in READERS + DIAGNOSTICS}} for order in orders}
        failures: dict = {}
        stops: dict = {}  # peers stopped at --reader-timeout
        page_cache: set[str] = set()  # what drop_page_cache did before each clock
        for repeat in range(args.repeats):
            for order in orders:
                args.shuffle_now = order == "shuffled"
                page_cache.add(drop_page_cache(args.drop_page_cache))
                raw = plain_parallel_download(
                    f"{proxy.url}/{bucket}/sparkgpu",
                    sparkgpu_shards,
                    args.connections,
                    work / "raw",
                    in_flight_bytes(profile),
                )
                runs[order]["raw"].append(raw)
                print(
                    f"repeat {repeat + 1}, {order}: raw parallel download ({args.connections} connections) "
                    f"{raw['mb_per_s']:.0f} MB/s",
                    flush=True,
                )
                rotation = READERS[repeat % 3 :] + READERS[: repeat % 3] + DIAGNOSTICS
                for name in rotation:
                    cache = work / "cache" / name
                    shutil.rmtree(cache, ignore_errors=True)
                    simulated_s3._forget_clients()
                    # Each reader in a process of its own, as a training job starts: no client, thread
                    # pool or runtime (obstore's tokio, which breaks forked DataLoader workers) of
                    # another reader is inherited.
                    spec = {
                        "name": name,
                        "url": f"s3://{bucket}/{name}",
                        "cache": str(cache),
                        "endpoint": proxy.url,
                        "control": proxy.control,
                        "credentials": [key, secret],
                        "sample_bytes": sample_bytes,
                        "args": {
                            k: getattr(args, k)
                            for k in (
                                "cache_limit",
                                "connections",
                                "workers",
                                "batch_size",
                                "shuffle_now",
                                "sample_bytes",
                                "drop_page_cache",
                            )
                        },
                    }
                    link_before = link_counts(proxy.control)
                    started = time.perf_counter()
                    # A session of its own: a reader stopped at --reader-timeout goes with its workers.
                    child = subprocess.Popen(
                        [sys.executable, __file__, json.dumps(spec)],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        cwd=Path(__file__).parent,
                        start_new_session=True,
                    )
                    try:
                        stdout, stderr = child.communicate(timeout=args.reader_timeout)
                    except subprocess.TimeoutExpired:
                        os.killpg(child.pid, signal.SIGKILL)
                        child.communicate()
                        shutil.rmtree(cache, ignore_errors=True)
                        if name == "sparkgpu":
                            raise
                        # A peer that finishes no two epochs in time is stopped and recorded with
                        # what it downloaded by then; the run goes on.
                        stopped = {
                            "repeat": repeat + 1,
                            "stopped_after_s": round(time.perf_counter() - started),
                            "bytes_downloaded_by_then": link_counts(proxy.control)["bytes_down"]
                            - link_before["bytes_down"],
                            "data_bytes": written[name]["bytes"],
                        }
                        stops.setdefault(order, {}).setdefault(name, []).append(stopped)
                        print(f"  {name} stopped after {stopped['stopped_after_s']} s: {stopped}", flush=True)
                        continue
                    shutil.rmtree(cache, ignore_errors=True)
                    sys.stderr.write(stderr)
                    if child.returncode != 0 and name != "sparkgpu":
                        # A peer that fails is recorded with its error, not measured; the run goes on.
                        error = [line for line in stderr.strip().splitlines() if line.strip()][-1:]
                        failures.setdefault(order, {}).setdefault(name, []).append(
                            {"exit": child.returncode, "error": error[0][:600] if error else ""}
                        )
                        print(f"  {name} failed (exit {child.returncode}): {error}", flush=True)
                        continue
                    if child.returncode != 0:
                        raise RuntimeError(f"{name} failed (exit {child.returncode}); its errors are above")
                    epochs, connections = json.loads(stdout.strip().splitlines()[-1])
                    page_cache.update(e.pop("page_cache") for e in epochs)
                    runs[order][name].append({"epoch1": epochs[0], "epoch2": epochs[1], **connections})
                    print(
                        "  "
                        + f"{name:20s}"
                        + "; ".join(
                            f"epoch {n}: {e['mb_per_s']:.0f} MB/s (steady {e['steady_mb_per_s']:.0f}, first batch "
                            f"{e['first_batch_s']:.2f} s), {e['bytes_downloaded'] / 1e9:.2f} GB down, "
                            f"{e['peak_open_connections']} conns"
                            for n, e in enumerate(epochs, 1)
                        ),
                        flush=True,
                    )
        results = summarize(runs, written, args, profile, total, failures, stops)
        results["page_cache_before_each_clock"] = sorted(page_cache)
        return results
    finally:
        for key_, value in saved.items():
            if value is None:
                os.environ.pop(key_, None)
            else:
                os.environ[key_] = value
        for proc in (proxy, server):
            if isinstance(proc, CountingProxy):
                proc.close()
            elif proc is not None:
                proc.terminate()
                proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def summarize(runs: dict, written: dict, args, profile: dict, total: int, failures: dict, stops: dict) -> dict:
    out: dict = {"profile": {"name": "s3-like", **profile}, "written": written, "orders": {}}
    for order, sides in runs.items():
        section: dict = {
            "raw_parallel_download_mb_per_s": spread([r["mb_per_s"] for r in sides["raw"]], higher_is_better=True),
            "raw_parallel_download": sides["raw"],
        }
        for name, fails in failures.get(order, {}).items():
            section[f"{name}_failures"] = fails
        for name, attempts in stops.get(order, {}).items():
            section[f"{name}_stopped"] = {
                "what": f"no two epochs within --reader-timeout={args.reader_timeout} s: the reader (and its "
                "workers) stopped, with the bytes the link answered it by then",
                "attempts": attempts,
            }
        measured = tuple(r for r in READERS + DIAGNOSTICS if sides[r])
        for name in measured:
            repeats = sides[name]
            side: dict = {"connections": {k: v for k, v in repeats[0].items() if k not in ("epoch1", "epoch2")}}
            for epoch in ("epoch1", "epoch2"):
                es = [r[epoch] for r in repeats]
                side[epoch] = {
                    "mb_per_s": spread([e["mb_per_s"] for e in es], higher_is_better=True),
                    "steady_mb_per_s": spread([e["steady_mb_per_s"] for e in es], higher_is_better=True),
                    "first_batch_s": spread([e["first_batch_s"] for e in es]),
                    "bytes_downloaded": spread([e["bytes_downloaded"] for e in es]),
                    "bytes_downloaded_over_data": statistics.median(e["bytes_downloaded"] for e in es)
                    / written[name.removesuffix("_in_process")]["bytes"],
                    "peak_open_connections": max(e["peak_open_connections"] for e in es),
                    "samples_seen": sorted({e["samples"] for e in es}),
                    "every_sample_once": all(
                        e["samples"] == args.samples and e["label_sum"] == args.samples * (args.samples - 1) // 2
                        for e in es
                    ),
                    "runs": es,
                }
            section[name] = side
        best_peer = {}
        ratios: dict = {}
        for epoch in ("epoch1", "epoch2"):
            for figure in ("mb_per_s", "steady_mb_per_s"):
                peers = {p: section[p][epoch][figure]["median"] for p in READERS[1:] if p in measured}
                if not peers:
                    continue
                peer = max(peers, key=peers.get)
                best_peer[f"{epoch}_{figure}"] = peer
                ratios[f"{epoch}_{figure}_vs_best_peer"] = section["sparkgpu"][epoch][figure]["median"] / max(
                    peers[peer], 1e-9
                )
        raw = section["raw_parallel_download_mb_per_s"]["median"]
        ratios["epoch1_vs_raw_parallel_download"] = section["sparkgpu"]["epoch1"]["mb_per_s"]["median"] / raw
        ratios["epoch1_steady_vs_raw_parallel_download"] = (
            section["sparkgpu"]["epoch1"]["steady_mb_per_s"]["median"] / raw
        )
        for name in measured[1:]:
            ratios[f"{name}_epoch1_vs_raw_parallel_download"] = section[name]["epoch1"]["mb_per_s"]["median"] / raw
        section["best_peer"] = best_peer
        section["ratios"] = ratios
        if "epoch1_mb_per_s_vs_best_peer" in ratios:
            section["goals"] = {
                "epoch1_at_least_1.3x_best_peer": ratios["epoch1_mb_per_s_vs_best_peer"] >= 1.3,
                "epoch1_at_least_80pct_of_raw": ratios["epoch1_vs_raw_parallel_download"] >= 0.8,
                "every_epoch_at_least_1.3x_best_peer": min(
                    ratios["epoch1_mb_per_s_vs_best_peer"], ratios["epoch2_mb_per_s_vs_best_peer"]
                )
                >= 1.3,
            }
        out["orders"][order] = section
    out["data_bytes"] = total
    out["cache_limit"] = args.cache_limit
    out["sparkgpu_shuffle_block_size"] = shuffle_block_size(args) or "default (262,144 samples)"
    out["data_over_cache_limit"] = None if not args.cache_limit else total / args.cache_limit
    return out


def reader_main(spec: dict) -> None:
    """One reader, two epochs, in this process; prints ``[epochs, connections]`` as JSON."""
    import argparse

    args = argparse.Namespace(**spec["args"])
    reader = Reader(spec["name"], spec["url"], Path(spec["cache"]), args, spec["endpoint"], tuple(spec["credentials"]))
    try:
        epochs = []
        for _ in range(2):
            dropped = drop_page_cache(args.drop_page_cache)
            epochs.append(reader.epoch(spec["control"], spec["sample_bytes"]) | {"page_cache": dropped})
    finally:
        reader.close()
    print(json.dumps([epochs, reader.connections]), flush=True)


if __name__ == "__main__":
    reader_main(json.loads(sys.argv[1]))
