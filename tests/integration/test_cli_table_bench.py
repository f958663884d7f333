"""`sparkgpu data bench --table`: the table dataset against a raw download, on S3 and a simulated S3 link."""

import json
import os
import re

import pytest

from sparkgpu.cli import main
from tests.integration.test_data_s3 import _upload
from tests.unit.test_data_table import dv_table

pytestmark = pytest.mark.integration


def test_bench_table_on_s3_prints_raw_epoch1_epoch2(s3_bucket, tmp_path, capsys):
    _, gone = dv_table(tmp_path)
    _upload(tmp_path / "clicks", f"{s3_bucket}/clicks")
    argv = [
        "data",
        "bench",
        f"{s3_bucket}/clicks",
        "--table",
        "--columns",
        "id,x",
        "--filter",
        "id >= 20",
        "--batch-size",
        "64",
        "--local",
        str(tmp_path / "cache"),
    ]
    assert main([*argv, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["kind"] == "table" and figures["shards"] == 3  # one data file per day partition
    assert figures["samples"] == figures["epoch1_from_volume"]["samples"] == figures["epoch2_from_cache"]["samples"]
    assert figures["samples"] == len([i for i in range(600) if i not in gone and i >= 20])
    assert figures["volume_bytes"] == sum(p.stat().st_size for p in (tmp_path / "clicks").rglob("*.parquet"))
    assert not any((tmp_path / "cache").iterdir())  # the temporary cache is gone
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("in 3 files" in line for line in lines)
    rows = {name: next(line for line in lines if name in line) for name in ("raw download", "epoch 1", "epoch 2")}
    assert rows["raw download"].rstrip(" │|").endswith("100%")
    assert all(re.search(r"\d\.\d\d s .*\d%", rows[name]) for name in ("epoch 1", "epoch 2"))


def test_bench_table_reads_a_local_table_through_a_simulated_s3_link(tmp_path, capsys):
    _, gone = dv_table(tmp_path)
    before = {key: os.environ.get(key) for key in ("AWS_ENDPOINT_URL", "AWS_SECRET_ACCESS_KEY")}
    assert main(["data", "bench", str(tmp_path / "clicks"), "--table", "--profile", "s3-like", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["remote"].startswith("s3://") and figures["profile"] == "s3-like"
    assert figures["samples"] == 600 - len(gone)
    # 30 ms before each request: no file of the table arrives sooner.
    assert figures["epoch1_from_volume"]["first_batch_s"] > 0.03
    assert {key: os.environ.get(key) for key in before} == before  # the bench's endpoint and credentials are gone


def test_bench_table_of_a_local_table_without_a_profile_says_what_to_do(tmp_path, capsys):
    dv_table(tmp_path)
    assert main(["data", "bench", str(tmp_path / "clicks"), "--table"]) != 0
    assert re.search("local table, read where it is.*--profile s3-like", capsys.readouterr().err)
    assert main(["data", "bench", str(tmp_path / "clicks"), "--filter", "id > 3"]) != 0
    assert "add --table" in capsys.readouterr().err
