"""The table and files datasets on a real S3-protocol server (moto on loopback).

Credentials and the endpoint reach the readers only through the usual ``AWS_*`` variables,
as they reach ranks and executors in a job.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pyarrow.parquet as pq
import pytest

from sparkgpu import data
from tests.unit.test_data_table import clicks, dv_table, ids_of

pytestmark = pytest.mark.integration


def _upload(folder, url: str) -> None:
    import fsspec

    fs = fsspec.filesystem("s3")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fs.pipe(f"{url[len('s3://') :]}/{path.relative_to(folder).as_posix()}", path.read_bytes())


def test_delta_table_with_deletion_vectors_on_s3_reads_the_surviving_rows_and_resumes(
    s3_bucket, tmp_path, monkeypatch, caplog
):
    import fsspec

    secret = "sentinel-secret-8d1f0c"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)  # the server takes any secret; it must never be written down
    caplog.set_level(logging.DEBUG)
    uri, gone = dv_table(tmp_path)  # storageType "u": the vectors are files inside the table folder
    table_url = f"{s3_bucket}/lake/clicks"
    _upload(tmp_path / "clicks", table_url)
    shutil.rmtree(uri)  # the table, its log and its deletion vectors now exist only on S3
    vectors = fsspec.filesystem("s3").glob(f"{table_url[len('s3://') :]}/*/deletion_vector_*.bin")
    assert len(vectors) == 3, "one vector per day's file, uploaded with the table"
    survivors = sorted(i for i in range(600) if i not in gone and i >= 20)
    cache = tmp_path / "cache"

    def open_(rank=0, world_size=1):
        return data.table_dataset(
            table_url,
            columns=["id", "x"],
            filter="id >= 20",
            batch_size=16,
            shuffle=True,
            seed=3,
            shuffle_block_size=100,
            local=str(cache),
            rank=rank,
            world_size=world_size,
        )

    everything = ids_of(open_())
    assert sorted(everything) == survivors
    assert {p.name for p in cache.rglob("*.parquet")} == {
        os.path.basename(p) for p in fsspec.filesystem("s3").glob(f"{table_url[len('s3://') :]}/*/*.parquet")
    }  # landed in the cache
    halves = [ids_of(open_(rank, 2)) for rank in range(2)]
    assert not set(halves[0]) & set(halves[1]) and len(halves[0]) == len(halves[1])
    # Resume: the rest of the epoch, exactly.
    first = open_()
    iterator = iter(first)
    head = [i for _ in range(5) for i in next(iterator)["id"].tolist()]
    again = open_()
    again.load_state_dict(first.state_dict())
    rest = [i for batch in again for i in batch["id"].tolist()]
    assert head + rest == everything
    written = [p.read_bytes() for p in cache.rglob("*") if p.is_file()]
    assert not any(secret.encode() in raw for raw in written)
    assert secret not in caplog.text and secret not in json.dumps(again.state_dict()) + str(again.identity)


def test_parquet_folder_on_s3(s3_bucket, tmp_path):
    folder = tmp_path / "events"
    for part in range(3):
        (folder / f"day={part}").mkdir(parents=True)
        pq.write_table(
            clicks(100, start=100 * part).drop(["day"]), folder / f"day={part}" / "part-0.parquet", row_group_size=30
        )
    _upload(folder, f"{s3_bucket}/events")
    ds = data.table_dataset(
        f"{s3_bucket}/events",
        filter="day >= 1 AND id < 250",
        batch_size=32,
        local=str(tmp_path / "cache"),
        rank=0,
        world_size=1,
    )
    batches = list(ds)
    assert sorted(i for b in batches for i in b["id"].tolist()) == list(range(100, 250))
    assert batches[0]["emb"].shape[1:] == (2,) and batches[0]["x"].dtype == __import__("torch").float32
    assert len(list((tmp_path / "cache").rglob("*.parquet"))) == 2  # day=0 pruned before any download


def test_files_dataset_over_an_s3_prefix_with_a_glob_resumes_exactly(s3_bucket, tmp_path):
    folder = tmp_path / "images"
    for i in range(17):
        (folder / f"class{i % 3}").mkdir(parents=True, exist_ok=True)
        (folder / f"class{i % 3}" / f"img{i:02d}.jpg").write_bytes(f"image {i}".encode())
    (folder / "labels.csv").write_text("not an image")
    _upload(folder, f"{s3_bucket}/vol/images")
    cache = tmp_path / "cache"

    def open_():
        return data.files_dataset(
            f"{s3_bucket}/vol/images",
            "**/*.jpg",
            shuffle=True,
            seed=2,
            as_bytes=True,
            local=cache,
            rank=0,
            world_size=1,
        )

    everything = list(open_())
    assert sorted(everything) == sorted((f"class{i % 3}/img{i:02d}.jpg", f"image {i}".encode()) for i in range(17))
    assert len(list(cache.rglob("*.jpg"))) == 17
    first = open_()
    iterator = iter(first)
    head = [next(iterator) for _ in range(6)]
    again = open_()
    again.load_state_dict(first.state_dict())
    assert head + list(again) == everything


def _rank_reads_the_s3_table(url: str, cache: str) -> list[int]:
    from sparkgpu import data

    rows = data.table_dataset(url, columns=["id"], filter="id >= 20", batch_size=8, shuffle=True, seed=1, local=cache)
    return [i for batch in rows for i in batch["id"].tolist()]


def test_a_2_rank_job_reads_an_s3_table_with_credentials_from_its_environment_only(s3_bucket, monkeypatch, tmp_path):
    from sparkgpu import distributed
    from sparkgpu.config import settings

    sentinel = "sentinel-aws-secret-7c2a41"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", sentinel)  # the server takes any secret; ranks inherit it
    uri, gone = dv_table(tmp_path)
    _upload(tmp_path / "clicks", f"{s3_bucket}/clicks")
    shutil.rmtree(uri)  # the ranks find the table and its deletion vectors on S3 only
    job = distributed(gpus=2, gpu_type="cpu")(_rank_reads_the_s3_table)
    parts = job.distributed(f"{s3_bucket}/clicks", str(tmp_path / "cache"))
    survivors = {i for i in range(600) if i not in gone and i >= 20}
    assert len(parts[0]) == len(parts[1]) and not set(parts[0]) & set(parts[1])
    assert set(parts[0]) | set(parts[1]) <= survivors and len(survivors) - 2 * len(parts[0]) == len(survivors) % 2
    run_dir = settings().staging_root / job.last_job_id
    leaked = [
        str(path)
        for home in (run_dir, tmp_path)
        for path in home.rglob("*")
        if path.is_file() and sentinel.encode() in path.read_bytes()
    ]
    assert not leaked, f"the AWS secret was written to {leaked}"


def test_loader_workers_forked_after_the_parent_read_s3_fetch_their_files_instead_of_hanging(s3_bucket, tmp_path):
    """obstore's runtime does not survive fork(): workers forked after the parent's first read used
    to wait forever on their first download. They read through fsspec instead, in bounded time."""
    import torch

    from sparkgpu.data.storage import _object_store

    folder = tmp_path / "images"
    for i in range(12):
        (folder / f"class{i % 2}").mkdir(parents=True, exist_ok=True)
        (folder / f"class{i % 2}" / f"img{i:02d}.jpg").write_bytes(f"image {i}".encode())
    _upload(folder, f"{s3_bucket}/vol/images")
    _, gone = dv_table(tmp_path)
    _upload(tmp_path / "clicks", f"{s3_bucket}/lake/clicks")

    warm = data.files_dataset(
        f"{s3_bucket}/vol/images", "**/*.jpg", as_bytes=True, local=tmp_path / "warm", rank=0, world_size=1
    )
    assert len(list(warm)) == 12  # the parent's own reads start obstore's runtime here
    assert _object_store._runtime_pid == os.getpid()

    files = data.files_dataset(
        f"{s3_bucket}/vol/images", "**/*.jpg", as_bytes=True, local=tmp_path / "cold", rank=0, world_size=1
    )
    loader = torch.utils.data.DataLoader(
        files, batch_size=None, num_workers=2, timeout=60, multiprocessing_context="fork"
    )
    assert sorted(map(tuple, loader)) == sorted(
        (f"class{i % 2}/img{i:02d}.jpg", f"image {i}".encode()) for i in range(12)
    )

    rows = data.table_dataset(
        f"{s3_bucket}/lake/clicks", columns=["id"], batch_size=50, local=str(tmp_path / "rows"), rank=0, world_size=1
    )
    read = [
        i
        for batch in rows.loader(num_workers=2, timeout=60, multiprocessing_context="fork")
        for i in batch["id"].tolist()
    ]
    assert len(read) == len(set(read)) and set(read) <= {i for i in range(600) if i not in gone}
    assert len(read) >= 600 - len(gone) - 50  # the remainder rule leaves out at most one batch's rows
