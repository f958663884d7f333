"""Training straight from a table: sparkgpu.data.table_dataset against its peers.

Question: how fast do the rows of a Parquet/Delta table (32 float32 + 1 int64 columns) reach
the training loop as torch tensors, in order and shuffled, with no conversion step?

Peers, on the same table in the same run, each in a fresh process, one whole epoch each:
  * sparkgpu.data.table_dataset on the Delta table (and on its Parquet files);
  * pyarrow.dataset ``to_batches`` into torch (shuffled: fragments in random order, rows
    permuted within each batch — a weaker shuffle than ours);
  * Ray Data ``read_parquet(...).iter_torch_batches`` (shuffled: ``local_shuffle_buffer_size``);
  * the MDS path: ``to_mds`` of the table, then ``sparkgpu.data.dataset``, its conversion time
    counted in its total.
Ceiling: a sequential read of the table's Parquet bytes (page cache warm).

Results: benchmarks/results/table.json.

    python benchmarks/bench_table.py                      # 2M rows
    python benchmarks/bench_table.py --rows 200000        # a quick look
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

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
FEATURES = 32


def prepare(work: Path, rows: int) -> str:
    import pyarrow as pa
    from deltalake import WriterProperties, write_deltalake

    rng = np.random.default_rng(0)
    columns = {f"f{i:02d}": pa.array(rng.random(rows, dtype=np.float32)) for i in range(FEATURES)}
    columns["label"] = pa.array(np.arange(rows, dtype=np.int64))
    uri = str(work / "delta")
    # About 64k rows per row group and 8 row groups per file, as Spark writes them.
    step = 512 * 1024
    for start in range(0, rows, step):
        write_deltalake(uri, pa.table(columns).slice(start, step), mode="append",
                        writer_properties=WriterProperties(max_row_group_size=64 * 1024))
    return uri


def parquet_files(uri: str) -> list[str]:
    return sorted(str(p) for p in Path(uri).glob("*.parquet"))


def epoch(batches) -> dict:
    started = time.perf_counter()
    first, rows = None, 0
    for batch in batches:
        if first is None:
            first = time.perf_counter() - started
        rows += len(batch["label"])
    seconds = time.perf_counter() - started
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "first_batch_s": first}


def run_peer(name: str, uri: str, batch_size: int, shuffle: bool, work: Path) -> dict:
    import torch

    if name == "table_dataset":
        from sparkgpu import data

        return epoch(data.table_dataset(uri, batch_size=batch_size, shuffle=shuffle, seed=0, rank=0, world_size=1))
    if name == "table_dataset_parquet":
        from sparkgpu import data

        folder = work / "parquet"
        if not folder.exists():
            folder.mkdir()
            for path in parquet_files(uri):
                os.link(path, folder / Path(path).name)
        return epoch(data.table_dataset(str(folder), batch_size=batch_size, shuffle=shuffle, seed=0, rank=0, world_size=1))
    if name == "pyarrow_to_batches":
        import pyarrow.dataset as pads

        def batches():
            rng = np.random.default_rng(0)
            fragments = list(pads.dataset(parquet_files(uri), format="parquet").get_fragments())
            if shuffle:
                fragments = [fragments[i] for i in rng.permutation(len(fragments))]
            for fragment in fragments:
                for record in fragment.to_batches(batch_size=batch_size):
                    order = rng.permutation(record.num_rows) if shuffle else None
                    if order is not None:
                        record = record.take(order)
                    yield {c: torch.from_numpy(record.column(c).to_numpy()) for c in record.schema.names}

        return epoch(batches())
    if name == "ray_data":
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        try:
            ds = ray.data.read_parquet(parquet_files(uri))
            options = {"local_shuffle_buffer_size": 8 * batch_size, "local_shuffle_seed": 0} if shuffle else {}
            return epoch(ds.iter_torch_batches(batch_size=batch_size, **options))
        finally:
            ray.shutdown()
    if name == "mds_with_conversion":
        from sparkgpu import data

        started = time.perf_counter()
        out = work / f"mds-{time.time_ns()}"
        data.to_mds(uri, str(out))
        converted = time.perf_counter() - started
        result = epoch(data.dataset(local=str(out), batch_size=batch_size, shuffle=shuffle, seed=0, rank=0, world_size=1))
        total = converted + result["seconds"]
        return dict(result, conversion_s=converted, seconds=total, rows_per_s=result["rows"] / total,
                    epoch_only_rows_per_s=result["rows_per_s"])
    raise ValueError(name)


PEERS = ("table_dataset", "table_dataset_parquet", "pyarrow_to_batches", "ray_data", "mds_with_conversion")


def sequential_read(uri: str) -> dict:
    paths = parquet_files(uri)
    total = sum(os.path.getsize(p) for p in paths)
    for p in paths:  # warm the page cache as every peer's second read would be
        Path(p).read_bytes()
    started = time.perf_counter()
    for p in paths:
        with open(p, "rb") as handle:
            while handle.read(8 << 20):
                pass
    seconds = time.perf_counter() - started
    return {"bytes": total, "seconds": seconds, "mb_per_s": total / seconds / 1e6}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--no-save", action="store_true", help="print the results only")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--shuffle", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer:
        result = run_peer(args.peer, args.uri, args.batch_size, args.shuffle, Path(args.work_dir))
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        work = Path(scratch)
        uri = prepare(work, args.rows)
        results = {"rows": args.rows, "batch_size": args.batch_size, "machine": platform.node(), "cpus": os.cpu_count(),
                   "ceiling_sequential_read": sequential_read(uri), "peers": {}}
        table_bytes = results["ceiling_sequential_read"]["bytes"]
        for shuffle in (False, True):
            for peer in args.peers.split(","):
                command = [sys.executable, __file__, "--peer", peer, "--uri", uri, "--batch-size", str(args.batch_size),
                           "--work-dir", str(work)] + (["--shuffle"] if shuffle else [])
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    result = {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
                else:
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    result["mb_per_s_of_parquet"] = table_bytes / result["seconds"] / 1e6
                key = f"{peer}{' shuffled' if shuffle else ''}"
                results["peers"][key] = result
                print(f"{key:36s} " + (f"{result['rows_per_s']:>12,.0f} rows/s  {result['seconds']:6.2f} s"
                                       if "error" not in result else result["error"]), flush=True)
    print(f"{'ceiling: sequential read':36s} {results['ceiling_sequential_read']['mb_per_s']:,.0f} MB/s of Parquet")
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "table.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
