"""`sparkgpu data convert|bench` and `sparkgpu cache ls|clear` on real files."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkgpu.cli import main

pytestmark = pytest.mark.integration


def test_convert_then_bench_then_cache(tmp_path, capsys):
    table = pa.table({"x": np.arange(5000, dtype=np.float32), "label": np.arange(5000, dtype=np.int64)})
    (tmp_path / "pq").mkdir()
    pq.write_table(table, tmp_path / "pq" / "part-0.parquet")
    out = tmp_path / "mds"

    assert main(["data", "convert", str(tmp_path / "pq"), str(out), "--hashes", "sha1"]) == 0
    assert "wrote 5000 samples" in capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())
    assert sum(s["samples"] for s in index["shards"]) == 5000

    assert main(["data", "bench", str(out), "--json", "--plot", str(tmp_path / "volume.png")]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) >= {"raw_parallel_download", "epoch1_from_volume", "epoch2_from_cache", "epoch1_vs_raw"}
    assert figures["epoch1_vs_raw"] > 0
    assert (tmp_path / "volume.png").stat().st_size > 0

    assert main(["data", "bench", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "MB/s" in line)
    assert all(column in header for column in ("samples/s", "first batch", "% of raw"))
    rows = {name: next(line for line in lines if name in line) for name in ("raw download", "epoch 1", "epoch 2")}
    assert rows["raw download"].rstrip(" │|").endswith("100%")  # the yardstick of the other rows
    assert all(re.search(r"\d\.\d\d s .*\d%", rows[name]) for name in ("epoch 1", "epoch 2"))  # first batch, % of raw
    assert "{'" not in "\n".join(lines), "a table, not a dump of dicts"

    from sparkgpu import data

    for _ in data.dataset(remote=str(out), batch_size=1000):
        pass
    assert main(["cache", "ls", "--json"]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["remote"], e["shards_cached"] == e["shards_total"]) for e in entries] == [(str(out), True)]
    assert main(["cache", "clear"]) == 0
    assert "freed" in capsys.readouterr().out
    assert main(["cache", "ls"]) == 0
    assert "the cache is empty" in capsys.readouterr().out


def test_bench_reads_a_local_dataset_through_a_simulated_s3_like_link(tmp_path, capsys):
    from sparkgpu import data

    data.to_mds(pa.table({"x": np.arange(20_000, dtype=np.float32)}), str(tmp_path / "mds"), progress=False)
    assert main(["data", "bench", str(tmp_path / "mds"), "--profile", "s3-like", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["profile"] == "s3-like" and figures["remote"].startswith("http://127.0.0.1:")
    assert figures["epoch1_from_volume"]["samples"] == 20_000
    # Every request waits 30 ms for its first byte: the first batch cannot come sooner.
    assert figures["epoch1_from_volume"]["first_batch_s"] >= 0.03

    assert main(["data", "bench", "s3://bucket/feats", "--profile", "s3-like"]) == 2  # a usage error
    assert "already remote: measure it as it is" in capsys.readouterr().err


def test_convert_of_a_missing_source_names_what_to_give(tmp_path, capsys):
    assert main(["data", "convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 1
    assert "give a Delta table, a folder of Parquet files or one file" in capsys.readouterr().err
    assert not (tmp_path / "out" / "index.json").exists()
