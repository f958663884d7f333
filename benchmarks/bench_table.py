"""Training straight from a table: sparkgpu.data.table_dataset against its peers.

Question: how fast do the rows of a Parquet/Delta table (32 float32 + 1 int64 columns) reach
the training loop as torch tensors, in order and shuffled, with no conversion step?

Peers, on the same table in the same run, one whole epoch each in a fresh process per repeat
(``--repeats`` for every peer, the peers' order alternating from repeat to repeat), in three
orders, each side doing the same work:
  * in order: sparkgpu.data.table_dataset on the Delta table (and on its Parquet files);
    pyarrow.dataset ``to_batches`` into torch; Ray Data ``read_parquet(...).iter_torch_batches``;
    the MDS path (``to_mds`` of the table, then ``sparkgpu.data.dataset``, its conversion time
    counted in its total);
  * "fragments" shuffle: ``table_dataset(shuffle="fragments")`` against pyarrow reading the
    same row groups (``split_by_row_group``) in a random order, each batch permuted: the same
    shuffle written by hand;
  * "shuffled" (rows mixed across a window of row groups): ``table_dataset(shuffle=True)``
    against pyarrow reading the row groups in a random order into windows of the same 262,144
    rows, each window permuted (``take``) and cut into batches; Ray Data with
    ``local_shuffle_buffer_size``; the MDS path shuffled.
Ceiling: a sequential read of the table's Parquet bytes (page cache warm).

Two figures per peer, taken the same way for all: start-up, from the reader's imports and construction
(``ray.init`` included for Ray, the conversion included for the MDS path) to its first batch,
and the steady rate, rows after the first batch over the time after it. An epoch of 2M rows
lasts under a second here while Ray's workers take seconds to start, so a rate with start-up
inside would mostly measure start-up; it is recorded too (``rows_per_s_including_startup``).
Ratios divide medians of the steady rate.

Results: benchmarks/results/table.json.

    python benchmarks/bench_table.py                      # 2M rows, about 5 minutes on 2 cores
    python benchmarks/bench_table.py --rows 200000        # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import load_seen, machine, method, spread

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
        write_deltalake(
            uri,
            pa.table(columns).slice(start, step),
            mode="append",
            writer_properties=WriterProperties(max_row_group_size=64 * 1024),
        )
    return uri


def parquet_files(uri: str) -> list[str]:
    return sorted(str(p) for p in Path(uri).glob("*.parquet"))


def epoch(batches, started: float) -> dict:
    """One epoch; ``started`` is when the reader's construction began (its start-up)."""
    first, rows, first_rows = None, 0, 0
    for batch in batches:
        rows += len(batch["label"])
        if first is None:
            first, first_rows = time.perf_counter() - started, rows
    seconds = time.perf_counter() - started
    return {
        "rows": rows,
        "seconds": seconds,
        "startup_s": first,
        "first_batch_s": first,
        "rows_per_s": (rows - first_rows) / max(seconds - first, 1e-9),
        "rows_per_s_including_startup": rows / seconds,
    }


# Orders: the suffix of each result key, and the peers that run in it.
ORDERS = {
    "": ("table_dataset", "table_dataset_parquet", "pyarrow_to_batches", "ray_data", "mds_with_conversion"),
    " fragments": ("table_dataset", "pyarrow_to_batches"),
    " shuffled": ("table_dataset", "table_dataset_parquet", "pyarrow_window", "ray_data", "mds_with_conversion"),
}
WINDOW = 1 << 18  # rows mixed together by the windowed shuffles (table_dataset's default)


def run_peer(name: str, uri: str, batch_size: int, order: str, work: Path) -> dict:
    import torch

    shuffle = {"": False, " fragments": "fragments", " shuffled": True}[order]
    started = time.perf_counter()
    if name == "table_dataset":
        from sparkgpu import data

        return epoch(
            data.table_dataset(uri, batch_size=batch_size, shuffle=shuffle, seed=0, rank=0, world_size=1), started
        )
    if name == "table_dataset_parquet":
        from sparkgpu import data

        folder = work / "parquet"
        if not folder.exists():
            folder.mkdir()
            for path in parquet_files(uri):
                os.link(path, folder / Path(path).name)
        return epoch(
            data.table_dataset(str(folder), batch_size=batch_size, shuffle=shuffle, seed=0, rank=0, world_size=1),
            started,
        )
    if name == "pyarrow_to_batches":
        import pyarrow.dataset as pads

        def batches():
            rng = np.random.default_rng(0)
            fragments = list(pads.dataset(parquet_files(uri), format="parquet").get_fragments())
            if shuffle:  # row groups, as table_dataset shuffles them, in a random order
                fragments = [group for fragment in fragments for group in fragment.split_by_row_group()]
                fragments = [fragments[i] for i in rng.permutation(len(fragments))]
            for fragment in fragments:
                for record in fragment.to_batches(batch_size=batch_size):
                    if shuffle:
                        record = record.take(rng.permutation(record.num_rows))
                    yield {c: torch.from_numpy(record.column(c).to_numpy()) for c in record.schema.names}

        return epoch(batches(), started)
    if name == "pyarrow_window":
        import pyarrow as pa
        import pyarrow.dataset as pads

        def batches():
            rng = np.random.default_rng(0)
            groups = [
                g
                for f in pads.dataset(parquet_files(uri), format="parquet").get_fragments()
                for g in f.split_by_row_group()
            ]
            pending, held = [], 0
            for position, index in enumerate(rng.permutation(len(groups))):
                table = groups[index].to_table()
                pending.append(table)
                held += table.num_rows
                if held < WINDOW and position < len(groups) - 1:
                    continue
                window = pa.concat_tables(pending).combine_chunks()
                window = window.take(rng.permutation(window.num_rows))
                pending, held = [], 0
                for record in window.to_batches(max_chunksize=batch_size):
                    yield {c: torch.from_numpy(record.column(c).to_numpy()) for c in record.schema.names}

        return epoch(batches(), started)
    if name == "ray_data":
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        try:
            ds = ray.data.read_parquet(parquet_files(uri))
            options = {"local_shuffle_buffer_size": 8 * batch_size, "local_shuffle_seed": 0} if shuffle else {}
            return epoch(ds.iter_torch_batches(batch_size=batch_size, **options), started)
        finally:
            ray.shutdown()
    if name == "mds_with_conversion":
        from sparkgpu import data

        out = work / f"mds-{time.time_ns()}"
        data.to_mds(uri, str(out))
        converted = time.perf_counter() - started
        result = epoch(
            data.dataset(local=str(out), batch_size=batch_size, shuffle=shuffle, seed=0, rank=0, world_size=1), started
        )
        return dict(result, conversion_s=converted)
    raise ValueError(name)


PEERS = (
    "table_dataset",
    "table_dataset_parquet",
    "pyarrow_to_batches",
    "pyarrow_window",
    "ray_data",
    "mds_with_conversion",
)


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
    parser.add_argument("--repeats", type=int, default=3, help="epochs per peer and order, each in a fresh process")
    parser.add_argument("--no-save", action="store_true", help="print the results only")
    parser.add_argument("--out", default=str(RESULTS / "table.json"))
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--order", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer:
        result = run_peer(args.peer, args.uri, args.batch_size, args.order, Path(args.work_dir))
        print(json.dumps(result))
        return
    facts = machine()  # before writing the table: that load is the benchmark's own
    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        work = Path(scratch)
        uri = prepare(work, args.rows)
        results = {
            "rows": args.rows,
            "batch_size": args.batch_size,
            "repeats": args.repeats,
            "ceiling_sequential_read": sequential_read(uri),
            "peers": {},
        }
        table_bytes = results["ceiling_sequential_read"]["bytes"]
        runs: dict[str, list[dict]] = {}
        peers = args.peers.split(",")
        for repeat in range(args.repeats):
            for order, in_order in ORDERS.items():
                chosen = [p for p in peers if p in in_order]
                for peer in chosen if repeat % 2 == 0 else chosen[::-1]:
                    command = [
                        sys.executable,
                        __file__,
                        "--peer",
                        peer,
                        "--uri",
                        uri,
                        "--batch-size",
                        str(args.batch_size),
                        "--work-dir",
                        str(work),
                    ] + ["--order", order]
                    done = subprocess.run(command, capture_output=True, text=True, check=False)
                    key = f"{peer}{order}"
                    if done.returncode != 0:
                        result = {
                            "error": done.stderr.strip().splitlines()[-1]
                            if done.stderr.strip()
                            else f"exit {done.returncode}"
                        }
                    else:
                        result = json.loads(done.stdout.strip().splitlines()[-1])
                    runs.setdefault(key, []).append(result)
                    print(
                        f"repeat {repeat} {key:36s} "
                        + (
                            f"start-up {result['startup_s']:6.2f} s, then {result['rows_per_s']:>12,.0f} rows/s"
                            if "error" not in result
                            else result["error"]
                        ),
                        flush=True,
                    )
        for key, attempts in runs.items():
            ok = [r for r in attempts if "error" not in r]
            if not ok:
                results["peers"][key] = attempts[-1]
                continue
            steady = spread([r["rows_per_s"] for r in ok], higher_is_better=True)
            startup = spread([r["startup_s"] for r in ok])
            whole = spread([r["rows_per_s_including_startup"] for r in ok], higher_is_better=True)
            results["peers"][key] = {
                "rows": ok[0]["rows"],
                "rows_per_s": steady["median"],
                "rows_per_s_spread": steady,
                "startup_s": startup["median"],
                "first_batch_s": startup["median"],
                "startup_s_spread": startup,
                "rows_per_s_including_startup": whole["median"],
                "rows_per_s_including_startup_spread": whole,
                "mb_per_s_of_parquet_steady": table_bytes * steady["median"] / ok[0]["rows"] / 1e6,
                "failed_runs": len(attempts) - len(ok),
                **(
                    {"conversion_s": spread([r["conversion_s"] for r in ok])["median"]}
                    if "conversion_s" in ok[0]
                    else {}
                ),
            }
        results["workers"] = {
            "table_dataset": "the main process (no loader workers)",
            "pyarrow_to_batches": "the main process; pyarrow's own thread pool decodes",
            "pyarrow_window": "the main process; pyarrow's own thread pool decodes",
            "ray_data": f"ray.init(num_cpus={os.cpu_count()}): Ray's default of one worker per core",
            "mds_with_conversion": "the main process",
        }
        results["method"] = method(
            "one epoch per fresh process, from the reader's construction to its last batch",
            startup="imports and construction to first batch (ray.init included for Ray, to_mds included for the MDS path), "
            "apart as startup_s; rows_per_s is the steady rate after the first batch",
            repeats=args.repeats,
            statistic="median over repeats of each figure",
            order="peers alternate order per repeat",
        )
        results["ratios"] = _ratios(results["peers"])
        results["machine"] = load_seen(facts)
    print(f"{'ceiling: sequential read':36s} {results['ceiling_sequential_read']['mb_per_s']:,.0f} MB/s of Parquet")
    for key, value in results["ratios"].items():
        print(f"  {key:60s} {value if isinstance(value, str) else f'{value:.2f}'}")
    if not args.no_save:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))


def _ratios(peers: dict) -> dict:
    out: dict[str, object] = {
        "method": "medians over repeats; steady = rows after the first batch over the time after it"
    }
    for suffix in ORDERS:
        ours = peers.get(f"table_dataset{suffix}", {})
        for peer in ("pyarrow_to_batches", "pyarrow_window", "ray_data"):
            theirs = peers.get(f"{peer}{suffix}", {})
            if "rows_per_s" in ours and "rows_per_s" in theirs:
                out[f"table_dataset / {peer}{suffix}, steady"] = ours["rows_per_s"] / theirs["rows_per_s"]
                out[f"table_dataset / {peer}{suffix}, start-up counted"] = (
                    ours["rows_per_s_including_startup"] / theirs["rows_per_s_including_startup"]
                )
                out[f"{peer} / table_dataset{suffix}, start-up"] = theirs["startup_s"] / ours["startup_s"]
    return out


if __name__ == "__main__":
    main()
