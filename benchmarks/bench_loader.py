"""Loader throughput from a warm local cache: sparkgpu.data.dataset against its peers.

Question: how many tabular samples (32 float32 + 1 int64, 136 bytes) per second reach the
training loop as torch tensors, shuffled and in order, when the shards are already on local
disk (and in the page cache)?

Peers, on the same data in the same run:
  * sparkgpu.data.dataset, default settings (and variants: C gathers off, decode thread on,
    DataLoader workers);
  * the same rows as (x, y) feature matrices: features= (C gather_fields, and its numpy
    version), beside the dict form followed by the torch.stack of 32 columns it replaces;
    features_over_ceiling_numpy_gather is the ratio of the features= row to the ceiling;
  * streaming.StreamingDataset + torch DataLoader (same batch size, same workers);
  * litdata (optimize + StreamingDataLoader), on a subset, since its optimize step writes
    about 10 thousand samples/s (skipped when litdata is not installed: pip install litdata);
  * torch DataLoader over a Parquet file read with pyarrow (iter_batches in order; row groups
    in random order with rows permuted inside each when shuffled).
Ceilings measured here: a plain numpy gather of the same rows in the same order from one
in-memory array, and a sequential read of the cache files. A last section reads variable-width
columns (token lists and text) with the C span gather and with its numpy version.

Each peer runs in a fresh process; its rate is measured over --repeats windows of --seconds
after the first batch (start-up is reported apart), and the median window is compared (the
best is recorded beside it). Results: benchmarks/results/loader.json
and loader.png.

    python benchmarks/bench_loader.py                 # about 5 minutes on 2 cores
    python benchmarks/bench_loader.py --samples 200000 --seconds 0.5 --repeats 1   # a quick look
    python benchmarks/bench_loader.py --only sparkgpu_features,ceiling_numpy_gather --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROW_BYTES = 32 * 4 + 8
from common import load_seen, machine, method  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_table(samples: int):
    import pyarrow as pa

    rng = np.random.default_rng(0)
    columns = {f"f{i:02d}": pa.array(rng.random(samples, dtype=np.float32)) for i in range(32)}
    columns["label"] = pa.array(np.arange(samples, dtype=np.int64))
    return pa.table(columns)


def prepare(work: Path, samples: int, lit_samples: int):
    """Writes the dataset as MDS (sparkgpu's writer, byte-identical to MDSWriter), Parquet and litdata."""
    import pyarrow.parquet as pq

    from sparkgpu import data

    table = make_table(samples)
    timings = {}
    started = time.perf_counter()
    data.to_mds(table, str(work / "mds"), size_limit=1 << 26, progress=False)
    timings["mds_write_s"] = time.perf_counter() - started
    pq.write_table(table, work / "data.parquet", row_group_size=65536)
    lit = None
    try:
        import litdata  # noqa: F401

        lit = _litdata_prepare(table.slice(0, lit_samples), work / "litdata")
    except ImportError:
        print("litdata is not installed (pip install litdata): its peer is skipped", file=sys.stderr)
    return timings, lit


def _litdata_chunk(args):
    path, start, stop = args
    import pyarrow.parquet as pq

    table = pq.read_table(path).slice(start, stop - start)
    x = np.stack([table.column(f"f{i:02d}").to_numpy() for i in range(32)], axis=1)
    y = table.column("label").to_numpy()
    for j in range(len(y)):
        yield {"x": x[j], "y": int(y[j])}


def _litdata_prepare(table, out: Path):
    import litdata
    import pyarrow.parquet as pq

    source = out.parent / "litdata-source.parquet"
    pq.write_table(table, source)
    step = 20_000
    inputs = [(str(source), a, min(a + step, len(table))) for a in range(0, len(table), step)]
    started = time.perf_counter()
    litdata.optimize(
        fn=_litdata_chunk, inputs=inputs, output_dir=str(out), chunk_bytes="64MB", num_workers=2, mode="overwrite"
    )
    return {"dir": str(out), "samples": len(table), "optimize_s": time.perf_counter() - started}


def warm(folder: Path) -> int:
    total = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            total += len(path.read_bytes())
    return total


def timed(batches, count, seconds: float, repeats: int, label: str) -> dict:
    """Rates over ``repeats`` windows of ``seconds`` each, after the first batch.

    The machine may be shared: the median window is quoted and every ratio divides medians;
    the best window is recorded beside it.
    """
    started = time.perf_counter()
    iterator = iter(batches)
    next(iterator)
    startup = time.perf_counter() - started
    rates = []
    for _ in range(repeats):
        samples, window_start = 0, time.perf_counter()
        for batch in iterator:
            samples += count(batch)
            if time.perf_counter() - window_start > seconds:
                break
        rates.append(samples / (time.perf_counter() - window_start))
    best, median = max(rates), float(np.median(rates))
    print(
        f"  {label:52s} {median:14,.0f} samples/s  {median * ROW_BYTES / 1e9:6.3f} GB/s  (best {best:,.0f}; start-up {startup:.2f} s)",
        flush=True,
    )
    return {
        "samples_per_s": median,
        "best_samples_per_s": best,
        "gb_per_s": median * ROW_BYTES / 1e9,
        "window_rates": rates,
        "startup_s": startup,
        "label": label,
    }


def ours(
    mds: str,
    batch_size: int,
    shuffle: bool,
    seconds: float,
    repeats: int,
    workers: int = 0,
    native: bool = True,
    prefetch: int = 0,
    features: str | None = None,
):
    """sparkgpu.data.dataset; ``features``: "matrix" yields (x, y) with features=, "stack" the dict
    form with the torch.stack every tabular loop did before features= existed."""
    from sparkgpu import data
    from sparkgpu.data import _gather

    previous = _gather.set_native_enabled(native)
    try:
        names = [f"f{i:02d}" for i in range(32)]
        matrix = {"features": names, "target": "label"} if features == "matrix" else {}
        ds = data.dataset(
            local=mds,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=0,
            num_workers=workers,
            prefetch_batches=prefetch,
            **matrix,
        )

        def epochs():
            while True:  # several epochs when one is shorter than the measuring window
                if features == "stack":
                    for batch in ds:
                        yield torch.stack([batch[n] for n in names], 1), batch["label"]
                else:
                    yield from ds

        label = f"sparkgpu (workers={workers}, native={native}, thread={bool(prefetch)})"
        if features:
            label = f"sparkgpu (x, y): {'features=' if features == 'matrix' else 'dict + torch.stack'}"
        count = (lambda b: len(b[1])) if features else (lambda b: len(b["label"]))
        return timed(epochs(), count, seconds, repeats, label)
    finally:
        _gather.set_native_enabled(previous)


def streaming_peer(mds: str, batch_size: int, shuffle: bool, seconds: float, repeats: int, workers: int):
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(local=mds, shuffle=shuffle, shuffle_seed=0, batch_size=batch_size)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers)

    def epochs():
        while True:
            yield from loader

    return timed(
        epochs(), lambda b: len(b["label"]), seconds, repeats, f"streaming.StreamingDataset (workers={workers})"
    )


def litdata_peer(lit: dict, batch_size: int, shuffle: bool, seconds: float, repeats: int, workers: int):
    import litdata

    ds = litdata.StreamingDataset(lit["dir"], shuffle=shuffle, seed=0)
    loader = litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers)

    def epochs():
        while True:
            yield from loader

    return timed(
        epochs(), lambda b: len(b["y"]), seconds, repeats, f"litdata (workers={workers}, {lit['samples']:,} samples)"
    )


class ParquetBatches(torch.utils.data.IterableDataset):
    """A torch IterableDataset over one Parquet file: what one writes without a loader library."""

    def __init__(self, path: str, batch_size: int, shuffle: bool):
        self.path, self.batch_size, self.shuffle = path, batch_size, shuffle

    def __iter__(self):
        import pyarrow.parquet as pq

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        handle = pq.ParquetFile(self.path)
        if not self.shuffle:
            groups = list(range(worker, handle.num_row_groups, workers))
            for record_batch in handle.iter_batches(batch_size=self.batch_size, row_groups=groups):
                yield {
                    name: torch.from_numpy(record_batch.column(i).to_numpy())
                    for i, name in enumerate(record_batch.schema.names)
                }
            return
        rng = np.random.default_rng(worker)
        for group in rng.permutation(handle.num_row_groups)[worker::workers]:
            table = handle.read_row_group(int(group))
            columns = {name: table.column(name).to_numpy() for name in table.column_names}
            perm = rng.permutation(table.num_rows)
            for start in range(0, table.num_rows, self.batch_size):
                rows = perm[start : start + self.batch_size]
                yield {name: torch.from_numpy(values[rows]) for name, values in columns.items()}


def parquet_peer(path: str, batch_size: int, shuffle: bool, seconds: float, repeats: int, workers: int):
    loader = torch.utils.data.DataLoader(
        ParquetBatches(path, batch_size, shuffle), batch_size=None, num_workers=workers
    )

    def epochs():
        while True:
            yield from loader

    return timed(
        epochs(), lambda b: len(b["label"]), seconds, repeats, f"torch DataLoader over Parquet (workers={workers})"
    )


def variable_width(work: Path, samples: int, batch_size: int, seconds: float, repeats: int) -> dict:
    """Token sequences (1-64 int32) and text: the native span gather against its numpy version."""
    import pyarrow as pa

    from sparkgpu import data
    from sparkgpu.data import _gather

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, samples)
    tokens = pa.array([np.arange(n, dtype=np.int32) for n in lengths], type=pa.list_(pa.int32()))
    text = pa.array([f"sample {i} " + "x" * int(n) for i, n in enumerate(lengths)])
    table = pa.table({"tokens": tokens, "text": text, "label": pa.array(np.arange(samples, dtype=np.int64))})
    data.to_mds(table, str(work / "var"), progress=False)
    warm(work / "var")
    out = {}
    for native in (True, False):
        previous = _gather.set_native_enabled(native)
        try:
            ds = data.dataset(local=str(work / "var"), batch_size=batch_size, shuffle=True, seed=0)

            def epochs():
                while True:
                    yield from ds

            out["native" if native else "numpy"] = timed(
                epochs(), lambda b: len(b["label"]), seconds, repeats, f"variable width, shuffled (native={native})"
            )
        finally:
            _gather.set_native_enabled(previous)
    out["native_over_numpy"] = out["native"]["samples_per_s"] / out["numpy"]["samples_per_s"]
    return out


def numpy_gather_ceiling(mds: str, batch_size: int, shuffle: bool, seconds: float, repeats: int):
    from sparkgpu import data
    from sparkgpu.data.mds.reader import ShardReader

    ds = data.dataset(local=mds, batch_size=batch_size, shuffle=shuffle, seed=0)
    rows = np.concatenate([ShardReader(Path(mds) / s.basename, s, ROW_BYTES).rows for s in ds.index.shards])
    order = ds._epoch_order(0)

    def batches():
        while True:
            for start in range(0, len(order), batch_size):
                yield np.take(rows, order[start : start + batch_size], axis=0)

    return timed(batches(), len, seconds, repeats, "ceiling: numpy gather from memory")


def sequential_read_ceiling(mds: str) -> dict:
    files = sorted(Path(mds).rglob("shard.*.mds"))
    size = max(f.stat().st_size for f in files)
    buffer = bytearray(size)
    total, started = 0, time.perf_counter()
    for _ in range(3):
        for path in files:
            with open(path, "rb", buffering=0) as handle:
                total += handle.readinto(buffer)
    elapsed = time.perf_counter() - started
    rate = total / elapsed
    print(
        f"  {'ceiling: sequential read of the cache files':48s} {rate / ROW_BYTES:14,.0f} samples/s  {rate / 1e9:6.3f} GB/s"
    )
    return {"bytes": total, "seconds": elapsed, "gb_per_s": rate / 1e9, "samples_per_s": rate / ROW_BYTES}


def peers(workers: int, have_litdata: bool) -> dict:
    """Name -> (function, extra arguments); each runs in a fresh process of its own."""
    table = {
        "sparkgpu": ("ours", {}),
        "sparkgpu_numpy_gather": ("ours", {"native": False}),
        "sparkgpu_decode_thread": ("ours", {"prefetch": 2}),
        "sparkgpu_features": ("ours", {"features": "matrix"}),
        "sparkgpu_features_numpy_gather": ("ours", {"features": "matrix", "native": False}),
        "sparkgpu_dict_stack": ("ours", {"features": "stack"}),
        f"sparkgpu_workers{workers}": ("ours", {"workers": workers}),
        "streaming": ("streaming_peer", {"workers": 0}),
        f"streaming_workers{workers}": ("streaming_peer", {"workers": workers}),
        "parquet": ("parquet_peer", {"workers": 0}),
        f"parquet_workers{workers}": ("parquet_peer", {"workers": workers}),
        "ceiling_numpy_gather": ("numpy_gather_ceiling", {}),
    }
    if have_litdata:
        table["litdata"] = ("litdata_peer", {"workers": 0})
        table[f"litdata_workers{workers}"] = ("litdata_peer", {"workers": workers})
    return table


def measure_peer(args) -> None:
    """Child process: one peer, both orders; prints its results as one JSON line."""
    function, extra = peers(args.workers, True)[args.peer]
    work = Path(args.data)
    source = {
        "ours": str(work / "mds"),
        "numpy_gather_ceiling": str(work / "mds"),
        "streaming_peer": str(work / "mds"),
        "parquet_peer": str(work / "data.parquet"),
        "litdata_peer": json.loads(args.litdata or "null"),
    }[function]
    out = {}
    for shuffle in (False, True):
        out["shuffled" if shuffle else "sequential"] = globals()[function](
            source, args.batch_size, shuffle, args.seconds, args.repeats, **extra
        )
    print("RESULT " + json.dumps(out), flush=True)


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="sparkgpu-bench-loader-", dir=args.work_dir))
    try:
        print(f"writing {args.samples:,} samples ({args.samples * ROW_BYTES / 1e6:.0f} MB) ...", flush=True)
        setup, lit = prepare(work, args.samples, args.litdata_samples)
        warm(work)
        results = {
            "setup": setup,
            "litdata": {k: v for k, v in lit.items() if k != "dir"} if lit else "not installed: its peer was skipped",
            "orders": {"sequential": {}, "shuffled": {}},
        }
        for name in peers(args.workers, lit is not None):
            if args.only and name not in args.only.split(","):
                continue
            print(f"{name}:", flush=True)
            command = [
                sys.executable,
                __file__,
                "--peer",
                name,
                "--data",
                str(work),
                "--litdata",
                json.dumps(lit),
                "--batch-size",
                str(args.batch_size),
                "--seconds",
                str(args.seconds),
                "--repeats",
                str(args.repeats),
                "--workers",
                str(args.workers),
            ]
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            print("\n".join(line for line in done.stdout.splitlines() if line.startswith("  ")), flush=True)
            if done.returncode != 0 or not lines:
                print(f"  {name} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            for order, result in json.loads(lines[-1][len("RESULT ") :]).items():
                results["orders"][order][name] = result
        for name in results["orders"]:
            results["orders"][name]["ceiling_sequential_read"] = sequential_read_ceiling(str(work / "mds"))
        if args.var_samples:
            print("variable-width columns:", flush=True)
            results["variable_width"] = variable_width(
                work, args.var_samples, args.batch_size, args.seconds, args.repeats
            )
        for order in results["orders"].values():
            order["ratios"] = ratios(order, args.workers)
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ratios(order: dict, workers: int) -> dict:
    best = order["sparkgpu"]["samples_per_s"]
    out = {
        f"sparkgpu_over_{name}": best / result["samples_per_s"]
        for name, result in order.items()
        if name != "sparkgpu" and result.get("samples_per_s")
    }
    out["targets"] = {"vs_numpy_gather_25pct": best / order["ceiling_numpy_gather"]["samples_per_s"] >= 0.25}
    if "streaming" in order:
        streaming = max(order["streaming"]["samples_per_s"], order[f"streaming_workers{workers}"]["samples_per_s"])
        out["targets"]["vs_streaming_100x"] = best / streaming >= 100
    if "sparkgpu_features" in order:
        matrix = order["sparkgpu_features"]["samples_per_s"]
        out["features_over_ceiling_numpy_gather"] = matrix / order["ceiling_numpy_gather"]["samples_per_s"]
        out["targets"]["features_vs_numpy_gather_50pct"] = out["features_over_ceiling_numpy_gather"] >= 0.5
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    for ax, (name, order) in zip(axes, results["orders"].items()):
        entries = [(k, v["samples_per_s"]) for k, v in order.items() if isinstance(v, dict) and "samples_per_s" in v]
        entries.sort(key=lambda kv: kv[1])
        colors = [
            "tab:green" if k.startswith("sparkgpu") else "tab:gray" if k.startswith("ceiling") else "tab:blue"
            for k, _ in entries
        ]
        ax.barh([k for k, _ in entries], [v for _, v in entries], color=colors)
        ax.set_xscale("log")
        ax.set_title(f"{name}: samples/s (log scale)")
        for i, (_, v) in enumerate(entries):
            ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    fig.suptitle("Loader throughput from a warm local cache (32 x float32 + int64 per sample)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--litdata-samples", type=int, default=100_000)
    parser.add_argument(
        "--var-samples", type=int, default=100_000, help="samples of the variable-width dataset (0: skip)"
    )
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one measuring window (a few seconds)")
    parser.add_argument("--repeats", type=int, default=3, help="measuring windows per peer and order")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--litdata", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated rows to run (a quick look; default: all)")
    parser.add_argument("--work-dir", default=None, help="where the temporary dataset goes (default: system temp)")
    parser.add_argument("--out", default=str(RESULTS / "loader.json"))
    args = parser.parse_args(argv)
    if args.peer:
        measure_peer(args)
        return
    facts = machine()
    results = run(args)
    from sparkgpu.data import _gather

    results["machine"] = load_seen(facts)
    results["method"] = method(
        "--repeats windows of at least --seconds after the first batch, one fresh process per peer and order",
        startup="excluded from the windows, reported apart as startup_s",
        repeats=args.repeats,
        statistic="median window (best_samples_per_s beside it)",
        workers=f"sparkgpu in-process; the peers' DataLoaders with 0 and {args.workers} workers, named per row",
    )
    config = {k: v for k, v in vars(args).items() if k not in ("peer", "data", "litdata", "out", "work_dir", "only")}
    results["config"] = config | {
        "row_bytes": ROW_BYTES,
        "native_built": _gather.native_available(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
