"""``sparkgpu data convert|bench`` and ``sparkgpu cache ls|clear``."""

from __future__ import annotations

import contextlib
import dataclasses
import json

__all__ = ["register_data", "register_cache"]


def register_data(subparsers) -> None:
    p = subparsers.add_parser("data", help="convert data to MDS shards; measure a volume against the local cache")
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    convert = sub.add_parser("convert", help="convert a Delta table or Parquet files into MDS shards")
    convert.add_argument("source", help="path or URL of a Delta table or of Parquet files")
    convert.add_argument("out", help="output folder: a local path or any fsspec URL")
    convert.add_argument("--version", type=int, help="Delta table version to read (default: latest)")
    convert.add_argument("--columns", help="comma-separated columns to keep (default: all)")
    convert.add_argument("--compression", help="e.g. zstd, zstd:7 (default: none)")
    convert.add_argument("--hashes", help="comma-separated shard hashes, e.g. sha1,xxh64")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing dataset in OUT")
    convert.set_defaults(handler=cmd_convert)
    bench = sub.add_parser("bench", help="epoch 1 from the volume vs epoch 2 from the local cache, with a plot")
    bench.add_argument("remote", help="volume URL of an MDS dataset (with --table: of a Delta table or Parquet folder)")
    bench.add_argument(
        "--table",
        action="store_true",
        help="read REMOTE with data.table_dataset (a Delta table or Parquet folder) instead of as MDS",
    )
    bench.add_argument("--columns", help="with --table: comma-separated columns to read (default: all)")
    bench.add_argument("--filter", help="with --table: rows to keep, a SQL predicate (\"day >= '2026-11-01'\")")
    bench.add_argument("--local", help="folder for the temporary cache (default SPARKGPU_CACHE_DIR)")
    bench.add_argument("--batch-size", type=int, default=1024)
    bench.add_argument("--shuffle", action="store_true")
    bench.add_argument(
        "--profile",
        choices=("loopback", "s3-like"),
        default="loopback",
        help="s3-like: read a local dataset folder through a simulated object-store link "
        "(30 ms to the first byte, 100 MB/s per connection; with --table, an S3 server on "
        "loopback, which needs moto[server])",
    )
    bench.add_argument("--plot", help="write the report as a PNG here")
    bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    bench.set_defaults(handler=cmd_bench)


def cmd_convert(args) -> int:
    from sparkgpu.data.convert.conversion import to_mds

    result = to_mds(
        args.source,
        args.out,
        version=args.version,
        columns=args.columns.split(",") if args.columns else None,
        compression=args.compression,
        hashes=tuple(args.hashes.split(",")) if args.hashes else None,
        overwrite=args.overwrite,
        progress=True,
    )
    print(
        f"wrote {result.samples} samples in {result.shards} shards ({result.bytes / 1e6:.1f} MB) "
        f"to {result.url} in {result.seconds:.1f}s"
    )
    return 0


def cmd_bench(args) -> int:
    from sparkgpu.errors import ConfigurationError

    if not args.table and (args.columns or args.filter):
        raise ConfigurationError("--columns and --filter apply to a table: add --table")
    if args.table:
        from sparkgpu.testing.simulated_s3 import simulated_s3
        from sparkgpu.data.report import table_report

        link = (
            simulated_s3(args.remote, args.profile)
            if args.profile != "loopback"
            else contextlib.nullcontext(args.remote)
        )
        with link as remote:
            figures = table_report(
                remote,
                columns=args.columns.split(",") if args.columns else None,
                filter=args.filter,
                local=args.local,
                batch_size=args.batch_size,
                shuffle=args.shuffle,
                png=args.plot,
            )
    else:
        from sparkgpu.testing.simulated_link import simulated_link
        from sparkgpu.data.report import volume_report

        with simulated_link(args.remote, args.profile) as remote:
            figures = volume_report(
                remote, local=args.local, batch_size=args.batch_size, shuffle=args.shuffle, png=args.plot
            )
    figures["profile"] = args.profile
    if args.json:
        print(json.dumps(figures, indent=2, default=str))
        return 0
    from rich.table import Table

    from sparkgpu.cli import console
    from sparkgpu.data.report import REPORT_COLUMNS, report_rows

    unit = "files" if figures["kind"] == "table" else "shards"
    table = Table(
        title=f"{figures['remote']}: {figures['samples']:,} samples, {figures['volume_bytes'] / 1e6:,.1f} MB "
        f"in {figures['shards']} {unit}"
    )
    for number, name in enumerate(REPORT_COLUMNS):
        table.add_column(name, justify="left" if number == 0 else "right")
    for row in report_rows(figures):
        table.add_row(*row)
    console().print(table)
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def register_cache(subparsers) -> None:
    p = subparsers.add_parser("cache", help="list or clear the local shard cache")
    p.add_argument("action", choices=("ls", "clear"))
    p.add_argument("--remote", help="with clear: only the entry caching this volume URL")
    p.add_argument("--dir", help="cache root (default SPARKGPU_CACHE_DIR)")
    p.add_argument("--json", action="store_true", help="with ls: one JSON object per entry")
    p.set_defaults(handler=cmd_cache)


def cmd_cache(args) -> int:
    from sparkgpu.data.storage.cache import cache_entries, clear_cache

    if args.action == "clear":
        freed = clear_cache(args.dir, remote=args.remote)
        print(f"freed {freed / 1e6:.1f} MB")
        return 0
    entries = cache_entries(args.dir)
    if args.json:
        for e in entries:
            print(json.dumps({**dataclasses.asdict(e), "path": str(e.path)}))
        return 0
    if not entries:
        print("the cache is empty")
        return 0
    from rich.table import Table

    from sparkgpu.cli import console

    table = Table(title="sparkgpu cache")
    for name in ("volume", "shards", "cached MB", "total MB", "folder"):
        table.add_column(name)
    for e in entries:
        table.add_row(
            e.remote,
            f"{e.shards_cached}/{e.shards_total}",
            f"{e.bytes_cached / 1e6:.1f}",
            f"{e.bytes_total / 1e6:.1f}",
            str(e.path),
        )
    console().print(table)
    return 0
