"""Training straight from a table: sparkgpu.data.table_dataset against its peers.

Question: how fast do the rows of a Parquet/Delta table (32 float32 + 1 int64 columns) reach
the training loop as torch tensors, in order and shuffled, with no conversion step?

Peers, on the same table in the same run, each in a fresh process per repeat (``--repeats``
for every peer, the peers' order alternating from repeat to repeat) reading ``--epochs`` whole
epochs in one timed window (an epoch of 2M rows lasts a fraction of a second; a window of
several seconds is what can be measured), in three orders, each side doing the same work:
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
and the steady rate, rows after the first batch over the time after it, through every epoch
of the window (what a reader does at each epoch's start is inside it). Ray's workers take
seconds to start, so a rate with start-up inside would mostly measure start-up; it is recorded
too (``rows_per_s_including_startup``). For ``table_dataset`` and the pyarrow ``to_batches`` code,
start-up is also marked where the reader's imports end (``imported_s``) and where its
construction ends (``opened_s``), in seconds from the same clock.
Ratios divide medians of the steady rate. Beside both, the seconds of full garbage collections
inside the epoch (``full_gc_s``, and after the first batch): such a pause falls on whichever
reader makes the objects that cross the interpreter's threshold. Every peer's window starts from
a collected heap (``gc.collect()`` after ``import torch``, before the clock starts): where the
interpreter's counters stood after torch's import would otherwise decide which reader pays for a
collection of torch's objects (one did in every ``table_dataset`` run and in no pyarrow run, for
the ~2,000 objects its imports add to pyarrow's 39,000).

Results: benchmarks/results/table.json.

    python benchmarks/bench_table.py                      # 2M rows, 15 epochs a window, about 15 minutes on 2 cores
    python benchmarks/bench_table.py --rows 200000 --epochs 2 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import cpu_mark, load_seen, machine, method, other_cpu_share, spread

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


class FullCollections:
    """The interpreter's full (generation 2) garbage collections and when they ran.

    One of these walks every object the process holds, torch's and pandas' included (about
    0.1 s here), and runs once enough objects have been made since the last: whichever reader
    makes the objects that cross the threshold pays for it, in start-up or in the steady rate.
    Every epoch records its own, so a difference between readers can be told from a pause.
    """

    def __init__(self):
        import gc

        self.runs: list[tuple[float, float]] = []  # (start, seconds) of each full collection
        self._began = 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.runs.append((self._began, time.perf_counter() - self._began))

    def seconds(self, after: float = 0.0) -> float:
        return sum(took for began, took in self.runs if began >= after)


def epochs(
    batches_of_epoch, count: int, started: float, collections: FullCollections, marks: dict[str, float] | None = None
) -> dict:
    """``count`` epochs in one timed window; ``started`` is when the reader's construction began.

    ``batches_of_epoch()`` gives one epoch's batches; it is called once per epoch, so whatever a
    reader does at the start of each epoch (an order to work out, files to list) is in the
    steady rate of every epoch after the first.
    """
    first, rows, first_rows = None, 0, 0
    for _ in range(count):
        for batch in batches_of_epoch():
            rows += len(batch["label"])
            if first is None:
                first, first_rows = time.perf_counter() - started, rows
    seconds = time.perf_counter() - started
    return {
        "rows": rows,
        "epochs": count,
        "seconds": seconds,
        "startup_s": first,
        "first_batch_s": first,
        "rows_per_s": (rows - first_rows) / max(seconds - first, 1e-9),
        "steady_window_s": seconds - first,
        "rows_per_s_including_startup": rows / seconds,
        "full_gc_s": collections.seconds(started),
        "full_gc_after_first_batch_s": collections.seconds(started + first) if first is not None else 0.0,
        # Where start-up goes, for the readers that mark it: seconds from the clock's start to the
        # end of the reader's imports and to the end of its construction; the first batch after.
        **({name: at - started for name, at in marks.items()} if marks else {}),
    }


# Orders: the suffix of each result key, and the peers that run in it.
ORDERS = {
    "": ("table_dataset", "table_dataset_parquet", "pyarrow_to_batches", "ray_data", "mds_with_conversion"),
    " fragments": ("table_dataset", "pyarrow_to_batches"),
    " shuffled": ("table_dataset", "table_dataset_parquet", "pyarrow_window", "ray_data", "mds_with_conversion"),
}
WINDOW = 1 << 18  # rows mixed together by the windowed shuffles (table_dataset's default)


def run_peer(name: str, uri: str, batch_size: int, order: str, work: Path, count: int) -> dict:
    import torch

    shuffle = {"": False, " fragments": "fragments", " shuffled": True}[order]
    gc.collect()  # every reader starts from the same collected heap (see the module's notes)
    collections = FullCollections()
    started = time.perf_counter()
    if name in ("table_dataset", "table_dataset_parquet"):
        import sparkgpu.data.loaders.table  # noqa: F401  (what data.table_dataset imports on first use)
        from sparkgpu import data

        marks = {"imported_s": time.perf_counter()}
        source = uri
        if name == "table_dataset_parquet":
            folder = work / "parquet"
            if not folder.exists():
                folder.mkdir()
                for path in parquet_files(uri):
                    os.link(path, folder / Path(path).name)
            source = str(folder)
        rows = data.table_dataset(source, batch_size=batch_size, shuffle=shuffle, seed=0, rank=0, world_size=1)
        marks["opened_s"] = time.perf_counter()
        return epochs(lambda: rows, count, started, collections, marks)  # each iteration reads the next epoch
    if name == "pyarrow_to_batches":
        import pyarrow.dataset as pads

        marks = {"imported_s": time.perf_counter()}
        rng = np.random.default_rng(0)
        fragments = list(pads.dataset(parquet_files(uri), format="parquet").get_fragments())
        if shuffle:  # row groups, as table_dataset shuffles them
            fragments = [group for fragment in fragments for group in fragment.split_by_row_group()]
        marks["opened_s"] = time.perf_counter()

        def batches():
            chosen = [fragments[i] for i in rng.permutation(len(fragments))] if shuffle else fragments
            for fragment in chosen:
                for record in fragment.to_batches(batch_size=batch_size):
                    if shuffle:
                        record = record.take(rng.permutation(record.num_rows))
                    yield {c: torch.from_numpy(record.column(c).to_numpy()) for c in record.schema.names}

        return epochs(batches, count, started, collections, marks)
    if name == "pyarrow_window":
        import pyarrow as pa
        import pyarrow.dataset as pads

        rng = np.random.default_rng(0)
        groups = [
            g
            for f in pads.dataset(parquet_files(uri), format="parquet").get_fragments()
            for g in f.split_by_row_group()
        ]

        def batches():
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

        return epochs(batches, count, started, collections)
    if name == "ray_data":
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        try:
            ds = ray.data.read_parquet(parquet_files(uri))
            options = {"local_shuffle_buffer_size": 8 * batch_size, "local_shuffle_seed": 0} if shuffle else {}
            return epochs(lambda: ds.iter_torch_batches(batch_size=batch_size, **options), count, started, collections)
        finally:
            ray.shutdown()
    if name == "mds_with_conversion":
        from sparkgpu import data

        out = work / f"mds-{time.time_ns()}"
        data.to_mds(uri, str(out))
        converted = time.perf_counter() - started
        loader = data.dataset(local=str(out), batch_size=batch_size, shuffle=shuffle, seed=0, rank=0, world_size=1)
        return dict(epochs(lambda: loader, count, started, collections), conversion_s=converted)
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
    parser.add_argument("--repeats", type=int, default=5, help="windows per peer and order, each in a fresh process")
    parser.add_argument(
        "--epochs", type=int, default=15, help="epochs in each timed window (a window of seconds, not milliseconds)"
    )
    parser.add_argument("--no-save", action="store_true", help="print the results only")
    parser.add_argument("--out", default=str(RESULTS / "table.json"))
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--order", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer:
        result = run_peer(args.peer, args.uri, args.batch_size, args.order, Path(args.work_dir), args.epochs)
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
            "epochs_per_window": args.epochs,
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
                        "--epochs",
                        str(args.epochs),
                    ] + ["--order", order]
                    mark = cpu_mark()
                    done = subprocess.run(command, capture_output=True, text=True, check=False)
                    other = other_cpu_share(mark)
                    key = f"{peer}{order}"
                    if done.returncode != 0:
                        result = {
                            "error": done.stderr.strip().splitlines()[-1]
                            if done.stderr.strip()
                            else f"exit {done.returncode}"
                        }
                    else:
                        result = json.loads(done.stdout.strip().splitlines()[-1])
                        result["other_cpu_share"] = other
                    runs.setdefault(key, []).append(result)
                    print(
                        f"repeat {repeat} {key:36s} "
                        + (
                            f"start-up {result['startup_s']:6.2f} s, then {result['rows_per_s']:>12,.0f} rows/s"
                            f" (full collections {result['full_gc_s']:.2f} s, {result['full_gc_after_first_batch_s']:.2f} s after the first batch)"
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
                "full_gc_s": spread([r.get("full_gc_s", 0.0) for r in ok])["median"],
                "full_gc_s_per_run": [r.get("full_gc_s", 0.0) for r in ok],
                "full_gc_after_first_batch_s_per_run": [r.get("full_gc_after_first_batch_s", 0.0) for r in ok],
                "other_cpu_share_per_run": [r.get("other_cpu_share") for r in ok],
                "failed_runs": len(attempts) - len(ok),
                **{
                    phase: spread([r[phase] for r in ok])["median"]
                    for phase in ("imported_s", "opened_s")
                    if all(phase in r for r in ok)
                },
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
            f"{args.epochs} epochs per fresh process in one window, from the reader's construction to its last batch",
            startup="imports and construction to first batch (ray.init included for Ray, to_mds included for the MDS path), "
            "apart as startup_s; rows_per_s is the steady rate after the first batch, over every epoch (each epoch's "
            "own start included)",
            repeats=args.repeats,
            statistic="median over repeats of each figure",
            order="peers alternate order per repeat",
        )
        results["ratios"] = _ratios(results["peers"])
        results["machine"] = load_seen(facts)
        # Ray's workers outlive the peer's process and count as other processes' CPU; every other
        # peer's window tells whether another job ran (the most any of them saw).
        outside = [
            r["other_cpu_share"]
            for key, attempts in runs.items()
            if not key.startswith("ray_data")
            for r in attempts
            if r.get("other_cpu_share") is not None
        ]
        if outside:
            results["machine"]["other_cpu_share_max_outside_ray"] = round(max(outside), 3)
            results["machine"]["other_load_seen"] = results["machine"]["other_load_at_start"] or max(outside) > 0.1
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
